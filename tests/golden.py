"""Characterisation runs: short runs of every stage with its options at distinctive, non-default values, and the
figures they gave, stored in tests/fixtures/golden/RUN.json.

The wiring tests pin each behaviour against a hand computation; these runs pin the combinations: a whole run
(rollouts, rewards, every loss term, the optimiser and its schedule, evaluation, the saved weights) must give the
stored figures. Each option here has a value no other option of its kind shares (cliprange 0.07 and
cliprange_value 0.11, not both 0.2), so an option read in the wrong place, ignored, or replaced by its default
changes the numbers. A refactor that must not change behaviour keeps them to the digit; a change that means to
change behaviour regenerates them, and says so in its commit:

    python -m tests.golden --update            # every run; rewrites tests/fixtures/golden/*.json
    python -m tests.golden --update ppo-adaptive   # one run
    python -m tests.golden                     # compare, as tests/test_golden.py does

Figures: every numeric metric of every step and of the end (timers, memory and throughput left out), the greedy
held-out answers where a stage saves them, and three sums of each saved weight tensor (Σw, Σw², Σ w·index-weights).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = Path(__file__).resolve().parent / "fixtures" / "golden"
SKIP = ("time/", "memory", "peak", "_per_s", "compile", "eta", "seconds", "wall", "gib")
REL, ABS = 1e-4, 1e-6  # fp32 on CPU: another machine's kernels round differently, far below any wiring change

COMMON = dict(zero_stage=0, compile=False, seed=3, save_every=0, final_checkpoint=False)
PPO_COMMON = dict(prompts_per_step=4, minibatch_size=2, micro_batch_size=2, ppo_epochs=2, max_new_tokens=6, max_steps=3,
                  eval_samples=3, eval_every=2, lr=3e-3, vf_lr=2e-3, cliprange=0.07, cliprange_value=0.11,
                  vf_coef=0.37, gamma=0.97, lam=0.91, init_kl_coef=0.23, ptx_coef=0.3, ptx_batch_size=3,
                  ptx_max_length=20, temperature=1.3, top_k=50, top_p=0.93, weight_decay=0.07, warmup_steps=1,
                  schedule="cosine", grad_clip=0.5)
GRPO_COMMON = dict(prompts_per_step=2, num_generations=4, micro_batch_size=4, max_new_tokens=6, max_steps=3,
                   eval_samples=3, eval_every=2, eval_k="1,2", lr=3e-3, temperature=1.2, top_k=40, top_p=0.9,
                   weight_decay=0.06, warmup_steps=1, schedule="linear", grad_clip=0.6,
                   reward=["math:0.8", "{reward}:0.3"])
PREF_COMMON = dict(batch_size=4, micro_batch_size=2, max_length=64, max_steps=3, eval_every=2, lr=2e-3,
                   weight_decay=0.04, warmup_steps=1, schedule="cosine", grad_clip=0.7, eval_samples=3,
                   max_new_tokens=5)

# name: (stage, options beyond COMMON; "{policy}"-style values are the models and data of `inputs`)
RUNS = {
    "sft-packing": ("sft", dict(batch_size=4, micro_batch_size=2, max_length=64, max_steps=3, eval_every=2,
                                eval_samples=3, max_new_tokens=5, lr=3e-3, weight_decay=0.05, warmup_steps=1,
                                schedule="cosine", grad_clip=0.3, packing=True, data="{arith}",
                                eval_data="{arith_test}", model="{policy}")),
    "rm-scalar": ("rm", dict(batch_size=4, micro_batch_size=2, max_length=64, max_steps=3, eval_every=2, lr=2e-3,
                             warmup_steps=1, schedule="linear", weight_decay=0.03, grad_clip=0.4, center_coef=0.05,
                             normalize_samples=8, normalize_scale=True, max_new_tokens=5, data="{prefs}",
                             eval_data="{prefs_test}", model="{policy}")),
    "rm-likelihood": ("rm", dict(batch_size=4, micro_batch_size=2, max_length=64, max_steps=2, eval_every=0,
                                 lr=1e-3, warmup_steps=0, head="likelihood", likelihood_beta=3.0, center_coef=0.02,
                                 normalize_samples=8, max_new_tokens=5, data="{prefs}", eval_data="{prefs_test}",
                                 model="{policy}")),
    "dpo-sigmoid": ("dpo", dict(PREF_COMMON, loss="sigmoid", beta=0.3, label_smoothing=0.1, nll_coef=0.2,
                                ref_model="{other}", data="{prefs}", eval_data="{prefs_test}",
                                pass_data="{arith_test}", model="{policy}")),
    "dpo-ipo-precomputed": ("dpo", dict(PREF_COMMON, loss="ipo", beta=0.4, precompute_ref=True, data="{prefs}",
                                        eval_data="{prefs_test}", pass_data="", eval_pairs=4, model="{policy}")),
    "dpo-simpo": ("dpo", dict(PREF_COMMON, loss="simpo", beta=2.5, simpo_gamma=0.7, data="{prefs}",
                              eval_data="{prefs_test}", pass_data="", model="{policy}")),
    "dpo-kto": ("dpo", dict(PREF_COMMON, loss="kto", beta=0.2, desirable_weight=1.3, undesirable_weight=0.8,
                            data="{prefs}", eval_data="{prefs_test}", pass_data="", model="{policy}")),
    "dpo-online": ("dpo", dict(PREF_COMMON, loss="hinge", beta=0.6, online=True, online_every=1, online_samples=3,
                               temperature=1.2, reward_model="{rm}", data="{arith}", eval_data="",
                               pass_data="{arith_test}", model="{policy}")),
    "grpo-clip-kl": ("grpo", dict(GRPO_COMMON, loss="clip", epsilon=0.01, epsilon_high=0.02, beta=0.05,
                                  num_iterations=2, mask_truncated=True, overlong_cache=2,
                                  drop_zero_std_groups=False, reward_model="{rm}", reward_model_weight=0.5,
                                  loss_agg="seq-mean-token-mean", data="{arith}", eval_data="{arith_test}",
                                  model="{eos}")),
    "grpo-gspo-teacher": ("grpo", dict(GRPO_COMMON, loss="gspo", epsilon=0.003, epsilon_high=0.004,
                                       advantage="rloo", loss_agg="seq-sum", teacher="{other}", distill_coef=0.3,
                                       num_iterations=2, data="{arith}", eval_data="{arith_test}",
                                       model="{policy}")),
    "grpo-cispo-stale": ("grpo", dict(GRPO_COMMON, loss="cispo", epsilon_high=0.01, advantage="mean",
                                      loss_agg="token-mean", max_staleness=1, tis_cap=1.7, data="{arith}",
                                      eval_data="", model="{policy}")),
    "grpo-reinforce": ("grpo", dict(GRPO_COMMON, loss="reinforce", advantage="reinforce++", data="{arith}",
                                    eval_data="", model="{policy}")),
    "ppo-adaptive": ("ppo", dict(PPO_COMMON, ent_coef=0.013, target_kl=3.1, kl_horizon=777.0, reward_clip=2.7,
                                 missing_eos_penalty=0.9, gold_reward="math", gold_reward_coef=0.4,
                                 kl_estimator="k1", ref_model="{other}", reward_model="{rm}", data="{arith}",
                                 eval_data="{arith_test}", ptx_data="{arith}", model="{eos}")),
    "ppo-fixed-k3": ("ppo", dict(PPO_COMMON, fixed_kl=True, kl_estimator="k3", max_approx_kl=0.02, tis_cap=1.9,
                                 ent_coef=0.02, reward_clip=1.5, reward_model="{rm}", value_model="{rm2}",
                                 data="{arith}", eval_data="{arith_test}", ptx_data="{text}", model="{policy}")),
}


def inputs(root: Path) -> dict[str, str]:
    """The tiny models and data files every run reads, made under `root` (deterministic: seeds)."""
    import torch

    from align.models import load_tokenizer, resolve
    from align.reward_model import OFFSET_KEY, load_sequence_classifier
    from tests.conftest import save_tiny_model

    root.mkdir(parents=True, exist_ok=True)
    from align.data import encode_prompts
    from tests.conftest import eos_prone

    out = {"policy": save_tiny_model(root / "policy", seed=0, silent_head=True),
           "other": save_tiny_model(root / "other", seed=1)}
    tok = load_tokenizer(resolve("tiny"))
    # a policy that ends some samples with EOS within a few tokens (the others are truncated)
    prompt = json.loads((ROOT / "data/arithmetic/train.jsonl").read_text().splitlines()[0])["prompt"]
    eos_prone(save_tiny_model(root / "plain", seed=0), encode_prompts(tok, [prompt])[0], 5.0, out=root / "eos")
    out["eos"] = root / "eos"
    # a reward with partial credit (the tiny policies never answer right): digits, less for length
    out["reward"] = root / "partial.py"
    out["reward"].write_text("def partial(prompt, completion, **row):\n"
                             "    return sum(c.isdigit() for c in completion) / 4 - len(completion) / 40\n")
    out["reward"] = f"{out['reward']}:partial"
    for name, seed, offset in (("rm", 1, 0.5), ("rm2", 2, -0.3)):
        rm = load_sequence_classifier(resolve("tiny"), tok, torch.float32, seed=seed)
        rm.config.pad_token_id = tok.pad_token_id
        setattr(rm.config, OFFSET_KEY, offset)
        rm.save_pretrained(root / name, safe_serialization=True)
        tok.save_pretrained(root / name)
        out[name] = root / name
    for name, (rel, n) in {"arith": ("arithmetic/train.jsonl", 24), "arith_test": ("arithmetic/test.jsonl", 6),
                           "prefs": ("prefs/train.jsonl", 24), "prefs_test": ("prefs/test.jsonl", 6)}.items():
        out[name] = root / f"{name}.jsonl"
        out[name].write_text("".join((ROOT / "data" / rel).read_text().splitlines(keepends=True)[:n]))
    out["text"] = root / "text.jsonl"
    out["text"].write_text("".join(json.dumps({"text": t}) + "\n" for t in
                                   ("Sam had 5 apples and ate 2.", "Sorted, the numbers 3 1 2 become 1 2 3.",
                                    "Seven minus four is three.")))
    return {k: str(v) for k, v in out.items()}


def config(name: str, files: dict, out: Path):
    """The stage's config of run `name`, validated."""
    from stages import dpo, grpo, ppo, rm, sft

    stage, kw = RUNS[name]
    cls = {"sft": sft.SFTConfig, "rm": rm.RMConfig, "dpo": dpo.DPOConfig, "grpo": grpo.GRPOConfig,
           "ppo": ppo.PPOConfig}[stage]
    fill = lambda v: v.format(**files) if isinstance(v, str) and v.startswith("{") else v  # noqa: E731
    kw = {k: [fill(x) for x in v] if isinstance(v, list) else fill(v) for k, v in kw.items()}
    cfg = cls(**{**COMMON, **kw, "out": str(out)})
    cfg.validate()
    return cfg


def run(name: str, files: dict, out: Path) -> dict:
    """Run `name` in this process and return its figures."""
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    from stages import dpo, grpo, ppo, rm, sft

    stage = RUNS[name][0]
    cfg = config(name, files, out)
    fn = {"sft": sft.run, "rm": rm.run, "dpo": dpo.run, "grpo": grpo.run, "ppo": ppo.run}[stage]
    try:
        final = fn(cfg)
    finally:
        unset_hf_deepspeed_config()
    return figures(out, final)


def numbers(d: dict) -> dict:
    return {k: v for k, v in sorted(d.items()) if isinstance(v, (int, float)) and not isinstance(v, bool)
            and not any(s in k for s in SKIP)}


def figures(out: Path, final: dict) -> dict:
    import torch
    from safetensors.torch import load_file

    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    weights = {}
    for f in sorted(p for p in out.rglob("*.safetensors") if "checkpoints" not in p.parts):
        for k, t in sorted(load_file(f).items()):
            k = f"{f.parent.relative_to(out)}/{k}"
            t = t.double().flatten()
            idx = torch.arange(t.numel(), dtype=torch.float64)
            weights[k] = [t.sum().item(), (t * t).sum().item(), (t * torch.cos(idx)).sum().item()]
    samples = out / "eval_samples.jsonl"
    answers = [r.get("greedy") for r in map(json.loads, samples.read_text().splitlines())] if samples.exists() else []
    return {"steps": [numbers(r) for r in rows], "final": numbers(final), "weights": weights, "answers": answers}


def weight_differences(want: list, got: list, where: str) -> list[str]:
    """A tensor's [Σw, Σw², Σw·cos(i)]: Σw² within REL; the two signed sums within REL·‖w‖ (they cancel to near
    zero, and another CPU's rounding of thousands of updates moves them by ~1e-5 absolute: a relative test of a sum
    of 0.005 would see rounding, not wiring)."""
    scale = REL * math.sqrt(max(want[1], 0.0)) + ABS
    out = [] if math.isclose(want[1], got[1], rel_tol=REL, abs_tol=ABS) else [f"{where}[1]: {got[1]!r}, stored {want[1]!r}"]
    return out + [f"{where}[{i}]: {got[i]!r}, stored {want[i]!r}" for i in (0, 2) if not abs(got[i] - want[i]) <= scale]


def implicit_reward_scale(want: dict, prefix: str) -> float | None:
    """How far rounding moves a DPO implicit reward β(log π − log π_ref) of the dict `want`: it is a difference of
    two sequence log-probs of magnitude |logps/chosen|, each known to ~1e-8 of itself on fp32 CPU kernels, so
    another CPU moves it by up to ABS·|logp| absolute (1e-4 at |logp| 100; an option wired wrongly moves the
    figures by 1e-3 and more). None where the dict logs no log-prob."""
    logp = want.get(prefix + "logps/chosen")
    return None if not isinstance(logp, (int, float)) else ABS * max(1.0, abs(logp))


def reward_differences(want: dict, got: dict, at) -> tuple[list[str], set[str]]:
    """The implicit rewards of a DPO step (`rewards/chosen`, `/rejected`, `/margins`, with or without `eval/`)
    within `implicit_reward_scale`; `rewards/accuracies` is the share of pairs with margin > 0, and where the
    stored rewards are all ~0 (the policy is still the reference: step 0, a tie in every pair) it is the sign of
    rounding, not compared. Returns the differences and the keys it judged."""
    out, judged = [], set()
    for prefix in ("", "eval/", "train/"):
        scale = implicit_reward_scale(want, prefix)
        keys = [prefix + "rewards/" + k for k in ("chosen", "rejected", "margins")]
        if scale is None or not isinstance(want.get(keys[2]), (int, float)) or keys[2] not in got:
            continue
        for k in (k for k in keys if isinstance(want.get(k), (int, float)) and isinstance(got.get(k), (int, float))):
            judged.add(k)
            if not abs(got[k] - want[k]) <= scale:
                out.append(f"{at(k)}: {got[k]!r}, stored {want[k]!r}")
        acc = prefix + "rewards/accuracies"
        if acc in want and acc in got and all(abs(want.get(k, 0.0)) <= scale for k in keys):
            judged.add(acc)
    return out, judged


def differences(want, got, where: str = "") -> list[str]:
    """Where `got` departs from `want` (numbers within REL / ABS; DPO's implicit rewards: `reward_differences`)."""
    if isinstance(want, dict) and isinstance(got, dict):
        at = lambda k: f"{where}.{k}" if where else str(k)  # noqa: E731
        out = [f"{at(k)}: missing" for k in want if k not in got]
        out += [f"{at(k)}: unexpected" for k in got if k not in want]
        rewards, judged = reward_differences(want, got, at)
        out += rewards
        for k in want:
            if k in got and k not in judged:
                out += differences(want[k], got[k], at(k))
        return out
    if isinstance(want, list) and isinstance(got, list):
        if len(want) != len(got):
            return [f"{where}: {len(got)} items, {len(want)} stored"]
        if where.startswith("weights.") and len(want) == 3:
            return weight_differences(want, got, where)
        return [d for i, (a, b) in enumerate(zip(want, got)) for d in differences(a, b, f"{where}[{i}]")]
    if isinstance(want, (int, float)) and isinstance(got, (int, float)):
        ok = math.isclose(want, got, rel_tol=REL, abs_tol=ABS) or (math.isnan(want) and math.isnan(got))
        return [] if ok else [f"{where}: {got!r}, stored {want!r}"]
    return [] if want == got else [f"{where}: {got!r}, stored {want!r}"]


def main() -> None:
    import tempfile

    ap = argparse.ArgumentParser(description="The characterisation runs: compare with, or rewrite, the stored figures.")
    ap.add_argument("runs", nargs="*", help=f"runs (default: all of {', '.join(RUNS)})")
    ap.add_argument("--update", action="store_true", help="store the figures of this code")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="align-golden-"))
    files = inputs(tmp / "inputs")
    bad = 0
    for name in a.runs or RUNS:
        got = run(name, files, tmp / name)
        path = GOLDEN / f"{name}.json"
        if a.update:
            GOLDEN.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(got, indent=1) + "\n")
            print(f"{name}: stored {path.relative_to(ROOT)}")
            continue
        diff = differences(json.loads(path.read_text()), got) if path.exists() else ["no stored figures"]
        bad += bool(diff)
        print(f"{name}: {'same' if not diff else f'{len(diff)} differences: ' + '; '.join(diff[:5])}")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
