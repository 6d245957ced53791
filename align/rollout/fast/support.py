"""Which models the fast decoder decodes: the Llama family's layout (`SUPPORTED`: dense, and the mixture-of-experts
families of `MOE`), the RoPE variants its rotary module computes (`ROPE_TYPES`), SiLU MLPs, and a rollout that fits
any sliding window; anything else decodes through HF `generate` (align.rollout.generation.use_fast_path), the
reason logged once."""

from __future__ import annotations

import os

from align.moe import num_experts

MOE = ("qwen3_moe", "qwen2_moe", "olmoe", "mixtral")  # mixture-of-experts MLPs (align.rollout.fast.moe)
SUPPORTED = ("llama", "qwen2", "qwen3", "mistral", *MOE)
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")  # computed by the model's own rotary module


def enabled_by_env() -> bool:
    return os.environ.get("ALIGN_FAST_GENERATION", "1").lower() not in ("0", "false", "no", "off")


def rope_type(cfg) -> str:
    for rp in (getattr(cfg, "rope_parameters", None), getattr(cfg, "rope_scaling", None)):
        if isinstance(rp, dict) and (rp.get("rope_type") or rp.get("type")):
            return rp.get("rope_type") or rp.get("type")
    return "default"


def sliding_window(cfg) -> int | None:
    """The attention window the HF forward applies (None: full causal attention). Mistral and Mixtral apply
    `sliding_window` to every layer, as Qwen3-MoE does (its config keeps one only with `use_sliding_window`);
    Qwen2/Qwen3 only with `use_sliding_window` (to some layers)."""
    window = getattr(cfg, "sliding_window", None)
    if not window:
        return None
    if getattr(cfg, "model_type", None) in ("mistral", "mixtral", "qwen3_moe"):
        return int(window)
    types = getattr(cfg, "layer_types", None) or []
    return int(window) if getattr(cfg, "use_sliding_window", False) or "sliding_attention" in types else None


def unsupported_reason(module, length: int | None = None) -> str | None:
    """None when `module` can use the fast path for sequences of up to `length` tokens (prompt + new), else why
    not (one short phrase, logged)."""
    cfg = getattr(module, "config", None)
    why = unsupported_config(cfg, length)
    if why is not None:
        return why
    if not hasattr(module, "lm_head") or not hasattr(getattr(module, "model", None), "layers"):
        return "unexpected module layout"
    if not hasattr(getattr(module.model, "rotary_emb", None), "original_inv_freq"):
        return "no rotary embedding module"
    return None


def unsupported_config(cfg, length: int | None = None) -> str | None:
    """`unsupported_reason` from a model's config alone (its attributes, as a transformers config's): the family,
    RoPE, activation and attention window; the memory plan asks it before any model is built."""
    if cfg is None or getattr(cfg, "model_type", None) not in SUPPORTED:
        return f"model type {getattr(cfg, 'model_type', None)!r} (fast path: {', '.join(SUPPORTED)})"
    rt = rope_type(cfg)
    if rt not in ROPE_TYPES:
        return f"RoPE type {rt!r} (fast path: {', '.join(ROPE_TYPES)})"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"activation {cfg.hidden_act}"
    window = sliding_window(cfg)
    if window is not None and length is not None and length > window:
        return f"sliding-window attention ({window} tokens) shorter than the rollout ({length} tokens)"
    if rt == "dynamic" and length is not None and length > cfg.max_position_embeddings:
        return f"dynamic RoPE past the original context ({cfg.max_position_embeddings} tokens)"
    return None


def describe(module) -> str:
    """What the fast path runs, for the log: 'qwen3 (q/k norm), llama3 RoPE'; 'olmoe (q/k norm, 64 experts, top-8),
    default RoPE'."""
    cfg = module.config
    extra = ["q/k norm"] if hasattr(module.model.layers[0].self_attn, "q_norm") else []
    if cfg.model_type in MOE:
        extra.append(f"{num_experts(cfg)} experts, top-{cfg.num_experts_per_tok}")
    inner = f" ({', '.join(extra)})" if extra else ""
    return f"{cfg.model_type}{inner}, {rope_type(cfg)} RoPE"
