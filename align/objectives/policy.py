"""Policy losses (kind "policy_loss"): per-token losses of GRPO's update, each

    fn(logp, old_logp, adv, mask, eps_low, eps_high) -> (loss [N, T], low [N, T] bool, high [N, T] bool)

logp / old_logp: log π_θ and log π_old of the sampled tokens [N, T]; adv broadcasts against them ([N, 1]); mask
[N, T] the tokens the loss may see; low / high: where a clip is active from below / above (the clip_ratio
metrics). The caller aggregates the loss over the mask (aggregate_loss, below). Trait `on_policy`: the loss has no
importance ratio, so it is only right on the policy's own fresh samples (one iteration per batch, no KL term).
"""

from __future__ import annotations

import torch

from align.objectives.catalog import LOSS_AGGREGATIONS  # the --loss-agg values (declared without torch)
from align.objectives.registry import register


@register("policy_loss", "clip", help="PPO's clipped surrogate", on_policy=False)
def clipped_surrogate(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask=None, eps_low: float = 0.2,
                      eps_high: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO's clipped objective as a per-token loss (Schulman et al. 2017), with DAPO's clip-higher
    (Yu et al. 2025: eps_high > eps_low lets low-probability tokens grow):

        ρ = exp(log π_θ − log π_old),  L = −min(ρ·A, clip(ρ, 1 − ε_low, 1 + ε_high)·A)

    Returns (loss, low_clipped, high_clipped): where the clip is active, i.e. ρ < 1 − ε_low with A < 0,
    and ρ > 1 + ε_high with A > 0 (there the gradient is zero). The mask is not needed (token-level).
    """
    eps_high = eps_low if eps_high is None else eps_high
    ratio = torch.exp(logp - old_logp)
    unclipped = ratio * adv
    clipped = ratio.clamp(1 - eps_low, 1 + eps_high) * adv
    loss = -torch.minimum(unclipped, clipped)
    low = (ratio < 1 - eps_low) & (adv < 0)
    high = (ratio > 1 + eps_high) & (adv > 0)
    return loss, low, high


@register("policy_loss", "cispo", help="clipped, detached IS weight × A × log π: every token keeps a gradient; "
                                       "MiniMax-M1", on_policy=False)
def cispo_surrogate(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask=None, eps_low: float = 0.2,
                    eps_high: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CISPO (MiniMax-M1, 2025): clip the importance-sampling WEIGHT, not the update, and stop its gradient:

        ρ = exp(log π_θ − log π_old),  L = −sg(clip(ρ, 1 − ε_low, 1 + ε_high)) · A · log π_θ

    Every token keeps a gradient (−sg(ρ̂)·A·∇log π): PPO's clip zeroes it for the clipped tokens, often the rare,
    high-ratio "fork" tokens of a reasoning trace. MiniMax-M1 sets no lower bound (ε_low ≥ 1) and tunes ε_high.
    Returns (loss, low, high): where the weight was clipped from below / above."""
    eps_high = eps_low if eps_high is None else eps_high
    ratio = torch.exp(logp - old_logp)
    weight = ratio.clamp(1 - eps_low, 1 + eps_high).detach()
    return -weight * adv * logp, ratio < 1 - eps_low, ratio > 1 + eps_high


@register("policy_loss", "gspo", help="one clipped length-normalised ratio per sequence, GSPO; pair with tiny "
                                      "--epsilon / --epsilon-high, e.g. 3e-4 / 4e-4, and --loss-agg "
                                      "seq-mean-token-mean", on_policy=False)
def sequence_clipped_surrogate(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
                               eps_low: float = 0.2, eps_high: float | None = None):
    """GSPO (Zheng et al. 2025, Group Sequence Policy Optimization): one importance ratio per SEQUENCE, the
    length-normalised likelihood ratio, clipped as a whole:

        s_i = (π_θ(y_i|x) / π_old(y_i|x))^(1/|y_i|) = exp((1/|y_i|) Σ_t (log π_θ − log π_old)),
        ℓ_i = −min(s_i·A_i, clip(s_i, 1 − ε_low, 1 + ε_high)·A_i)

    `adv` [N] or [N, 1], `mask` [N, T] the tokens y_i counts. ℓ_i is returned on every token of sequence i, so
    `--loss-agg seq-mean-token-mean` gives GSPO's (1/N) Σ_i ℓ_i (token-mean weights sequences by length). The
    paper's clip ranges are ~1e3 times smaller than PPO's (3e-4 / 4e-4): a sequence ratio is a geometric mean.
    Returns (per-token loss [N, T], low, high [N, T] bool)."""
    eps_high = eps_low if eps_high is None else eps_high
    m = mask.to(logp.dtype)
    s = torch.exp(((logp - old_logp) * m).sum(dim=1) / m.sum(dim=1).clamp(min=1))
    a = adv.reshape(-1)
    loss = -torch.minimum(s * a, s.clamp(1 - eps_low, 1 + eps_high) * a)
    low, high = (s < 1 - eps_low) & (a < 0), (s > 1 + eps_high) & (a > 0)
    return (loss[:, None].expand_as(logp), low[:, None].expand(mask.shape), high[:, None].expand(mask.shape))


@register("policy_loss", "reinforce", help="nanochat's on-policy REINFORCE −A·log π: no ratio, clip or KL; "
                                           "also --reinforce", on_policy=True)
def reinforce(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask=None, eps_low: float = 0.2,
              eps_high: float | None = None):
    """REINFORCE (Williams 1992) on the policy's own samples, as nanochat's GRPO: L = −A · log π_θ per token, the
    baseline being the advantage estimator's. No importance ratio, so nothing is clipped (low = high = False)."""
    none = torch.zeros_like(logp, dtype=torch.bool)
    return -adv * logp, none, none


def aggregate_loss(per_token: torch.Tensor, mask: torch.Tensor, mode: str, *, n_tokens: float, n_seqs: float,
                   max_len: int) -> torch.Tensor:
    """Reduce a [N, T] per-token loss to a scalar. Counts are GLOBAL (all ranks, all micro-batches), so
    micro-batching and data parallelism do not change the objective.

    seq-mean-token-mean (GRPO): (1/N) Σ_i (1/|o_i|) Σ_t ℓ_it      — N = n_seqs
    token-mean (DAPO):          (1/Σ_i |o_i|) Σ_i Σ_t ℓ_it      — Σ|o_i| = n_tokens
    seq-sum (Dr. GRPO):         (1/(N·L_max)) Σ_i Σ_t ℓ_it       — a constant normaliser, no length bias
    """
    mask = mask.to(per_token.dtype)
    summed = per_token * mask
    if mode == "token-mean":
        return summed.sum() / max(n_tokens, 1.0)
    if mode == "seq-mean-token-mean":
        lengths = mask.sum(dim=1).clamp(min=1)
        return (summed.sum(dim=1) / lengths).sum() / max(n_seqs, 1.0)
    if mode == "seq-sum":
        return summed.sum() / (max(n_seqs, 1.0) * max_len)
    raise ValueError(f"loss aggregation {mode!r} not in {LOSS_AGGREGATIONS}")
