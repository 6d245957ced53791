"""The built-in objectives as `--help` lists them and a value is checked against them: each entry's kind, name,
one-line summary and traits, without its function. Pure Python (no torch), so `align grpo --help` and a config's
check need not import the math; each module of align/objectives registers its functions under these names with the
same summaries and traits (tests/test_objectives.py checks that the two agree).

An objective registered at run time (a plug-in, a test) is not listed here: `registry.Choices` adds the live
registry's entries to these.
"""

from __future__ import annotations

LOSS_AGGREGATIONS = ("seq-mean-token-mean", "token-mean", "seq-sum")  # GRPO's --loss-agg (policy.aggregate_loss)

# the modules whose import registers the built-in entries (registry.load)
MODULES = ("advantages", "kl", "policy", "preference", "shaping")

# kind -> ((name, --help summary, traits), ...), in registration order
BUILTIN: dict[str, tuple[tuple[str, str, dict], ...]] = {
    "advantage": (
        ("zscore", "(r − mean) / std within the group, GRPO", {"group_baseline": True}),
        ("mean", "r − group mean, Dr. GRPO", {"group_baseline": True}),
        ("batch", "group-centred reward / the batch's std", {"group_baseline": True}),
        ("rloo", "leave-one-out baseline", {"group_baseline": True}),
        ("reinforce++", "rewards whitened over the global batch, no group baseline", {"group_baseline": False}),
    ),
    "policy_loss": (
        ("clip", "PPO's clipped surrogate", {"on_policy": False}),
        ("cispo", "clipped, detached IS weight × A × log π: every token keeps a gradient; MiniMax-M1",
         {"on_policy": False}),
        ("gspo", "one clipped length-normalised ratio per sequence, GSPO; pair with tiny --epsilon / --epsilon-high, "
                 "e.g. 3e-4 / 4e-4, and --loss-agg seq-mean-token-mean", {"on_policy": False}),
        ("reinforce", "nanochat's on-policy REINFORCE −A·log π: no ratio, clip or KL; also --reinforce",
         {"on_policy": True}),
    ),
    "kl": (
        ("k1", "log π − log π_ref", {}),
        ("k3", "e^r − r − 1 with r = log π_ref − log π, capped at r ≤ 20: unbiased, ≥ 0", {}),
    ),
    "preference": (
        ("sigmoid", "DPO", {"needs_reference": True, "label_smoothing": True}),
        ("ipo", "IPO on summed log-probs, the DPO authors' convention",
         {"needs_reference": True, "label_smoothing": False}),
        ("ipo-mean", "IPO on per-token mean log-probs, TRL's: the same β pulls much harder",
         {"needs_reference": True, "label_smoothing": False}),
        ("hinge", "SLiC", {"needs_reference": True, "label_smoothing": False}),
        ("simpo", "no reference: β·mean log-prob reward with margin --simpo-gamma; SimPO uses β ~2",
         {"needs_reference": False, "label_smoothing": False}),
        ("orpo", "no reference: chosen NLL + β · odds-ratio term", {"needs_reference": False, "label_smoothing": False}),
    ),
    "unpaired_preference": (
        ("kto", "on unpaired {prompt, completion, label} rows, or on pairs split into two such rows",
         {"needs_reference": True, "label_smoothing": False}),
    ),
    "shaping": (
        ("overlong", "DAPO's soft overlong punishment over the last --overlong-cache tokens", {}),
        ("length", "Kimi k1.5's length reward within a group (--reward length)", {}),
    ),
}
