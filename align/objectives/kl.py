"""KL estimators (kind "kl"): fn(logp, ref_logp) -> per-token estimate of KL(π‖π_ref) on tokens sampled from π
(Schulman 2020, "Approximating KL divergence")."""

from __future__ import annotations

import torch

from align.objectives.registry import register


@register("kl", "k1", help="log π − log π_ref")
def kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k1 = log π(a|s) − log π_ref(a|s): unbiased per-token estimate of KL(π‖π_ref), can be negative
    (Schulman 2020, "Approximating KL divergence")."""
    return logp - ref_logp


@register("kl", "k3", help="e^r − r − 1 with r = log π_ref − log π, capped at r ≤ 20: unbiased, ≥ 0")
def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor, clamp: float = 20.0) -> torch.Tensor:
    """k3 = exp(r) − r − 1 with r = log π_ref − log π: unbiased, always >= 0, low variance (Schulman 2020);
    GRPO's KL term. r is capped at +clamp (e^20 ≈ 5e8 stays finite in fp32 where the reference is far likelier);
    below there is no cap, so however far the policy runs ahead of the reference (r → −∞, k3 ≈ −r − 1) the
    gradient keeps pulling it back."""
    r = (ref_logp - logp).clamp(max=clamp)
    return torch.exp(r) - r - 1


# ---- the KL coefficient β of PPO's per-token penalty


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences"):

        e = clip(KL / KL_target − 1, −0.2, 0.2),   β ← β · (1 + e · n / horizon)

    KL is the batch's mean per-episode KL, n the episodes in the batch. β rises while KL > target and
    falls while KL < target, by at most 20% · n / horizon per update."""

    def __init__(self, init_kl_coef: float, target: float, horizon: float):
        self.value, self.target, self.horizon = init_kl_coef, target, horizon

    def update(self, kl: float, n_episodes: int) -> float:
        e = min(max(kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + e * n_episodes / self.horizon
        return self.value


class FixedKLController:
    """A constant β (--fixed-kl)."""

    def __init__(self, init_kl_coef: float):
        self.value = init_kl_coef

    def update(self, kl: float, n_episodes: int) -> float:
        return self.value
