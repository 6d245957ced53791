"""Token-level likelihood math, as small pure functions: the log-probs of the sampled tokens, their entropy, a
response's summed log-probability, and SFT's loss (the completion tokens' negative log-likelihood).

Labels follow Hugging Face's convention: −100 (IGNORE) on tokens no loss sees (prompt, padding)."""

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


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed response log-probability log π(y|x) = Σ_t m_t · log π(y_t | x, y_<t) per row (NOT averaged: the DPO
    objective is on sequence likelihoods), m_t = 1 where labels ≠ −100. logits [B, T, V], labels [B, T] -> [B]."""
    target = shift_labels(labels)
    mask = target != IGNORE
    lp = token_logprobs(logits[:, :-1], target.clamp(min=0))
    return (lp * mask).sum(-1)


def entropy_from_logits(logits: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """Per-position entropy H = logsumexp(z) − Σ softmax(z)·z, chunked over positions ([B, T, V] -> [B, T]).
    Differentiable (PPO's entropy bonus); pass detached logits when it is only a metric."""
    flat = logits.reshape(-1, logits.size(-1))
    out = torch.empty(flat.shape[0], dtype=torch.float32, device=logits.device)
    for i in range(0, flat.shape[0], chunk):
        z = flat[i : i + chunk].float()
        out[i : i + chunk] = z.logsumexp(-1) - (z.softmax(-1) * z).sum(-1)
    return out.view(logits.shape[:-1])
