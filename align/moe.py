"""Mixture-of-experts (MoE) models: what identifies one, how its experts are shaped, and the router's auxiliary
load-balancing loss a training forward adds.

transformers (5.x) builds its MoE causal LMs (Qwen3-MoE, Qwen2-MoE / Qwen1.5-MoE, OLMoE, Mixtral) the same way:
each sparse block has a router (`gate`, an [E, h] weight, no bias) that picks the top-k of E experts per token,
and the experts as fused 3-D parameters (`experts.gate_up_proj` [E, 2i, h], `experts.down_proj` [E, h, i]), not
one Linear per expert; Qwen2-MoE adds a shared expert (a dense MLP, `shared_expert`) and its sigmoid gate
(`shared_expert_gate`, a Linear h -> 1). The model records each router's logits when its forward is called with
`output_router_logits=True` (`outputs.router_logits`: one [tokens, E] tensor per sparse layer).

Everything here reads a config as a dict (config.json) or an object (a model's config), so the memory plan and
the engine share it.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch

EXPERT_KEYS = ("num_experts", "num_local_experts")  # the config key of the number of routed experts, by family
DEFAULT_AUX_COEF = 0.001  # transformers' default router_aux_loss_coef (Qwen-MoE, Mixtral)


def _get(config, key: str, default=None):
    if isinstance(config, dict):
        return config.get(key, default)
    return getattr(config, key, default)


def num_experts(config) -> int:
    """The routed experts per sparse layer (0: a dense model)."""
    for key in EXPERT_KEYS:
        n = _get(config, key)
        if isinstance(n, int) and n > 0:
            return n
    return 0


def is_moe(config) -> bool:
    """Whether `config` (a dict or a model config) is a mixture-of-experts model: it names routed experts and how
    many each token goes to."""
    return num_experts(config) > 0 and bool(_get(config, "num_experts_per_tok"))


def top_k(config) -> int:
    """Experts per token (num_experts_per_tok)."""
    return int(_get(config, "num_experts_per_tok") or 0)


def expert_intermediate(config) -> int:
    """One expert's MLP width: moe_intermediate_size (Qwen-MoE), else intermediate_size (OLMoE, Mixtral)."""
    return int(_get(config, "moe_intermediate_size") or _get(config, "intermediate_size"))


def shared_intermediate(config) -> int:
    """The shared expert's MLP width (Qwen2-MoE's shared_expert_intermediate_size; 0: none)."""
    return int(_get(config, "shared_expert_intermediate_size") or 0)


def sparse_layers(config) -> list[bool]:
    """Per layer, whether its MLP is the sparse MoE block (transformers' Qwen-MoE rule: not in mlp_only_layers and
    (index + 1) a multiple of decoder_sparse_step); the others are a dense MLP of intermediate_size."""
    layers = int(_get(config, "num_hidden_layers") or 0)
    if not is_moe(config):
        return [False] * layers
    dense, step = set(_get(config, "mlp_only_layers") or ()), int(_get(config, "decoder_sparse_step") or 1)
    return [i not in dense and (i + 1) % step == 0 for i in range(layers)]


def aux_coef(config, override: float = -1.0) -> float:
    """The weight of the router's load-balancing loss: `override` (--router-aux-coef) when >= 0, else the model
    config's router_aux_loss_coef; 0 for a dense model (nothing to balance)."""
    if not is_moe(config):
        return 0.0
    if override >= 0:
        return float(override)
    coef = _get(config, "router_aux_loss_coef")
    return float(coef) if isinstance(coef, (int, float)) else DEFAULT_AUX_COEF


def is_moe_block(module) -> bool:
    """Whether `module` is a sparse MoE block: it holds a router `gate` and the `experts`."""
    return hasattr(module, "experts") and hasattr(module, "gate")


def moe_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The sparse MoE blocks of `model` (`is_moe_block`), in order."""
    return [m for m in model.modules() if is_moe_block(m)]


def load_balancing_loss(router_logits: tuple[torch.Tensor, ...], k: int,
                        mask: torch.Tensor | None = None) -> torch.Tensor:
    """The auxiliary load-balancing loss of Switch Transformer (Fedus et al. 2021, "Switch Transformers: Scaling to
    Trillion Parameter Models with Simple and Efficient Sparsity", eq. 4-6), with top-k routing as transformers
    computes it (`load_balancing_loss_func`, Mixtral / Qwen-MoE / OLMoE):

        aux = E · Σ_e f_e · P_e
        f_e = (1/N) Σ_{layer, token} 1[e ∈ top-k(p)]     (assignments to expert e per token; Σ_e f_e = k)
        P_e = (1/N) Σ_{layer, token} p_e,  p = softmax(router logits)

    over the N = layers × tokens rows the mask keeps (`mask`: [B, T] of 1 for a real token, or None: every
    row). `router_logits`: one [B·T, E] tensor per sparse layer. Perfectly balanced routing gives k (f_e = k/E,
    P_e = 1/E); it grows as the router favours some experts. Returns an fp32 scalar, differentiable through P."""
    E = router_logits[0].shape[-1]
    device = router_logits[0].device
    w = None if mask is None else mask.reshape(-1).to(device=device, dtype=torch.float32)
    counts_E = torch.zeros(E, dtype=torch.float32, device=device)
    probs_E = torch.zeros(E, dtype=torch.float32, device=device)
    rows = torch.zeros((), dtype=torch.float32, device=device)
    for logits_NE in router_logits:
        p_NE = torch.softmax(logits_NE.to(device).float(), dim=-1)
        chosen_NK = p_NE.topk(k, dim=-1).indices
        hits_NE = torch.zeros_like(p_NE).scatter_(1, chosen_NK, 1.0)
        if w is not None:
            hits_NE, p_NE = hits_NE * w[:, None], p_NE * w[:, None]
        counts_E, probs_E = counts_E + hits_NE.sum(0), probs_E + p_NE.sum(0)
        rows = rows + (w.sum() if w is not None else p_NE.shape[0])
    return E * (counts_E / rows * probs_E / rows).sum()


def router_aux_loss(outputs, k: int, attention_mask: torch.Tensor | None = None) -> torch.Tensor | None:
    """The load-balancing loss of a forward's `outputs` (asked with output_router_logits=True), over the tokens
    its `attention_mask` keeps (None: every position, as transformers does without a mask); None when the
    outputs hold no router logits (a dense model, or a head that does not return them)."""
    logits = getattr(outputs, "router_logits", None)
    if not logits:
        return None
    mask = attention_mask if attention_mask is not None and attention_mask.dim() == 2 else None
    return load_balancing_loss(tuple(logits), k, mask)


_TOKENS: contextvars.ContextVar = contextvars.ContextVar("align_moe_tokens", default=None)


@contextlib.contextmanager
def routed_tokens(mask: torch.Tensor | None):
    """The real tokens of the forwards run inside: `mask` [B, T], 1 for a token and 0 for padding, for a batch the
    model is given no attention mask for (right-padded rows, packed rows: align.logprobs); the router loss counts
    only those (None: every position)."""
    token = _TOKENS.set(mask)
    try:
        yield
    finally:
        _TOKENS.reset(token)


class RouterAux:
    """The router's load-balancing loss of a trained MoE engine (align.engine.build.Trained holds one): each
    training forward (gradients on) asks for the router logits and keeps its loss until the next backward, which
    adds `coef` · (the sum of the kept losses) as that micro-batch's share (`pending`); the step's mean per forward
    is the metric `router/aux_loss` (`record`)."""

    def __init__(self, coef: float, k: int):
        self.coef, self.k = coef, k
        self.kept: list[torch.Tensor] = []
        self.total, self.count = 0.0, 0

    def forward(self, call, *args, **kwargs):
        """`call(*args, **kwargs)` with the router logits asked for when gradients are on (a training forward;
        π_old, the reference and generation run without); the loss, over the tokens of its attention mask (else
        of `routed_tokens`, else every position), is kept."""
        if not torch.is_grad_enabled():
            return call(*args, **kwargs)
        out = call(*args, **{**kwargs, "output_router_logits": True})
        mask = kwargs.get("attention_mask")
        aux = router_aux_loss(out, self.k, mask if mask is not None else _TOKENS.get())
        if aux is not None:
            self.kept.append(aux)
            self.total, self.count = self.total + aux.detach(), self.count + 1
        return out

    def pending(self, share: float) -> torch.Tensor | float:
        """coef · Σ kept / `share` (the micro-batches × processes of the step: the backward's loss is the
        micro-batch's share of the global objective, and the aux loss a mean per forward), and forget them."""
        if not self.kept:
            return 0.0
        term = self.coef * torch.stack(self.kept).sum() / share
        self.kept = []
        return term

    def record(self, stats, name: str = "router/aux_loss") -> None:
        """The step's mean aux loss per training forward into `stats` (a mean over every rank), then reset (a loss
        kept from a forward no backward followed is dropped: it must not reach the next step's)."""
        stats.mean(name, self.total, self.count)
        self.total, self.count, self.kept = 0.0, 0, []


def returns_router_logits(model: torch.nn.Module) -> bool:
    """Whether `model`'s forward (a peft model's base) takes output_router_logits: transformers' MoE causal LMs
    do; their sequence / token classifiers (a scalar reward model, PPO's value network) return no router logits."""
    import inspect

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "output_router_logits" in inspect.signature(type(base).forward).parameters


def router_aux(model: torch.nn.Module, override: float = -1.0) -> RouterAux | None:
    """The RouterAux of a model about to be trained: an MoE causal LM with a coefficient > 0 (`override`:
    --router-aux-coef, -1: the config's), else None (dense, a head without router logits, or turned off)."""
    coef = aux_coef(model.config, override)
    if coef <= 0 or not returns_router_logits(model):
        return None
    return RouterAux(coef, top_k(model.config))


MOE_TYPES = ("qwen3_moe", "qwen2_moe", "olmoe", "mixtral")  # transformers' MoE causal LMs this module knows


def class_defaults(model_type: str) -> dict:
    """transformers' default config values of `model_type` ({} when it does not know it): what a config.json
    that leaves a value out means."""
    from transformers import AutoConfig

    try:
        return AutoConfig.for_model(model_type).to_dict()
    except (ValueError, KeyError):
        return {}
