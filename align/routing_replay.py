"""Routing replay (--routing-replay): the trainer's forward of a mixture-of-experts policy sends each token to the
experts the rollout's decoder chose for it, instead of its own top-k.

Why: an MoE policy's log-probs depend on discrete routes. The decoder and the trainer compute the router logits with
different kernels (and, with an async or stale rollout, different weights), so some tokens' top-k differ between the
two; such a token's log-prob differs by far more than rounding, the importance ratios of the update blow up, and RL
on MoE models becomes unstable. Replaying the inference routes in training removes that gap (Ma et al. 2025,
"Stabilizing MoE Reinforcement Learning by Aligning Training and Inference Routers", "R3"; verl's and slime's
router replay).

What is replayed is the choice of experts only: the gate weights are computed from the trainer's own router
logits at the replayed experts, with the family's own normalisation, so the router keeps its gradient
(`replayed_gate_weights`). With the decoder's weights equal to the trainer's, the trainer's log-probs then equal
the decoder's sampling log-probs to rounding.

How: the fast decoder records, for every token of prompt and response, the experts of every MoE layer
(align.rollout.fast, `Completion.routes`); the rollout batch carries them as `routed_experts` [N, L, MoE layers, k]
(-1: no route recorded: the token's own top-k); `align.logprobs` passes them to the model as a forward argument
where replay is installed on it. Inside `routing_replay(model)` (a context manager: everything is undone on exit)
each MoE block's forward is patched, and a hook on its layer's attention (the one submodule of a decoder layer that
is given the forward's arguments) hands the block its layer's column. The routes travel as forward arguments, so a
layer recomputed under gradient checkpointing (transformers re-runs the layer's forward with the same arguments)
sees them again; the patch is on the block's forward, so under ZeRO-3, where the block is a leaf module whose
parameters are gathered together, nothing changes there. The context must span the backward pass of a
checkpointed model: the stages enter it around the whole update.
"""

from __future__ import annotations

import contextlib
import types

import torch

from align.errors import UserError
from align.lora import bare
from align.moe import is_moe_block

KWARG = "routed_experts"  # the forward argument, and the rollout batch's key


def gate_weights(p_NK: torch.Tensor, renorm: bool, dtype: torch.dtype, fp32_weights: bool) -> torch.Tensor:
    """The gate weights of chosen experts from their softmax probabilities p_NK (fp32, over all experts): p / Σ_k p
    where the family renormalises, then in `dtype` unless the family keeps fp32."""
    if renorm:
        p_NK = p_NK / p_NK.sum(-1, keepdim=True)
    return p_NK if fp32_weights else p_NK.to(dtype)


def replayed_gate_weights(logits_NE: torch.Tensor, idx_NK: torch.Tensor, renorm: bool,
                          fp32_weights: bool) -> torch.Tensor:
    """The gate weights of the experts idx_NK from the trainer's router logits: p = softmax(logits) in fp32 over all
    E experts, p at idx (differentiable in the logits), then the family's normalisation (as its HF router does for
    its own top-k): Mixtral p / Σ_k p (= a softmax over the chosen experts' logits: R3's masked softmax);
    Qwen3-MoE, Qwen2-MoE and OLMoE the same with `norm_topk_prob`, else p itself; in the logits' dtype (Mixtral:
    fp32)."""
    p_NK = logits_NE.float().softmax(-1).gather(-1, idx_NK)
    return gate_weights(p_NK, renorm, logits_NE.dtype, fp32_weights)


def route_flips(own_NK: torch.Tensor, replayed_NK: torch.Tensor) -> torch.Tensor:
    """[routes that differ, routes compared] over the tokens with a replayed route (>= 0): a route differs where the
    set of experts the trainer's own top-k picks is not the replayed set (the order within a top-k does not
    matter: the sum over the k experts is the same). Their ratio is `rollout/route_flip_frac`."""
    have = (replayed_NK >= 0).all(-1)
    differ = (own_NK.sort(-1).values != replayed_NK.sort(-1).values).any(-1) & have
    return torch.stack([differ.sum(), have.sum()]).to(torch.float64)


def moe_blocks(model) -> list[tuple[torch.nn.Module, torch.nn.Module]]:
    """(decoder layer, MoE block) of every layer whose MLP routes to experts, in order (column j of the routes is
    the j-th)."""
    layers = getattr(getattr(bare(model), "model", None), "layers", None) or []
    return [(layer, layer.mlp) for layer in layers if is_moe_block(getattr(layer, "mlp", None))]


def check(model, on: bool) -> bool:
    """`on` for a policy with MoE layers; --routing-replay on a dense one: a UserError."""
    if on and not moe_blocks(model):
        cfg = getattr(getattr(model, "module", model), "config", None)
        raise UserError(f"--routing-replay: the policy ({getattr(cfg, 'model_type', '?')}) has no mixture-of-experts "
                        "layers, so there are no routes to replay; drop the flag.")
    return on


def installed(model) -> bool:
    blocks = moe_blocks(model)
    return bool(blocks) and "_align_replay" in vars(blocks[0][1])


def _replayed_forward(block, hidden_states: torch.Tensor) -> torch.Tensor:
    """The MoE block's forward with the experts its layer was handed (`_align_routes` [B·T, k], -1: the token's
    own top-k), the gate weights from the current router logits (`replayed_gate_weights`), plus Qwen2-MoE's gated
    shared expert (not routed: computed as the block computes it); without routes (HF generate, a forward with no
    `routed_experts`) the block's own forward."""
    routes = block.__dict__.pop("_align_routes", None)
    if routes is None:
        return type(block).forward(block, hidden_states)
    B, T, H = hidden_states.shape
    jitter = getattr(block, "jitter_noise", 0)
    if block.training and jitter:  # Mixtral's router jitter, as its own forward applies it
        hidden_states = hidden_states * torch.empty_like(hidden_states).uniform_(1.0 - jitter, 1.0 + jitter)
    h = hidden_states.reshape(-1, H)
    logits, _, own = block.gate(h)
    idx = torch.where(routes >= 0, routes, own)
    renorm, fp32, counts = block._align_replay
    counts += route_flips(own.detach(), routes)
    out = block.experts(h, idx, replayed_gate_weights(logits, idx, renorm, fp32))
    if hasattr(block, "shared_expert"):  # Qwen2-MoE: its gated shared expert, as the block's own forward adds it
        out = out + torch.sigmoid(block.shared_expert_gate(h)) * block.shared_expert(h)
    return out.reshape(B, T, H)


def _hand_routes(block, j: int):
    """A forward pre-hook (with kwargs) for the layer's attention: column j of the forward's `routed_experts`
    [B, T, MoE layers, k] for the block, as [B·T, k] indices."""

    def hook(_module, _args, kwargs):
        routes = kwargs.get(KWARG)
        if routes is not None:
            block._align_routes = routes[:, :, j].reshape(-1, routes.shape[-1]).long()

    return hook


@contextlib.contextmanager
def routing_replay(model, on: bool = True, stats=None):
    """Within: forwards of `model` (a module, engine or peft model) given `routed_experts` replay them. Re-entrant
    (an inner use of the same model does nothing); off (`on` False) or a dense model: nothing. `stats`
    (align.engine.stats.Stats): on exit, `rollout/route_flip_frac`: the share of the replayed (token, MoE layer)
    routes the trainer's own router would have chosen otherwise (`route_flips`; every replayed forward counts,
    a checkpointed recompute too: the same routes again, so the share is the same)."""
    blocks = moe_blocks(model) if on else []
    if not blocks or installed(model):
        yield
        return
    mixtral = getattr(bare(model).config, "model_type", None) == "mixtral"
    counts = torch.zeros(2, dtype=torch.float64, device=blocks[0][1].gate.weight.device)
    handles = []
    for j, (layer, block) in enumerate(blocks):
        block._align_replay = (mixtral or bool(getattr(block.gate, "norm_topk_prob", False)), mixtral, counts)
        block.forward = types.MethodType(_replayed_forward, block)
        handles.append(layer.self_attn.register_forward_pre_hook(_hand_routes(block, j), with_kwargs=True))
    try:
        yield
        if stats is not None and counts[1] > 0:
            stats.mean("rollout/route_flip_frac", counts[0], counts[1])
    finally:
        for h in handles:
            h.remove()
        for _, block in blocks:
            for k in ("forward", "_align_replay", "_align_routes"):
                block.__dict__.pop(k, None)


def forward_kwargs(model, batch: dict) -> dict:
    """{routed_experts: ...} for a forward of `model` on `batch` where the batch has routes and replay is installed
    on the model (the policy inside `routing_replay`); nothing otherwise (the reference model routes itself)."""
    routes = batch.get(KWARG)
    return {KWARG: routes} if routes is not None and installed(model) else {}


def routes_batch(completions, shape: tuple[int, int], device) -> torch.Tensor | None:
    """The rollout batch's `routed_experts` [N, L, MoE layers, k] (right-padded like its input_ids; -1 where no
    route was recorded: padding, the last token, a completion HF generate decoded), or None when no completion
    has routes."""
    have = [c.routes for c in completions if c.routes is not None]
    if not have:
        return None
    out = torch.full((*shape, *have[0].shape[1:]), -1, dtype=have[0].dtype)
    for i, c in enumerate(completions):
        if c.routes is not None:
            out[i, : c.routes.shape[0]] = c.routes
    return out.to(device)
