"""Losses and log-probabilities as small pure functions (each with its formula). The preference losses that
`align dpo --loss` selects are registered in align.objectives.preference."""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE = -100


def _at_least_fp32(t: torch.Tensor) -> torch.dtype:
    """bf16/fp16 logits are upcast for the softmax; fp64 stays fp64 (gradcheck)."""
    return torch.promote_types(t.dtype, torch.float32)


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """Token t is predicted from positions < t: logits[:, t-1] scores labels[:, t]."""
    return labels[:, 1:]


def completion_nll(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed negative log-likelihood over completion tokens and their count.

    NLL = −Σ_t m_t · log p_θ(y_t | y_<t), with m_t = 1 on completion tokens (labels ≠ −100) and 0 on prompt
    and padding. Returning the sum and the count lets the caller normalise by the token count of the whole
    global batch (every rank, every micro-batch), so the gradient does not depend on how the batch is split.
    """
    target = shift_labels(labels)
    logits = logits[:, :-1]
    nll = F.cross_entropy(logits.reshape(-1, logits.size(-1)).to(_at_least_fp32(logits)), target.reshape(-1),
                          ignore_index=IGNORE, reduction="sum")
    return nll, (target != IGNORE).sum()


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """log π(ids_t | ·) for every position: log_softmax(logits)[ids], computed `chunk` rows at a time so the
    full B×T×V fp32 log-softmax never exists at once. logits: [B, T, V], ids: [B, T] -> [B, T]."""
    flat_logits = logits.reshape(-1, logits.size(-1))
    flat_ids = ids.reshape(-1)
    dtype = _at_least_fp32(logits)
    out = torch.empty(flat_ids.shape, dtype=dtype, device=logits.device)
    for i in range(0, flat_ids.numel(), chunk):
        lg = flat_logits[i : i + chunk].to(dtype)
        out[i : i + chunk] = lg.gather(-1, flat_ids[i : i + chunk, None]).squeeze(-1) - lg.logsumexp(-1)
    return out.view(ids.shape)


# ---- preference losses (reward model, DPO)


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


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed response log-probability log π(y|x) = Σ_t m_t · log π(y_t | x, y_<t) per row (NOT averaged: the DPO
    objective is on sequence likelihoods), m_t = 1 where labels ≠ −100. logits [B, T, V], labels [B, T] -> [B]."""
    target = shift_labels(labels)
    mask = target != IGNORE
    lp = token_logprobs(logits[:, :-1], target.clamp(min=0))
    return (lp * mask).sum(-1)


def likelihood_reward(logits: torch.Tensor, labels: torch.Tensor, beta: float) -> torch.Tensor:
    """A reward read from the language-model head: r(x, y) = β · (1/|y|) Σ_t log π_φ(y_t | x, y_<t), the mean
    response log-probability (the reference-free implicit reward of SimPO, Meng et al. 2024), used as the
    Bradley–Terry score r of a likelihood reward model. Averaged over the |y| response tokens (labels ≠ −100), so
    it does not favour short answers. logits [B, T, V], labels [B, T] -> [B]."""
    n = (shift_labels(labels) != IGNORE).sum(-1).clamp(min=1)
    return beta * sequence_logps(logits, labels) / n


def rpo_nll(policy_chosen: torch.Tensor, chosen_len: torch.Tensor, alpha: float) -> torch.Tensor:
    """Per-pair NLL term of RPO (Pang et al. 2024, "Iterative Reasoning Preference Optimization"):
    α · (−log π_θ(y_w|x) / |y_w|), added to the preference loss. DPO only widens the gap between the two
    answers and on near-identical pairs (a right and a wrong digit) it lowers the likelihood of both; the NLL term
    keeps the chosen answer likely. Inputs are per pair: summed log-probs and response lengths."""
    return -alpha * policy_chosen / chosen_len
