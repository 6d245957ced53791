"""Per-token log-probabilities of a batch: THE one entry point, `logprobs(model, batch, temperature)`.

It picks the path itself. Fused (models whose LM head is a bias-free Linear): the head's forward is swapped, for
the length of one call, for a chunked "linear + selective log-softmax": for the selected positions only (the
response tokens), `chunk` rows at a time, logits = h·Wᵀ / T in fp32, log π(target) = z[target] − logsumexp(z),
entropy = logsumexp(z) − Σ softmax(z)·z. The backward recomputes the logits slice by slice
(grad_z = g·(onehot − softmax)), so memory is O(chunk × V) instead of O(B × T × V) — the largest activation of
an RL update at a 150k vocabulary. Exact (same function as log_softmax + gather). Plain (any other head, or a
differentiable entropy for an entropy bonus): one forward to full logits, then log_softmax + gather in chunks.

Works on a plain module and on a DeepSpeed engine (ZeRO-3 included: the head runs inside its own module call,
so its weight is gathered there and again for the backward, as for any Linear).
"""

from __future__ import annotations

import contextlib

import torch

from align.objectives.tokens import entropy_from_logits, token_logprobs


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
        dev = h.device.type
        ctx.amp = (dev, torch.get_autocast_dtype(dev)) if torch.is_autocast_enabled(dev) else None
        ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, g, _g_ent):
        # the backward runs under the forward's autocast (torch runs a Function's backward without it): under
        # --precision bf16-mixed its GEMMs are bf16 like the forward's, not fp32
        if ctx.amp is None:
            return _LinearLogprob._backward(ctx, g)
        with torch.autocast(ctx.amp[0], dtype=ctx.amp[1]):
            return _LinearLogprob._backward(ctx, g)

    @staticmethod
    def _backward(ctx, g):
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


def supports_fused(module) -> bool:
    head = getattr(module, "lm_head", None)
    return isinstance(head, torch.nn.Linear) and head.bias is None


@contextlib.contextmanager
def _head_as_logprobs(module, targets: torch.Tensor, select: torch.Tensor, temperature: float, chunk: int):
    head = module.lm_head

    def forward(hidden):
        h = hidden[:, :-1]
        if temperature != 1.0:
            h = h / temperature  # (h / T)·Wᵀ = logits / T
        sel = select.bool()
        lp, ent = linear_logprobs(h[sel], head.weight, targets[sel], chunk)
        zeros = torch.zeros(sel.shape, dtype=torch.float32, device=h.device)
        return zeros.masked_scatter(sel, lp), zeros.masked_scatter(sel, ent)

    head.forward = forward
    try:
        yield
    finally:
        del head.forward


def _fused(model, batch: dict, temperature: float, chunk: int):
    module = getattr(model, "module", model)
    ids = batch["input_ids"]
    with _head_as_logprobs(module, ids[:, 1:], batch["response_mask"], temperature, chunk):
        return model(input_ids=ids, **_context(batch)).logits


def _plain(model, batch: dict, temperature: float, entropy_grad: bool):
    logits = model(input_ids=batch["input_ids"], **_context(batch)).logits[:, :-1]
    if temperature != 1.0:
        logits = logits / temperature
    mask = batch["response_mask"].to(torch.float32)
    logp = token_logprobs(logits, batch["input_ids"][:, 1:]) * mask
    return logp, entropy_from_logits(logits if entropy_grad else logits.detach()) * mask


def _context(batch: dict) -> dict:
    """attention_mask (absent: a right-padded batch, where causal attention never looks at the padding) and
    position_ids (packed rows) when the batch has them; never a KV cache."""
    kw = {k: batch[k] for k in ("attention_mask", "position_ids") if batch.get(k) is not None}
    return {**kw, "use_cache": False}


def logprobs(model, batch: dict, *, temperature: float = 1.0, with_entropy: bool = False,
             entropy_grad: bool = False, fused: bool | None = None, chunk: int = 0):
    """log π(x_{t+1} | x_≤t) from logits / `temperature` (as sampled) at the positions `batch["response_mask"]`
    selects, 0 elsewhere: [N, L−1] fp32; and the entropy per position (detached, or differentiable with
    `entropy_grad`), or None. `model`: module or engine. `fused` forces a path (None: the fused one wherever the
    model allows it and no differentiable entropy is asked)."""
    if fused is None:
        fused = supports_fused(getattr(model, "module", model)) and not entropy_grad
    if fused:
        logp, ent = _fused(model, batch, temperature, chunk)
    else:
        logp, ent = _plain(model, batch, temperature, entropy_grad)
    return logp, (ent if with_entropy else None)


@torch.no_grad()
def batched_logprobs(model, batch: dict, micro: int, temperature: float = 1.0, fused: bool | None = None) -> torch.Tensor:
    """`logprobs` without gradients over a whole batch, `micro` rows at a time (π_old, π_ref)."""
    n = batch["input_ids"].shape[0]
    return torch.cat([logprobs(model, {k: v[i : i + micro] for k, v in batch.items()}, temperature=temperature,
                               fused=fused)[0] for i in range(0, n, micro)])
