"""AdamW that updates bf16 weights with stochastic rounding (--precision bf16-pure).

A bf16 weight near 1.0 moves in steps of 2^-7 ≈ 0.008; an AdamW update at lr 1e-5 is ~1e-5, so round-to-nearest
throws every such update away and a bf16 model stepped in bf16 does not learn (TRL's bf16 path at lr 1e-5).
Stochastic rounding (Gupta et al. 2015, "Deep Learning with Limited Numerical Precision"; Zamirai et al. 2020,
"Revisiting BFloat16 Training") rounds the fp32 result up or down with probability proportional to its distance
from each neighbour, so E[SR(x)] = x: small updates survive in expectation and the weights follow the fp32
trajectory up to zero-mean noise, with the memory of plain bf16 training (bf16 weights, gradients and moments:
8 bytes per parameter, against 16 for fp32 master weights + fp32 moments).
"""

from __future__ import annotations

import torch


def stochastic_round_bf16(x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """fp32 → bf16 with stochastic rounding: E[SR(x)] = x.

    bf16 is fp32 with the low 16 mantissa bits dropped. Adding a uniform integer in [0, 2^16) to the fp32 bit
    pattern and then truncating those 16 bits carries into the kept bits with probability (low bits) / 2^16 —
    exactly the distance to the lower neighbour over the gap. Sign-magnitude makes this the same for negative
    numbers (the magnitude rounds up or down); a carry out of the mantissa moves the exponent, as it should.
    Values bf16 holds exactly (low bits 0) never move."""
    bits = x.to(torch.float32).contiguous().view(torch.int32)
    noise = torch.randint(0, 1 << 16, bits.shape, dtype=torch.int32, device=x.device, generator=generator)
    return ((bits + noise) & -65536).view(torch.float32).to(torch.bfloat16)


class AdamWSR(torch.optim.Optimizer):
    """AdamW (Loshchilov & Hutter 2019) whose arithmetic runs in fp32 and whose bf16 parameters are written back
    with stochastic rounding; moments are kept in the parameter's dtype (rounded to nearest). For fp32
    parameters it is plain AdamW:

        m ← β1 m + (1 − β1) g,   v ← β2 v + (1 − β2) g²
        θ ← SR( θ (1 − lr λ) − lr · (m / (1 − β1^t)) / (√(v / (1 − β2^t)) + ε) )
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.01):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                t = state["step"].item()
                g = p.grad.float()
                m = state["exp_avg"].float().mul_(b1).add_(g, alpha=1 - b1)
                v = state["exp_avg_sq"].float().mul_(b2).addcmul_(g, g, value=1 - b2)
                state["exp_avg"].copy_(m)
                state["exp_avg_sq"].copy_(v)
                denom = (v / (1 - b2**t)).sqrt_().add_(eps)  # v may be the state itself (fp32)
                x = p.float().mul_(1 - lr * wd).addcdiv_(m, denom, value=-lr / (1 - b1**t))
                p.copy_(stochastic_round_bf16(x) if p.dtype == torch.bfloat16 else x)
        return loss
