"""The split-KV decode attention kernel (align.rollout.fast.decode_attention) against SDPA, run by Triton's
interpreter on CPU tensors (TRITON_INTERPRET=1; the interpreter's bf16 matmul is wrong, so fp32 and fp16 here: bf16
is checked on a GPU by tests/test_gpu_paths.py). Needs Triton, which the CPU install does not carry: skipped
without it."""

import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

from align.rollout.fast import decode_attention  # noqa: E402

NEG = torch.finfo(torch.float32).min


@pytest.mark.parametrize("B,KV,G,D,n,dtype", [(3, 2, 6, 64, 384, torch.float32), (2, 1, 4, 32, 256, torch.float16),
                                              (2, 2, 1, 16, 40, torch.float32), (1, 1, 16, 16, 129, torch.float32)])
def test_split_kv_attention_equals_sdpa_with_padding_and_unwritten_slots(B, KV, G, D, n, dtype):
    """Left padding (row 0's first 150 slots: a whole 128-slot chunk masked), slots past the written ones masked
    for every row, a last chunk shorter than 128 slots: the chunks' log-sum-exp combination is the softmax over
    the attended slots."""
    g = torch.Generator().manual_seed(B * 100 + n)
    q, k, v = (torch.randn(B, KV, G if i == 0 else n + 7, D, generator=g).to(dtype) for i in range(3))
    k, v = k[:, :, :n], v[:, :, :n]  # views of a longer cache, as the decoder passes them
    bias = torch.zeros(B, n + 7)
    bias[0, : min(150, n - 5)] = NEG
    bias[:, n - 3:] = NEG
    bias = bias[:, :n]
    got = decode_attention.attention(q, k, v, bias, 0.17)
    want = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=bias[:, None, None],
                                                            scale=0.17)
    assert got.dtype == dtype and got.shape == (B, KV, G, D)
    torch.testing.assert_close(got.float(), want, atol=2e-3 if dtype == torch.float16 else 1e-5, rtol=1e-3)
