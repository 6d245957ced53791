"""--precision bf16-pure: ZeRO keeps master weights and Adam moments in bf16 (bf16: in fp32).
--offload-optimizer: the same updates with the optimizer in CPU memory."""


import pytest
import torch

from align import runtime
from align.engine import build
from align.errors import UserError
from align.models import load_causal_lm, load_tokenizer, resolve


@pytest.fixture(autouse=True)
def single_process_env(single_process):
    """Every test here builds engines in this process (tests/conftest.py)."""


def train_three_steps(tiny_model_dir, dtype, zero_stage=3, **ds_kw):
    """A ZeRO engine on the tiny model after three AdamW steps on a fixed batch: (engine, losses)."""
    runtime.init()
    ref = resolve(str(tiny_model_dir))
    tok = load_tokenizer(ref)
    cfg = build.ds_config(zero_stage=zero_stage, micro_batch=2, grad_accum=1, world_size=1, dtype=dtype, **ds_kw)
    model, link = build.load_partitioned(cfg, lambda dtype: load_causal_lm(ref, tok, dtype, seed=0), dtype)  # noqa: F841
    sr = ds_kw.get("precision") == "bf16-pure"  # as StageRun.train builds it
    eng = build.wrap(model, cfg, build.adamw(model, 1e-3, 0.0, stochastic_rounding=sr))
    ids = torch.tensor([[1, 5, 6, 7, 2], [1, 8, 9, 10, 2]])
    losses = []
    for _ in range(3):
        loss = eng(input_ids=ids, labels=ids).loss
        losses.append(loss.item())
        eng.backward(loss)
        eng.step()
    return eng, losses


def optimizer_dtypes(tiny_model_dir, precision: str) -> set:
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    eng, _ = train_three_steps(tiny_model_dir, torch.bfloat16, precision=precision)
    inner = eng.optimizer.optimizer  # the AdamW that ZeRO drives
    from align.optim import AdamWSR

    assert isinstance(inner, AdamWSR) == (precision == "bf16-pure")  # stochastic rounding onto bf16 masters
    dtypes = {t.dtype for st in inner.state.values() for k, t in st.items() if k in ("exp_avg", "exp_avg_sq")}
    dtypes |= {p.dtype for g in inner.param_groups for p in g["params"]}  # the master partitions
    unset_hf_deepspeed_config()
    return dtypes


def test_bf16_pure_keeps_master_weights_and_moments_in_bf16(tiny_model_dir):
    assert optimizer_dtypes(tiny_model_dir, "bf16-pure") == {torch.bfloat16}
    assert optimizer_dtypes(tiny_model_dir, "bf16") == {torch.float32}


def test_bf16_pure_on_zero_0_is_plain_bf16_training(tiny_model_dir):
    """No ZeRO optimizer, no master copy: AdamW steps the bf16 module's own parameters (TRL's memory layout)."""
    from align.optim import AdamWSR

    eng, losses = train_three_steps(tiny_model_dir, torch.bfloat16, zero_stage=0, precision="bf16-pure")
    assert isinstance(eng.optimizer, AdamWSR)  # stochastic rounding: see tests/test_optim.py
    params = [p for g in eng.optimizer.param_groups for p in g["params"]]
    assert {p.dtype for p in params} == {torch.bfloat16}
    assert {p.data_ptr() for p in params} <= {p.data_ptr() for p in eng.module.parameters()}  # no copy
    assert {t.dtype for st in eng.optimizer.state.values() for t in st.values() if t.ndim} == {torch.bfloat16}
    assert losses[-1] < losses[0]
    # DeepSpeed's throughput timer is off: it synchronized the device at every forward from the third step on
    assert not eng.tput_timer.config.enabled


def test_offload_optimizer_gives_the_same_updates(tiny_model_dir):
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    eng, plain = train_three_steps(tiny_model_dir, torch.float32)
    unset_hf_deepspeed_config()
    eng, offloaded = train_three_steps(tiny_model_dir, torch.float32, offload_optimizer=True)
    assert eng.zero_optimization_partition_weights() and eng.zero_offload_optimizer()
    unset_hf_deepspeed_config()
    assert plain[0] == pytest.approx(offloaded[0], abs=1e-6) and plain[0] - plain[-1] > 0.01
    assert offloaded == pytest.approx(plain, abs=1e-5)


def test_offload_needs_zero_and_fp32_master_weights():
    from align.config import StageConfig, TrainConfig

    StageConfig(precision="bf16-pure", zero_stage=0)  # plain bf16 training, see above
    with pytest.raises(UserError, match="--offload-optimizer"):
        TrainConfig(offload_optimizer=True, zero_stage=0)
    with pytest.raises(UserError, match="--offload-optimizer"):
        TrainConfig(offload_optimizer=True, precision="bf16-pure")


def test_bf16_mixed_keeps_fp32_weights_computes_in_bf16_and_small_updates_count(tiny_model_dir):
    """--precision bf16-mixed: the module stays fp32 and DeepSpeed's forward runs under torch.autocast(bf16)
    (bf16 logits). A norm gain (1.0) moved by an lr-1e-4 step changes in the model that computes (fp32), where
    with --precision bf16 the bf16 module cannot see it (2^-7 steps near 1.0), however exact its fp32 master."""
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    from align.rollout.generation import Sampling, generate_local

    def norm_gain_after_one_step(precision):
        runtime.init()
        ref = resolve(str(tiny_model_dir))
        tok = load_tokenizer(ref)
        dtype = build.compute_dtype(torch.device("cpu"), precision)
        cfg = build.ds_config(zero_stage=3, micro_batch=2, grad_accum=1, world_size=1, dtype=dtype,
                              precision=precision, user_config=None)
        model, link = build.load_partitioned(cfg, lambda dt: load_causal_lm(ref, tok, dt, seed=0), dtype)  # noqa: F841
        eng = build.wrap(model, cfg, build.adamw(model, 1e-4, 0.0))
        ids = torch.tensor([[1, 5, 6, 7, 2], [1, 8, 9, 10, 2]])
        out = eng(input_ids=ids, labels=ids)
        eng.backward(out.loss)
        eng.step()
        with runtime.gathered_for_generation(eng) as module:
            gain = module.model.norm.weight.detach().clone()
            texts = generate_local(module, tok, [[1, 5, 6]], Sampling(3, 0.0), 1, "cpu", fast=False)
            fast = generate_local(module, tok, [[1, 5, 6]], Sampling(3, 0.0), 1, "cpu", fast=True)
            copy = module._align_fast_decoder.dtype
        unset_hf_deepspeed_config()
        return out.logits.dtype, next(model.parameters()).dtype, gain, len(texts[0].ids), (len(fast[0].ids), copy)

    logits, params, gain, n_hf, n_fast = norm_gain_after_one_step("bf16-mixed")
    assert (logits, params) == (torch.bfloat16, torch.float32)
    assert n_hf > 0 and n_fast == (3, torch.bfloat16)  # both generation paths run (the fast one: a bf16 copy)
    assert ((gain - 1).abs() > 0).all() and ((gain - 1).abs() < 2e-4).all()  # moved by about lr, and it shows
    _, params, gain, _, _ = norm_gain_after_one_step("bf16")
    assert params == torch.bfloat16 and (gain == 1).all()  # the same update, invisible to the bf16 module


def test_auto_precision_and_the_one_gpu_engine_stage(tmp_path):
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert build.resolve_precision(cuda) == "bf16-pure" and build.compute_dtype(cuda) == torch.bfloat16
    assert build.resolve_precision(cuda, offload=True) == "bf16-mixed"  # ZeRO-Offload keeps fp32 master weights
    assert build.resolve_precision(cpu) == "fp32" and build.compute_dtype(cuda, "bf16") == torch.bfloat16
    stage, note = build.engine_stage(3, 1, cuda)
    assert stage == 0 and "ZeRO-0" in note  # one GPU: nothing to partition, and the log says so
    assert build.engine_stage(3, 2, cuda) == (3, "")  # two processes: ZeRO as asked
    assert build.engine_stage(3, 1, cpu) == (3, "")  # CPU: as asked
    assert build.engine_stage(3, 1, cuda, keep=True) == (3, "")  # an offload needs ZeRO
    ds = tmp_path / "ds.json"
    ds.write_text('{"zero_optimization": {"stage": 2}}')
    assert build.engine_stage(3, 1, cuda, user_config=str(ds)) == (2, "")  # a --deepspeed file's stage runs, and is logged


def test_zero_0_clips_and_reports_the_gradient_norm_as_zero_3_does(tiny_model_dir):
    """With no ZeRO optimizer and fp32 parameters DeepSpeed clips but keeps no norm: `Trained` clips and measures
    itself. One step with an active clip: the same norm and the same updated weights as ZeRO-3's optimizer (and
    without DeepSpeed's all-reduce over the one rank, which ZeRO-0 on one process skips)."""
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    def one_step(zero_stage):
        runtime.init()
        ref = resolve(str(tiny_model_dir))
        tok = load_tokenizer(ref)
        cfg = build.ds_config(zero_stage=zero_stage, micro_batch=2, grad_accum=2, world_size=1,
                              dtype=torch.float32, grad_clip=0.05, precision="fp32")
        clip = build.own_clipping(cfg)
        assert (clip, cfg["gradient_clipping"]) == ((0.05, 0.0) if zero_stage == 0 else (None, 0.05))
        model, link = build.load_partitioned(cfg, lambda dt: load_causal_lm(ref, tok, dt, seed=0), torch.float32)  # noqa: F841
        eng = build.Trained(build.wrap(model, cfg, build.adamw(model, 1e-3, 0.0), lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0)),
                            accum=2, world=1, lr=1e-3, clip=clip)
        # one process at ZeRO-0: no flattened all-reduce bucket over a single rank (the weights below match)
        assert eng.eng.enable_backward_allreduce == (zero_stage != 0)
        for ids in (torch.tensor([[1, 5, 6, 7, 2], [1, 8, 9, 10, 2]]), torch.tensor([[1, 7, 7, 5, 2], [1, 9, 8, 6, 2]])):
            eng.backward(eng(input_ids=ids, labels=ids).loss / 2)
        with runtime.gathered_for_generation(eng.eng) as module:
            weights = torch.cat([p.detach().flatten().clone() for p in module.parameters()])
        unset_hf_deepspeed_config()
        return eng.metrics()["grad_norm"], weights

    norm0, w0 = one_step(0)
    norm3, w3 = one_step(3)
    assert norm0 > 0.05 and norm0 == pytest.approx(norm3, rel=1e-5)  # the clip was active, the norm reported
    torch.testing.assert_close(w0, w3, rtol=0, atol=1e-6)


def test_sft_under_bf16_pure_learns_through_stochastic_rounding(tmp_path):
    """The whole stage path (StageRun.train) under --precision bf16-pure at lr 2e-3 on the tiny model: the run
    completes, its loss falls, and the engine's optimizer is AdamWSR (the same run with round-to-nearest bf16
    AdamW is the setting where small updates vanish)."""
    import json

    from tests.conftest import output, run_align, small_sft

    out = tmp_path / "sft"
    proc = run_align("sft", *small_sft(), "--precision", "bf16-pure", "--max-steps", "30", "--batch-size", "8",
                     "--eval-every", "0", "--out", out)
    assert proc.returncode == 0, output(proc)[-2000:]
    assert "AdamW writes the bf16 weights with stochastic rounding" in output(proc)  # the engine's optimizer
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.3
    assert json.loads((out / "artifact.json").read_text())["status"] == "complete"
