"""Split-KV ("flash-decoding") attention for one new token per row with grouped-query heads, as a Triton kernel.

    o = softmax(q·kᵀ·scale + bias)·v    q [B, KV, G, D] (the G query heads of each KV head), k, v [B, KV, n, D],
                                        bias [B, n] (0 where a slot is attended, a large negative number elsewhere)

The fused SDPA kernels give each (row, KV head) one thread block that walks the whole cache: at 64 rows × 2 KV
heads that is 128 blocks on 132 multiprocessors, each reading its K/V slot after slot, and the decode step's
attention ran at ~7x the time its K/V bytes take to read (docs/results-history.md). Here the cache is cut into
chunks of SPLIT slots: one program per (row, KV head, chunk) computes its chunk's softmax-weighted sum of V and its
log-sum-exp (the G query heads of the KV head are the rows of one small matmul), and the chunks are combined by
their log-sum-exps (Dao et al., "Flash-Decoding for long-context inference", 2023):

    o = Σ_s exp(lse_s − M) · o_s / Σ_s exp(lse_s − M),   M = max_s lse_s

`attention` is a torch custom op (torch.library.triton_op), so the fast decoder's compiled step traces it and its
CUDA graph holds it. On a CPU (or without Triton) the decoder keeps SDPA; `TRITON_INTERPRET=1` runs the kernel on
CPU tensors (tests/test_decode_attention.py).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs: the decoder uses SDPA
    triton = None

SPLIT = 128  # cache slots per program
BLOCK_N = 32  # slots per inner iteration


def available() -> bool:
    return triton is not None


def supports(head_dim: int, group: int) -> bool:
    """Shapes the kernel is written for: a power-of-two head dim of 16..256 and at most 64 query heads per KV head."""
    return available() and head_dim in (16, 32, 64, 128, 256) and 1 <= group <= 64


if triton is not None:

    @triton.jit
    def _chunk(Q, K, V, Bias, O, L, n, scale,
               s_qb, s_qh, s_qg, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, s_bb,
               s_ob, s_oh, s_os, s_og, s_lb, s_lh, s_ls,
               KV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, SPLIT: tl.constexpr,
               BLOCK_N: tl.constexpr):
        bh, s = tl.program_id(0), tl.program_id(1)
        b, h = bh // KV, bh % KV
        g, d = tl.arange(0, GP), tl.arange(0, D)
        q = tl.load(Q + b * s_qb + h * s_qh + g[:, None] * s_qg + d[None, :], mask=g[:, None] < G, other=0.0)
        m = tl.full([GP], float("-inf"), tl.float32)
        l = tl.zeros([GP], tl.float32)  # noqa: E741
        acc = tl.zeros([GP, D], tl.float32)
        lo = s * SPLIT
        hi = tl.minimum(lo + SPLIT, n)
        for j in range(lo, hi, BLOCK_N):
            cols = j + tl.arange(0, BLOCK_N)
            ok = cols < hi
            k = tl.load(K + b * s_kb + h * s_kh + cols[:, None] * s_kn + d[None, :], mask=ok[:, None], other=0.0)
            x = (tl.dot(q, tl.trans(k)) * scale).to(tl.float32)  # a scalar argument may arrive as fp64
            x += tl.load(Bias + b * s_bb + cols, mask=ok, other=float("-inf"))[None, :]
            m_new = tl.maximum(m, tl.max(x, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(x - m_safe[:, None])
            alpha = tl.exp(m - m_safe)
            v = tl.load(V + b * s_vb + h * s_vh + cols[:, None] * s_vn + d[None, :], mask=ok[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            l = l * alpha + tl.sum(p, 1)  # noqa: E741
            m = m_new
        out = acc / tl.where(l == 0.0, 1.0, l)[:, None]
        lse = tl.where(l == 0.0, float("-inf"), m + tl.log(tl.where(l == 0.0, 1.0, l)))
        tl.store(O + b * s_ob + h * s_oh + s * s_os + g[:, None] * s_og + d[None, :], out, mask=g[:, None] < G)
        tl.store(L + b * s_lb + h * s_lh + s * s_ls + g, lse, mask=g < G)

    @torch.library.triton_op("align::decode_attention", mutates_args=())
    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float) -> torch.Tensor:
        """softmax(q·kᵀ·scale + bias)·v: q [B, KV, G, D], k/v [B, KV, n, D] (last dim contiguous), bias [B, n]."""
        B, KV, G, D = q.shape
        n = k.shape[2]
        S = triton.cdiv(n, SPLIT)
        o_s = torch.empty((B, KV, S, G, D), device=q.device, dtype=torch.float32)
        lse_s = torch.empty((B, KV, S, G), device=q.device, dtype=torch.float32)
        q = q.contiguous()
        torch.library.wrap_triton(_chunk)[(B * KV, S)](
            q, k, v, bias, o_s, lse_s, n, scale,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), bias.stride(0),
            o_s.stride(0), o_s.stride(1), o_s.stride(2), o_s.stride(3), lse_s.stride(0), lse_s.stride(1),
            lse_s.stride(2), KV=KV, G=G, GP=max(16, triton.next_power_of_2(G)), D=D, SPLIT=SPLIT, BLOCK_N=BLOCK_N)
        w = torch.softmax(lse_s, dim=2)  # exp(lse_s − M) / Σ exp(lse_s − M) over the chunks
        return (o_s * w[..., None]).sum(2).to(q.dtype)
