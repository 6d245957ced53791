"""Rollouts as tensors: prompt+response sequences, the response mask, and per-token log-probs.

Shared by the RL stages. Sequences are right-padded; `response_mask[i, t] = 1` when target token t+1 of row i
is a response token (the EOS included, prompt / padding / anything after EOS excluded).
"""

from __future__ import annotations

import torch

from align.data import pad
from align.generation import Completion
from align.losses import token_logprobs
from align.rl import entropy_from_logits


def rollout_batch(completions: list[Completion], pad_id: int, device) -> dict:
    seqs = [c.prompt_ids + c.ids for c in completions]
    ids = torch.tensor(pad(seqs, pad_id), device=device)
    attn = torch.tensor(pad([[1] * len(s) for s in seqs], 0), device=device)
    resp = torch.zeros(ids.shape[0], ids.shape[1] - 1, device=device)
    for i, c in enumerate(completions):
        start = len(c.prompt_ids) - 1  # logits at position p predict token p+1
        resp[i, start : start + len(c.ids)] = 1
    return {"input_ids": ids, "attention_mask": attn, "response_mask": resp}


def select(batch: dict, idx: slice) -> dict:
    return {k: v[idx] for k, v in batch.items()}


def forward_logprobs(model, batch: dict, with_entropy: bool = False, temperature: float = 1.0,
                     entropy_grad: bool = False):
    """log π(token_{t+1} | ≤ t) for every position, [N, L-1], from logits / temperature (as sampled); optionally
    the per-position entropy (detached, or differentiable with `entropy_grad` for an entropy bonus)."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
    logits = logits[:, :-1]
    if temperature != 1.0:
        logits = logits / temperature
    logp = token_logprobs(logits, batch["input_ids"][:, 1:])
    if not with_entropy:
        return logp, None
    return logp, entropy_from_logits(logits if entropy_grad else logits.detach())


@torch.no_grad()
def batched_logprobs(model, batch: dict, micro: int, temperature: float = 1.0) -> torch.Tensor:
    """No-grad log-probs over a whole rollout batch, `micro` rows at a time (π_old or π_ref)."""
    n = batch["input_ids"].shape[0]
    return torch.cat([forward_logprobs(model, select(batch, slice(i, i + micro)), temperature=temperature)[0]
                      for i in range(0, n, micro)])
