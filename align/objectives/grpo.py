"""GRPO's loss (Shao et al. 2024, with DAPO's, Dr. GRPO's, GSPO's and CISPO's options), one function over a typed
micro-batch: the registered policy loss on the group-relative advantages, reweighted by truncated importance
sampling where a decoder sampled, + β·k3 toward the reference, + on-policy distillation toward a teacher,
aggregated over the global batch. The advantage estimators are align.objectives.advantages."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from align.objectives.distill import reverse_kl_distill
from align.objectives.kl import kl_k3
from align.objectives.offpolicy import truncated_is_weights
from align.objectives.policy import aggregate_loss
from align.objectives.registry import get


@dataclass
class GRPOBatch:
    """One micro-batch of N completions × T response positions. logp: log π_θ of the sampled tokens at the sampling
    temperature (carries the gradient); old_logp: log π_old, the policy the rollout was sampled from (sg(logp) on a
    single iteration); adv: one advantage per completion; loss_mask: the tokens whose terms enter the loss. Optional:
    the frozen reference's log-probs (β > 0), the decoder's sampling log-probs (TIS), a teacher's log-probs and the
    counted mask (the tokens the normaliser counts; distillation trains on all of them, dropped groups' too)."""

    logp_NT: torch.Tensor
    old_logp_NT: torch.Tensor
    adv_N: torch.Tensor
    loss_mask_NT: torch.Tensor
    ref_logp_NT: torch.Tensor | None = None
    sampler_logp_NT: torch.Tensor | None = None
    teacher_logp_NT: torch.Tensor | None = None
    counted_mask_NT: torch.Tensor | None = None


@dataclass(frozen=True)
class GRPOCoefs:
    """The loss's settings: --loss (a registered policy loss), --epsilon / --epsilon-high, β, --tis-cap (0: off),
    --distill-coef, --loss-agg and the token budget --max-new-tokens (seq-sum's constant normaliser)."""

    policy_loss: str
    eps_low: float
    eps_high: float
    beta: float
    tis_cap: float
    distill_coef: float
    loss_agg: str
    max_len: int


def grpo_loss(b: GRPOBatch, c: GRPOCoefs, *, n_tokens: float,
              n_seqs: float) -> tuple[torch.Tensor, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """GRPO's loss on one micro-batch, normalised by the global batch's counts (n_tokens counted tokens, n_seqs
    counted completions), so micro-batching and data parallelism do not change it:

        ℓ_t = ℓ^pg_t(ρ_t, A_i; ε_low, ε_high) · w_t + β · k3_t          on the kept tokens (loss_mask)
            (+ c_d · sg(log π_θ − log π_T)_t · log π_θ                     on every counted token, with a teacher)
        L = aggregate(ℓ, mask; --loss-agg)

    ℓ^pg the registered policy loss (clip: −min(ρA, clip(ρ, 1 − ε_low, 1 + ε_high)A), ρ = π_θ/π_old), w_t the
    truncated IS weight min(π_old/π_sampler, C), k3 = e^r − r − 1 with r = log π_ref − log π_θ (Schulman 2020),
    the distillation term reverse_kl_distill's. Returns (L, metrics: name → (per-token values, the mask they are
    averaged over): clip_ratio/low, clip_ratio/high, clip_ratio, and kl and distill/reverse_kl where present)."""
    mask = b.loss_mask_NT
    per_tok, low, high = get("policy_loss", c.policy_loss).fn(b.logp_NT, b.old_logp_NT, b.adv_N[:, None], mask,
                                                              c.eps_low, c.eps_high)
    if c.tis_cap and b.sampler_logp_NT is not None:
        per_tok = per_tok * truncated_is_weights(b.old_logp_NT, b.sampler_logp_NT, c.tis_cap)
    kl = kl_k3(b.logp_NT, b.ref_logp_NT) if b.ref_logp_NT is not None else None
    if kl is not None:
        per_tok = per_tok + c.beta * kl
    distill = None
    if b.teacher_logp_NT is not None:  # on every counted token: a group without reward signal still distils
        d_loss, distill = reverse_kl_distill(b.logp_NT, b.teacher_logp_NT)
        per_tok = per_tok * mask + c.distill_coef * d_loss * b.counted_mask_NT
        mask = b.counted_mask_NT
    loss = aggregate_loss(per_tok, mask, c.loss_agg, n_tokens=n_tokens, n_seqs=n_seqs, max_len=c.max_len)
    kept = b.loss_mask_NT
    metrics = {"clip_ratio/low": (low, kept), "clip_ratio/high": (high, kept), "clip_ratio": (low | high, kept)}
    if kl is not None:
        metrics["kl"] = (kl.detach(), kept)
    if distill is not None:
        metrics["distill/reverse_kl"] = (distill, mask)
    return loss, metrics
