"""Per-token log-probs (and entropies) without materialising the [B, T, V] logits.

The LM head's forward is swapped, for the length of one call, for a chunked "linear + selective log-softmax":
for the selected positions only (the response tokens), `chunk` rows at a time, logits = h·Wᵀ in fp32,
log π(target) = z[target] − logsumexp(z), entropy = logsumexp(z) − Σ softmax(z)·z. The backward recomputes
the logits slice by slice (grad_z = g·(onehot − softmax)), so memory is O(chunk × V) instead of O(B × T × V) — the
largest activation of an RL update at a 150k vocabulary. Exact (same function as log_softmax + gather).

Works on a plain module and on a DeepSpeed engine (ZeRO-3 included: the head runs inside its own module call,
so its weight is gathered there and again for the backward, as for any Linear).
"""

from __future__ import annotations

import contextlib

import torch


class _LinearLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, w, ids, chunk: int):
        n = h.shape[0]
        logp = torch.empty(n, dtype=torch.float32, device=h.device)
        ent = torch.empty_like(logp)
        lse = torch.empty_like(logp)
        for i in range(0, n, chunk):
            z = (h[i : i + chunk] @ w.t()).float()
            l = z.logsumexp(-1)
            logp[i : i + chunk] = z.gather(-1, ids[i : i + chunk, None]).squeeze(-1) - l
            ent[i : i + chunk] = l - ((z - l[:, None]).exp() * z).sum(-1)
            lse[i : i + chunk] = l
        ctx.save_for_backward(h, w, ids, lse)
        ctx.chunk = chunk
        ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, g, _g_ent):
        # Sliced over the VOCABULARY (same element budget as a forward chunk): each slice of grad_w is one GEMM
        # over all rows written straight in the weight's dtype (no [V, H] fp32 buffer: 0.5 GB at 152k × 896,
        # and a single rounding), while grad_h [N, H] — small — sums the slices in fp32.
        h, w, ids, lse = ctx.saved_tensors
        n, vocab = h.shape[0], w.shape[0]
        cols = max(1, ctx.chunk * vocab // max(n, 1))
        gf = g.float()
        gh = torch.zeros(h.shape, dtype=torch.float32, device=h.device) if ctx.needs_input_grad[0] else None
        gw = torch.empty_like(w) if ctx.needs_input_grad[1] else None
        for j in range(0, vocab, cols):
            wj = w[j : j + cols]
            z = (h @ wj.t()).float()
            dz = (z - lse[:, None]).exp_().mul_(-gf[:, None])
            hit = (ids >= j) & (ids < j + wj.shape[0])  # rows whose target falls in this slice: + g (no sync)
            dz.scatter_add_(1, (ids - j).clamp(0, wj.shape[0] - 1)[:, None], (gf * hit)[:, None])
            dz = dz.to(h.dtype)
            if gh is not None:
                gh += dz @ wj
            if gw is not None:
                gw[j : j + cols] = dz.t() @ h
        return (gh.to(h.dtype) if gh is not None else None), gw, None, None


CHUNK_ELEMENTS = 1 << 25  # fp32 logits per chunk: 128 MB (a 152k vocabulary: 220 rows; 49k: 680)


def rows_per_chunk(vocab: int) -> int:
    return max(64, CHUNK_ELEMENTS // vocab)


def linear_logprobs(h: torch.Tensor, w: torch.Tensor, ids: torch.Tensor, chunk: int = 0):
    """h [N, H], w [V, H], ids [N] -> (log softmax(h·wᵀ)[ids] [N] fp32, entropy [N] fp32, no grad).
    `chunk` rows at a time (0: as many as fit CHUNK_ELEMENTS fp32 logits)."""
    return _LinearLogprob.apply(h, w, ids, chunk or rows_per_chunk(w.shape[0]))


def supports(module) -> bool:
    head = getattr(module, "lm_head", None)
    return isinstance(head, torch.nn.Linear) and head.bias is None


@contextlib.contextmanager
def _head_as_logprobs(module, targets: torch.Tensor, select: torch.Tensor, chunk: int):
    head = module.lm_head

    def forward(hidden):
        h = hidden[:, :-1]
        sel = select.bool()
        lp, ent = linear_logprobs(h[sel], head.weight, targets[sel], chunk)
        zeros = torch.zeros(sel.shape, dtype=torch.float32, device=h.device)
        return zeros.masked_scatter(sel, lp), zeros.masked_scatter(sel, ent)

    head.forward = forward
    try:
        yield
    finally:
        del head.forward


def fused_logprobs(model, batch: dict, with_entropy: bool = False, select: torch.Tensor | None = None,
                   chunk: int = 0):
    """Like rollout.forward_logprobs: log π(token_{t+1} | ≤ t), [N, L-1] fp32, (entropy or None); computed only
    where `select` (default: batch["response_mask"]) is non-zero, 0 elsewhere. `model`: module or engine."""
    module = getattr(model, "module", model)
    ids = batch["input_ids"]
    sel = batch["response_mask"] if select is None else select
    extra = {"position_ids": batch["position_ids"]} if batch.get("position_ids") is not None else {}
    with _head_as_logprobs(module, ids[:, 1:], sel, chunk):
        out = model(input_ids=ids, attention_mask=batch.get("attention_mask"), use_cache=False, **extra).logits
    logp, ent = out
    return logp, (ent if with_entropy else None)


@torch.no_grad()
def batched_fused_logprobs(model, batch: dict, micro: int) -> torch.Tensor:
    n = batch["input_ids"].shape[0]
    parts = []
    for i in range(0, n, micro):
        mb = {k: v[i : i + micro] for k, v in batch.items()}
        parts.append(fused_logprobs(model, mb)[0])
    return torch.cat(parts)
