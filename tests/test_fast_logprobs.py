"""align.fast_logprobs: the chunked linear + selective log-softmax gives the same log-probs, entropies and
gradients as full logits + log_softmax (CPU, fp64/fp32)."""

import torch

from align.fast_logprobs import fused_logprobs, linear_logprobs
from align.rl import entropy_from_logits
from align.rollout import forward_logprobs


def test_linear_logprobs_matches_log_softmax_and_grads():
    torch.manual_seed(0)
    h = torch.randn(37, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, 50, (37,))
    g = torch.randn(37, dtype=torch.float64)
    lp, ent = linear_logprobs(h, w, ids, chunk=8)
    z = h @ w.t()
    ref = z.log_softmax(-1).gather(-1, ids[:, None]).squeeze(-1)
    torch.testing.assert_close(lp.double(), ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ent.double(), entropy_from_logits(z.detach()).double(), rtol=1e-5, atol=1e-5)
    gh, gw = torch.autograd.grad((lp * g).sum(), (h, w))
    rh, rw = torch.autograd.grad((ref * g).sum(), (h, w))
    torch.testing.assert_close(gh, rh, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gw, rw, rtol=1e-5, atol=1e-6)


def test_fused_logprobs_on_a_model_matches_the_plain_path():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    m = LlamaForCausalLM(LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                     intermediate_size=64, vocab_size=101, tie_word_embeddings=True))
    ids = torch.randint(3, 101, (3, 9))
    attn = torch.ones_like(ids)
    attn[2, 7:] = 0
    resp = torch.zeros(3, 8)
    resp[:, 3:7] = 1
    batch = {"input_ids": ids, "attention_mask": attn, "response_mask": resp}
    lp, ent = fused_logprobs(m, batch, with_entropy=True, chunk=5)
    rlp, rent = forward_logprobs(m, batch, with_entropy=True)
    torch.testing.assert_close(lp * resp, rlp * resp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent * resp, rent * resp, rtol=1e-4, atol=1e-4)
    g1 = torch.autograd.grad((lp * resp).sum(), list(m.parameters()))
    g2 = torch.autograd.grad((rlp * resp).sum(), list(m.parameters()))
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert "forward" not in vars(m.lm_head)  # the head is restored


def test_bf16_gradients_match_fp64_within_bf16_rounding():
    """The backward slices the vocabulary (uneven last slice here) and writes grad_w in bf16: each element is one
    GEMM's sum, rounded once, so it stays within bf16 rounding of the exact fp64 gradient."""
    torch.manual_seed(1)
    h64 = torch.randn(29, 24, dtype=torch.float64)
    w64 = torch.randn(70, 24, dtype=torch.float64) / 4
    ids = torch.randint(0, 70, (29,))
    g = torch.randn(29, dtype=torch.float64)
    h, w = h64.bfloat16().requires_grad_(), w64.bfloat16().requires_grad_()
    gh, gw = torch.autograd.grad((linear_logprobs(h, w, ids, chunk=6)[0] * g.float()).sum(), (h, w))
    assert gh.dtype == gw.dtype == torch.bfloat16
    hr, wr = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = (hr @ wr.t()).log_softmax(-1).gather(-1, ids[:, None]).squeeze(-1)
    rh, rw = torch.autograd.grad((ref * g).sum(), (hr, wr))
    for got, want in ((gh, rh), (gw, rw)):
        err = (got.double() - want).abs().max() / want.abs().max()
        assert err < 2e-2, err
