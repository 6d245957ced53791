"""Preference losses. Kind "preference" (`align dpo --loss`), on pairs:

    fn(pairs: Pairs, beta, *, label_smoothing=0.0, gamma=0.0) -> (loss per pair, reward of chosen, of rejected)

the rewards detached (logged, and the held-out accuracy of a loss without a reference). Traits: `needs_reference`
(the reference's log-probs are in `pairs`; without it none is loaded) and `label_smoothing` (whether it takes
--label-smoothing ε). Kind "unpaired_preference" (KTO) on unpaired rows has its own signature (see kto_loss).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from align.objectives.registry import get, register


@dataclass
class Pairs:
    """One batch of pairs, each [B]: summed response log-probs log π(y|x) of the policy, of the reference (None
    without one), and the response lengths |y_w|, |y_l|."""

    policy_chosen: torch.Tensor
    policy_rejected: torch.Tensor
    ref_chosen: torch.Tensor | None
    ref_rejected: torch.Tensor | None
    chosen_len: torch.Tensor
    rejected_len: torch.Tensor

    def mean_logps(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The policy's per-token mean log-probs ℓ(y) = log π(y|x) / |y| of chosen and rejected."""
        return self.policy_chosen / self.chosen_len, self.policy_rejected / self.rejected_len

    def log_ratios(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(log π − log π_ref)(y_w), (log π − log π_ref)(y_l)."""
        return self.policy_chosen - self.ref_chosen, self.policy_rejected - self.ref_rejected


def _dpo_rewards(loss: torch.Tensor, chosen: torch.Tensor, rejected: torch.Tensor, beta: float):
    """(loss, β·chosen, β·rejected), the rewards detached."""
    return loss, (beta * chosen).detach(), (beta * rejected).detach()


@register("preference", "sigmoid", help="DPO", needs_reference=True, label_smoothing=True)
def dpo_sigmoid(pairs: Pairs, beta: float, *, label_smoothing: float = 0.0, gamma: float = 0.0):
    """DPO (Rafailov et al. 2023), with ε > 0 conservative DPO (cDPO, Mitchell 2023):

        Δ = (log π − log π_ref)(y_w) − (log π − log π_ref)(y_l)   (summed log-probs)
        loss = −(1−ε)·log σ(βΔ) − ε·log σ(−βΔ),   rewards β(log π − log π_ref)(y)"""
    c, r = pairs.log_ratios()
    d = beta * (c - r)
    return _dpo_rewards(-(1 - label_smoothing) * F.logsigmoid(d) - label_smoothing * F.logsigmoid(-d), c, r, beta)


@register("preference", "ipo", help="IPO on summed log-probs, the DPO authors' convention", needs_reference=True,
          label_smoothing=False)
def ipo(pairs: Pairs, beta: float, *, label_smoothing: float = 0.0, gamma: float = 0.0):
    """IPO (Azar et al. 2023) on summed log-probs, as in the DPO authors' implementation: loss = (Δ − 1/(2β))²,
    Δ as in DPO; rewards β(log π − log π_ref)(y)."""
    c, r = pairs.log_ratios()
    return _dpo_rewards((c - r - 1 / (2 * beta)) ** 2, c, r, beta)


@register("preference", "ipo-mean", help="IPO on per-token mean log-probs, TRL's: the same β pulls much harder",
          needs_reference=True, label_smoothing=False)
def ipo_mean(pairs: Pairs, beta: float, *, label_smoothing: float = 0.0, gamma: float = 0.0):
    """IPO on per-token MEAN log-probs (TRL's IPO): loss = (Δ̄ − 1/(2β))² with Δ̄ = (ℓ − ℓ_ref)(y_w) − (ℓ − ℓ_ref)(y_l),
    ℓ(y) = log π(y|x)/|y|; rewards β(ℓ − ℓ_ref)(y), per token."""
    c = (pairs.policy_chosen - pairs.ref_chosen) / pairs.chosen_len
    r = (pairs.policy_rejected - pairs.ref_rejected) / pairs.rejected_len
    return _dpo_rewards((c - r - 1 / (2 * beta)) ** 2, c, r, beta)


@register("preference", "hinge", help="SLiC", needs_reference=True, label_smoothing=False)
def hinge(pairs: Pairs, beta: float, *, label_smoothing: float = 0.0, gamma: float = 0.0):
    """SLiC-HF (Zhao et al. 2023): loss = max(0, 1 − βΔ), Δ as in DPO; rewards β(log π − log π_ref)(y)."""
    c, r = pairs.log_ratios()
    return _dpo_rewards(torch.relu(1 - beta * (c - r)), c, r, beta)


@register("preference", "simpo", help="no reference: β·mean log-prob reward with margin --simpo-gamma; SimPO uses "
                                      "β ~2", needs_reference=False, label_smoothing=False)
def simpo(pairs: Pairs, beta: float, *, label_smoothing: float = 0.0, gamma: float = 0.0):
    """SimPO (Meng et al. 2024, "Simple Preference Optimization with a Reference-Free Reward"): the reward is the
    length-normalised log-likelihood, no reference model,

        r(y) = (β/|y|)·log π(y|x),   loss = −log σ(r(y_w) − r(y_l) − γ)   (γ: a target reward margin).

    The paper's β is ~2-2.5 with γ/β ~0.5: much larger than DPO's."""
    l_w, l_l = pairs.mean_logps()
    return _dpo_rewards(-F.logsigmoid(beta * l_w - beta * l_l - gamma), l_w, l_l, beta)


def log_odds(mean_logp: torch.Tensor) -> torch.Tensor:
    """log(P / (1 − P)) for P = exp(mean_logp) < 1, as log P − log(1 − P) = ℓ − log(−expm1(ℓ)) (exact near P → 1;
    ℓ is capped just below 0, where the odds are infinite)."""
    ell = mean_logp.clamp(max=-1e-6)
    return ell - torch.log(-torch.expm1(ell))


@register("preference", "orpo", help="no reference: chosen NLL + β · odds-ratio term", needs_reference=False,
          label_smoothing=False)
def orpo(pairs: Pairs, beta: float, *, label_smoothing: float = 0.0, gamma: float = 0.0):
    """ORPO (Hong et al. 2024, "Monolithic Preference Optimization without Reference Model"): SFT on the chosen
    answer plus an odds-ratio term, no reference model, λ = β:

        ℓ(y) = log π(y|x) / |y|  (per-token mean; P(y|x) = e^ℓ as in the paper's code),  odds(y) = P / (1 − P)
        loss = −ℓ(y_w) + λ·(−log σ(log odds(y_w) − log odds(y_l))),   rewards λ·ℓ(y) (TRL's logged rewards)."""
    l_w, l_l = pairs.mean_logps()
    return _dpo_rewards(-l_w - beta * F.logsigmoid(log_odds(l_w) - log_odds(l_l)), l_w, l_l, beta)


@register("unpaired_preference", "kto", needs_reference=True, label_smoothing=False,
          help="on unpaired {prompt, completion, label} rows, or on pairs split into two such rows")
def kto_loss(policy: torch.Tensor, ref: torch.Tensor, kl_sums: torch.Tensor, desirable: torch.Tensor, beta: float,
             w_desirable: float = 1.0, w_undesirable: float = 1.0):
    """KTO (Ethayarajh et al. 2024, "KTO: Model Alignment as Prospect Theoretic Optimization") on unpaired rows:

        r = log π(y|x) − log π_ref(y|x)   (summed response log-probs),
        z0 = max(0, mean over the batch of log π(y'|x) − log π_ref(y'|x))   (mismatched x, y': the reference
             point, an estimate of KL(π‖π_ref); no gradient),
        desirable y:   λ_D · (1 − σ(β(r − z0))),   undesirable y:   λ_U · (1 − σ(β(z0 − r))).

    `kl_sums` = [Σ (log π − log π_ref) over the mismatched rows, their count], already summed over every rank
    (the reference point is the global batch's). Returns (loss per row, β·r detached, z0)."""
    z0 = (kl_sums[0] / kl_sums[1].clamp(min=1)).clamp(min=0).detach()
    r = policy - ref
    loss = torch.where(desirable, w_desirable * (1 - torch.sigmoid(beta * (r - z0))),
                       w_undesirable * (1 - torch.sigmoid(beta * (z0 - r))))
    return loss, (beta * r).detach(), z0


def rpo_nll(policy_chosen: torch.Tensor, chosen_len: torch.Tensor, alpha: float) -> torch.Tensor:
    """Per-pair NLL term of RPO (Pang et al. 2024, "Iterative Reasoning Preference Optimization"):
    α · (−log π_θ(y_w|x) / |y_w|), added to the preference loss. DPO only widens the gap between the two
    answers and on near-identical pairs (a right and a wrong digit) it lowers the likelihood of both; the NLL term
    keeps the chosen answer likely. Inputs are per pair: summed log-probs and response lengths."""
    return -alpha * policy_chosen / chosen_len


def dpo_loss(pairs: Pairs, loss: str, beta: float, *, label_smoothing: float = 0.0, gamma: float = 0.0,
             nll_coef: float = 0.0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The whole loss of `align dpo` on pairs, per pair (the stage averages it over the global batch):

        ℓ = ℓ_pref(pairs; β, ε, γ) + α · (−log π(y_w|x) / |y_w|)

    ℓ_pref the preference loss registered as `loss` (sigmoid: DPO, ipo, ipo-mean, hinge, simpo, orpo), the second
    term RPO's NLL (rpo_nll) with α = --nll-coef (0: off). Returns (ℓ [B], metrics [B] each, detached, TRL's names:
    loss, rewards/chosen and rewards/rejected (the loss's own implicit rewards, also the held-out accuracy's),
    rewards/accuracies, rewards/margins, logps/chosen, logps/rejected, and loss/nll with α > 0)."""
    per_pair, rw_c, rw_r = get("preference", loss).fn(pairs, beta, label_smoothing=label_smoothing, gamma=gamma)
    metrics = {}
    if nll_coef:
        nll = rpo_nll(pairs.policy_chosen, pairs.chosen_len, nll_coef)
        metrics["loss/nll"] = nll.detach()
        per_pair = per_pair + nll
    return per_pair, {**metrics, "loss": per_pair.detach(), "rewards/chosen": rw_c, "rewards/rejected": rw_r,
                      "rewards/accuracies": (rw_c > rw_r).float(), "rewards/margins": rw_c - rw_r,
                      "logps/chosen": pairs.policy_chosen.detach(), "logps/rejected": pairs.policy_rejected.detach()}
