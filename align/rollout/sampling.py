"""Sampling whose random numbers belong to the prompt, not to the batch: the same samples for any batch size,
number of processes, or company of other prompts.

Every prompt gets a 32-bit key from the sampling seed and its index in the prompt list (`prompt_keys`). The noise
of the token at position t of that prompt's completion is a hash of (key, t, vocabulary index), a counter-based
generator: stateless, so a row's noise never depends on which rows share its batch, and cheap enough to compute
inside the compiled decode step (fused into the sampling kernel, nothing materialised). A token is drawn by the
exponential race, argmax(p / E) with E ~ Exp(1) per vocabulary entry, which samples softmax(z) exactly like a
multinomial draw. HF `generate` (a logits processor) and the fast decoder (align.rollout.fast) share `filter_logits`
(top-k, top-p) and `choose`, so they sample the same tokens from the same logits.
"""

from __future__ import annotations

import torch

M32 = 0xFFFFFFFF
M64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """SplitMix64's finaliser on a Python int (host side: keys)."""
    x = (x + 0x9E3779B97F4A7C15) & M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


def derive(seed: int, *parts: int) -> int:
    """A 64-bit seed from `seed` and integer `parts` (e.g. a step), each mixed in turn."""
    x = _splitmix64(seed & M64)
    for p in parts:
        x = _splitmix64(x ^ (p & M64))
    return x


def prompt_keys(seed: int, indices) -> list[int]:
    """The 32-bit sampling key of each prompt index under `seed`."""
    return [derive(seed, i) & M32 for i in indices]


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for int64 tensors holding 32-bit values, without a 64-bit overflow (c split in 16-bit
    halves: every product stays below 2^48)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & M32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finaliser (a bijection with full avalanche) on int64 tensors holding 32-bit values."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def exponential_noise(keys: torch.Tensor, position, vocab: int) -> torch.Tensor:
    """[B, vocab] float32 Exp(1) noise of the token at `position` (an int or a 1-element tensor) of the rows
    whose keys are `keys` [B] (int64)."""
    row = _fmix32((keys + position * 0x9E3779B9) & M32)  # position < 2^31: the product stays below 2^63
    col = _mul32(torch.arange(vocab, device=keys.device), 0x27D4EB2F)  # odd: a bijection of the vocabulary index
    h = _fmix32(row[:, None] ^ col[None, :])
    u = ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))  # 24 bits: in (0, 1), exact in float32
    return -torch.log(u)


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Top-k then top-p (nucleus) filtering of [B, V] fp32 logits (already divided by the temperature); the
    same rule as HF's warpers: keep the smallest set whose probability reaches top_p, always the top token."""
    neg = torch.finfo(logits.dtype).min
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, neg)
    if top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, descending=False, dim=-1)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        remove_sorted = cum <= (1 - top_p)
        remove_sorted[:, -1] = False
        remove = remove_sorted.scatter(1, idx, remove_sorted)
        logits = logits.masked_fill(remove, neg)
    return logits


def choose(z: torch.Tensor, keys: torch.Tensor, position) -> torch.Tensor:
    """[B] tokens sampled from softmax(z) ([B, V] fp32 logits, already divided by the temperature and filtered) by
    the exponential race with each row's keyed noise."""
    return (z.softmax(-1) / exponential_noise(keys, position, z.shape[-1])).argmax(-1)


def sampled_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """[B] log_softmax(logits / T)[token] in fp32: the sampler's log-probability of the tokens it drew from [B, V]
    logits, unfiltered (top-k / top-p not applied), as the trainer scores them (align.logprobs)."""
    return (logits.float() / temperature).log_softmax(-1).gather(-1, tokens[:, None])[:, 0]
