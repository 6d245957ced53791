"""--precision bf16-pure: ZeRO keeps master weights and Adam moments in bf16 (bf16: in fp32)."""

import pytest
import torch

from align import runtime, training
from align.errors import UserError
from align.models import load_causal_lm, load_tokenizer, resolve


def optimizer_dtypes(tiny_model_dir, precision: str) -> set:
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    runtime.init()
    ref = resolve(str(tiny_model_dir))
    tok = load_tokenizer(ref)
    cfg = runtime.ds_config(zero_stage=3, micro_batch=2, grad_accum=1, world_size=1, dtype=torch.bfloat16,
                            precision=precision)
    loader = runtime.ZeroLoader(cfg)  # noqa: F841
    model = load_causal_lm(ref, tok, torch.bfloat16)
    eng = runtime.engine(model, cfg, training.adamw(model, 1e-3, 0.0))
    ids = torch.tensor([[1, 5, 6, 7, 2], [1, 8, 9, 10, 2]])
    eng.backward(eng(input_ids=ids, labels=ids).loss)
    eng.step()
    inner = eng.optimizer.optimizer  # the torch AdamW that ZeRO drives
    dtypes = {t.dtype for st in inner.state.values() for k, t in st.items() if k in ("exp_avg", "exp_avg_sq")}
    dtypes |= {p.dtype for g in inner.param_groups for p in g["params"]}  # the master partitions
    unset_hf_deepspeed_config()
    return dtypes


def test_bf16_pure_keeps_master_weights_and_moments_in_bf16(tiny_model_dir):
    assert optimizer_dtypes(tiny_model_dir, "bf16-pure") == {torch.bfloat16}
    assert optimizer_dtypes(tiny_model_dir, "bf16") == {torch.float32}


def test_bf16_pure_needs_zero():
    from align.config import StageConfig

    with pytest.raises(UserError, match="zero-stage"):
        StageConfig(precision="bf16-pure", zero_stage=0)
