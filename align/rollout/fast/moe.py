"""The fast decoder's mixture-of-experts MLP (Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral), as the HF MoE block computes it:
the router's top-k experts of each token, their SwiGLU MLPs (HF v5 keeps each layer's experts as two 3-D tensors,
`gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I]) weighted by the gate, summed (Qwen2-MoE then adds its gated
shared expert: align.rollout.fast.layers.LayerMath._shared_expert).

Grouped, never a Python loop over experts, and with no data-dependent shape or host sync, so that the decode step
stays capturable in a CUDA graph:

* `experts_grouped`: the N·k (token, expert) pairs sorted by expert, each expert's rows one group of
  `torch._grouped_mm` (offsets on the device), then un-sorted and summed per token. Where this torch runs it for the
  device and dtype (`grouped_mm_works`: CUDA bf16 on sm80+/sm90, CPU).
* `experts_gathered`: each pair's expert matrices gathered (W_EIH[idx_NK] → [N, k, 2I, H]) and multiplied as a
  batch (einsum); the fallback, in token chunks of at most GATHER_BYTES gathered weights.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from align.routing_replay import gate_weights

GATHER_BYTES = 256 << 20  # the gathered expert weights of one chunk of tokens (experts_gathered)


def route(logits_NE: torch.Tensor, k: int, renorm: bool, fp32_weights: bool):
    """The router's top-k experts and their gate weights, as the HF MoE router computes them: p = softmax(logits)
    in fp32, the k largest p (their experts `idx_NK`, in descending order), renormalised to sum to 1 where the
    family does (`renorm`: Mixtral always — top-k then a softmax over the chosen, Jiang et al. 2024 "Mixtral of
    Experts" eq. 1 —, Qwen3-MoE, Qwen2-MoE and OLMoE with `norm_topk_prob`); the weights in the logits' dtype, or
    in fp32 (`fp32_weights`: Mixtral's router returns them so)."""
    p = logits_NE.float().softmax(-1)
    w_NK, idx_NK = p.topk(k, dim=-1)
    return idx_NK, gate_weights(w_NK, renorm, logits_NE.dtype, fp32_weights)


def swiglu(gu: torch.Tensor) -> torch.Tensor:
    g, u = gu.chunk(2, dim=-1)
    return F.silu(g) * u


def experts_gathered(x_NH: torch.Tensor, gu_EIH: torch.Tensor, down_EHI: torch.Tensor, idx_NK: torch.Tensor,
                     w_NK: torch.Tensor) -> torch.Tensor:
    """Σ_k w_nk · down_e(silu(gate_e(x_n)) · up_e(x_n)), e = idx_nk: each token's k experts' matrices gathered and
    multiplied as a batch, in chunks of tokens whose gathered weights stay under GATHER_BYTES (static: graph-safe)."""
    N, K = idx_NK.shape
    per_token = K * (gu_EIH[0].numel() + down_EHI[0].numel()) * gu_EIH.element_size()
    step = max(1, GATHER_BYTES // per_token)
    out = []
    for s in range(0, N, step):
        x, idx, w = x_NH[s : s + step], idx_NK[s : s + step], w_NK[s : s + step]
        a = swiglu(torch.einsum("nh,nkih->nki", x, gu_EIH[idx]))
        y = torch.einsum("nki,nkhi->nkh", a, down_EHI[idx])
        out.append((y * w[..., None]).to(x.dtype).sum(1))
    return torch.cat(out) if len(out) > 1 else out[0]


def experts_grouped(x_NH: torch.Tensor, gu_EIH: torch.Tensor, down_EHI: torch.Tensor, idx_NK: torch.Tensor,
                    w_NK: torch.Tensor) -> torch.Tensor:
    """`experts_gathered`'s sum with torch._grouped_mm: the N·k (token, expert) pairs sorted by expert (stable),
    expert e's rows the e-th group (offsets: the cumulative counts, on the device), one grouped GEMM for gate/up
    and one for down, then each pair's row back in place and the k rows of a token summed (no atomics:
    deterministic)."""
    N, K = idx_NK.shape
    E = gu_EIH.shape[0]
    flat = idx_NK.reshape(-1)
    order = flat.argsort(stable=True)
    counts = torch.zeros(E, dtype=torch.int32, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = counts.cumsum(0, dtype=torch.int32)
    xs = x_NH[order // K]
    a = swiglu(torch._grouped_mm(xs, gu_EIH.transpose(1, 2), offs=offs))
    y = torch._grouped_mm(a, down_EHI.transpose(1, 2), offs=offs)
    y = (y * w_NK.reshape(-1)[order, None]).to(x_NH.dtype)
    back = torch.empty_like(y).index_copy_(0, order, y)
    return back.view(N, K, -1).sum(1)


@functools.cache
def grouped_mm_works(device_type: str, dtype: torch.dtype, hidden: int, inter: int) -> bool:
    """Whether this torch runs torch._grouped_mm for experts of these dimensions on this device and dtype (a tiny
    probe, once: the kernel's device, dtype and alignment rules changed across releases; CUDA only in bf16)."""
    if not hasattr(torch, "_grouped_mm") or (device_type == "cuda" and dtype != torch.bfloat16):
        return False
    try:
        x = torch.zeros(4, hidden, dtype=dtype, device=device_type)
        gu = torch.zeros(2, 2 * inter, hidden, dtype=dtype, device=device_type)
        down = torch.zeros(2, hidden, inter, dtype=dtype, device=device_type)
        idx = torch.tensor([[0, 1], [1, 0], [0, 1], [1, 0]], device=device_type)
        experts_grouped(x, gu, down, idx, torch.ones(4, 2, dtype=dtype, device=device_type))
        return True
    except (RuntimeError, NotImplementedError):
        return False
