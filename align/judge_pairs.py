"""Preference pairs ranked by an LLM judge (RLAIF: Bai et al. 2022, "Constitutional AI"; Lee et al. 2023, "RLAIF"):
`align data make prefs --from-model M --judge J`.

Each prompt's distinct samples are ranked by the judge (align.judge.Judge), never by a verifier:

- two samples: pairwise, the judge reading both in both orders, P(a ≻ b) = ½ [P_ab(first) + 1 − P_ba(first)]
  (`Judge.preferences`); the chosen side is the one it prefers, and

      judge_prob = P(chosen ≻ rejected) ∈ [½, 1],   judge_margin = P(c ≻ r) − P(r ≻ c) = 2 · judge_prob − 1;

- more samples: pointwise, each sample's expected score s ∈ [0, 1] (`Judge.scores`, G-Eval); the best against the
  worst (up to --pairs-per-prompt of the worst, each its own pair, as InstructGPT's several comparisons of a
  prompt), judge_margin = s_chosen − s_rejected.

Either margin lies in [0, 1], 0 a tie: a pair whose margin is below --judge-margin, or within 1e-6 of 0, is dropped (a
judge that cannot tell two answers apart teaches a reward model or DPO nothing but noise; UltraFeedback's
binarised pairs drop ties the same way).
"""

from __future__ import annotations


def preference_margin(p_chosen: float) -> float:
    """P(c ≻ r) − P(r ≻ c) = 2p − 1 for p = P(c ≻ r) (both orders averaged, so P(r ≻ c) = 1 − p): 0 for a tie, 1
    for a judge certain of its verdict."""
    return 2.0 * p_chosen - 1.0


def rank_two(a: str, b: str, p_ab: float) -> dict:
    """The pair of two samples by the judge's P(a ≻ b): {chosen, rejected, judge_prob = P(chosen ≻ rejected),
    judge_margin}; at p_ab = ½ exactly, a is chosen with margin 0 (a tie, dropped by `keep`)."""
    chosen, rejected, p = (a, b, p_ab) if p_ab >= 0.5 else (b, a, 1.0 - p_ab)
    return {"chosen": chosen, "rejected": rejected, "judge_prob": p, "judge_margin": preference_margin(p)}


def rank_scored(texts: list[str], scores: list[float], k: int = 1) -> list[dict]:
    """Up to k pairs of one prompt's distinct samples by their pointwise scores: the best (the first of the best
    on a tie) against each of the k worst, worst first: {chosen, rejected, judge_chosen, judge_rejected,
    judge_margin = score(chosen) − score(rejected)}; [] for fewer than two texts."""
    order = sorted(range(len(texts)), key=lambda i: -scores[i])
    best, worst = order[0], order[1:][::-1][:k]
    return [{"chosen": texts[best], "rejected": texts[j], "judge_chosen": scores[best], "judge_rejected": scores[j],
             "judge_margin": scores[best] - scores[j]} for j in worst]


# A margin this small is a tie: an even verdict computed in fp32 (½ [σ(z) + 1 − σ(z)]) lands within a few 1e-8 of 0.
TIE = 1e-6


def keep(pair: dict, min_margin: float) -> bool:
    """Whether a pair is kept: its margin at least `min_margin` (--judge-margin) and above `TIE` (a tie has no
    side)."""
    return pair["judge_margin"] > TIE and pair["judge_margin"] >= min_margin


def distinct(texts: list[str]) -> list[str]:
    """Each text once, in order: identical samples carry no preference."""
    return list(dict.fromkeys(texts))


def judge_pairs(judge, prompts: list[str], samples: list[list[str]], k: int = 1,
                min_margin: float = 0.0) -> tuple[list[list[dict]], dict]:
    """The kept pairs of each prompt (a list per prompt, [] for none) and counts: {pairwise: whether the two-sample
    form ran, ranked: pairs the judge ranked, ties: those dropped under the margin, identical: prompts whose
    samples were all one text}. Every prompt has the same number of samples: two ask the judge pairwise (both
    orders), more pointwise (one batched call of the judge either way)."""
    texts = [distinct(s) for s in samples]
    pairwise = all(len(s) == 2 for s in samples)
    ranked: list[list[dict]] = [[] for _ in prompts]
    todo = [i for i, t in enumerate(texts) if len(t) >= 2]
    if pairwise and todo:
        p = judge.preferences([prompts[i] for i in todo], [texts[i][0] for i in todo], [texts[i][1] for i in todo])
        for i, p_ab in zip(todo, p):
            ranked[i] = [rank_two(texts[i][0], texts[i][1], p_ab)]
    elif todo:
        flat = [(i, t) for i in todo for t in texts[i]]
        scores = judge.scores([prompts[i] for i, _ in flat], [t for _, t in flat])
        at = 0
        for i in todo:
            ranked[i] = rank_scored(texts[i], scores[at:at + len(texts[i])], k)
            at += len(texts[i])
    kept = [[pair for pair in r if keep(pair, min_margin)] for r in ranked]
    n_ranked = sum(map(len, ranked))
    return kept, {"pairwise": pairwise, "ranked": n_ranked, "ties": n_ranked - sum(map(len, kept)),
                  "identical": len(prompts) - len(todo)}


def agreement(verdicts: list[tuple[bool, bool]]) -> tuple[float | None, int]:
    """(the share of the pairs the verifier grades (chosen right, rejected wrong) among those whose two sides it
    grades differently, how many such pairs): the judge's agreement with the truth; None when no pair splits the
    verifier. `verdicts`: the verifier's (chosen, rejected) grades of each pair."""
    split = [c for c, r in verdicts if c != r]
    if not split:
        return None, 0
    return sum(split) / len(split), len(split)
