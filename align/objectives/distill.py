"""On-policy distillation's per-token loss (GRPO's --teacher)."""

from __future__ import annotations

import torch


def reverse_kl_distill(logp: torch.Tensor, teacher_logp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """On-policy distillation (Agarwal et al. 2024, GKD with λ = 1; Thinking Machines 2025): per-token reverse
    KL(π_θ‖π_T) on the student's OWN samples. With y_t ~ π_θ, k1 = log π_θ(y_t) − log π_T(y_t) estimates it, and
    its policy gradient (each token's own log-ratio as a negative reward, no credit to later tokens) is

        ∇ KL ≈ sg(log π_θ − log π_T) · ∇ log π_θ,   so the per-token loss is sg(k1) · log π_θ.

    Returns (loss per token, k1 per token, detached: the logged `distill/reverse_kl`)."""
    k1 = (logp - teacher_logp).detach()
    return k1 * logp, k1
