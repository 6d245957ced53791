"""LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models") through `peft`: THE one place
adapters are added, switched off, merged and saved.

A LoRA layer computes W x + (α/r) · B A x with the base W frozen and A [r, in], B [out, r] trained (B starts
at 0, so step 0 is the base model). `--lora-r R --lora-alpha A --lora-dropout P --lora-targets all-linear|names`
on every training stage (a reward model's and PPO's value network's score head trains in full); the reference
of dpo, grpo and ppo is the policy engine with its adapters switched off (no second copy of the model). The
artifact's model/adapter/ holds the adapter in peft's format and model/ the merged weights W + (α/r) B A (plain
transformers loads them); with --no-merge model/ holds only the config and tokenizer beside the adapter, and a
later stage loads the run's input model and merges the adapter into it (`merge_saved_adapter`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from align.errors import UserError

ADAPTER_DIR = "adapter"
_PREFIX = "base_model.model."


def lora_config(cfg, head: str | None = None, model=None):
    """The peft LoraConfig of a stage's flags (`head`: a new scalar head, trained in full beside the adapters;
    `model`: the model it goes on, whose kind decides what all-linear means)."""
    from peft import LoraConfig

    return LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout, bias="none",
                      target_modules=target_names(cfg, model), modules_to_save=[head] if head else None)


# A mixture-of-experts model's LoRA targets: attention's projections. peft (0.17+) would turn all-linear, and the
# MLP names gate / gate_proj / up_proj / down_proj / w1 / w2 / w3, into adapters on the fused 3-D expert parameters
# and the router (target_parameters): adapters this module neither merges nor saves merged, so they are refused.
MOE_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MOE_EXPERT_NAMES = ("experts", "gate_up_proj", "gate", "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")


def target_names(cfg, model=None) -> list[str] | str:
    """--lora-targets as peft takes it: all-linear (every Linear but the head; on a mixture-of-experts `model`,
    attention's projections: MOE_ATTENTION) or the list of names."""
    from align.moe import is_moe

    targets = cfg.lora_targets
    if targets == "all-linear":
        return list(MOE_ATTENTION) if model is not None and is_moe(model.config) else targets
    return [t.strip() for t in targets.split(",") if t.strip()]


def check_targets(cfg, model, name: str) -> None:
    """Every name of --lora-targets names Linear layers of `model` (the module tree of the model `name` that gets
    adapters; a weightless copy does): refused before --out is touched, not by peft while the engines are built."""
    targets = target_names(cfg)
    if targets == "all-linear":
        return
    if not targets:
        raise UserError("--lora-targets names no module: give all-linear or module names (q_proj,v_proj).")
    from align.moe import is_moe

    experts = [t for t in targets if t.rsplit(".", 1)[-1] in MOE_EXPERT_NAMES]
    if is_moe(model.config) and experts:
        raise UserError(f"--lora-targets {cfg.lora_targets}: {', '.join(map(repr, experts))}: {name} is a mixture of "
                        "experts whose experts are fused 3-D parameters (experts.gate_up_proj, experts.down_proj) "
                        "and whose router is not a Linear layer; LoRA does not go on them here (they stay frozen). "
                        f"Use all-linear or names among {','.join(MOE_ATTENTION)} (attention), or train every "
                        "weight without --lora-r.")
    from transformers.pytorch_utils import Conv1D

    modules = dict(model.named_modules())
    linear = {n for n, m in modules.items() if isinstance(m, (torch.nn.Linear, Conv1D))}
    for t in targets:
        what = _not_a_target(t, modules, linear)
        if what:
            names = ", ".join(sorted({n.rsplit(".", 1)[-1] for n in linear} - {"lm_head", "score"}))
            raise UserError(f"--lora-targets {cfg.lora_targets}: {t!r}: {what} in {name}; its Linear layers: "
                            f"{names} (or use all-linear).")


def _not_a_target(name: str, modules: dict, linear: set) -> str:
    """'' when `name` matches Linear layers only (peft's rule: the module's name or a dotted suffix of it),
    else what it matches."""
    hits = [n for n in modules if n == name or n.endswith("." + name)]
    if not hits:
        return "no module of that name"
    if set(hits) <= linear:
        return ""
    if any(isinstance(modules[n], torch.nn.Embedding) for n in hits):
        return "an embedding (LoRA goes on Linear layers here, not on embeddings)"
    return f"not a Linear layer ({', '.join(sorted({type(modules[n]).__name__ for n in hits} - {'Linear'}))})"


def with_lora(load, cfg):
    """`load(dtype)` followed by peft's adapters (frozen base, trainable A and B; a sequence classifier's score
    head — a reward model, PPO's value network — trained in full), or `load` itself without --lora-r."""
    if not getattr(cfg, "lora_r", 0):
        return load

    def load_with_adapters(dtype):
        from peft import get_peft_model

        model = load(dtype)
        head = "score" if isinstance(getattr(model, "score", None), torch.nn.Linear) else None
        model = get_peft_model(model, lora_config(cfg, head, model))
        apply_in_activation_dtype(model)
        fuse_lora_forward(model)
        other = sorted({n for n, m in model.named_modules() if hasattr(m, "lora_A") and not len(m.lora_A)
                        and len(getattr(m, "lora_embedding_A", ()))})
        if other:  # an embedding's adapter (lora_embedding_A/B) is neither merged nor saved merged here
            raise UserError(f"--lora-targets {cfg.lora_targets}: LoRA goes on Linear layers here, not on "
                            f"embeddings ({', '.join(n.split('.')[-1] for n in other)}); name Linear modules "
                            "(q_proj,v_proj,...) or use all-linear.")
        return model

    return load_with_adapters


def _linear_in_input_dtype(self, x: torch.Tensor) -> torch.Tensor:
    bias = None if self.bias is None else self.bias.to(x.dtype)
    return torch.nn.functional.linear(x, self.weight.to(x.dtype), bias)


def apply_in_activation_dtype(model) -> int:
    """peft keeps the adapters A and B in fp32 beside a bf16 base and casts each LoRA layer's input up to fp32:
    an fp32 copy of every targeted Linear's input and an fp32 sum of its output, kept for the backward — more
    activation memory than full fine-tuning of the same model. Here the branch runs in the activations' dtype
    instead, (α/r)·B(A x) with A and B cast to x's dtype (bf16: the base path's own rounding), while A, B, their
    gradients and Adam moments stay fp32: the adapters' updates are not rounded to bf16. With an fp32 model
    (CPU, --precision bf16-mixed) nothing changes. Returns the number of LoRA layers changed."""
    import types

    n = 0
    for m in model.modules():
        if hasattr(m, "lora_A") and hasattr(m, "_cast_input_dtype") and len(m.lora_A):
            m.cast_input_dtype_enabled = False  # peft's switch (peft.helpers.disable_input_dtype_casting)
            for lin in [*m.lora_A.values(), *m.lora_B.values()]:
                if isinstance(lin, torch.nn.Linear):
                    lin.forward = types.MethodType(_linear_in_input_dtype, lin)
            n += 1
    return n


def lora_linear(x, w, b, a, bw, s: float):
    """One LoRA Linear with its base W (and bias b) frozen (Hu et al. 2021, eq. 3: h = W₀x + ΔWx, ΔW = (α/r)·BA):

        y = x·Wᵀ + b + s·(x·Aᵀ)·Bᵀ,  s = α/r,  A [r, in], B [out, r]

    The adapter's term is added INTO the base output by one in-place addmm (β = 1): no [N, out] tensors beside
    y (peft's layer makes B(Ax), its scaled copy and their sum). The in-place add is safe for autograd: the base
    Linear's backward reads W, not y. A and B may be stored in fp32 beside bf16 activations: they are used in
    x's dtype (the base path's rounding) and receive gradients in their own."""
    y = torch.nn.functional.linear(x, w, b)
    u = torch.nn.functional.linear(x, a.to(x.dtype))
    y.view(-1, y.shape[-1]).addmm_(u.view(-1, u.shape[-1]), bw.to(x.dtype).t(), alpha=s)
    return y


def _lean_forward(self, x, *args, **kwargs):
    """A peft LoRA Linear's forward through `lora_linear` when it is the plain case — one active vanilla
    adapter, no dropout, adapters on and unmerged, a frozen whole (not ZeRO-3-partitioned) base, no autocast;
    anything else runs peft's own forward."""
    active = [n for n in self.active_adapters if n in self.lora_A]
    if args or kwargs or self.disable_adapters or self.merged or len(active) != 1:
        return type(self).forward(self, x, *args, **kwargs)
    name = active[0]
    base, A, B = self.get_base_layer(), self.lora_A[name], self.lora_B[name]
    if (name in (getattr(self, "lora_variant", None) or {}) or (getattr(self, "use_dora", None) or {}).get(name)
            or not isinstance(self.lora_dropout[name], torch.nn.Identity) or A.bias is not None or B.bias is not None
            or type(base) is not torch.nn.Linear or base.weight.requires_grad
            or (base.bias is not None and base.bias.requires_grad)
            or any(hasattr(t, "ds_id") for t in (base.weight, A.weight, B.weight))
            or torch.is_autocast_enabled(x.device.type)):
        return type(self).forward(self, x, *args, **kwargs)
    return lora_linear(x, base.weight, base.bias, A.weight, B.weight, self.scaling[name])


def fuse_lora_forward(model) -> int:
    """Every peft LoRA Linear of `model` computes through `lora_linear` where it can (`_lean_forward`): one
    output buffer, as a plain Linear's, and fewer kernels. Returns the number of layers changed."""
    import types

    from peft.tuners.lora.layer import Linear

    n = 0
    for m in model.modules():
        if isinstance(m, Linear):
            m.forward = types.MethodType(_lean_forward, m)
            n += 1
    return n


def is_peft(module) -> bool:
    return hasattr(module, "peft_config") and hasattr(module, "get_base_model")


def bare(module):
    """The HF model inside a DeepSpeed engine (DeepSpeed's unwrap_model_for_generation yields the engine) and
    inside a peft model (its LoRA layers stay in it: the fast decoder's `load_weights` applies their adapters)."""
    inner = getattr(module, "module", None)
    module = inner if isinstance(inner, torch.nn.Module) and hasattr(inner, "config") else module
    return module.get_base_model() if is_peft(module) else module


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


class ParkedBase:
    """A LoRA policy's frozen base weights parked in (pinned) host memory while the fast decoder serves a rollout.

    The decoder decodes with its own merged copy W + (α/r) B A, so during a rollout the base W on the device is
    a second copy of the model nobody reads: `park()` copies each frozen storage to a host buffer (allocated once,
    reused every rollout) and frees it on the device; `restore()` brings it back before the next forward. The
    tensors stay the same objects (their storage is resized, as FSDP frees unsharded parameters), so optimizers,
    hooks and compiled blocks see nothing. Costs two copies of the base per rollout over the host link (~40 ms
    at 0.5B on a PCIe 5 card). Only unpartitioned parameters (ZeRO-0..2; a ZeRO-3 parameter is `ds_id`'s) and
    only when the model has trainable adapters.
    """

    def __init__(self, model):
        seen, self.storages = set(), []
        for p in model.parameters():
            st = p.untyped_storage()
            if p.requires_grad or hasattr(p, "ds_id") or st.data_ptr() in seen or not st.nbytes():
                continue
            seen.add(st.data_ptr())
            self.storages.append(st)
        self.cuda = bool(self.storages) and self.storages[0].device.type == "cuda"
        self.host = [torch.empty(st.nbytes(), dtype=torch.uint8, pin_memory=self.cuda).untyped_storage()
                     for st in self.storages]
        self.nbytes = sum(st.nbytes() for st in self.storages)
        self.parked = False

    def park(self) -> None:
        if self.parked:
            return
        for st, host in zip(self.storages, self.host):
            host.copy_(st, non_blocking=True)
        if self.cuda:
            torch.cuda.current_stream().synchronize()  # the copies must land before the storage is reused
        for st in self.storages:
            st.resize_(0)
        self.parked = True

    def restore(self) -> None:
        if not self.parked:
            return
        for st, host in zip(self.storages, self.host):
            st.resize_(host.nbytes())
            st.copy_(host, non_blocking=True)
        self.parked = False


def parked_base(module, device) -> ParkedBase | None:
    """The LoRA `module`'s ParkedBase (made on first use; `module` the peft model a rollout decodes from), or
    None: not a LoRA model, nothing frozen and unpartitioned, not on CUDA. ALIGN_PARK_BASE=0 turns it off, =1 on
    on any device (tests)."""
    import os

    env = os.environ.get("ALIGN_PARK_BASE", "auto").lower()
    if not is_peft(module) or env in ("0", "false", "no", "off") or (
            env == "auto" and torch.device(device).type != "cuda"):
        return None
    parked = getattr(module, "_align_parked_base", None)
    if parked is None:
        parked = ParkedBase(module)
        object.__setattr__(module, "_align_parked_base", parked)  # plain attribute: not a submodule
        if parked.storages:
            from align.console import info

            info(f"LoRA: the frozen base weights ({parked.nbytes / 2**30:.2f} GiB) wait in host memory during "
                 "each rollout (the decoder has its own merged copy); ALIGN_PARK_BASE=0 keeps them on the device")
    return parked if parked.storages else None


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


def save(module, state: dict, out_dir: Path, merge: bool = True, max_shard_size: int | str = "5GB") -> None:
    """Write a peft `module` (its full state dict `state`) as the adapter alone in `out_dir/adapter` and, with
    `merge`, the merged plain model in `out_dir` (safetensors files of at most `max_shard_size`); without,
    `out_dir` gets only the model's config (rank 0)."""
    cfg, base = module.peft_config["default"], module.get_base_model()
    if merge:
        base.save_pretrained(out_dir, state_dict=merged_state_dict(state, cfg.lora_alpha / cfg.r),
                             safe_serialization=True, max_shard_size=max_shard_size)
    else:
        base.config.save_pretrained(out_dir)
    module.save_pretrained(out_dir / ADAPTER_DIR, state_dict=state, safe_serialization=True)


def is_adapter_only(model_dir: Path) -> bool:
    """A model directory of a --no-merge run: the adapter and the config, no weights of the model itself."""
    return (model_dir / ADAPTER_DIR / "adapter_config.json").is_file() and not any(model_dir.glob("*.safetensors"))


def merge_saved_adapter(model, adapter_dir: Path) -> None:
    """Merge the peft adapter saved in `adapter_dir` into the plain `model` (its base) in place: W += (α/r) B A
    for each LoRA pair (in fp32, stored in W's dtype: the rounding of `merged_state_dict`), and the weights of a
    module trained in full beside the adapters (a score head) copied. Every rank calls it: under ZeRO-3 each
    parameter is gathered, changed and partitioned again."""
    import deepspeed
    from safetensors.torch import load_file

    conf = json.loads((adapter_dir / "adapter_config.json").read_text())
    if conf.get("use_dora") or conf.get("use_rslora") or conf.get("peft_type", "LORA") != "LORA":
        raise UserError(f"{adapter_dir}: only plain LoRA adapters (no DoRA, no rsLoRA) are merged here.")
    scaling = conf["lora_alpha"] / conf["r"]
    saved = {k.removeprefix(_PREFIX): v for k, v in load_file(adapter_dir / "adapter_model.safetensors").items()}
    params = dict(model.named_parameters())
    for name, value in saved.items():
        if ".lora_B." in name:
            continue
        if ".lora_A." in name:
            stem, b = name.split(".lora_A.")[0], saved.get(name.replace(".lora_A.", ".lora_B."))
            target = params.get(f"{stem}.weight")
            delta = None if b is None else scaling * (b.float() @ value.float())
        else:  # a module trained in full (modules_to_save)
            target, delta = params.get(name), None
        if target is None or (delta is not None and delta.shape != tuple(getattr(target, "ds_shape", target.shape))):
            raise UserError(f"{adapter_dir}: the adapter's {name} does not fit the base model it is merged into.")
        with deepspeed.zero.GatheredParameters([target], modifier_rank=0):
            with torch.no_grad():
                if delta is None:
                    target.copy_(value.to(target.dtype))
                else:
                    target.copy_((target.float() + delta.to(target.device)).to(target.dtype))

