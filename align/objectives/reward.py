"""The reward model's loss (`align rm train`): Bradley–Terry on pairs with an optional margin, plus reward
centring; and the likelihood head's reward (`--head likelihood`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from align.objectives.tokens import IGNORE, sequence_logps, shift_labels


def bradley_terry_loss(r_chosen: torch.Tensor, r_rejected: torch.Tensor, margin: torch.Tensor | None = None) -> torch.Tensor:
    """Per-pair reward-model loss −log σ(r_w − r_l − m) (Bradley–Terry preference model as used for RLHF reward
    models: Stiennon et al. 2020, Ouyang et al. 2022 "InstructGPT"; the optional margin m is Llama 2's).
    Computed with logsigmoid, stable for any reward gap. Returns one value per pair (the caller normalises)."""
    diff = r_chosen - r_rejected
    if margin is not None:
        diff = diff - margin
    return -F.logsigmoid(diff)


def centering_penalty(r_chosen: torch.Tensor, r_rejected: torch.Tensor, coef: float) -> torch.Tensor:
    """Per-pair reward-centring regulariser coef · (r_w + r_l)² (its mean over pairs is the usual
    coef · mean((r_w + r_l)²), Eisenstein et al. 2023): keeps the rewards near zero, since BT sees only differences."""
    return coef * (r_chosen + r_rejected) ** 2


def rm_loss(r_chosen_B: torch.Tensor, r_rejected_B: torch.Tensor, margin_B: torch.Tensor | None = None,
            center_coef: float = 0.0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The reward model's whole loss per pair (the stage divides the sum by the global batch's pair count):

        ℓ = −log σ(r_w − r_l − m) + c · (r_w + r_l)²      (bradley_terry_loss + centering_penalty; c = --center-coef)

    Returns (ℓ [B], metrics [B] each, detached: loss, accuracy 1[r_w > r_l], rewards/chosen, rewards/rejected,
    margin r_w − r_l)."""
    per_pair = bradley_terry_loss(r_chosen_B, r_rejected_B, margin_B)
    if center_coef:
        per_pair = per_pair + centering_penalty(r_chosen_B, r_rejected_B, center_coef)
    d = (r_chosen_B - r_rejected_B).detach()
    return per_pair, {"loss": per_pair.detach(), "accuracy": (d > 0).to(d.dtype), "rewards/chosen": r_chosen_B.detach(),
                      "rewards/rejected": r_rejected_B.detach(), "margin": d}


def likelihood_reward(logits: torch.Tensor, labels: torch.Tensor, beta: float) -> torch.Tensor:
    """A reward read from the language-model head: r(x, y) = β · (1/|y|) Σ_t log π_φ(y_t | x, y_<t), the mean
    response log-probability (the reference-free implicit reward of SimPO, Meng et al. 2024), used as the
    Bradley–Terry score r of a likelihood reward model. Averaged over the |y| response tokens (labels ≠ −100), so
    it does not favour short answers. logits [B, T, V], labels [B, T] -> [B]."""
    n = (shift_labels(labels) != IGNORE).sum(-1).clamp(min=1)
    return beta * sequence_logps(logits, labels) / n
