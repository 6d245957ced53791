"""The pieces that make a GPU step cheap, checked on CPU: frozen engines beside a ZeRO-1/2 engine, ZeRO-3 leaf
blocks, and mask-free forwards of right-padded batches."""

import pytest
import torch

from align import runtime
from align.engine import build


def tiny_qwen2_cuda():
    """A 2-layer Qwen2 (grouped K/V heads, q/k/v biases) in bf16 on the GPU, seeded: the GPU kernels' test model."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(hidden_size=256, num_hidden_layers=2, num_attention_heads=8,
                                        num_key_value_heads=2, intermediate_size=512, vocab_size=1000)).cuda().bfloat16()


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, intermediate_size=64, vocab_size=101))


def test_frozen_engines_beside_zero_2_are_plain_replicas():
    cfg = build.ds_config(zero_stage=2, micro_batch=2, grad_accum=1, world_size=1, dtype=torch.bfloat16,
                            precision="bf16-pure", offload_optimizer=True)
    frozen = build.frozen_config(cfg)
    assert frozen["zero_optimization"]["stage"] == 0 and "offload_optimizer" not in frozen["zero_optimization"]
    assert frozen["bf16"] == {"enabled": True}
    assert cfg["zero_optimization"]["stage"] == 2 and "offload_optimizer" in cfg["zero_optimization"]  # untouched
    z3 = build.ds_config(zero_stage=3, micro_batch=2, grad_accum=1, world_size=1, dtype=torch.float32)
    assert build.frozen_config(z3)["zero_optimization"]["stage"] == 3
    assert build.frozen_config(z3, offload_params=True)["zero_optimization"]["offload_param"] == {"device": "cpu"}


def test_zero_3_fetches_whole_transformer_blocks():
    from deepspeed.utils import z3_leaf_module

    m = tiny_llama()
    build.set_block_leaves(m)
    assert all(z3_leaf_module(layer) for layer in m.model.layers)
    assert not z3_leaf_module(m) and not z3_leaf_module(m.model) and not z3_leaf_module(m.lm_head)


def test_right_padded_batch_needs_no_attention_mask():
    """DPO's pair batches are right-padded and go through `logprobs` without an attention mask (so attention runs
    the fused causal kernel): the log-probs of every real position are those of the masked forward."""
    from align.logprobs import logprobs
    from stages.dpo import pair_logps

    m = tiny_llama().eval()
    ids = torch.randint(3, 101, (4, 9))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    mask[3, 4:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :2] = -100  # two prompt tokens
    resp = labels[:, 1:] != -100
    with torch.no_grad():
        masked, _ = logprobs(m, {"input_ids": ids, "attention_mask": mask, "response_mask": resp})
        free = pair_logps(m, {"input_ids": ids, "labels": labels})
        logits = m(input_ids=ids).logits
    torch.testing.assert_close(free.flatten(), masked.sum(-1), rtol=1e-5, atol=1e-5)
    padded = m(input_ids=ids, attention_mask=mask).logits
    assert not torch.allclose(logits[mask == 0], padded[mask == 0], atol=1e-3)  # only padding positions differ


def test_token_budget_micro_batches():
    """grpo --micro-batch-size 0: the largest divisor of the rows whose worst-case padded tokens fit the budget."""
    assert build.rows_within(128, 124, 16384) == 128  # the real-model recipe: one micro-batch
    assert build.rows_within(128, 200, 16384) == 64  # 81 rows would fit; 64 divides 128
    assert build.rows_within(12, 100, 500) == 4
    assert build.rows_within(7, 10_000, 100) == 1  # nothing fits: one row at a time


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA allocator to measure (run on a GPU machine)")
def test_rl_phases_log_their_cuda_peak_and_the_run_keeps_its_own():
    """`timed` (an RL step's phases) logs memory/<phase> = the peak allocated during that phase; resetting the
    peak per phase must not lose the run's overall peak (the summary's peak_memory_gib_per_rank)."""
    from types import SimpleNamespace

    from align import runtime
    from align.rollout.batch import timed

    MiB = 2**20
    big = torch.empty(512 * MiB, dtype=torch.uint8, device="cuda")
    del big
    times = {}
    with timed(times, "time/generate"):
        kept = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
    with timed(times, "time/update"):
        tmp = torch.empty(128 * MiB, dtype=torch.uint8, device="cuda")
        del tmp
    base = torch.cuda.memory_allocated() / 2**30 - 64 / 1024  # what was allocated before `kept`
    assert times["memory/generate"] == pytest.approx(base + 64 / 1024, abs=0.01)
    assert times["memory/update"] == pytest.approx(base + 192 / 1024, abs=0.01)  # kept + tmp
    assert runtime.peak_memory_gib(SimpleNamespace(device=torch.device("cuda"))) >= base + 0.5
    del kept


def test_compile_applies_to_one_gpu_process_with_whole_parameters_only():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert build.compiles(True, cuda, 0, 1)
    assert not build.compiles(True, cuda, 3, 1)  # ZeRO-3's gather hooks on each block
    assert not build.compiles(True, cuda, 2, 1)  # one GPU keeps ZeRO-2 only with an offload: eager (not measured)
    assert build.compiles(True, cuda, 0, 2)  # replicas on several GPUs: each compiles its own copy
    assert not build.compiles(True, cuda, 3, 2)
    assert not build.compiles(True, cpu, 0, 1) and not build.compiles(False, cuda, 0, 1)


def test_compiled_blocks_give_the_eager_log_probs_and_gradients():
    """Regional compilation (here with dynamo's aot_eager backend: the same graph capture and autograd split as
    inductor, without building kernels) under gradient checkpointing, with the fused log-prob head and ragged
    lengths: the update's log-probs and gradients are the eager model's; the state-dict keys do not change; HF
    generate runs the blocks eagerly under `runtime.eager()` (no new graph) and samples the same tokens."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from align.logprobs import logprobs

    torch._dynamo.reset()
    ref, m = tiny_llama(), tiny_llama()
    keys = list(m.state_dict())
    for model in (ref, m):  # as a stage does: checkpointing is asked for when the model loads, before the engine
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    assert build.compile_blocks(m, backend="aot_eager") == len(m.model.layers) == 2
    assert list(m.state_dict()) == keys
    for length in (9, 13, 7):  # a second length makes the graph dynamic; the third reuses it
        ids = torch.randint(3, 101, (4, length))
        mask = torch.ones_like(ids)
        mask[1, length - 3 :] = 0
        resp = torch.zeros(4, length - 1)
        resp[:, 3:] = 1
        resp[1, length - 4 :] = 0
        batch = {"input_ids": ids, "attention_mask": mask, "response_mask": resp}
        out = []
        for model in (ref, m):
            model.zero_grad()
            lp, _ = logprobs(model, batch)
            (lp * torch.linspace(-1, 1, lp.shape[1])).sum().backward()
            out.append((lp.detach(), [p.grad.clone() for p in model.parameters()]))
        torch.testing.assert_close(out[1][0], out[0][0], rtol=1e-5, atol=1e-6)
        for g_c, g_e in zip(out[1][1], out[0][1]):
            torch.testing.assert_close(g_c, g_e, rtol=1e-4, atol=1e-6)
    graphs = counters["stats"]["unique_graphs"]
    assert graphs >= 1  # the blocks did run compiled

    def saved_bytes(model):  # what a training forward keeps for its backward
        sizes = []

        def pack(t):
            sizes.append(t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model.model(input_ids=torch.randint(3, 101, (4, 32)), use_cache=False)
        return sum(sizes)

    plain = tiny_llama().train()  # no checkpointing: every block's activations saved
    assert not m.is_gradient_checkpointing  # transformers' wrapper is off: the recompute is inside the compiled block
    assert saved_bytes(m) < saved_bytes(plain) / 2
    graphs = counters["stats"]["unique_graphs"]
    prompt = torch.randint(3, 101, (2, 5))
    for model in (ref, m):
        model.eval()
    with torch.no_grad(), runtime.eager():
        a = m.generate(input_ids=prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    b = ref.generate(input_ids=prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(a, b) and counters["stats"]["unique_graphs"] == graphs


def test_checkpointed_blocks_save_the_rng_state_only_when_they_draw_random_numbers(monkeypatch):
    """The recompute inside a compiled block replays the forward; only a block with dropout needs the RNG state
    saved for it (saving it when nothing is random cost ~50 s of compile on the GPU's first step)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from align.models import uses_dropout

    seen = []
    import torch.utils.checkpoint as C

    real = C.checkpoint
    monkeypatch.setattr(C, "checkpoint", lambda f, *a, **k: seen.append(k["preserve_rng_state"]) or real(f, *a, **k))
    for p in (0.0, 0.1):
        torch.manual_seed(0)
        m = LlamaForCausalLM(LlamaConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                         num_key_value_heads=2, intermediate_size=64, vocab_size=101,
                                         attention_dropout=p)).train()
        b = build.blocks(m)[0]
        assert uses_dropout(b) == (p > 0)
        b.forward = build._recomputed(b, b.forward)
        m(input_ids=torch.randint(3, 101, (2, 8)), use_cache=False).logits.sum().backward()
    assert seen == [False, True]


def test_compiled_checkpointed_block_takes_no_float_scalars_as_tensors():
    """Compiled with dynamic shapes and checkpointed, a block's graph gets its float constants (norm ε, attention
    scaling) as constants: no 0-d float64 tensor inputs, which on a GPU became CPU kernels compiled with a C++
    compiler at the first step."""
    import torch._dynamo

    torch._dynamo.reset()
    seen = []

    def backend(gm, inputs):
        seen.extend(x for x in inputs if isinstance(x, torch.Tensor))
        return gm

    m = tiny_llama().train()
    m.gradient_checkpointing_enable()
    build.compile_blocks(m, backend=backend)
    m(input_ids=torch.randint(3, 101, (2, 8)), use_cache=False).logits.sum().backward()
    assert seen and not [x for x in seen if x.ndim == 0 and x.dtype == torch.float64]
    torch._dynamo.reset()


def test_compiled_blocks_with_lora_adapters_match_eager_with_adapters_on_and_off():
    """LoRA layers inside a compiled block (aot_eager, as above), checkpointed: the adapters' gradients are the
    eager model's, and the reference forward with the adapters switched off (DPO/GRPO's base-model reference) is
    the eager base model's."""
    import torch._dynamo
    from peft import LoraConfig, get_peft_model

    torch._dynamo.reset()
    models = []
    for _ in range(2):
        base = tiny_llama()
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        torch.manual_seed(1)
        m = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False))
        models.append(m.train())
    assert build.compile_blocks(models[1], backend="aot_eager") == 2
    for length in (9, 12):
        ids = torch.randint(3, 101, (3, length))
        out = []
        for m in models:
            m.zero_grad()
            m(input_ids=ids, use_cache=False).logits.float().pow(2).mean().backward()
            with torch.no_grad(), m.disable_adapter():
                off = m(input_ids=ids, use_cache=False).logits
            out.append(([p.grad.clone() for p in m.parameters() if p.requires_grad], off))
        for g_c, g_e in zip(out[1][0], out[0][0]):
            torch.testing.assert_close(g_c, g_e, rtol=1e-4, atol=1e-7)
        torch.testing.assert_close(out[1][1], out[0][1], rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the split-KV decode kernel runs on a GPU (run on a GPU machine)")
def test_split_kv_decode_attention_equals_sdpa_in_bf16_and_in_the_compiled_decoder():
    """bf16 on the GPU (tests/test_decode_attention.py checks fp32/fp16 in Triton's interpreter): the kernel equals
    SDPA on padded inputs at cache lengths of 1, 2 and 6 chunks; and a compiled, graph-captured FastDecoder with it
    decodes the same greedy tokens as with SDPA (ALIGN_DECODE_ATTN=sdpa)."""
    import os

    from align.rollout.fast import decode_attention
    from align.rollout.fast.decoder import FastDecoder
    from align.rollout.generation import Sampling

    g = torch.Generator(device="cuda").manual_seed(0)
    for n in (100, 256, 768):
        q = torch.randn(64, 2, 6, 128, device="cuda", generator=g, dtype=torch.bfloat16)
        k, v = (torch.randn(64, 2, n, 128, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
        bias = torch.zeros(64, n, device="cuda")
        bias[::3, : n // 2] = torch.finfo(torch.float32).min
        got = decode_attention.attention(q, k, v, bias, 128**-0.5).float()
        want = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(),
                                                                attn_mask=bias[:, None, None], scale=128**-0.5)
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    m = tiny_qwen2_cuda()
    prompts = [[5 + i, 7, 9 + 2 * i][: 1 + i % 3] for i in range(8)]
    outs = {}
    for impl in ("split", "sdpa"):
        os.environ["ALIGN_DECODE_ATTN"] = impl
        try:
            dec = FastDecoder(m, "cuda")
            assert dec.split_kv == (impl == "split")
            dec.load_weights(m)
            outs[impl] = dec.generate(prompts, Sampling(max_new_tokens=300, temperature=0.0), eos=-1, pad=0)
        finally:
            del os.environ["ALIGN_DECODE_ATTN"]
    same = sum(a[:32] == b[:32] for a, b in zip(outs["split"], outs["sdpa"]))
    assert same >= 7, (same, outs)  # bf16: a near-tie may flip one row's greedy token late; not most rows early


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="PyTorch's varlen attention kernel runs on a GPU (run on a GPU machine)")
def test_varlen_packed_forward_equals_the_padded_one_in_bf16_eager_and_compiled():
    """--packing on a GPU: the ragged sequences in one row attended with PyTorch's varlen flash kernel
    (align.varlen) give the padded batch's log-probs and gradients in bf16 (fp32 reductions), eagerly and with the
    update's compiled, checkpointed blocks; the compiled blocks serve three micro-batches of other lengths with no
    recompile after the second."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from align import varlen as V
    from align.logprobs import logprobs

    def batch(lengths, seed):
        g = torch.Generator().manual_seed(seed)
        N, L = len(lengths), max(lengths)
        ids, resp = torch.randint(3, 1000, (N, L), generator=g), torch.zeros(N, L - 1)
        for i, n in enumerate(lengths):
            ids[i, n:] = 0
            resp[i, 20 : n - 1] = 1  # a 20-token prompt, then the response
        return {"input_ids": ids.cuda(), "response_mask": resp.cuda()}

    def close_grads(got, want):  # bf16 weights: each parameter's gradient within 2 % of the padded one's, as a whole
        for x, y in zip(got, want):  # (one of a norm weight's 64 entries differed by 12 % elementwise on an H100)
            assert (x - y).norm() <= 0.02 * y.norm() + 1e-6, ((x - y).norm() / y.norm()).item()

    def grads(m, b, pack):
        m.zero_grad()
        lp = logprobs(m, b, pack=pack)[0]
        (lp * torch.linspace(-1, 1, lp.shape[1], device="cuda")).sum().backward()
        return lp.detach(), [p.grad.float().clone() for p in m.parameters()]

    ref, m = tiny_qwen2_cuda(), tiny_qwen2_cuda()
    assert V.enable(m) and m.config._attn_implementation == V.NAME  # the kernel is there: not the per-segment path
    b = batch([300, 41, 170, 90, 260, 33, 120, 64], 0)
    (want, gw), (got, gg) = grads(ref, b, False), grads(m, b, True)
    torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)
    close_grads(gg, gw)
    torch._dynamo.reset()
    counters.clear()
    ref.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ref.train(), m.train()
    build.compile_blocks(ref), build.compile_blocks(m)
    for i, lengths in enumerate(([300, 41, 170, 90, 260, 33, 120, 64], [200, 25, 77, 150], [90, 400, 61],
                                 [128, 33, 257, 300, 99])):
        b = batch(lengths, i)
        (want, gw), (got, gg) = grads(ref, b, False), grads(m, b, True)
        torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)
        close_grads(gg, gw)
        if i == 1:
            frames = counters["stats"]["unique_graphs"]
    assert counters["stats"]["unique_graphs"] == frames  # dynamic lengths and boundaries: no recompile after the second


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the FP8 GEMM runs on a GPU (run on a GPU machine)")
def test_fp8_rollouts_compile_and_replay_near_the_bf16_decoder():
    """--rollout-precision fp8 on the GPU: torch._scaled_mm with row scales inside the compiled, graph-captured
    decode step. The sampled tokens' log-probs are the FP8 model's: a small distance from what the bf16 trainer
    scores on the same tokens, where the bf16 decoder's are within bf16 rounding of it."""
    from align.logprobs import logprobs
    from align.rollout.batch import rollout_batch
    from align.rollout.generation import Sampling, generate_local

    class Tok:
        eos_token_id, pad_token_id, bos_token_id = 2, 0, 1

        def decode(self, ids, skip_special_tokens=True):
            return " ".join(map(str, ids))

    m = tiny_qwen2_cuda()
    prompts = [[5 + i, 7, 9 + 2 * i][: 1 + i % 3] for i in range(8)]
    gaps = {}
    for precision in ("", "fp8"):
        out = generate_local(m, Tok(), prompts, Sampling(64, 1.0, seed=5, precision=precision), 8, "cuda", fast=True)
        batch = rollout_batch(out, 0, "cuda")
        with torch.no_grad():
            trainer, _ = logprobs(m, batch)
        mask = batch["response_mask"].bool()
        gaps[precision or "bf16"] = (batch["sampler_logp"] - trainer)[mask].abs().mean().item()
    dec = m._align_fast_decoder_fp8
    assert dec.use_graphs and dec.layers[0]["gu"].dtype == torch.float8_e4m3fn
    assert gaps["bf16"] < 0.02 and gaps["bf16"] < gaps["fp8"] < 0.2, gaps
