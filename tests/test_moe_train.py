"""Mixture-of-experts models (align.moe) through the training stages: the router's load-balancing loss against
hand-computed values and transformers' own, its scaling in a trained engine's backward, the memory plan's total
and active parameters (tiny configs against the built models, real configs against their published sizes), LoRA's
targets on an MoE model, and short end-to-end runs of every stage on tiny random MoE models (Qwen3-MoE, OLMoE,
Mixtral, Qwen2-MoE)."""

from __future__ import annotations

import json
import math
import os
import sys

import pytest
import torch

from align import moe
from align.engine import plan as P
from align.runtime import free_port
from tests.conftest import (MOE_FAMILIES, MOE_SHAPE, assert_user_error, output, parity_reward, run_align,
                            run_command, small_data, small_sft)

LN3, LN15 = math.log(3.0), math.log(1.5)


# ---------------------------------------------------------------------------------------------- the aux loss


def test_aux_loss_by_hand():
    # one layer, two tokens, E 2, top-1: p = [.75, .25] and [.6, .4], both pick expert 0:
    # f = [1, 0], P = [.675, .325] -> 2 · (1 · .675) = 1.35; the second token masked out: P = [.75, .25] -> 1.5
    layer = torch.tensor([[LN3, 0.0], [LN15, 0.0]])
    assert moe.load_balancing_loss((layer,), 1).item() == pytest.approx(1.35)
    assert moe.load_balancing_loss((layer,), 1, torch.tensor([[1, 0]])).item() == pytest.approx(1.5)
    # a second layer whose tokens both pick expert 1 (p = [.25, .75]): pooled over 4 rows, f = [.5, .5],
    # P = [(.75 + .6 + .25 + .25) / 4, ...] = [.4625, .5375] -> 2 · (.5 · .4625 + .5 · .5375) = 1.0
    other = torch.tensor([[0.0, LN3], [0.0, LN3]])
    assert moe.load_balancing_loss((layer, other), 1).item() == pytest.approx(1.0)
    # top-2 of 2 experts: f = [1, 1] whatever the router does, so the loss is E · Σ P_e = 2
    assert moe.load_balancing_loss((layer,), 2).item() == pytest.approx(2.0)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "olmoe"])
def test_aux_loss_matches_transformers(family):
    import importlib

    hf = importlib.import_module(f"transformers.models.{family}.modeling_{family}").load_balancing_loss_func
    g = torch.Generator().manual_seed(0)
    logits = tuple(torch.randn(2 * 5, 6, generator=g) * 2 for _ in range(3))  # 3 layers, B 2 × T 5, E 6
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0]])
    for k in (1, 2, 3):
        assert moe.load_balancing_loss(logits, k).item() == pytest.approx(hf(logits, 6, k).item(), rel=1e-6)
        assert moe.load_balancing_loss(logits, k, mask).item() == pytest.approx(hf(logits, 6, k, mask).item(), rel=1e-6)


def tiny_moe(family: str, **kw):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(family, vocab_size=64, **MOE_SHAPE,
                                                                 **{**MOE_FAMILIES[family], **kw}))


class Recorder:
    """The part of a DeepSpeed engine align.engine.build.Trained calls, around a real module: the loss each
    backward is given, recorded."""

    def __init__(self, module):
        self.module, self.losses = module, []

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def backward(self, loss):
        self.losses.append(loss.detach())

    def step(self):
        pass


def test_trained_engine_adds_the_router_loss_as_a_share_of_its_mean():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    from align.engine.build import Trained

    model = tiny_moe("qwen3_moe", router_aux_loss_coef=0.25)
    router = moe.router_aux(model)
    assert router.coef == 0.25 and moe.router_aux(model, 0.0) is None and moe.router_aux(model, 2.0).coef == 2.0
    eng = Recorder(model)
    trained = Trained(eng, accum=2, world=3, lr=1.0, router=router)
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():  # π_old / reference passes: no router loss asked for, none kept
        assert trained(input_ids=ids).router_logits is None and not router.kept
    out = trained(input_ids=ids)
    aux = load_balancing_loss_func(out.router_logits, 4, 2)
    trained.backward(torch.tensor(0.5))
    # (0.5 + 0.25 · aux / (accum 2 · world 3)) · 6: DeepSpeed's averaging over both leaves coef · aux per forward
    assert eng.losses[0].item() == pytest.approx(0.5 * 6 + 0.25 * aux.item(), rel=1e-6)
    trained.backward(torch.tensor(0.5))  # no forward since: nothing added
    assert eng.losses[1].item() == pytest.approx(3.0)
    from align.engine.stats import Stats

    stats = Stats()
    trained.record(stats)
    assert stats.reduce("cpu")["router/aux_loss"] == pytest.approx(aux.item(), rel=1e-6)


def test_router_loss_of_a_right_padded_or_packed_batch_counts_its_tokens_not_its_padding():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    from align.engine.build import Trained
    from align.logprobs import logprobs, packing

    model = tiny_moe("qwen3_moe").eval()  # dropout off; gradients stay on
    router = moe.router_aux(model)
    trained = Trained(Recorder(model), accum=1, world=1, lr=1.0, router=router)
    lengths = [8, 4, 3, 5]
    ids = torch.randint(3, 64, (4, 8), generator=torch.Generator().manual_seed(2))
    resp = torch.zeros(4, 7)
    for i, n in enumerate(lengths):
        ids[i, n:] = 0  # padding
        resp[i, 1 : n - 1] = 1  # position p predicts token p + 1: tokens 2 .. n - 1 are the response
    real = torch.arange(8)[None] < torch.tensor(lengths)[:, None]
    with torch.no_grad():
        logits = model(input_ids=ids, output_router_logits=True).router_logits
    want = load_balancing_loss_func(logits, 4, 2, real.long()).item()
    assert want != pytest.approx(load_balancing_loss_func(logits, 4, 2).item())  # the padding would count
    batch = {"input_ids": ids, "response_mask": resp}
    assert packing(batch, min_saving=0.1) is not None  # 3 rows of 8 for 4: packed below
    for pack in (False, True):
        logprobs(trained, batch, pack=pack)
        assert router.kept[-1].item() == pytest.approx(want, rel=1e-5), pack
    with torch.no_grad():  # a reference's pass: nothing kept
        logprobs(trained, batch)
    assert len(router.kept) == 2


def test_dense_models_and_heads_without_router_logits_get_no_router_loss(shipped_tokenizer):
    from transformers import AutoModelForSequenceClassification

    from align.models import load_causal_lm, resolve

    assert moe.router_aux(load_causal_lm(resolve("tiny"), shipped_tokenizer, torch.float32)) is None
    cfg = tiny_moe("qwen3_moe").config
    cfg.num_labels = 1
    assert moe.router_aux(AutoModelForSequenceClassification.from_config(cfg)) is None  # a scalar reward head
    assert moe.aux_coef({"num_experts": 4, "num_experts_per_tok": 2}) == moe.DEFAULT_AUX_COEF
    assert moe.aux_coef({"num_experts": 0}, 1.0) == 0.0


# ---------------------------------------------------------------------------------------------- the memory plan


def built(config: dict, head: str = "lm"):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    hf = AutoConfig.for_model(**config)
    with torch.device("meta"):
        if head == "lm":
            return AutoModelForCausalLM.from_config(hf)
        hf.num_labels = 1
        return AutoModelForSequenceClassification.from_config(hf)


@pytest.mark.parametrize("family", list(MOE_FAMILIES))
def test_plan_counts_every_expert_of_the_tiny_configs(family):
    from peft import get_peft_model

    from align.lora import lora_config

    variants = [{}, {"tie_word_embeddings": False}] + ([{"mlp_only_layers": [0]}] if "qwen" in family else [])
    for extra in variants:
        config = {"model_type": family, "vocab_size": 512, **MOE_SHAPE, **MOE_FAMILIES[family], **extra}
        a = P.arch(config)
        assert a.moe and a.experts == 4 and a.experts_per_tok == 2
        assert P.n_params(a) == sum(p.numel() for p in built(config).parameters()), extra
        if family != "olmoe":  # transformers has no OLMoE sequence classifier
            assert P.n_params(a, "score") == sum(p.numel() for p in built(config, "score").parameters()), extra
        for targets in ("all-linear", "q_proj,v_proj"):
            cfg = type("C", (), dict(lora_r=2, lora_alpha=4.0, lora_dropout=0.0, lora_targets=targets))
            model = built(config)
            peft = get_peft_model(model, lora_config(cfg, None, model))
            assert P.lora_params(a, 2, targets) == sum(p.numel() for p in peft.parameters() if p.requires_grad)
    # active: attention, norms, the router and 2 of the 4 experts (3 · 32 · i' each) per layer
    a = P.arch({"model_type": family, "vocab_size": 512, **MOE_SHAPE, **MOE_FAMILIES[family]})
    assert P.n_params(a) - P.n_params(a, active=True) == 2 * 2 * 3 * 32 * 32
    assert a.token_intermediate == 2 * 32 + (32 if family == "qwen2_moe" else 0)


def test_plan_of_real_moe_configs_against_their_published_sizes():
    from benchmarks.vs_trl import MODELS, MOE_PUBLISHED

    for name, (total, active) in MOE_PUBLISHED.items():
        model_type, kw = MODELS[name]
        config = {"model_type": model_type, **kw}
        a = P.arch(config)
        assert P.n_params(a) == sum(p.numel() for p in built(config).parameters()), name
        assert abs(P.n_params(a) / total - 1) < 0.01, (name, P.n_params(a))
        # published to two digits (1.3B, 3.3B): within 2 %
        assert abs(P.n_params(a, active=True) / active - 1) < 0.02, (name, P.n_params(a, active=True))
    # the activations and the no-gradient passes of Mixtral-8x7B run 2 of 8 experts: 2 · 14336 wide
    mixtral = P.arch({"model_type": "mixtral", **MODELS["mixtral-8x7b"][1]})
    dense = P.replace(mixtral, experts=0, sparse=())
    s = P.Setup(precision="bf16", device="cuda")
    assert P.inference_bytes(mixtral, 1, 1, s) == 2 * 3 * 2 * 14336 + 2 * 2 * 4096
    assert P.activation_bytes(mixtral, 1, 10, s) > P.activation_bytes(dense, 1, 10, s)


def test_plan_counts_transformers_moe_decode_where_the_fast_decoder_does_not_take_the_model():
    """transformers' generate decodes an MoE on a GPU with batched_mm, gathering every row's top-k experts'
    weights (gate, up, down) one layer at a time: Qwen1.5-MoE-A2.7B with the fast decoder off
    (ALIGN_FAST_GENERATION=0) at 64 rows, top-4, h 2048, expert width 1408 in bf16. With it on, Qwen1.5-MoE (its
    shared expert included) and OLMoE decode on the fast decoder, and a CPU keeps grouped_mm: no such term."""
    from align.config import build
    from benchmarks.vs_trl import MODELS
    from stages.grpo import GRPOConfig, GRPOPlan

    cfg = build(GRPOConfig, None, {"model": "x", "prompts_per_step": 8, "num_generations": 8, "max_new_tokens": 256,
                                   "lora_r": 16})
    gpu = P.Device("cuda", 1e12, 1, True, True, "test")
    term = "rollout: transformers' MoE decode (batched_mm: each row's top-k experts gathered)"

    def rows(name, device=gpu):
        a = P.arch({"model_type": MODELS[name][0], **MODELS[name][1]})
        return {n: v for n, v in P.estimate(GRPOPlan(cfg), {"policy": P.Model("policy", a)}, device, P.Data(37)).rows}

    hf = P.Device("cuda", 1e12, 1, True, False, "test")  # fast_decoder False: ALIGN_FAST_GENERATION=0
    assert rows("qwen1.5-moe-a2.7b", hf)[term] == {"rollout": 64 * 4 * 3 * 2048 * 1408 * 2}
    assert term not in rows("qwen1.5-moe-a2.7b")
    assert "rollout: decoder's bf16 copy" in rows("qwen1.5-moe-a2.7b")  # LoRA: the fast decoder's merged copy
    assert term not in rows("olmoe-1b-7b")
    assert term not in rows("qwen1.5-moe-a2.7b", P.Device("cpu", 1e12, 1, False, False, "test"))


def test_plan_says_total_and_active_parameters(moe_model_dirs, tmp_path):
    proc = run_align("sft", "--model", moe_model_dirs["qwen3_moe"], "--plan", *small_sft(), "--out", tmp_path / "o")
    assert proc.returncode == 0, output(proc)
    a = P.arch(json.loads((moe_model_dirs["qwen3_moe"] / "config.json").read_text()))
    total, active = P.n_params(a) / 1e9, P.n_params(a, active=True) / 1e9
    assert f"policy: mixture of experts, {total:.3g}B parameters in all (4 experts" in output(proc)
    assert f"{active:.3g}B active per token (top-2" in output(proc)
    assert not (tmp_path / "o").exists()


# ---------------------------------------------------------------------------------------------- LoRA


def test_lora_on_the_experts_is_refused_before_anything_is_written(moe_model_dirs, tmp_path):
    from align.errors import UserError
    from align.lora import check_targets

    proc = run_align("sft", "--model", moe_model_dirs["mixtral"], "--lora-r", "4", "--lora-targets", "down_proj",
                     *small_sft(), "--max-steps", "1", "--out", tmp_path / "o")
    assert_user_error(proc, "--lora-targets down_proj", "mixture of experts", "q_proj,k_proj,v_proj,o_proj")
    assert not (tmp_path / "o").exists()
    for family in ("qwen2_moe", "olmoe"):  # names peft would put on the experts or the router (gate)
        with torch.device("meta"):
            model = tiny_moe(family)
        for targets in ("q_proj,experts", "gate", "mlp.gate_proj", "gate_up_proj"):
            cfg = type("C", (), dict(lora_targets=targets))
            with pytest.raises(UserError, match="mixture of experts"):
                check_targets(cfg, model, "the policy")
        check_targets(type("C", (), dict(lora_targets="q_proj,o_proj")), model, "the policy")


# ---------------------------------------------------------------------------------------------- the stages


def rows(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def ok(proc):
    assert proc.returncode == 0, output(proc)[-4000:]
    return proc


def trained_rows(out) -> list[dict]:
    """The step lines of a run (not its evaluations), each with a positive router/aux_loss."""
    steps = [r for r in rows(out) if "grad_norm" in r]
    assert steps and all(r["router/aux_loss"] > 0 and math.isfinite(r["router/aux_loss"]) for r in steps), steps
    return steps


SFT = ["--max-steps", "2", "--batch-size", "8", "--eval-every", "0", "--eval-samples", "2", "--max-new-tokens", "4",
       "--lr", "1e-3", "--warmup-steps", "0"]


@pytest.mark.parametrize("family,zero", [("qwen3_moe", "3"), ("olmoe", "3"), ("mixtral", "0")])
def test_sft_trains_each_moe_family(moe_model_dirs, tmp_path, family, zero):
    """(Qwen2-MoE: the 2-process run below.)"""
    out = tmp_path / "sft"
    ok(run_align("sft", "--model", moe_model_dirs[family], "--data", small_data()["arith"], "--eval-data", "", *SFT,
                 "--zero-stage", zero, "--out", out))
    steps = trained_rows(out)
    assert steps[-1]["loss"] < steps[0]["loss"]
    art = json.loads((out / "artifact.json").read_text())
    assert art["status"] == "complete" and json.loads((out / "model/config.json").read_text())["model_type"] == family


def test_a_dense_model_logs_no_router_loss_and_the_flag_is_checked(tiny_model_dir, tmp_path):
    from align.errors import UserError
    from stages.sft import SFTConfig

    ok(run_align("sft", "--model", tiny_model_dir, *SFT, "--max-steps", "1", "--data", small_data()["arith"],
                 "--eval-data", "", "--out", tmp_path / "dense"))
    assert rows(tmp_path / "dense") and not any("router/aux_loss" in r for r in rows(tmp_path / "dense"))
    with pytest.raises(UserError, match="--router-aux-coef must be -1"):
        SFTConfig(router_aux_coef=-0.5)
    assert SFTConfig(router_aux_coef=0.0).router_aux_coef == 0.0  # 0: off (moe.router_aux gives None)


@pytest.fixture(scope="module")
def rm_artifact(moe_model_dirs, tmp_path_factory):
    out = tmp_path_factory.mktemp("moe_rm") / "rm"
    ok(run_align("rm", "train", "--model", moe_model_dirs["qwen3_moe"], "--data", small_data()["prefs"],
                 "--eval-data", small_data()["prefs_test"], "--max-steps", "2", "--batch-size", "8",
                 "--eval-every", "0", "--normalize-samples", "16", "--out", out))
    return out


def test_rm_trains_a_moe_reward_model(rm_artifact):
    art = json.loads((rm_artifact / "artifact.json").read_text())
    assert art["status"] == "complete" and art["model_kind"] == "reward"
    # the scalar head (a sequence classifier) returns no router logits: no router loss
    assert not any("router/aux_loss" in r for r in rows(rm_artifact))


def test_dpo_on_a_moe_policy(moe_model_dirs, tmp_path):
    out = tmp_path / "dpo"
    ok(run_align("dpo", "--model", moe_model_dirs["olmoe"], "--data", small_data()["prefs"], "--eval-data",
                 small_data()["prefs_test"], "--max-steps", "2", "--batch-size", "8", "--eval-every", "0",
                 "--eval-samples", "0", "--out", out))
    trained_rows(out)


def test_grpo_with_lora_on_a_moe_policy(moe_model_dirs, tmp_path):
    out = tmp_path / "grpo"
    ok(run_align("grpo", "--model", moe_model_dirs["mixtral"], *small_sft(), "--reward", parity_reward(),
                 "--max-steps", "2", "--prompts-per-step", "4", "--num-generations", "4", "--max-new-tokens", "6",
                 "--eval-samples", "2", "--eval-k", "1", "--micro-batch-size", "8", "--lr", "1e-3",
                 "--lora-r", "4", "--out", out))
    trained_rows(out)
    from safetensors.torch import load_file

    adapter = load_file(out / "model/adapter/adapter_model.safetensors")
    assert adapter and all(".self_attn." in k for k in adapter), sorted(adapter)[:4]
    merged = load_file(out / "model/model.safetensors")
    base = load_file(moe_model_dirs["mixtral"] / "model.safetensors")
    assert merged.keys() == base.keys()
    assert all(torch.equal(merged[k], base[k]) for k in merged if ".experts." in k)  # frozen, not adapted
    assert any(not torch.equal(merged[k], base[k]) for k in merged if "q_proj" in k)


def test_ppo_on_a_moe_policy_and_reward_model(moe_model_dirs, rm_artifact, tmp_path):
    out = tmp_path / "ppo"
    ok(run_align("ppo", "--model", moe_model_dirs["qwen3_moe"], "--reward-model", rm_artifact,
                 "--data", small_data()["arith"], "--eval-data", small_data()["arith_test"],
                 "--ptx-data", small_data()["arith"], "--max-steps", "2", "--prompts-per-step", "4",
                 "--minibatch-size", "4", "--micro-batch-size", "2", "--ppo-epochs", "1", "--max-new-tokens", "6",
                 "--ptx-batch-size", "2", "--eval-samples", "2", "--out", out))
    steps = trained_rows(out)
    assert not any("val/router/aux_loss" in r for r in steps)  # the value network's score head: none


def test_two_process_zero3_sft_on_a_moe_model(moe_model_dirs, tmp_path):
    """Ranks route their tokens to different experts; whole blocks are gathered (ZeRO-3 leaf modules), so
    neither waits on a gather the other never makes."""
    out = tmp_path / "two"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           "-m", "align", "sft", "--model", str(moe_model_dirs["qwen2_moe"]), "--data", str(small_data()["arith"]),
           "--eval-data", "", *SFT,
           "--out", str(out)]
    ok(run_command(cmd, {**os.environ, "ALIGN_DIST_TIMEOUT": "120", "COLUMNS": "200"}, timeout=300))
    assert json.loads((out / "artifact.json").read_text())["world_size"] == 2
    trained_rows(out)
