"""FP8 rollouts (`--rollout-precision fp8`): the fast decoder's linear layers (q/k/v, o, gate/up, down) read E4M3
weights and multiply in FP8, the training stays in bf16.

Scaling as in "FP8 Formats for Deep Learning" (Micikevicius et al. 2022) with fine-grained scales: each weight
row (output channel) n gets its own scale s_n = max_k |W_nk| / 448 (448: E4M3's largest finite value), each
activation row (token) m its own s_m = max_k |x_mk| / 448, computed on the fly; the product is

    y_mn = s_m · s_n · Σ_k Q(x_mk / s_m) · Q(W_nk / s_n)

with Q the rounding to E4M3, accumulated in fp32 (`torch._scaled_mm`, the Hopper FP8 tensor-core GEMM on a GPU).
A decode step reads each weight once, so its time is the weights' bytes over the memory bandwidth: half of
bf16's. The embedding, the norms, the biases and the LM head stay in the trainer's dtype (the sampled tokens'
log-probs come from the head's logits). The sampler then differs from the trainer by the rounding:
`rollout/logp_abs_diff` measures it and truncated importance sampling (`--tis-cap`) corrects the update for it.
"""

from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
TINY = 1e-12  # the scale of an all-zero row: its quantised values are 0 whatever it is


def supported(shape: tuple[int, ...]) -> bool:
    """Whether a weight [N, K] can be an FP8 GEMM operand: the GPU kernel wants N and K multiples of 16."""
    return len(shape) == 2 and shape[0] % 16 == 0 and shape[1] % 16 == 0


def row_scales(x: torch.Tensor) -> torch.Tensor:
    """s = max |x| / 448 along the last dimension (fp32, keepdim): the row's largest magnitude maps to E4M3's."""
    return x.abs().amax(-1, keepdim=True).float().clamp(min=TINY) / E4M3_MAX


def quantize_rows(w_NK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(Q(W / s), s): E4M3 values [N, K] and the fp32 scale of each row [N]; W ≈ Q(W / s) · s."""
    s = row_scales(w_NK)
    return (w_NK.float() / s).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), s.squeeze(-1)


def fp8_linear(x: torch.Tensor, w8_NK: torch.Tensor, s_N: torch.Tensor,
               b_N: torch.Tensor | None = None) -> torch.Tensor:
    """x·Wᵀ (+ b) with x quantised per row (token) on the fly and W given quantised per row (`quantize_rows`):
    x [..., K] in bf16 / fp16 / fp32, returned in x's dtype."""
    lead, K = x.shape[:-1], x.shape[-1]
    x_MK = x.reshape(-1, K)
    s_M = row_scales(x_MK)
    x8 = (x_MK.float() / s_M).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    y = torch._scaled_mm(x8, w8_NK.t(), scale_a=s_M, scale_b=s_N[None], out_dtype=x.dtype)
    if b_N is not None:
        y = y + b_N
    return y.view(*lead, w8_NK.shape[0])
