"""Variable-length attention for packed rows: sequences laid end to end in one row, each attending causally to
itself alone, with no padding and no [T, T] mask (FlashAttention-2's varlen interface, Dao 2023, §3.1: the
sequences' boundaries given as cumulative lengths `cu_seqlens`, e.g. lengths 3, 5 → [0, 3, 8]).

`enable(module)` switches a transformers model to the attention function `attention` (registered as
`align_varlen`): a forward given `cu_seq_lens_q` / `max_length_q` (what `align.logprobs.Packing.pack` adds)
runs `varlen_attn` over the flattened rows; any other forward (a padded batch, HF generate with its cache) runs
transformers' own SDPA attention with its usual mask, unchanged. The boundaries travel as forward arguments, so a
layer recomputed under gradient checkpointing sees them again.

On CUDA the kernel is PyTorch's `torch.nn.attention.varlen.varlen_attn` (flash attention, fused backward); on
other devices each sequence runs causal SDPA on its own (`_segments`: the reference the kernel is tested against,
and the CPU path of the tests).
"""

from __future__ import annotations

import functools
import inspect
import itertools

import torch
import torch.nn.functional as F

NAME = "align_varlen"
# set by `register` (outside any compiled region: the attention below runs inside compiled blocks)
_KERNEL = None  # torch.nn.attention.varlen.varlen_attn, where this torch has it
_TAKES: frozenset = frozenset()  # the keyword arguments it takes (scale, enable_gqa, window_size / is_causal)
_SDPA = None  # transformers' SDPA attention function


def cu_seqlens(lengths: list[int], device=None) -> torch.Tensor:
    """Cumulative sequence lengths [0, l₀, l₀+l₁, …] (int32, as flash-attention takes them)."""
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)


def _segments(q_TH, k_TH, v_TH, cu: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of each segment [cu_i, cu_{i+1}) of the flat [T, H, D] tensors on its own (SDPA per
    segment, grouped-query heads expanded): the definition varlen attention computes."""
    out = torch.empty_like(q_TH)
    for s, e in itertools.pairwise(cu.tolist()):
        if e == s:
            continue
        q, k, v = (x[s:e].transpose(0, 1)[None] for x in (q_TH, k_TH, v_TH))  # [1, H, n, D]
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
        out[s:e] = o[0].transpose(0, 1)
    return out


@functools.cache
def _kernel():
    """PyTorch's varlen_attn (None where this torch has none) and the names of its parameters: its signature
    grew over releases (is_causal, then scale, window_size, enable_gqa)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None, frozenset()
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


def varlen_causal(q_TH, k_TH, v_TH, cu: torch.Tensor, max_len: int, scale: float) -> torch.Tensor:
    """Causal attention within each segment of the flat rows: softmax(q·kᵀ·scale + causal mask) · v per
    sequence. q [T, Hq, D], k / v [T, Hkv, D] (Hq a multiple of Hkv: grouped-query attention), cu int32 [S+1]."""
    fn = _KERNEL if q_TH.is_cuda else None
    if fn is None:
        return _segments(q_TH, k_TH, v_TH, cu, scale)
    kw = {"window_size": (-1, 0)} if "window_size" in _TAKES else {"is_causal": True}
    if "scale" in _TAKES:
        kw["scale"] = scale
    elif abs(scale - q_TH.shape[-1] ** -0.5) > 1e-6:
        raise NotImplementedError(f"varlen attention with scale {scale} needs a newer torch")
    g = q_TH.shape[1] // k_TH.shape[1]
    if g > 1 and "enable_gqa" in _TAKES:
        kw["enable_gqa"] = True
    elif g > 1:  # this torch's kernel takes as many K/V heads as query heads
        k_TH, v_TH = k_TH.repeat_interleave(g, 1), v_TH.repeat_interleave(g, 1)
    return fn(q_TH, k_TH, v_TH, cu, cu, max_len, max_len, **kw)


def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention interface (query [B, Hq, T, D], key / value [B, Hkv, T, D] → [B, T, Hq, D], None):
    varlen attention where the forward carries `cu_seq_lens_q` (the B rows flattened, the boundaries over all of
    them), else transformers' SDPA attention."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        return _SDPA(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    if dropout or kwargs.get("sliding_window"):
        raise NotImplementedError("packed forwards take no attention dropout nor sliding window")
    B, Hq, T, D = query.shape
    flat = lambda x: x.transpose(1, 2).reshape(B * T, x.shape[1], D)  # noqa: E731  [B·T, H, D]
    scale = scaling if scaling is not None else D ** -0.5
    out = varlen_causal(flat(query), flat(key), flat(value), cu, int(kwargs["max_length_q"]), scale)
    return out.view(B, T, Hq, D), None


def register() -> None:
    global _KERNEL, _TAKES, _SDPA
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    _KERNEL, _TAKES = _kernel()
    _SDPA = sdpa_attention_forward
    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)  # its usual mask; a packed forward's goes unused


def available(module) -> bool:
    """Whether packed forwards of `module` run varlen attention: a CUDA model with PyTorch's varlen kernel whose
    transformers class takes an attention function (config._attn_implementation), attending with SDPA now."""
    p = next(module.parameters(), None)
    return (p is not None and p.is_cuda and _kernel()[0] is not None and getattr(module, "_supports_attention_backend",
            False) and getattr(module.config, "_attn_implementation", None) in ("sdpa", NAME))


def enable(module, force: bool = False) -> bool:
    """Switch `module` (a transformers model, or a DeepSpeed engine's) to `attention` where `available` (or
    `force`: the per-segment SDPA path on any device, for tests); True where its forwards now take
    `cu_seq_lens_q`."""
    module = getattr(module, "module", module)
    if getattr(module.config, "_attn_implementation", None) == NAME:
        return True
    if not (force or available(module)):
        return False
    register()
    module.config._attn_implementation = NAME
    for m in module.modules():  # sub-configs (a text model inside a wrapper) read their own
        cfg = getattr(m, "config", None)
        if cfg is not None and getattr(cfg, "_attn_implementation", None) == "sdpa":
            cfg._attn_implementation = NAME
    return True
