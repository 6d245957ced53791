"""The pieces that make a GPU step cheap, checked on CPU: frozen engines beside a ZeRO-1/2 engine, ZeRO-3 leaf
blocks, and mask-free forwards of right-padded batches."""

import torch

from align import data as D
from align import runtime


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, intermediate_size=64, vocab_size=101))


def test_frozen_engines_beside_zero_2_are_plain_replicas():
    cfg = runtime.ds_config(zero_stage=2, micro_batch=2, grad_accum=1, world_size=1, dtype=torch.bfloat16,
                            precision="bf16-pure", offload_optimizer=True)
    frozen = runtime.frozen_config(cfg)
    assert frozen["zero_optimization"]["stage"] == 0 and "offload_optimizer" not in frozen["zero_optimization"]
    assert frozen["bf16"] == {"enabled": True}
    assert cfg["zero_optimization"]["stage"] == 2 and "offload_optimizer" in cfg["zero_optimization"]  # untouched
    z3 = runtime.ds_config(zero_stage=3, micro_batch=2, grad_accum=1, world_size=1, dtype=torch.float32)
    assert runtime.frozen_config(z3)["zero_optimization"]["stage"] == 3


def test_zero_3_fetches_whole_transformer_blocks():
    from deepspeed.utils import z3_leaf_module

    m = tiny_llama()
    runtime.set_block_leaves(m)
    assert all(z3_leaf_module(layer) for layer in m.model.layers)
    assert not z3_leaf_module(m) and not z3_leaf_module(m.model) and not z3_leaf_module(m.lm_head)


def test_right_padded_batch_needs_no_attention_mask():
    m = tiny_llama().eval()
    ids = torch.randint(3, 101, (3, 9))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    mask[2, 4:] = 0
    batch = {"input_ids": ids, "attention_mask": mask, "labels": ids}
    inputs = D.right_padded_inputs(batch)
    assert "attention_mask" not in inputs and "labels" not in inputs
    with torch.no_grad():
        masked = m(**D.model_inputs(batch)).logits
        free = m(**inputs).logits
    real = mask.bool()
    torch.testing.assert_close(free[real], masked[real], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(free[~real], masked[~real], atol=1e-3)  # only padding positions see a difference
