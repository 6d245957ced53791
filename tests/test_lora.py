"""LoRA (`--lora-r`): the merge W + (α/r) B A on hand values; an SFT run trains only the adapter and writes the
merged model (plain transformers) beside the adapter (peft), which agree, or with --no-merge the adapter alone,
which later stages merge into its base; the reference of DPO, GRPO and PPO is the policy with its adapters off
(GRPO's and PPO's give the base model's log-probs while the adapter trains); the fast decoder decodes with the
adapter applied; two ZeRO-3 processes; refusals."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from align.lora import merged_state_dict
from tests.conftest import _DIST_ENV, assert_user_error, parity_reward, run_align, small_data

ARITH = small_data()["arith"]
SFT = ["sft", "--data", ARITH, "--max-steps", "6", "--batch-size", "8", "--lr", "3e-3", "--warmup-steps", "1",
       "--eval-every", "0", "--eval-samples", "0", "--lora-r", "4", "--lora-alpha", "8"]


def ok(proc):
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


RM = ["rm", "train", "--lora-r", "4", "--max-steps", "4", "--batch-size", "8", "--lr", "3e-3", "--eval-every", "0",
      "--normalize-samples", "8", "--data", small_data()["prefs"], "--eval-data", small_data()["prefs_test"]]


@pytest.fixture(scope="module")
def sft_runs(tmp_path_factory, tiny_model_dir):
    """A base model (the tiny one, copied: a test changes it) and the LoRA SFT run on it, the adapter merged
    (merged/, what it printed) and kept alone (alone/, --no-merge): (root, base, printed)."""
    import shutil

    root = tmp_path_factory.mktemp("lora")
    base = root / "base"
    shutil.copytree(tiny_model_dir, base)
    said = ok(run_align(*SFT, "--model", base, "--out", root / "merged")).stdout
    ok(run_align(*SFT, "--model", base, "--out", root / "alone", "--no-merge"))
    return root, base, said


@pytest.fixture(scope="module")
def rm_runs(sft_runs):
    """A LoRA reward model of the base, the adapter merged (rm-merged/) and kept alone (rm-alone/): root."""
    root, base, _ = sft_runs
    ok(run_align(*RM, "--model", base, "--out", root / "rm-merged"))
    ok(run_align(*RM, "--model", base, "--out", root / "rm-alone", "--no-merge"))
    return root


def test_merge_is_w_plus_scaled_b_a():
    W, A, B = torch.tensor([[1.0, 0.0], [0.0, 1.0]]), torch.tensor([[1.0, 2.0]]), torch.tensor([[3.0], [-1.0]])
    state = {"base_model.model.layer.q.base_layer.weight": W, "base_model.model.layer.q.base_layer.bias": torch.ones(2),
             "base_model.model.layer.q.lora_A.default.weight": A, "base_model.model.layer.q.lora_B.default.weight": B,
             "base_model.model.norm.weight": torch.full((2,), 0.5)}
    out = merged_state_dict(state, scaling=0.5)
    assert set(out) == {"layer.q.weight", "layer.q.bias", "norm.weight"}
    assert out["layer.q.weight"].tolist() == [[1 + 1.5, 3.0], [-0.5, 1 - 1.0]]  # W + 0.5 · [[3, 6], [-1, -2]]
    assert out["layer.q.bias"].tolist() == [1.0, 1.0] and out["norm.weight"].tolist() == [0.5, 0.5]


def test_sft_trains_the_adapter_and_saves_the_merged_model_beside_it(sft_runs):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    root, base_dir, said = sft_runs
    out = root / "merged"
    assert "LoRA r 4" in said and "the base frozen" in said
    merged = AutoModelForCausalLM.from_pretrained(out / "model")  # plain transformers, no peft
    base = AutoModelForCausalLM.from_pretrained(base_dir)
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), out / "model" / "adapter")
    ids = torch.tensor([[1, 5, 9, 11, 20, 31]])
    torch.testing.assert_close(logits(merged, ids), logits(adapted, ids), rtol=1e-4, atol=1e-4)
    assert not torch.allclose(logits(merged, ids), logits(base, ids), atol=1e-3)  # the adapter learned something
    for name, p in base.named_parameters():  # what changed is low-rank: every 2-D difference has rank <= r
        d = merged.state_dict()[name] - p.detach()
        if d.ndim == 2 and d.abs().max() > 0:
            assert torch.linalg.matrix_rank(d.double(), atol=1e-5).item() <= 4, name
    art = json.loads((out / "artifact.json").read_text())
    assert art["status"] == "complete" and (out / "model" / "adapter" / "adapter_config.json").is_file()


def test_dpo_reference_is_the_policy_with_its_adapters_off(tmp_path):
    out = tmp_path / "dpo"
    said = ok(run_align("dpo", "--model", "tiny", "--lora-r", "4", "--max-steps", "2", "--batch-size", "8",
                        "--lr", "1e-3", "--warmup-steps", "1", "--eval-every", "0", "--eval-samples", "0",
                        "--data", small_data()["prefs"], "--eval-data", "", "--out", out)).stdout
    assert "the policy with its LoRA adapters off" in said
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    assert rows[0]["loss"] == pytest.approx(math.log(2), abs=1e-5)  # B = 0 at step 0: policy = reference
    assert rows[-1]["rewards/margins"] != 0.0


def base_logprobs(model_dir, batch: dict, temperature: float) -> torch.Tensor:
    """log π_base of the response tokens of a right-padded rollout batch, from the base weights on disk with plain
    transformers (no peft, no DeepSpeed): what the reference must give."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    ids = batch["input_ids"].cpu()
    lp = (logits(model, ids)[:, :-1] / temperature).log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]
    return lp * batch["response_mask"].cpu()


def check_reference_is_the_base(model_dir, batch, ref_logp, policy_logp, temperature):
    """The reference's log-probs are the base model's, and an updated policy's are not (so a reference computed
    with the adapters on, which is the policy, fails here)."""
    mask = batch["response_mask"].cpu().bool()
    assert mask.sum() > 8
    want = base_logprobs(model_dir, batch, temperature)
    torch.testing.assert_close(ref_logp.cpu()[mask], want[mask], rtol=0, atol=1e-5)
    assert (policy_logp.cpu()[mask] - want[mask]).abs().max() > 1e-3  # the adapter moved the policy


def test_grpo_reference_is_the_base_model_while_the_adapter_trains(tiny_model_dir, tmp_path, single_process):
    """GRPO --lora-r --beta: after a step has trained the adapter, the π_ref log-probs the update is given (the
    stage's own rollout of step 2) are those of the base weights computed apart, not the policy's."""
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    from align.engine.run import StageRun
    from align.logprobs import batched_logprobs
    from stages.grpo import GRPO, GRPOConfig

    cfg = GRPOConfig(model=str(tiny_model_dir), out=str(tmp_path / "g"), data=str(ARITH), eval_data="", lora_r=4,
                     lora_alpha=8, beta=0.1, reward=[parity_reward()], prompts_per_step=4, num_generations=4,
                     micro_batch_size=16, max_new_tokens=8, lr=1e-2, warmup_steps=0, temperature=0.7)
    cfg.validate()
    seen = []
    with StageRun(cfg, "grpo") as run:
        algo = GRPO(cfg, run)
        update = algo.update
        algo.update = lambda batch, adv, old, ref, *a: seen.append((batch, ref)) or update(batch, adv, old, ref, *a)
        algo.step(0)  # trains the adapter (B = 0 before it: policy = base)
        algo.step(1)
        batch, ref = seen[1]
        policy = batched_logprobs(algo.policy, batch, 16, cfg.temperature)  # the policy that sampled step 2
    unset_hf_deepspeed_config()
    check_reference_is_the_base(tiny_model_dir, batch, ref, policy, cfg.temperature)


def test_ppo_reference_is_the_base_model_while_the_adapter_trains(tiny_model_dir, tiny_reward_model_dir, tmp_path,
                                                                   single_process):
    """PPO --lora-r: the π_ref log-probs of step 2's rollout (after a step trained the adapters) are the base
    model's, computed apart; π_old of the same rollout (the trained policy) is not."""
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    from align.engine.run import StageRun
    from stages.ppo import PPO, PPOConfig

    cfg = PPOConfig(model=str(tiny_model_dir), reward_model=str(tiny_reward_model_dir), out=str(tmp_path / "p"),
                    data=str(ARITH), eval_data="", ptx_coef=0.0, lora_r=4, lora_alpha=8, prompts_per_step=4,
                    minibatch_size=4, micro_batch_size=4, ppo_epochs=1, max_new_tokens=8, lr=1e-2, temperature=0.7)
    cfg.validate()
    seen = []
    with StageRun(cfg, "ppo") as run:
        algo = PPO(cfg, run)
        advantages = algo.advantages
        algo.advantages = lambda batch, *a: seen.append((batch, advantages(batch, *a))) or seen[-1][1]
        algo.step(0)
        algo.step(1)
    unset_hf_deepspeed_config()
    batch, ro = seen[1]
    check_reference_is_the_base(tiny_model_dir, batch, ro["ref_logp"], ro["old_logp"], cfg.temperature)


def test_the_fast_decoder_decodes_with_the_adapter():
    """Rollouts must see the current adapter: the decoder's copy is W + (α/r) B A, token for token what HF
    `generate` gives on the peft model — and not what the base model gives."""
    from peft import LoraConfig, get_peft_model

    from align.rollout.generation import Sampling, generate_local
    from tests.test_fast_generate import PROMPTS, Tok, make

    s = Sampling(max_new_tokens=10, temperature=0.0)
    model = get_peft_model(make("qwen2", True), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    before = generate_local(model, Tok(), PROMPTS, s, 4, "cpu", fast=True)  # B = 0: the base model's tokens
    assert [c.ids for c in before] == [c.ids for c in generate_local(make("qwen2", True), Tok(), PROMPTS, s, 4, "cpu",
                                                                     fast=False)]
    torch.manual_seed(1)
    with torch.no_grad():  # an "update" of the adapter only, between two rollouts of the same decoder
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    after = generate_local(model, Tok(), PROMPTS, s, 4, "cpu", fast=True)
    assert [c.ids for c in after] == [c.ids for c in generate_local(model, Tok(), PROMPTS, s, 4, "cpu", fast=False)]
    assert [c.ids for c in after] != [c.ids for c in before]


def test_the_adapter_branch_runs_in_the_activations_dtype():
    """A bf16 base with peft's fp32 adapters: peft alone keeps an fp32 copy of every targeted Linear's input for
    the backward; `apply_in_activation_dtype` runs (α/r)·B(A x) in bf16 — the adapters add no fp32 activation to
    what the bare bf16 model saves (its norms' and softmaxes' fp32) — while A and B stay fp32 and get fp32
    gradients close to peft's own."""
    from peft import LoraConfig, get_peft_model

    from align.lora import apply_in_activation_dtype, fuse_lora_forward
    from tests.test_fast_generate import make

    ids = torch.tensor([[1, 5, 9, 11, 7, 30, 31, 32]] * 4)

    def run(mode: str):
        torch.manual_seed(0)
        model = make("qwen2", False).to(torch.bfloat16)
        if mode != "bare":
            model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
            with torch.no_grad():
                for n, p in model.named_parameters():
                    if "lora_B" in n:
                        p.normal_(0, 0.5)
        if mode == "ours":  # as `with_lora` leaves a model
            assert apply_in_activation_dtype(model) == 2 * 7  # 2 layers x q, k, v, o, gate, up, down
            assert fuse_lora_forward(model) == 2 * 7
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        fp32 = []

        def pack(t):
            if t.untyped_storage().data_ptr() not in params and t.dtype == torch.float32:
                fp32.append(t.untyped_storage().nbytes())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(input_ids=ids).logits
        out.float().square().mean().backward()
        grads = {n: p.grad for n, p in model.named_parameters() if "lora_" in n}
        assert all(p.dtype == torch.float32 for n, p in model.named_parameters() if "lora_" in n)
        return out, sum(fp32), grads

    _, bare_fp32, _ = run("bare")
    ref, ref_fp32, ref_grads = run("peft")
    out, fp32, grads = run("ours")
    assert ref_fp32 > bare_fp32 >= fp32
    assert out.dtype == torch.bfloat16
    assert torch.allclose(out.float(), ref.float(), atol=0.05, rtol=0.02)
    assert len(grads) == 2 * 2 * 7
    for n, g in grads.items():
        assert g is not None and g.dtype == torch.float32 and g.abs().sum() > 0, n
        cos = torch.nn.functional.cosine_similarity(g.flatten(), ref_grads[n].flatten(), dim=0)
        assert cos > 0.99, (n, cos)


def test_lora_linear_is_its_formula_with_exact_gradients():
    """`lora_linear` = x·Wᵀ + b + s·(x·Aᵀ)·Bᵀ on hand values; its gradients (an in-place add into the base
    output) pass gradcheck (float64) for x, A and B; fp32 adapters beside bf16 activations get fp32 grads."""
    from align.lora import lora_linear

    x = torch.tensor([[1.0, 2.0], [0.0, -1.0]])
    w = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])  # [out 3, in 2]
    b = torch.tensor([0.5, 0.0, -1.0])
    a = torch.tensor([[1.0, -1.0]])  # r = 1
    bw = torch.tensor([[2.0], [0.0], [1.0]])
    # x·Wᵀ + b = [[1.5, 2, 2], [0.5, -1, -2]];  x·Aᵀ = [[-1], [1]];  0.5·(x·Aᵀ)·Bᵀ = [[-1, 0, -0.5], [1, 0, 0.5]]
    want = torch.tensor([[0.5, 2.0, 1.5], [1.5, -1.0, -1.5]])
    torch.testing.assert_close(lora_linear(x, w, b, a, bw, 0.5), want)

    g = torch.Generator().manual_seed(0)
    X = torch.randn(2, 3, 5, dtype=torch.float64, generator=g, requires_grad=True)
    W, Bias = torch.randn(4, 5, dtype=torch.float64, generator=g), torch.randn(4, dtype=torch.float64, generator=g)
    A = torch.randn(2, 5, dtype=torch.float64, generator=g, requires_grad=True)
    B = torch.randn(4, 2, dtype=torch.float64, generator=g, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, a, bw: lora_linear(x, W, Bias, a, bw, 1.5), (X, A, B))
    ref = X @ W.t() + Bias + 1.5 * (X @ A.t()) @ B.t()
    torch.testing.assert_close(lora_linear(X, W, Bias, A, B, 1.5), ref)

    xb = torch.randn(3, 5, generator=g).bfloat16().requires_grad_()
    a32, b32 = torch.randn(2, 5, generator=g, requires_grad=True), torch.randn(4, 2, generator=g, requires_grad=True)
    y = lora_linear(xb, W.bfloat16(), None, a32, b32, 2.0)
    y.float().sum().backward()
    assert y.dtype == torch.bfloat16 and xb.grad.dtype == torch.bfloat16
    assert a32.grad.dtype == b32.grad.dtype == torch.float32


def test_lora_layers_compute_through_one_buffer_unless_they_cannot(monkeypatch):
    """`fuse_lora_forward` (what `with_lora` applies): a peft model's logits and adapter gradients are peft's own;
    with the adapters switched off it is the base model; with dropout on, peft's forward runs."""
    from peft import LoraConfig, get_peft_model

    from align import lora
    from tests.test_fast_generate import make

    ids = torch.tensor([[1, 5, 9, 11, 7, 30, 31, 32]] * 3)

    def run(fused: bool, dropout: float = 0.0):
        torch.manual_seed(0)
        model = get_peft_model(make("qwen2", False), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                                 lora_dropout=dropout))
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.5)
        if fused:
            assert lora.fuse_lora_forward(model) == 2 * 7
        out = model(input_ids=ids).logits
        out.square().mean().backward()
        return model, out, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    calls = []
    real = lora.lora_linear
    monkeypatch.setattr(lora, "lora_linear", lambda *a: calls.append(1) or real(*a))
    _, ref, ref_grads = run(False)
    assert not calls
    model, out, grads = run(True)
    assert len(calls) == 2 * 7
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert sorted(grads) == sorted(ref_grads) and len(grads) == 2 * 2 * 7  # A and B of every layer, no base
    for n in grads:
        torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-4, atol=1e-6)
    calls.clear()
    with torch.no_grad(), model.disable_adapter():
        off = model(input_ids=ids).logits
    assert not calls
    torch.testing.assert_close(off, logits(make("qwen2", False), ids))
    run(True, dropout=0.1)
    assert not calls  # dropout: peft's path


def test_the_frozen_base_waits_in_host_memory_during_a_rollout(monkeypatch):
    """The decoder decodes from its merged copy, so the base W is parked in host memory for the rollout: freed
    on the device while the decoder runs, then back bit for bit; the adapters stay; the tokens are those of HF
    `generate` on the peft model; the parameter objects are the same before and after."""
    from peft import LoraConfig, get_peft_model

    from align.lora import parked_base
    from align.rollout.generation import Sampling, generate_local
    from tests.test_fast_generate import PROMPTS, Tok, make

    monkeypatch.setenv("ALIGN_PARK_BASE", "1")  # on CUDA it is on by default; here it is asked for
    torch.manual_seed(0)
    model = get_peft_model(make("qwen2", False), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    params = dict(model.named_parameters())
    frozen = {n: p.detach().clone() for n, p in params.items() if not p.requires_grad}
    ids = torch.tensor([PROMPTS[0]])
    before = logits(model, ids)
    s = Sampling(max_new_tokens=8, temperature=0.0)
    seen = []

    def during(_n):  # called inside the rollout, after each chunk
        seen.append([params[n].untyped_storage().nbytes() for n in frozen])
        assert all(p.untyped_storage().nbytes() > 0 for n, p in params.items() if "lora_" in n)

    fast = generate_local(model, Tok(), PROMPTS, s, 2, "cpu", fast=True, on_batch=during)
    assert len(seen) == 2 and all(b == 0 for row in seen for b in row)  # every frozen storage was freed
    parked = parked_base(model, "cpu")
    assert parked is not None and not parked.parked and parked.nbytes > 0
    assert dict(model.named_parameters()) == params  # the same objects
    for n, v in frozen.items():
        assert torch.equal(params[n], v), n
    assert torch.equal(logits(model, ids), before)
    monkeypatch.setenv("ALIGN_PARK_BASE", "0")
    assert [c.ids for c in fast] == [c.ids for c in generate_local(model, Tok(), PROMPTS, s, 2, "cpu", fast=False)]
    assert parked_base(model, "cpu") is None
    monkeypatch.delenv("ALIGN_PARK_BASE")
    assert parked_base(model, "cpu") is None  # by default: on CUDA only
    assert parked_base(make("qwen2", False), "cuda") is None  # not a LoRA model


def test_two_process_zero3_lora_sft(tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from align.runtime import free_port

    out = tmp_path / "sft2"
    env = {k: v for k, v in os.environ.items() if k not in _DIST_ENV}
    ok(subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
                       "-m", "align", *map(str, SFT), "--model", str(tiny_model_dir), "--out", str(out)],
                      capture_output=True, text=True, timeout=300, env=env))
    merged = AutoModelForCausalLM.from_pretrained(out / "model")
    assert torch.isfinite(logits(merged, torch.tensor([[1, 5, 9]]))).all()


def test_reward_model_and_ppo_with_lora(tmp_path, tiny_model_dir, rm_runs):
    """rm train: adapters on the body, the new score head trained in full; the merged model scores as the
    adapter on its base does. ppo: policy and value get adapters, the reference is the policy with them off."""
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification

    rm = rm_runs / "rm-merged"  # a LoRA reward model of a copy of tiny_model_dir
    ids = torch.tensor([[1, 5, 9, 11, 20, 31]])
    merged = AutoModelForSequenceClassification.from_pretrained(rm / "model")
    adapted = PeftModel.from_pretrained(AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1),
                                        rm / "model" / "adapter")
    torch.testing.assert_close(logits(merged, ids), logits(adapted, ids), rtol=1e-4, atol=1e-4)
    said = ok(run_align("ppo", "--model", tiny_model_dir, "--reward-model", rm, "--lora-r", "4", "--max-steps", "1",
                        "--prompts-per-step", "4", "--minibatch-size", "2", "--micro-batch-size", "2", "--ppo-epochs",
                        "1", "--max-new-tokens", "8", "--ptx-batch-size", "2", "--eval-samples", "4", "--data", ARITH,
                        "--eval-data", small_data()["arith_test"], "--ptx-data", ARITH, "--out", tmp_path / "ppo")).stdout
    assert "value: LoRA r 4" in said  # its reference: test_ppo_reference_is_the_base_model_while_the_adapter_trains


def test_bad_lora_flags_exit_2(tmp_path):
    """Through the CLI: exit 2 and the flag named; the other config-level refusals in-process (the same check)."""
    from align.config import build
    from align.errors import UserError
    from stages.grpo import GRPOConfig
    from stages.sft import SFTConfig

    assert_user_error(run_align("sft", "--lora-r", "-1", "--out", tmp_path / "sft"), "--lora-r")
    with pytest.raises(UserError, match="--lora-dropout"):
        build(GRPOConfig, None, {"lora_r": 4, "lora_dropout": 1.5})
    with pytest.raises(UserError, match="--lora-r"):  # --no-merge keeps an adapter: there must be one
        build(SFTConfig, None, {"merge": False})
    with pytest.raises(UserError, match="preset"):  # an adapter over a random init could not be merged later
        build(SFTConfig, None, {"model": "tiny", "lora_r": 4, "merge": False})
    said = assert_user_error(run_align("sft", "--lora-r", "4", "--lora-targets", "embed_tokens,q_proj", "--max-steps",
                                       "1", "--data", ARITH, "--out", tmp_path / "e"), "embeddings")
    assert "embed_tokens" in said


def test_a_lora_run_resumes_exactly(tmp_path):
    """3 steps, then --resume to 5: the adapter and the merged weights of an uninterrupted 5-step run."""
    from safetensors.torch import load_file

    args = ["sft", "--model", "tiny", "--data", ARITH, "--batch-size", "8", "--lr", "3e-3", "--schedule", "constant",
            "--warmup-steps", "0", "--eval-every", "0", "--eval-samples", "0", "--lora-r", "4", "--save-every", "1"]
    ok(run_align(*args, "--max-steps", "5", "--out", tmp_path / "a"))
    ok(run_align(*args, "--max-steps", "3", "--out", tmp_path / "b"))
    assert "resumed from the checkpoint at step 3" in ok(run_align(*args, "--max-steps", "5", "--resume",
                                                                   "--out", tmp_path / "b")).stdout
    for f in ("model.safetensors", "adapter/adapter_model.safetensors"):
        a, b = load_file(tmp_path / "a" / "model" / f), load_file(tmp_path / "b" / "model" / f)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_no_merge_keeps_the_adapter_alone_and_later_stages_merge_it_into_its_base(tmp_path, sft_runs, rm_runs):
    """--no-merge: model/ holds the config, tokenizer and adapter but no weights; loading the artifact (any stage)
    merges the adapter into the run's --model and gives the weights the --merge run saved; a reward model's
    score head comes from the adapter. A changed base is refused (a preset base and --no-merge without --lora-r:
    test_bad_lora_flags_exit_2)."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from align.errors import UserError
    from align.models import load_causal_lm, load_tokenizer, resolve
    from align.reward_model import load_reward_model

    runs, base, _ = sft_runs
    alone = runs / "alone" / "model"
    assert not list(alone.glob("*.safetensors")) and (alone / "adapter" / "adapter_model.safetensors").is_file()
    source = resolve(str(runs / "alone"))
    loaded = load_causal_lm(source, load_tokenizer(source), torch.float32).state_dict()
    saved = AutoModelForCausalLM.from_pretrained(runs / "merged" / "model").state_dict()
    assert loaded.keys() == saved.keys()
    for k in saved:
        torch.testing.assert_close(loaded[k], saved[k], rtol=0, atol=1e-6)
    assert not torch.equal(loaded["model.layers.0.self_attn.q_proj.weight"],
                           AutoModelForCausalLM.from_pretrained(base).state_dict()["model.layers.0.self_attn.q_proj.weight"])
    # a later stage loads it, under ZeRO-3 on two processes (align eval: the same samples as the merged model in one
    # process: generation does not depend on the process count, test_distributed, which leaves to this check its
    # case of two processes gathering the ZeRO-3 weights for generation)
    for name, nproc in (("alone", "2"), ("merged", "1")):
        ok(run_align("eval", runs / name, "--data", small_data()["arith_test"], "--k", "1,2", "--limit", "8",
                     "--max-new-tokens", "6", "--nproc", nproc, "--out", tmp_path / f"eval-{name}"))
    assert (tmp_path / "eval-alone" / "samples.jsonl").read_text() == (tmp_path / "eval-merged" / "samples.jsonl").read_text()

    rm_source = resolve(str(rm_runs / "rm-alone"), expect="reward")
    got = load_reward_model(rm_source, load_tokenizer(rm_source), torch.float32)
    want = AutoModelForSequenceClassification.from_pretrained(rm_runs / "rm-merged" / "model")
    for k, v in want.state_dict().items():
        torch.testing.assert_close(got.state_dict()[k], v, rtol=0, atol=1e-6)
    assert got.config.align_reward_offset == want.config.align_reward_offset

    config = (base / "config.json").read_text()
    (base / "config.json").write_text(config + "\n")  # the base changed since
    try:
        with pytest.raises(UserError, match="has changed since the adapter was trained"):
            resolve(str(runs / "alone"))
    finally:
        (base / "config.json").write_text(config)  # for the module's other tests
