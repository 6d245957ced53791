"""align.logprobs: the fused path (chunked linear + selective log-softmax) gives the same log-probs, entropies and
gradients as full logits + log_softmax (CPU, fp64/fp32), at any temperature; the entry point picks its path."""

import pytest
import torch

from align.logprobs import linear_logprobs, logprobs, supports_fused
from align.objectives.tokens import entropy_from_logits


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



def test_the_fused_backward_runs_under_the_forwards_autocast():
    """--precision bf16-mixed: the forward's GEMMs run in bf16 under autocast, and so must the backward's (torch
    runs a custom Function's backward without autocast: it would be fp32 GEMMs, several times slower on a GPU)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class MatmulDtypes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten.mm.default:
                self.seen.add(out.dtype)
            return out

    torch.manual_seed(0)
    h = torch.randn(37, 16, requires_grad=True)
    w = torch.randn(50, 16, requires_grad=True)
    ids = torch.randint(0, 50, (37,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp, _ = linear_logprobs(h, w, ids, chunk=8)
    mode = MatmulDtypes()
    with mode:
        gh, gw = torch.autograd.grad(lp.sum(), (h, w))
    assert mode.seen == {torch.bfloat16} and gh.dtype == gw.dtype == torch.float32
    rh, rw = torch.autograd.grad((h @ w.t()).log_softmax(-1).gather(-1, ids[:, None]).sum(), (h, w))
    torch.testing.assert_close(gh, rh, rtol=0.05, atol=0.05)  # bf16 GEMMs: within bf16 rounding
    torch.testing.assert_close(gw, rw, rtol=0.05, atol=0.05)
    lp, _ = linear_logprobs(h, w, ids, chunk=8)  # no autocast: fp32 throughout
    mode = MatmulDtypes()
    with mode:
        torch.autograd.grad(lp.sum(), (h, w))
    assert mode.seen == {torch.float32}

def tiny_llama(**kw):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, intermediate_size=64, vocab_size=101, **kw))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fused_logprobs_on_a_model_matches_the_plain_path(temperature):
    torch.manual_seed(0)
    m = tiny_llama(tie_word_embeddings=True)
    ids = torch.randint(3, 101, (3, 9))
    attn = torch.ones_like(ids)
    attn[2, 7:] = 0
    resp = torch.zeros(3, 8)
    resp[:, 3:7] = 1
    batch = {"input_ids": ids, "attention_mask": attn, "response_mask": resp}
    lp, ent = logprobs(m, batch, temperature=temperature, with_entropy=True, fused=True, chunk=5)
    rlp, rent = logprobs(m, batch, temperature=temperature, with_entropy=True, fused=False)
    torch.testing.assert_close(lp, rlp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, rent, rtol=1e-4, atol=1e-4)
    assert (lp[resp == 0] == 0).all() and (rlp[resp == 0] == 0).all()  # prompt and padding positions: 0
    # by hand: log softmax(logits / T) at the response positions
    logits = m(input_ids=ids, attention_mask=attn).logits[:, :-1] / temperature
    want = logits.log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0] * resp
    torch.testing.assert_close(lp, want.detach(), rtol=1e-5, atol=1e-5)
    g1 = torch.autograd.grad(lp.sum(), list(m.parameters()))
    g2 = torch.autograd.grad(rlp.sum(), list(m.parameters()))
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


def test_the_entry_point_picks_its_path():
    """fused where the head is a bias-free Linear and no differentiable entropy is asked; plain otherwise."""
    m = tiny_llama()
    assert supports_fused(m)
    m.lm_head.bias = torch.nn.Parameter(torch.zeros(101))
    assert not supports_fused(m)
    calls = []
    m2 = tiny_llama()
    m2.lm_head.register_forward_hook(lambda mod, inp, out: calls.append(type(out).__name__))
    batch = {"input_ids": torch.randint(3, 101, (2, 6)), "response_mask": torch.ones(2, 5)}
    logprobs(m2, batch)
    logprobs(m2, batch, with_entropy=True, entropy_grad=True)
    assert calls == ["tuple", "Tensor"]  # the swapped head returns (log-probs, entropies); the plain one logits


@pytest.mark.parametrize("fused,varlen", [(True, False), (False, False), (True, True), (False, True)])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_packed_forward_gives_the_padded_log_probs_entropies_and_gradients(fused, varlen, family):
    """Padding-free (`pack=True`): ragged right-padded sequences (an RL batch: prompt, response, padding; an
    episode's mask with a gap) packed first-fit into fewer rows with restarting positions, or (`varlen`) into one
    row attended with varlen attention (align.varlen: its per-segment path here, the CUDA kernel's definition),
    give the padded batch's log-probs, entropies and gradients, in its layout (0 at prompt, gap and padding
    positions)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from align import varlen as V
    from align.logprobs import packing

    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        family, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, vocab_size=101, attn_implementation="sdpa"))
    lengths = [14, 5, 9, 4, 6, 3]  # tokens per sequence; the batch is as wide as the longest
    N, L = len(lengths), max(lengths)
    ids = torch.randint(3, 101, (N, L))
    resp = torch.zeros(N, L - 1)
    for i, n in enumerate(lengths):
        ids[i, n:] = 0  # padding
        resp[i, 1 : n - 1] = 1  # position p predicts token p + 1: the response is tokens 2 .. n - 1
    resp[0, 5:8] = 0  # an environment's tokens inside the first sequence
    batch = {"input_ids": ids, "response_mask": resp}
    if varlen:
        assert V.enable(m, force=True) and m.config._attn_implementation == V.NAME
        p = packing(batch, varlen=True)
        assert len(p.rows) == 1 and p.tokens == 41  # every sequence end to end: no padding at all
        packed = p.pack(batch)
        assert packed["cu_seq_lens_q"].tolist() == [0, 14, 23, 29, 34, 38, 41] and packed["max_length_q"] == 14
    else:
        p = packing(batch)
        assert len(p.rows) == 3 and p.tokens == 3 * 14 < N * L  # [14], [9, 5], [6, 4, 3]: 42 positions for 84
        packed = p.pack(batch)
        assert packed["position_ids"][2].tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 0, 1, 2, 0]
        assert p.segments() == [14, 9, 5, 6, 4, 3, 1]  # row by row, the last row's padding a segment of its own
    got, got_ent = logprobs(m, batch, with_entropy=True, fused=fused, pack=True)
    want, want_ent = logprobs(m, batch, with_entropy=True, fused=fused)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_ent, want_ent, rtol=1e-4, atol=1e-4)
    assert (got[resp == 0] == 0).all()
    # GRPO's loss (two iterations' worth: a moved π_old, a reference) over both: the same loss and gradients
    from align.objectives.grpo import GRPOBatch, GRPOCoefs, grpo_loss

    coefs = GRPOCoefs("clip", 0.2, 0.28, 0.04, 0.0, 0.0, "token-mean", L)
    adv, old, ref = torch.randn(N), want.detach() + 0.05 * torch.randn(N, L - 1), want.detach() - 0.1
    losses = [grpo_loss(GRPOBatch(lp, old * resp, adv, resp, ref * resp), coefs, n_tokens=resp.sum(), n_seqs=N)[0]
              for lp in (got, want)]
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6)
    g1 = torch.autograd.grad(losses[0], list(m.parameters()))
    g2 = torch.autograd.grad(losses[1], list(m.parameters()))
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    same = {"input_ids": ids[:2, :5].clone(), "response_mask": torch.ones(2, 4)}
    assert packing(same, min_saving=0.1, varlen=varlen) is None  # equal lengths: nothing to gain, padded it runs


def test_varlen_attention_keeps_the_boundaries_when_gradient_checkpointing_recomputes_a_layer(monkeypatch):
    """Under gradient checkpointing a layer's forward runs again in the backward pass: the packed row's boundaries
    travel as forward arguments (not a context), so the recomputed attention is the same varlen one and the
    gradients equal the padded batch's. Without the boundaries the packed row would attend across sequences."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from align import varlen as V

    torch.manual_seed(1)
    m = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "llama", hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, vocab_size=101, attn_implementation="sdpa"))
    lengths = [11, 4, 7, 3]
    N, L = len(lengths), max(lengths)
    ids, resp = torch.randint(3, 101, (N, L)), torch.zeros(N, L - 1)
    for i, n in enumerate(lengths):
        ids[i, n:] = 0
        resp[i, : n - 1] = 1
    batch, w = {"input_ids": ids, "response_mask": resp}, torch.randn(N, L - 1)
    want = torch.autograd.grad((logprobs(m, batch)[0] * w).sum(), list(m.parameters()))
    V.enable(m, force=True)
    m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    m.train()
    calls, kernel = [], V.varlen_causal
    monkeypatch.setattr(V, "varlen_causal", lambda *a: calls.append(a[3].tolist()) or kernel(*a))
    got = torch.autograd.grad((logprobs(m, batch, pack=True)[0] * w).sum(), list(m.parameters()))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert calls == [[0, 11, 18, 22, 25]] * 4  # 2 layers, each forward and recomputed: all varlen
    # the attention function itself: the segments [0, 3) and [3, 7) of a flat row each attend to themselves only
    q, k, v = torch.randn(7, 4, 8), torch.randn(7, 2, 8), torch.randn(7, 2, 8)
    out = V.varlen_causal(q, k, v, V.cu_seqlens([3, 4]), 4, 8 ** -0.5)
    for s, e in ((0, 3), (3, 7)):
        ref = torch.nn.functional.scaled_dot_product_attention(
            q[s:e].transpose(0, 1), k[s:e].repeat_interleave(2, 1).transpose(0, 1),
            v[s:e].repeat_interleave(2, 1).transpose(0, 1), is_causal=True).transpose(0, 1)
        torch.testing.assert_close(out[s:e], ref)
