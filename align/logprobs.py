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

from align import routing_replay, vision
from align.moe import is_moe, routed_tokens
from align.objectives.tokens import entropy_from_logits, token_logprobs
from align.varlen import cu_seqlens, enable as enable_varlen


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
        return model(input_ids=ids, **_forward_kwargs(model, batch)).logits


def _plain(model, batch: dict, temperature: float, entropy_grad: bool):
    logits = model(input_ids=batch["input_ids"], **_forward_kwargs(model, batch)).logits[:, :-1]
    if temperature != 1.0:
        logits = logits / temperature
    mask = batch["response_mask"].to(torch.float32)
    logp = token_logprobs(logits, batch["input_ids"][:, 1:]) * mask
    return logp, entropy_from_logits(logits if entropy_grad else logits.detach()) * mask


VARLEN_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def _context(batch: dict) -> dict:
    """attention_mask (absent: a right-padded batch, where causal attention never looks at the padding),
    position_ids (packed rows), the packed sequences' boundaries (varlen attention, align.varlen) and a
    vision-language model's images (align.vision) when the batch has them; never a KV cache."""
    kw = {k: batch[k] for k in ("attention_mask", "position_ids", *VARLEN_KEYS) if batch.get(k) is not None}
    return {**kw, **vision.forward_images(batch), "use_cache": False}


def _forward_kwargs(model, batch: dict) -> dict:
    """_context, and the rollout's routes where the model replays them (align.routing_replay)."""
    return {**_context(batch), **routing_replay.forward_kwargs(model, batch)}


# ---- padding-free forwards


class Packing:
    """Where each sequence of a right-padded batch goes when the batch is packed (`packing`): the sequences (their
    tokens up to the last one a response position predicts) first-fit by decreasing length into rows `width`
    wide, `position_ids` restarting at 0 for each, so that none attends to another: transformers gives every
    sequence its own causal block (align.data.pack_examples), or, with `varlen`, varlen attention reads the
    boundaries (`cu_seq_lens_q`: one row holding every sequence, no padding, no mask; align.varlen). `src` /
    `dst`: the flat indices of the packed and the padded prediction positions ([rows, width − 1] and [N, L − 1])
    that hold the same prediction."""

    def __init__(self, lengths: list[int], width: int, shape: tuple[int, int], varlen: bool = False):
        self.shape = shape  # the padded batch's [N, L]
        self.width = width
        self.varlen = varlen
        self.rows: list[list[tuple[int, int]]] = []  # per packed row: (sequence, offset)
        used: list[int] = []
        for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
            r = next((r for r, u in enumerate(used) if u + lengths[i] <= width), None)
            if r is None:
                self.rows.append([]), used.append(0)
                r = len(used) - 1
            self.rows[r].append((i, used[r]))
            used[r] += lengths[i]
        self.lengths, self.used = lengths, used
        src, dst = [], []
        for r, seqs in enumerate(self.rows):
            for i, o in seqs:
                n = lengths[i] - 1  # the sequence's prediction positions
                src += range(r * (width - 1) + o, r * (width - 1) + o + n)
                dst += range(i * (shape[1] - 1), i * (shape[1] - 1) + n)
        self.src, self.dst = torch.tensor(src, dtype=torch.long), torch.tensor(dst, dtype=torch.long)

    @property
    def tokens(self) -> int:
        """Token positions the packed batch runs (the padded batch: N × L)."""
        return len(self.rows) * self.width

    def pack(self, batch: dict) -> dict:
        """input_ids, position_ids, token_mask (the sequences' tokens, not the rows' padding) [rows, width] and
        response_mask [rows, width − 1] of the packed batch."""
        ids, resp = batch["input_ids"], batch["response_mask"]
        R, W, dev = len(self.rows), self.width, ids.device
        out_ids = torch.zeros(R, W, dtype=ids.dtype, device=dev)
        pos = torch.zeros(R, W, dtype=torch.long)
        for r, seqs in enumerate(self.rows):
            for i, o in seqs:
                n = self.lengths[i]
                out_ids[r, o : o + n] = ids[i, :n]
                pos[r, o : o + n] = torch.arange(n)
            pos[r, self.used[r]:] = torch.arange(W - self.used[r])  # the row's padding: a segment of its own
        mask = torch.zeros(R * (W - 1), dtype=resp.dtype, device=dev)
        mask[self.src.to(dev)] = resp.reshape(-1)[self.dst.to(dev)]
        used = torch.tensor(self.used, device=dev)
        out = {"input_ids": out_ids, "position_ids": pos.to(dev), "response_mask": mask.view(R, W - 1),
               "token_mask": torch.arange(W, device=dev)[None] < used[:, None]}
        routes = batch.get(routing_replay.KWARG)
        if routes is not None:  # each sequence's routes where its tokens went; -1 (own routing) on the padding
            packed = routes.new_full((R, W, *routes.shape[2:]), -1)
            for r, seqs in enumerate(self.rows):
                for i, o in seqs:
                    packed[r, o : o + self.lengths[i]] = routes[i, : self.lengths[i]]
            out[routing_replay.KWARG] = packed
        if self.varlen:
            seg = self.segments()
            cu = cu_seqlens(seg, dev)
            out.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(seg), max_length_k=max(seg))
        return out

    def segments(self) -> list[int]:
        """The lengths of the causal segments of the flattened rows, in order: each row's sequences, then its
        padding (a segment of its own)."""
        out = []
        for r, seqs in enumerate(self.rows):
            out += [self.lengths[i] for i, _ in seqs]
            if self.used[r] < self.width:
                out.append(self.width - self.used[r])
        return out

    def unpack(self, x: torch.Tensor | None) -> torch.Tensor | None:
        """A packed per-position tensor [rows, width − 1] in the padded batch's layout [N, L − 1] (0 elsewhere);
        differentiable."""
        if x is None:
            return None
        N, L = self.shape
        out = x.new_zeros(N * (L - 1))
        out[self.dst.to(x.device)] = x.reshape(-1)[self.src.to(x.device)]
        return out.view(N, L - 1)


def packing(batch: dict, min_saving: float = 0.0, varlen: bool = False) -> Packing | None:
    """The Packing of a right-padded batch (no attention mask, no position ids: a rollout's or DPO's batch), or None
    when packing would not save more than `min_saving` of its token positions (equal lengths: nothing to gain).
    A sequence ends at the last token its response positions predict. `varlen`: one row holding all the sequences
    (the model attends with align.varlen); else rows as wide as the longest sequence."""
    if batch.get("attention_mask") is not None or batch.get("position_ids") is not None:
        return None
    if vision.forward_images(batch):  # a VLM computes M-RoPE positions from each row's image tokens: padded rows
        from align.console import info

        info("--packing: batches with images run padded (their M-RoPE positions come from each row)", once=True)
        return None
    resp = batch["response_mask"]
    N, L = batch["input_ids"].shape
    pos = torch.arange(1, L, device=resp.device).expand(N, L - 1)
    lengths = ((resp != 0) * pos).amax(1).add(1).clamp(min=2).tolist()  # last predicted token's index + 1
    p = Packing(lengths, sum(lengths) if varlen else max(lengths), (N, L), varlen)
    return p if p.tokens < (1 - min_saving) * N * L else None


def logprobs(model, batch: dict, *, temperature: float = 1.0, with_entropy: bool = False,
             entropy_grad: bool = False, fused: bool | None = None, chunk: int = 0, pack: bool = False):
    """log π(x_{t+1} | x_≤t) from logits / `temperature` (as sampled) at the positions `batch["response_mask"]`
    selects, 0 elsewhere: [N, L−1] fp32; and the entropy per position (detached, or differentiable with
    `entropy_grad`), or None. `model`: module or engine. `fused` forces a path (None: the fused one wherever the
    model allows it and no differentiable entropy is asked). `pack`: the forward runs padding-free (`packing`:
    the sequences packed into fewer rows, or one row under varlen attention where the model allows it
    (align.varlen.enable); the same values, in the batch's layout) where that saves positions."""
    p = packing(batch, min_saving=0.1, varlen=enable_varlen(model)) if pack else None
    if p is not None:
        logp, ent = logprobs(model, p.pack(batch), temperature=temperature, with_entropy=with_entropy,
                             entropy_grad=entropy_grad, fused=fused, chunk=chunk)
        return p.unpack(logp), p.unpack(ent)
    module = getattr(model, "module", model)
    if fused is None:
        fused = supports_fused(module) and not entropy_grad
    with routed_tokens(real_tokens(batch) if is_moe(getattr(module, "config", None)) else None):
        if fused:
            logp, ent = _fused(model, batch, temperature, chunk)
        else:
            logp, ent = _plain(model, batch, temperature, entropy_grad)
    return logp, (ent if with_entropy else None)


def real_tokens(batch: dict) -> torch.Tensor | None:
    """[N, L] bool: the tokens of a batch given without an attention mask — a packed batch's `token_mask`, else a
    right-padded row's tokens up to the last one a response position predicts (what follows is padding); None
    when the batch has an attention mask (it says). A mixture-of-experts router's loss counts only these
    (align.moe.routed_tokens)."""
    if batch.get("attention_mask") is not None:
        return None
    if batch.get("token_mask") is not None:
        return batch["token_mask"]
    resp = batch["response_mask"]
    N, L = batch["input_ids"].shape
    last = ((resp != 0) * torch.arange(1, L, device=resp.device).expand(N, L - 1)).amax(1)
    return torch.arange(L, device=resp.device)[None] <= last[:, None]


@torch.no_grad()
def batched_logprobs(model, batch: dict, micro: int, temperature: float = 1.0, fused: bool | None = None,
                     pack: bool = False) -> torch.Tensor:
    """`logprobs` without gradients over a whole batch, `micro` rows at a time (π_old, π_ref)."""
    n = batch["input_ids"].shape[0]
    return torch.cat([logprobs(model, vision.select_rows(batch, slice(i, i + micro)), temperature=temperature,
                               fused=fused, pack=pack)[0] for i in range(0, n, micro)])
