"""Off-policy corrections and diagnostics shared by GRPO and PPO: the truncated importance weights of tokens a
decoder sampled (its kernels, precision or a stale weight copy differ from the trainer's), and the mismatch
between the two distributions that RLMonitor watches."""

from __future__ import annotations

import torch

from align.objectives.kl import kl_k3


def truncated_is_weights(old_logp: torch.Tensor, sampler_logp: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance sampling (TIS) weights of the rollout's tokens (Yao et al. 2025, "Your efficient RL
    framework secretly brings you off-policy RL training"):

        w_t = min(π_train(a_t|s_t) / π_sampler(a_t|s_t), C) = min(exp(log π_old − log π_sampler), C)

    with π_old the trainer's log-probs of the rollout before the update and π_sampler the decoder's (its kernels,
    precision or a stale weight copy make them differ). Multiplying the per-token policy-gradient loss by w_t
    (no gradient through it) corrects the gradient for tokens drawn from π_sampler instead of π_train; the cap C
    bounds the variance. Detached, >= 0, [same shape as the inputs]."""
    return torch.exp(old_logp.detach() - sampler_logp).clamp(max=cap)


def rollout_mismatch(sampler_logp: torch.Tensor, trainer_logp: torch.Tensor, mask: torch.Tensor) -> tuple:
    """(Σ|log π_sampler − log π_trainer|, Σ k3, Σ mask) over the masked response tokens: the sums behind
    rollout/logp_abs_diff (mean |Δ log p|) and rollout/kl, KL(π_sampler‖π_trainer) estimated with k3 on tokens drawn
    from the sampler (Schulman 2020: exp(r) − r − 1, r = log π_trainer − log π_sampler). Both are 0 when the
    decoder samples from exactly the trainer's distribution."""
    diff = (sampler_logp - trainer_logp.detach()).float()
    # k3 in float64: e^r − r − 1 of an fp32 r ~ 1e-7 cancels to ±1e-9, a "negative KL" on every healthy step
    k3 = kl_k3(sampler_logp.double(), trainer_logp.detach().double()) * mask
    return (diff.abs() * mask).sum(), k3.sum().float(), mask.sum()
