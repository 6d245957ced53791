"""The memory plan (align.engine.plan): hand-computed terms of a tiny config, parameter counts against
transformers and peft, phases and the peak, the smallest change that fits, and the check in a real run (exit 2
before anything is written, --plan, --no-plan-check, an automatic micro-batch). The compile cache and the
time/compile metric (align.compile_cache)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from align.config import build
from align.engine import plan as P
from align.errors import UserError
from stages.dpo import DPOConfig, DPOPlan
from stages.grpo import GRPOConfig, GRPOPlan
from stages.ppo import PPOConfig, PPOPlan
from stages.sft import SFTConfig, SFTPlan
from tests.conftest import output, run_align, small_data

# h 8, 2 layers, 2 heads of 4 (1 KV head), MLP 16, vocabulary 32, tied embeddings. By hand, per layer: q 8·8 = 64,
# k 8·4 = 32, v 32, o 64, gate 8·16 = 128, up 128, down 128, two norms 2·8: 592; the model 32·8 + 2·592 + 8 = 1448
# (an LM head tied to the embedding), 1448 + 8 = 1456 with a score head.
TINY = dict(model_type="llama", hidden_size=8, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            head_dim=4, intermediate_size=16, vocab_size=32, tie_word_embeddings=True)
A = P.arch(TINY)
N, N_SCORE = 1448, 1456
LORA_2 = 2 * 2 * ((8 + 8) + (8 + 4) + (8 + 4) + (8 + 8) + 3 * (8 + 16))  # r (in + out) per Linear, 2 layers: 512
GPU = P.Device("cuda", 1e12, 1, True, True, "test")


def test_parameter_counts_by_hand_and_against_transformers():
    assert P.n_params(A) == N and P.n_params(A, "score") == N_SCORE
    assert P.n_params(P.arch({**TINY, "tie_word_embeddings": False})) == N + 32 * 8
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    shapes = [TINY, {**TINY, "tie_word_embeddings": False}, {**TINY, "model_type": "qwen2"},
              {**TINY, "model_type": "qwen3", "head_dim": 6}, {**TINY, "attention_bias": True, "mlp_bias": True}]
    for config in shapes:
        hf = AutoConfig.for_model(**config)
        with torch.device("meta"):
            lm = AutoModelForCausalLM.from_config(hf)
            hf.num_labels = 1
            clf = AutoModelForSequenceClassification.from_config(hf)
        assert P.n_params(P.arch(config)) == sum(p.numel() for p in lm.parameters()), config
        assert P.n_params(P.arch(config), "score") == sum(p.numel() for p in clf.parameters()), config


def test_lora_adapter_count_against_peft():
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    assert P.lora_params(A, 2) == LORA_2 == 512
    for targets in ("all-linear", "q_proj,v_proj"):
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**TINY))
        names = targets if targets == "all-linear" else targets.split(",")
        peft = get_peft_model(model, LoraConfig(r=2, target_modules=names))
        trained = sum(p.numel() for p in peft.parameters() if p.requires_grad)
        assert P.lora_params(A, 2, targets) == trained


def test_bytes_per_term_by_hand():
    policy = P.Model("policy", A, trained=True)
    pure = P.Setup("bf16-pure", 0)
    assert P.model_state(policy, pure) == {"weights": N * 2, "gradients": N * 2, "optimizer": N * 4}
    # ZeRO-2 on 2 processes: bf16 master partition (+2) and moments sharded, gradients sharded, weights whole
    assert P.model_state(policy, P.Setup("bf16-pure", 2, world=2)) == {
        "weights": N * 2, "gradients": N * 2 / 2, "optimizer": N * 6 / 2}
    # ZeRO-3 on 4: everything sharded; fp32 moments, no master copy (the fp32 partition is the master)
    assert P.model_state(policy, P.Setup("fp32", 3, world=4)) == {
        "weights": N * 4 / 4, "gradients": N * 4 / 4, "optimizer": N * 8 / 4}
    assert P.model_state(policy, P.Setup("bf16-mixed", 3, offload_optimizer=True)) == {
        "weights": N * 4, "gradients": N * 4, "optimizer": 0}  # the bucket is larger than this model's gradients
    assert P.model_state(P.Model("reference", A), pure) == {"weights": N * 2, "gradients": 0, "optimizer": 0}
    assert P.model_state(P.Model("reference", A), P.Setup("bf16-pure", 3, offload_frozen=True))["weights"] == 0
    lora = P.Model("policy", A, trained=True, lora_r=2)  # frozen bf16 base + fp32 adapters (4 + 4 + 8 bytes)
    assert P.model_state(lora, pure) == {"weights": N * 2 + 512 * 4, "gradients": 512 * 4, "optimizer": 512 * 8}
    value = P.Model("value", A, "score", trained=True, lora_r=2)  # + the score head (8), trained in full
    assert P.model_state(value, pure) == {"weights": N * 2 + 520 * 4, "gradients": 520 * 4, "optimizer": 520 * 8}


def test_activations_logits_and_kv_cache_by_hand():
    # per token and layer: 2 norms · (4·8 + 2·2·8) = 128, + 2 · (3·8 + 2·4 + 4·16) = 192: 320; + the final norm
    # (64) and the head's hidden states (2·2·8 = 32): (2·320 + 96) · 6 tokens
    bf16 = P.Setup("bf16-pure", 0)
    assert P.activation_bytes(A, 2, 3, bf16) == (2 * 320 + 96) * 6 == 4416
    checkpointed = P.Setup("bf16-pure", 0, checkpointing=True)  # each layer keeps its input (2·8), one recomputes
    assert P.activation_bytes(A, 2, 3, checkpointed) == (2 * 16 + 320 + 96) * 6
    fp32 = P.Setup("fp32", 0)  # norms 32 + 64 = 96; 2·96 + 4·96 = 576 per layer; + 96 + 64
    assert P.activation_bytes(A, 2, 3, fp32) == (2 * 576 + 160) * 6
    assert P.full_logit_bytes(2, 3, 32, bf16) == 2 * 3 * 32 * (2 + 2 + 4 + 4)
    # the fused head: 3 fp32 copies of one chunk, 2^25 elements at most (220 rows of a 152k vocabulary)
    assert P.chunked_logit_bytes(6, 32) == 3 * 6 * 32 * 4
    assert P.chunked_logit_bytes(10_000, 151_936) == 3 * 220 * 151_936 * 4
    # 5 rows decode as 8 (a power of two), 100 tokens in 128 + 1 cache slots: 2 · 2 layers · 8 · 1 · 129 · 4 · 2
    assert P.kv_cache_bytes(A, 5, 100, bf16, fast=True) == 2 * 2 * 8 * 1 * 129 * 4 * 2
    assert P.kv_cache_bytes(A, 5, 100, bf16, fast=False) == 2 * 2 * 5 * 1 * 100 * 4 * 2


def rows(plan: P.Plan) -> dict[str, dict[str, float]]:
    return dict(plan.rows)


def test_ppo_holds_four_models():
    cfg = build(PPOConfig, None, {"model": "x"})
    models = {"policy": P.Model("policy", A), "value": P.Model("value", A, "score"),
              "reward model": P.Model("reward model", A, "score")}
    r = rows(P.estimate(PPOPlan(cfg), models, GPU, P.Data(prompt_tokens=10)))
    assert r["policy: weights"]["update"] == N * 2 and r["policy: optimizer state"]["rollout"] == N * 4
    assert r["policy: gradients"] == {"update": N * 2}  # none outside the update
    assert r["value: weights"]["update"] == N_SCORE * 2 and r["value: gradients"] == {"update": N_SCORE * 2}
    assert r["value: optimizer state"]["score"] == N_SCORE * 4
    assert r["reference: weights"]["update"] == N * 2 and r["reward model: weights"]["rollout"] == N_SCORE * 2
    lora = P.estimate(PPOPlan(build(PPOConfig, None, {"model": "x", "lora_r": 2})), models, GPU, P.Data(10))
    assert "reference: weights" not in rows(lora) and any("adapters off" in n for n in lora.notes)
    assert rows(lora)["value: optimizer state"]["update"] == (LORA_2 + 8) * 8


def test_grpo_peak_is_the_larger_phase_not_the_sum(monkeypatch):
    cfg = build(GRPOConfig, None, {"model": "x", "prompts_per_step": 4, "num_generations": 2, "max_new_tokens": 50})
    est = lambda: P.estimate(GRPOPlan(cfg), {"policy": P.Model("policy", A)}, GPU, P.Data(20))  # noqa: E731
    # bf16-pure, one process: a model this small decodes from a fused bf16 copy (freed before the update)
    assert rows(est())["rollout: decoder's bf16 copy"] == {"rollout": N * 2}
    # ALIGN_FAST_DECODER_COPY=0: the decoder reads the policy's own weights; bf16-mixed (fp32 weights): a bf16 copy
    # all the same
    monkeypatch.setenv("ALIGN_FAST_DECODER_COPY", "0")
    plan = est()
    r = rows(plan)
    assert "rollout: decoder's bf16 copy" not in r and any("own weights" in n for n in plan.notes)
    mixed = rows(P.estimate(GRPOPlan(build(GRPOConfig, None, {"model": "x", "prompts_per_step": 4, "num_generations": 2,
                                                             "max_new_tokens": 50, "precision": "bf16-mixed"})),
                            {"policy": P.Model("policy", A)}, GPU, P.Data(prompt_tokens=20)))
    assert mixed["rollout: decoder's bf16 copy"] == {"rollout": N * 2}
    assert r["rollout: KV cache (8 rows x 129 slots)"] == {"rollout": 2 * 2 * 8 * 129 * 4 * 2}
    assert "update" not in r["rollout: prefill and sampling buffers"]
    totals = {p: plan.total(p) for p in plan.phases}
    assert plan.peak == max(totals.values()) < sum(totals.values())
    assert "reference: weights" not in r  # β 0 loads none
    with_ref = rows(P.estimate(GRPOPlan(build(GRPOConfig, None, {"model": "x", "beta": 0.1})),
                               {"policy": P.Model("policy", A)}, GPU, P.Data(20)))
    assert with_ref["reference: weights"]["update"] == N * 2
    lora = rows(P.estimate(GRPOPlan(build(GRPOConfig, None, {"model": "x", "beta": 0.1, "lora_r": 2})),
                           {"policy": P.Model("policy", A)}, GPU, P.Data(20)))
    assert "reference: weights" not in lora
    assert lora["policy: weights"]["rollout"] == LORA_2 * 4  # the base waits in host memory while decoding
    assert lora["policy: weights"]["update"] == N * 2 + LORA_2 * 4
    hf = P.estimate(GRPOPlan(cfg), {"policy": P.Model("policy", P.arch({**TINY, "model_type": "gpt_neox"}))}, GPU,
                    P.Data(20))
    assert not any(n.startswith("rollout: decoder") for n, _ in hf.rows)  # transformers' generate: no copy
    assert any("model type 'gpt_neox'" in n for n in hf.notes)
    window = P.arch({**TINY, "model_type": "mistral", "sliding_window": 64})  # shorter than the rollout's 70
    assert any("sliding-window" in n for n in P.estimate(GRPOPlan(cfg), {"policy": P.Model("policy", window)}, GPU,
                                                         P.Data(20)).notes)


def test_rollout_gpus_put_the_rollout_in_a_decoder_column_of_its_own(monkeypatch):
    """--rollout-gpus 1 of 3 processes: 2 ZeRO-3 trainers hold no rollout terms; a decoder holds the whole policy
    (bf16 with ALIGN_FAST_DECODER_COPY=0: its fast decoder reads it in place; under LoRA it keeps a merged copy)
    and the KV cache of all 4 x 2 samples."""
    monkeypatch.setenv("ALIGN_FAST_DECODER_COPY", "0")
    cfg = build(GRPOConfig, None, {"model": "x", "prompts_per_step": 4, "num_generations": 2, "max_new_tokens": 50,
                                   "rollout_gpus": 1, "nproc": 3})
    two = P.Device("cuda", 1e12, 2, True, True, "test")
    plan = P.estimate(GRPOPlan(cfg), {"policy": P.Model("policy", A)}, two, P.Data(prompt_tokens=20))
    r = rows(plan)
    assert plan.phases == (P.DECODER, "score", "update")
    assert r["decoder: policy weights"] == {P.DECODER: N * 2} and "rollout: decoder's bf16 copy" not in r
    assert r["rollout: KV cache (8 rows x 129 slots)"] == {P.DECODER: 2 * 2 * 8 * 129 * 4 * 2}
    assert P.DECODER not in r["policy: weights"] and r["policy: weights"]["update"] == N * 2 / 2  # sharded over 2
    assert "rollout: policy gathered (ZeRO-3)" not in r
    lora = rows(P.estimate(GRPOPlan(build(GRPOConfig, None, {"model": "x", "lora_r": 2, "rollout_gpus": 1,
                                                              "nproc": 2})),
                           {"policy": P.Model("policy", A)}, GPU, P.Data(20)))
    assert lora["decoder: policy weights"] == {P.DECODER: N * 2 + LORA_2 * 4}
    assert lora["rollout: decoder's bf16 copy"] == {P.DECODER: N * 2}  # the merged W + (α/r) B A


def test_dpo_reference_live_precomputed_none():
    policy = {"policy": P.Model("policy", A)}
    live = P.estimate(DPOPlan(build(DPOConfig, None, {"model": "x"})), policy, GPU)
    # a live reference: its forwards of a step's pairs run before the policy's micro-batches, a phase of their own
    assert live.phases == ("reference pass", "update")
    assert rows(live)["reference: weights"] == {"reference pass": N * 2, "update": N * 2}
    assert set(rows(live)["reference pass: forward"]) == {"reference pass"}
    pre = P.estimate(DPOPlan(build(DPOConfig, None, {"model": "x", "precompute_ref": True})), policy, GPU)
    assert pre.phases == ("reference pass", "update") and rows(pre)["reference: weights"] == {"reference pass": N * 2}
    for flags in ({"loss": "simpo"}, {"lora_r": 2}):
        assert "reference: weights" not in rows(P.estimate(DPOPlan(build(DPOConfig, None, {"model": "x", **flags})),
                                                           policy, GPU))
    short = P.estimate(DPOPlan(build(DPOConfig, None, {"model": "x"})), policy, GPU, P.Data(sequence_tokens=40))
    assert any("x 40 tokens" in n for n, _ in short.rows)  # padded to the data's longest pair, not --max-length


CPU = P.Device("cpu", 1e12, 1, False, False, "test")


def judge_forward(rows: int, tokens: int, b: int) -> float:
    """One batch of the judge by hand (TINY: intermediate 16, hidden 8, vocabulary 32): a layer's widest tensors
    rows x tokens x b x (3·16 + 2·8), and the last position's logits in the judge's dtype and in fp32."""
    return rows * tokens * b * (3 * 16 + 2 * 8) + rows * 32 * (b + 4)


def test_a_judge_adds_its_whole_weights_and_one_batch_of_its_forward():
    """An LLM judge (grpo --reward judge:MODEL, ppo --judge, dpo --online --judge) is loaded whole on every process
    outside DeepSpeed, fp32 on a CPU and bf16 on a GPU: every phase of the plan grows by its weights (not sharded
    by ZeRO-3 over 2 processes, as the policy is), and the phase where it judges by one batch of its forward: at
    most 16 texts of the rubric's characters + the prompt + the answers (two for a pairwise judge)."""
    from align.judge import PAIR_RUBRIC, RUBRIC

    judge = {"judge": P.Model("judge", A)}
    flags = {"model": "x", "prompts_per_step": 4, "num_generations": 2, "max_new_tokens": 50}
    grpo = build(GRPOConfig, None, {**flags, "reward": ["math", "judge:J:0.5"]})
    assert GRPOPlan(grpo).models() == {"policy": "x", "judge": "J"}
    for device, b in ((CPU, 4), (GPU, 2), (replace(GPU, world=2), 2)):
        with_judge = P.estimate(GRPOPlan(grpo), {"policy": P.Model("policy", A), **judge}, device, P.Data(20))
        without = P.estimate(GRPOPlan(build(GRPOConfig, None, flags)), {"policy": P.Model("policy", A)}, device,
                             P.Data(20))
        rows_ = 4 // device.world * 2  # this process's samples: fewer than a batch of 16
        grown = {p: with_judge.total(p) - without.total(p) for p in with_judge.phases}
        assert grown == pytest.approx({"rollout": N * b, "score": N * b + judge_forward(rows_, len(RUBRIC) + 70, b),
                                       "update": N * b}), device
    ppo = build(PPOConfig, None, {"model": "x", "reward_model": "", "judge": "J", "prompts_per_step": 64,
                                  "minibatch_size": 32})
    assert PPOPlan(ppo).models() == {"policy": "x", "value": "x", "judge": "J"}  # the value network: the policy's
    models = {"policy": P.Model("policy", A), "value": P.Model("value", A, "score")}
    r = rows(P.estimate(PPOPlan(ppo), {**models, **judge}, CPU, P.Data(10)))
    assert r["judge: weights (whole on every process)"] == {"rollout": N * 4, "score": N * 4, "update": N * 4}
    assert r[f"judge: forward (16 texts x {len(RUBRIC) + 10 + 48} tokens)"] == {
        "score": judge_forward(16, len(RUBRIC) + 10 + 48, 4)}  # 64 episodes a step: batches of 16
    assert "judge: forward" not in " ".join(rows(P.estimate(PPOPlan(build(PPOConfig, None, {"model": "x"})),
                                                            {**models, "reward model": P.Model("rm", A, "score")},
                                                            CPU, P.Data(10))))
    dpo = build(DPOConfig, None, {"model": "x", "online": True, "judge": "J", "online_samples": 2, "batch_size": 4,
                                  "max_new_tokens": 16})
    assert DPOPlan(dpo).models() == {"policy": "x", "judge": "J"}
    r = rows(P.estimate(DPOPlan(dpo), {"policy": P.Model("policy", A), **judge}, CPU, P.Data(10)))
    tokens = len(PAIR_RUBRIC) + 10 + 2 * 16  # pairwise: both answers in one text
    assert r[f"judge: forward (8 texts x {tokens} tokens)"] == {"rollout": judge_forward(8, tokens, 4)}


def test_smallest_change_in_order():
    cfg = build(SFTConfig, None, {"model": "x", "micro_batch_size": 8, "eval_data": ""})
    policy = {"policy": P.Model("policy", A)}
    at = lambda c, d=GPU: P.estimate(SFTPlan(c), policy, d).peak  # noqa: E731
    smaller = build(SFTConfig, None, {"model": "x", "micro_batch_size": 4, "eval_data": ""})
    between = P.Device("cuda", (at(cfg) + at(smaller)) / 2)
    change, plan = P.smallest_change(SFTPlan(cfg), policy, between)
    assert change == "--micro-batch-size 4" and plan.fits  # the largest micro-batch that fits
    # SFT's held-out loss forwards 64 rows with their full logits: a phase of its own, which --eval-data '' drops
    evals = build(SFTConfig, None, {"model": "x", "micro_batch_size": 1, "precision": "bf16-mixed"})
    plan = P.estimate(SFTPlan(evals), policy, GPU, P.Data(sequence_tokens=10))
    assert plan.phases == ("update", "eval") and plan.peak_phase == "eval"
    assert rows(plan)["eval: logits (64 x 10 x 32, fp32 loss)"] == {"eval": 64 * 10 * 32 * 12}
    tight = P.Device("cuda", plan.total("update") + 1)
    assert P.smallest_change(SFTPlan(evals), policy, tight, P.Data(sequence_tokens=10))[0] == "--eval-data ''"
    one = build(GRPOConfig, None, {"model": "x", "micro_batch_size": 1})
    g = lambda c: P.estimate(GRPOPlan(c), policy, GPU, P.Data(20)).peak  # noqa: E731
    tight = P.Device("cuda", (g(one) + g(build(GRPOConfig, None, {"model": "x", "micro_batch_size": 1,
                                                                  "gradient_checkpointing": True}))) / 2)
    assert P.smallest_change(GRPOPlan(one), policy, tight, P.Data(20))[0] == "--gradient-checkpointing"
    families = GRPOPlan(build(GRPOConfig, None, {"model": "x"})).changes(GPU, P.Data(20))
    labels = [P.flags(family[0][0]) for family in families if family]
    assert labels == ["--micro-batch-size 64", "--gradient-checkpointing", "--lora-r 16", "--offload-optimizer",
                      "--prompts-per-step 8", "--max-new-tokens 24", "--nproc 2"]
    # a 1.2B model, GRPO's defaults (16 prompts x G 8): at 8 GiB only 8 processes fit; at 4 GiB no single change
    # does, several together do; at 1 GiB nothing does
    big = {"policy": P.Model("policy", P.arch(dict(
        model_type="llama", hidden_size=2048, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=8,
        intermediate_size=8192, vocab_size=32000)))}
    cfg = build(GRPOConfig, None, {"model": "x"})
    assert P.smallest_change(GRPOPlan(cfg), big, P.Device("cuda", 8 * P.GiB), P.Data(100))[0] == "--nproc 8"
    change, plan = P.smallest_change(GRPOPlan(cfg), big, P.Device("cuda", 4 * P.GiB), P.Data(100))
    assert change.startswith("--micro-batch-size 1 ") and "--lora-r 16" in change and plan.fits
    assert P.smallest_change(GRPOPlan(cfg), big, P.Device("cuda", 1 * P.GiB), P.Data(100)) is None


def test_decoder_ranks_are_the_first_thing_given_up_when_a_trainer_does_not_fit():
    """GRPO's default on 2 GPUs (1 decoder + 1 trainer) puts an 8B model's whole training state on one trainer
    (~61 GiB); synchronous ZeRO-3 over both GPUs holds half of it (~48 GiB). Between the two, the check's first
    suggestion is --rollout-gpus 0, ahead of a smaller micro-batch or LoRA."""
    llama8b = {"policy": P.Model("policy", P.arch(dict(
        model_type="llama", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        intermediate_size=14336, vocab_size=128256)))}
    flags = {"model": "x", "nproc": 2, "gradient_checkpointing": True, "micro_batch_size": 4}
    split = build(GRPOConfig, None, {**flags, "rollout_gpus": 1})
    sync = build(GRPOConfig, None, {**flags, "rollout_gpus": 0})
    one_trainer = P.estimate(GRPOPlan(split), llama8b, P.Device("cuda", 1e12, 1), P.Data(100)).peak
    both_train = P.estimate(GRPOPlan(sync), llama8b, P.Device("cuda", 1e12, 2), P.Data(100)).peak
    assert both_train < 0.85 * one_trainer
    between = P.Device("cuda", (one_trainer + both_train) / 2, 1)
    change, plan = P.smallest_change(GRPOPlan(split), llama8b, between, P.Data(100))
    assert change == "--rollout-gpus 0" and plan.fits


def test_replicas_are_suggested_where_the_training_state_fits_each_gpu():
    """Several GPU processes under ZeRO-3 (the default) for a model whose whole training state fits each GPU: the
    plan says --zero-stage 0 would hold it (faster: compiled blocks, no gathers). Not on one GPU, a CPU, ZeRO-0
    already, or where the replicas' peak passes 80 % of the free memory."""
    cfg = build(SFTConfig, None, {"model": "x", "nproc": 2})
    policy = {"policy": P.Model("policy", A)}
    two = P.Device("cuda", 1e12, 2, True, True, "test")
    hint = P.replicas_hint(SFTPlan(cfg), policy, two)
    assert hint and "--zero-stage 0" in hint and "2 processes" in hint
    assert P.replicas_hint(SFTPlan(cfg), policy, P.Device("cuda", 1e12, 1, True, True, "test")) is None
    assert P.replicas_hint(SFTPlan(cfg), policy, P.Device("cpu", 1e12, 2, False, False, "test")) is None
    zero0 = SFTPlan(build(SFTConfig, None, {"model": "x", "nproc": 2, "zero_stage": 0}))
    assert P.replicas_hint(zero0, policy, two) is None
    peak = P.estimate(SFTPlan(replace(cfg, zero_stage=0)), policy, two).peak
    assert P.replicas_hint(SFTPlan(cfg), policy, P.Device("cuda", peak / 0.79, 2, True, True, "test"))
    assert P.replicas_hint(SFTPlan(cfg), policy, P.Device("cuda", peak / 0.81, 2, True, True, "test")) is None


def test_real_8b_grpo_against_its_measured_peaks(monkeypatch):
    """docs/results-history.md, "GRPO at Llama-3.1-8B, 4K-token sequences" (one H200): 8 prompts x G 8, ~250-380
    prompt tokens + 3,840 new, micro-batch 4, gradient checkpointing: steady steps peaked at 95.4 GiB in the
    rollout and 67.4 GiB in the update. That run's decoder kept its own bf16 copy of the weights (as it still does
    with ALIGN_FAST_DECODER_COPY=1); without it the rollout needs 15 GiB less."""
    from benchmarks.memory_plan import config, print_plans

    shared = print_plans(["llama3.1-8b"], prompt_tokens=380, extra=("--micro-batch-size", "4",
                                                                    "--gradient-checkpointing"))["llama3.1-8b"]
    monkeypatch.setenv("ALIGN_FAST_DECODER_COPY", "1")
    plan = print_plans(["llama3.1-8b"], prompt_tokens=380, extra=("--micro-batch-size", "4",
                                                                  "--gradient-checkpointing"))["llama3.1-8b"]
    assert abs(plan.total("rollout") / P.GiB - 95.4) < 0.05 * 95.4
    assert abs(plan.total("update") / P.GiB - 67.4) < 0.05 * 67.4
    copy = P.n_params(P.arch(config("llama3.1-8b"))) * 2
    assert plan.total("rollout") - shared.total("rollout") == copy and shared.total("update") == plan.total("update")


def test_real_8b_grpo_compiled_without_checkpointing():
    """docs/results-history.md, "Real sizes, second round": the same shape at the defaults (compiled blocks, no
    checkpointing) ran micro-batches of 4 and peaked at 130.1 GiB in the update: the plan stays above it, by
    less than 5 %."""
    from benchmarks.memory_plan import print_plans

    plan = print_plans(["llama3.1-8b"], free_gib=134.77, extra=("--micro-batch-size", "4"))["llama3.1-8b"]
    assert 130.1 <= plan.total("update") / P.GiB < 1.05 * 130.1 and plan.fits


def test_lora_grpo_update_kept_within_the_rollout():
    """GRPO under LoRA on a GPU, micro-batch left at 0: the largest micro-batch whose update needs no more
    memory than the rollout (the 8B 4K shape: 1 row of 4,096 tokens; without the rule 4 rows, 90 GiB)."""
    from benchmarks.memory_plan import config

    flags = dict(model="plan-only", prompts_per_step=8, num_generations=8, max_new_tokens=3840, lora_r=16)
    models = {"policy": P.Model("policy", P.arch(config("llama3.1-8b")))}
    device = P.Device("cuda", 134.77 * P.GiB, 1, True, True, "test")
    cfg = build(GRPOConfig, None, flags)
    before = P.estimate(GRPOPlan(cfg), models, device, P.Data(256))
    plan, rows = P._lora_within_rollout(GRPOPlan(cfg), models, device, P.Data(256), before)
    assert before.total("update") > before.total("rollout") and before.peak_phase == "update"
    assert rows == 1 and plan.total("update") <= plan.total("rollout") and cfg.micro_batch_size == 0
    assert plan.peak < 0.4 * 130.1 * P.GiB  # the full fine-tuning run's measured peak
    full = build(GRPOConfig, None, {**flags, "lora_r": 0})  # full fine-tuning: untouched
    assert P._lora_within_rollout(GRPOPlan(full), models, device, P.Data(256),
                                  P.estimate(GRPOPlan(full), models, device))[1] is None


def test_model_configs_and_device(tiny_model_dir, tiny_reward_model_dir, monkeypatch):
    m = P.model_of("policy", str(tiny_model_dir))
    assert (m.arch.hidden, m.arch.layers, m.head) == (128, 2, "lm")
    assert P.model_of("reward model", str(tiny_reward_model_dir)).head == "score"
    assert P.read_config("tiny")["hidden_size"] == 128
    cfg = build(SFTConfig, None, {"model": "tiny", "nproc": 2})
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv(P.ENV_BUDGET, "3e9")
    dev = P.device_for(cfg)
    assert (dev.free, dev.world, dev.enforced) == (3e9, 2, True)
    monkeypatch.setenv(P.ENV_BUDGET, "lots")
    with pytest.raises(UserError, match=P.ENV_BUDGET):
        P.device_for(cfg)


# ------------------------------------------------------------------------------------------ in a real run


def sft_peak(**flags) -> float:
    """The peak the tiny SFT run below plans (the same data, so the same longest row)."""
    from align import data as D
    from align.models import load_tokenizer, resolve

    tok = load_tokenizer(resolve("tiny"))
    longest = D.longest_row(D.sft_examples(tok, D.load_rows(str(small_data()["arith"]), "sft"), 256))
    cfg = build(SFTConfig, None, {"model": "tiny", **flags})
    device = P.device_for(cfg)
    return P.estimate(SFTPlan(cfg), {"policy": P.model_of("policy", "tiny")}, device, P.Data(None, longest)).peak


SFT = ["sft", "--model", "tiny", "--data", small_data()["arith"], "--eval-data", "", "--max-steps", "2"]


def test_a_plan_that_does_not_fit_stops_before_anything_is_written(tmp_path):
    budget = str(int((sft_peak(micro_batch_size=16) + sft_peak(micro_batch_size=32)) / 2))
    out = tmp_path / "out"
    proc = run_align(*SFT, "--out", out, "--micro-batch-size", "32", env={P.ENV_BUDGET: budget})
    text = output(proc)
    assert proc.returncode == 2, text
    assert "Traceback" not in text and not out.exists()
    assert "memory plan: sft" in text and "does NOT fit" in text and "activations (32 rows" in text
    assert "the smallest change that fits: --micro-batch-size 16" in text and "--no-plan-check" in text
    proc = run_align(*SFT, "--out", out, "--micro-batch-size", "32", "--plan", env={P.ENV_BUDGET: budget})
    assert proc.returncode == 0 and "does NOT fit" in output(proc) and not out.exists()
    proc = run_align(*SFT, "--out", out, "--plan")  # no budget: informational on a CPU, exits 0
    assert proc.returncode == 0 and "RAM, informational" in output(proc) and not out.exists()


def test_a_micro_batch_left_to_the_stage_is_made_to_fit(tmp_path):
    budget = str(int((sft_peak(micro_batch_size=16) + sft_peak(micro_batch_size=32)) / 2))
    proc = run_align(*SFT, "--out", tmp_path / "auto", env={P.ENV_BUDGET: budget})
    assert proc.returncode == 0, output(proc)
    assert "memory plan: micro-batches of 16 rows (--micro-batch-size 0 chose 32" in output(proc)
    assert "micro batch 16 x accum 2" in output(proc), output(proc)  # what the stage ran, not only what it logged
    art = json.loads((tmp_path / "auto" / "artifact.json").read_text())
    assert art["config"]["micro_batch_size"] == 16 and art["status"] == "complete"
    # the check off: the plan is only reported, the run keeps what it was given; the compile phase is logged
    proc = run_align(*SFT, "--out", tmp_path / "off", "--micro-batch-size", "32", "--no-plan-check",
                     env={P.ENV_BUDGET: budget})
    assert proc.returncode == 0 and "Running anyway (plan check off)" in output(proc), output(proc)
    lines = [json.loads(x) for x in (tmp_path / "off" / "metrics.jsonl").read_text().splitlines()]
    steps = [x for x in lines if "time/step" in x]
    assert len(steps) == 2 and all(x["time/compile"] == 0.0 for x in steps)  # nothing compiles on a CPU
    art = json.loads((tmp_path / "off" / "artifact.json").read_text())
    assert art["metrics"]["time/compile"] == 0.0 and art["config"]["micro_batch_size"] == 32



def test_a_micro_batch_left_to_the_stage_is_not_shrunk_where_only_more_changes_fit(tmp_path):
    """Where no micro-batch fits alone and the smallest change that fits is a smaller micro-batch *with* LoRA,
    the run stops (exit 2, naming that change) instead of running the smaller micro-batch alone, which does not
    fit (Llama-3.1-8B at 4K on 63 GiB ran out of memory so)."""
    peak = lambda **f: sft_peak(eval_data="", **f)  # noqa: E731  (SFT below runs no held-out evaluation)
    budget = (peak(micro_batch_size=1) + peak(micro_batch_size=1, lora_r=16)) / 2
    assert min(peak(lora_r=16), peak(offload_optimizer=True), peak(micro_batch_size=1)) > budget
    out = tmp_path / "out"
    proc = run_align(*SFT, "--out", out, env={P.ENV_BUDGET: str(int(budget))})
    text = output(proc)
    assert proc.returncode == 2 and not out.exists(), text
    assert "the smallest change that fits: --micro-batch-size 1 --lora-r 16" in text
    assert "memory plan: micro-batches of" not in text

# ------------------------------------------------------------------------------------------ compile cache


def test_compile_cache_directory(monkeypatch, tmp_path):
    import torch

    from align.compile_cache import INDUCTOR_ENV, cache_root, use_persistent_cache

    for k in ("ALIGN_CACHE_DIR", "XDG_CACHE_HOME", INDUCTOR_ENV):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home" / ".cache" / "align"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "align"
    monkeypatch.setenv("ALIGN_CACHE_DIR", str(tmp_path / "mine"))
    want = str(tmp_path / "mine" / "torch-compile" / f"torch-{torch.__version__}")
    assert use_persistent_cache() == want and os.environ[INDUCTOR_ENV] == want
    monkeypatch.setenv(INDUCTOR_ENV, str(tmp_path / "users"))  # a directory the user chose is kept
    assert use_persistent_cache() == str(tmp_path / "users") and os.environ[INDUCTOR_ENV] == str(tmp_path / "users")


def test_runtime_init_sets_the_cache_before_anything_compiles(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "ALIGN_CACHE_DIR", "RANK",
                                                             "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env["XDG_CACHE_HOME"] = str(tmp_path)
    code = "import os; from align import runtime; runtime.init(); print(os.environ['TORCHINDUCTOR_CACHE_DIR'])"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert Path(proc.stdout.strip().splitlines()[-1]).parent == tmp_path / "align" / "torch-compile"


def test_compile_seconds_counts_torch_compile():
    import torch

    from align.compile_cache import compile_seconds

    before = compile_seconds()
    f = torch.compile(lambda x: torch.sin(x) * 2 + 1, backend="eager")
    f(torch.ones(3))
    assert compile_seconds() > before


def test_pipeline_summary_reports_each_stage_compile_time(tmp_path, capsys):
    from align import pipeline as P_
    from align import pipeline_cli

    f = tmp_path / "p.toml"
    f.write_text(f'[pipeline]\nout = "{tmp_path / "runs"}"\n\n[stages.sft]\nmodel = "tiny"\n'
                 f'data = "{small_data()["arith"]}"\neval_data = ""\nmax_steps = 1\nbatch_size = 8\n')
    pipeline_cli.run(file=str(f), from_=None, dry_run=False, set_=[], seed=None, report_to=None)
    table = capsys.readouterr().out
    header = next(line for line in table.splitlines() if "stage" in line and "wall" in line)
    row = next(line for line in table.splitlines() if line.strip("│┃ ").startswith("sft"))
    cells = [c.strip() for c in row.strip("│ ").split("│")]
    assert "compile" in header and cells[3] == "0.0s"  # stage, status, wall, compile, metrics
    (result,) = P_.run(f)  # up to date now: skipped, no compile time of its own
    assert result.status == "skipped (up to date)" and result.compile_seconds is None
    art = json.loads((tmp_path / "runs" / "sft" / "artifact.json").read_text())
    assert art["metrics"]["time/compile"] == 0.0
    # --plan / --plan-check change nothing the stage trains: the fingerprint (up to date) ignores them
    plan = P_.load(f, ["stages.sft.plan_check=false"])
    assert P_.fingerprint(plan, plan.stages[0]) == P_.fingerprint(P_.load(f), P_.load(f).stages[0])
