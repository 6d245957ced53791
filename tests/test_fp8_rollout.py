"""FP8 rollouts (--rollout-precision fp8, align/rollout/fast/fp8.py) on CPU: the row-scaled E4M3 GEMM against its
definition and against the exact product, the decoder's E4M3 copy (quantised at each load, half the bytes of its
matrices), its logits near the exact model's, the sampler's log-probs carried as they are (the trainer's differ by
the rounding: what --tis-cap corrects), and the stage's option (TIS on unless given, evaluation in the compute
dtype)."""

import pytest
import torch

from align.rollout.fast import fp8
from align.rollout.fast.decoder import FastDecoder
from align.rollout.generation import Sampling, generate_local
from tests.test_fast_generate import PAD, PROMPTS, Tok, make


def test_quantize_rows_scales_each_row_to_e4m3s_largest_value():
    w = torch.tensor([[1.0, -2.0, 0.5, 0.25], [448.0, 1.0, -3.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    q, s = fp8.quantize_rows(w)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    torch.testing.assert_close(s, torch.tensor([2.0 / 448, 1.0, fp8.TINY / 448]))
    assert q.float()[0].tolist() == [224.0, -448.0, 112.0, 56.0]  # powers of two: exact in E4M3
    assert q.float()[:, 0].abs().max() == 448 and q.float()[2].abs().max() == 0  # an all-zero row stays 0
    w = torch.randn(32, 64)
    q, s = fp8.quantize_rows(w)
    err = (q.float() * s[:, None] - w).abs() / w.abs().amax(1, keepdim=True)
    assert err.max() <= 2 ** -4 * 1.01  # E4M3: 3 mantissa bits, half an ulp at most at the row's top binade


def test_fp8_linear_is_the_scaled_product_of_the_quantised_operands():
    """y_mn = s_m s_n Σ_k Q(x_mk/s_m) Q(W_nk/s_n) (+ b_n): equal to the dequantised matmul in fp32, and within a
    few percent of the exact product."""
    torch.manual_seed(0)
    x, w, b = torch.randn(2, 5, 64), torch.randn(48, 64), torch.randn(48)
    w8, s_w = fp8.quantize_rows(w)
    y = fp8.fp8_linear(x, w8, s_w, b)
    assert y.shape == (2, 5, 48) and y.dtype == torch.float32
    x2 = x.reshape(10, 64)
    s_x = x2.abs().amax(1, keepdim=True) / 448
    want = ((x2 / s_x).to(torch.float8_e4m3fn).float() * s_x) @ (w8.float() * s_w[:, None]).T + b
    torch.testing.assert_close(y.reshape(10, 48), want, rtol=1e-5, atol=1e-5)
    exact = x @ w.T + b
    assert 0 < ((y - exact).norm() / exact.norm()).item() < 0.06
    yb = fp8.fp8_linear(x.bfloat16(), w8, s_w, b.bfloat16())
    assert yb.dtype == torch.bfloat16 and ((yb.float() - exact).norm() / exact.norm()).item() < 0.06


def test_the_fp8_decoder_keeps_e4m3_matrices_and_decodes_near_the_exact_model(monkeypatch):
    m = make("qwen2", tied=False)
    exact, dec = FastDecoder(m, "cpu"), FastDecoder(m, "cpu", precision="fp8")
    for d in (exact, dec):
        d.load_weights(m)
    assert dec.copy_reason.startswith("FP8") and not dec.shares_weights
    L, a = dec.layers[0], m.model.layers[0].self_attn
    assert {k: L[k].dtype for k in ("qkv", "o", "gu", "down")} == dict.fromkeys(("qkv", "o", "gu", "down"),
                                                                               torch.float8_e4m3fn)
    assert L["qkv_b"].dtype == dec.embed.dtype == dec.head.dtype == torch.float32  # biases, embedding, head: exact
    nq = dec.nq
    got = L["qkv"][:nq].float() * L["qkv_s"][:nq, None]
    assert (got - a.q_proj.weight).abs().max() <= a.q_proj.weight.abs().max() / 16
    # the matrices in 1 byte each where the compute dtype (fp32 here) takes 4, plus a 4-byte scale per row
    monkeypatch.setenv("ALIGN_FAST_DECODER_COPY", "1")
    full = FastDecoder(m, "cpu")
    mats = sum(L2[k].numel() for L2 in dec.layers for k in ("qkv", "o", "gu", "down"))
    rows = sum(L2[k].shape[0] for L2 in dec.layers for k in ("qkv", "o", "gu", "down"))
    assert full.weight_bytes() - dec.weight_bytes() == 3 * mats - 4 * rows > 0
    ids = torch.tensor([[PAD] * 3 + PROMPTS[0], [PAD] * 5 + PROMPTS[1]])
    mask = (ids != PAD).long()
    with torch.no_grad():
        for d in (exact, dec):
            d._alloc(2, 32)
        want, got = exact._prefill(ids, mask), dec._prefill(ids, mask)
    rel = ((got - want).norm() / want.norm()).item()
    assert 1e-4 < rel < 0.1  # rounded (not the exact model), but close
    # a new step's weights are quantised again at the next load
    with torch.no_grad():
        m.model.layers[0].mlp.down_proj.weight.mul_(2.0)
    dec.load_weights(m)
    torch.testing.assert_close(dec.layers[0]["down_s"], fp8.quantize_rows(m.model.layers[0].mlp.down_proj.weight)[1])


def test_fp8_rollouts_take_the_fast_decoder_and_their_sampler_log_probs_differ_by_the_rounding():
    """Sampling(precision="fp8") decodes in the module's FP8 decoder (a second one beside the exact decoder); the
    sampled tokens' log-probs are the FP8 model's, within a small distance of the trainer's (what
    rollout/logp_abs_diff reports and --tis-cap corrects), while the exact decoder's equal the trainer's."""
    from align.logprobs import logprobs
    from align.rollout.batch import rollout_batch

    m = make("llama", False)
    gaps = {}
    for precision in ("", "fp8"):
        s = Sampling(max_new_tokens=8, temperature=1.0, seed=3, precision=precision)
        out = generate_local(m, Tok(), PROMPTS, s, 4, "cpu", fast=None if precision else True)
        batch = rollout_batch(out, PAD, "cpu")
        with torch.no_grad():
            trainer, _ = logprobs(m, batch)
        mask = batch["response_mask"].bool()
        gaps[precision] = (batch["sampler_logp"] - trainer)[mask].abs().mean().item()
    assert hasattr(m, "_align_fast_decoder_fp8") and hasattr(m, "_align_fast_decoder")
    assert gaps[""] < 1e-5 and 1e-4 < gaps["fp8"] < 0.2, gaps


def test_the_option_turns_tis_on_and_keeps_evaluation_exact():
    from stages.grpo_config import GRPOConfig

    cfg = GRPOConfig(rollout_precision="fp8")
    assert cfg.decode_precision() == "fp8" and cfg.automatic()["tis_cap"][0] == 2.0
    assert "tis_cap" not in GRPOConfig(rollout_precision="fp8", tis_cap=3.0).automatic()
    assert GRPOConfig().decode_precision() == "" and "tis_cap" not in GRPOConfig().automatic()
    with pytest.raises(Exception):
        GRPOConfig(rollout_precision="fp4").validate()
