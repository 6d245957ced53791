"""LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models") through `peft`: THE one place
adapters are added, switched off, merged and saved.

A LoRA layer computes W x + (α/r) · B A x with the base W frozen and A [r, in], B [out, r] trained (B starts
at 0, so step 0 is the base model). `--lora-r R --lora-alpha A --lora-dropout P --lora-targets all-linear|names`
on every training stage (a reward model's and PPO's value network's score head trains in full); the reference
of dpo, grpo and ppo is the policy engine with its adapters switched off (no second copy of the model); the artifact's model/ holds the merged weights W + (α/r) B A (plain
transformers loads it, and every later stage), and model/adapter/ the adapter alone in peft's format.
"""

from __future__ import annotations

import torch

ADAPTER_DIR = "adapter"
_PREFIX = "base_model.model."


def lora_config(cfg, head: str | None = None):
    """The peft LoraConfig of a stage's flags (`head`: a new scalar head, trained in full beside the adapters)."""
    from peft import LoraConfig

    targets = cfg.lora_targets
    return LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout, bias="none",
                      target_modules=targets if targets == "all-linear" else [t.strip() for t in targets.split(",")],
                      modules_to_save=[head] if head else None)


def with_lora(load, cfg):
    """`load(dtype)` followed by peft's adapters (frozen base, trainable A and B; a sequence classifier's score
    head — a reward model, PPO's value network — trained in full), or `load` itself without --lora-r."""
    if not getattr(cfg, "lora_r", 0):
        return load

    def load_with_adapters(dtype):
        from peft import get_peft_model

        model = load(dtype)
        head = "score" if isinstance(getattr(model, "score", None), torch.nn.Linear) else None
        return get_peft_model(model, lora_config(cfg, head))

    return load_with_adapters


def is_peft(module) -> bool:
    return hasattr(module, "peft_config") and hasattr(module, "get_base_model")


class AdaptersOff:
    """A trained engine with its LoRA adapters switched off for each call: the base model, which is the frozen
    reference of dpo, grpo and ppo (StageRun.reference), without a second copy of it. Forward only."""

    def __init__(self, trained):
        self.trained, self.module = trained, trained.module

    def __call__(self, *args, **kwargs):
        with torch.no_grad(), self.module.disable_adapter():
            return self.trained(*args, **kwargs)


def effective_weight(linear) -> torch.Tensor:
    """The weight a Linear applies: for a LoRA layer with its adapters active, W + (α/r) B A; else its weight."""
    w = linear.weight
    if hasattr(linear, "get_delta_weight") and not linear.disable_adapters and not linear.merged:
        for name in linear.active_adapters:
            if name in linear.lora_A:
                w = w + linear.get_delta_weight(name)
    return w


def merged_state_dict(state: dict, scaling: float, adapter: str = "default") -> dict:
    """A peft model's full state dict -> the plain model's, each LoRA layer merged: W' = W + scaling · B A
    (computed in fp32, stored in W's dtype; scaling = α / r), its bias kept, a fully trained module (the score
    head) as trained, the peft prefixes dropped."""
    out = {}
    for key, value in state.items():
        if ".lora_" in key or ".original_module." in key:
            continue
        name = (key.removeprefix(_PREFIX).replace(".base_layer.", ".")
                .replace(f".modules_to_save.{adapter}.", "."))
        if key.endswith(".base_layer.weight"):
            stem = key[: -len("base_layer.weight")]
            a, b = state[f"{stem}lora_A.{adapter}.weight"], state[f"{stem}lora_B.{adapter}.weight"]
            value = (value.float() + scaling * (b.float() @ a.float())).to(value.dtype)
        out[name] = value
    return out


def save(module, state: dict, out_dir, safe: bool = True) -> None:
    """Write a peft `module` (its full state dict `state`) as the merged plain model in `out_dir` and the adapter
    alone in `out_dir/adapter` (rank 0)."""
    cfg = module.peft_config["default"]
    module.get_base_model().save_pretrained(out_dir, state_dict=merged_state_dict(state, cfg.lora_alpha / cfg.r),
                                            safe_serialization=safe)
    module.save_pretrained(out_dir / ADAPTER_DIR, state_dict=state, safe_serialization=safe)

