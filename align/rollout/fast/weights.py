"""The fast decoder's weights: the module's own tensors read in place, or one fused inference copy of its own.

The copy is kept where the module's tensors are not what decoding needs (ZeRO-3 shards, bf16-mixed's fp32
weights, LoRA adapters to merge) and, on a GPU, for a small model, whose fused q/k/v and gate/up matmuls decode
faster (`copy_reason`); ALIGN_FAST_DECODER_COPY=1 / 0 forces it / avoids it wherever it can.
"""

from __future__ import annotations

import math
import os

import torch

from align.lora import effective_weight, is_peft
from align.rollout.fast import fp8

SMALL_COPY_BYTES = 4 << 30  # on a GPU, a policy up to this size (~2B parameters in bf16) decodes from a fused copy


def copy_setting() -> str:
    """ALIGN_FAST_DECODER_COPY: "1" a weight copy wherever the decoder runs, "0" the module's own weights wherever
    it can read them, unset: the rule of `copy_reason`."""
    v = os.environ.get("ALIGN_FAST_DECODER_COPY", "").strip().lower()
    return "" if not v else "0" if v in ("0", "false", "no", "off") else "1"


def copy_forced() -> bool:
    return copy_setting() == "1"


def copies_small(weight_bytes: int) -> bool:
    """Whether a GPU decoder keeps a fused copy of weights it could read in place: below SMALL_COPY_BYTES, where
    the copy costs little memory (and lives only during the rollout) and one q/k/v and one gate/up matmul a layer
    instead of five decode faster (2.79 vs 3.16 ms per token at Qwen2.5-1.5B on an H200); above it the second
    copy's memory matters more (15 GiB at 8B) and large matmuls gain little from fusing."""
    return copy_setting() != "0" and weight_bytes <= SMALL_COPY_BYTES


def copy_reason(module, device, dtype, precision: str = "") -> str | None:
    """Why the decoder keeps its own copy of the module's weights (None: it decodes from them in place)."""
    if precision == "fp8":
        return "FP8 rollouts: E4M3 weights with a scale per row"
    if copy_forced():
        return "ALIGN_FAST_DECODER_COPY"
    if is_peft(module) or any(hasattr(m, "get_delta_weight") for m in module.modules()):
        return "LoRA: the decoder decodes W + (α/r) B A"
    want = torch.device(device)
    if want.type == "cuda" and want.index is None and torch.cuda.is_available():
        want = torch.device("cuda", torch.cuda.current_device())
    for p in module.parameters():
        if hasattr(p, "ds_id"):
            return "ZeRO-3: the weights are gathered only for the copy"
        if p.dtype != dtype or p.device != want:
            return f"weights in {p.dtype} on {p.device}, decoding in {dtype} on {want}"
    size = sum(p.numel() for p in module.parameters()) * torch.finfo(dtype).bits // 8
    if want.type == "cuda" and copies_small(size):
        return f"a small model ({size / 2**30:.1f} GiB): fused q/k/v and gate/up matmuls decode faster"
    return None


MATRICES = ("qkv", "o", "gu", "down")  # the copy's linear layers: E4M3 under FP8 rollouts


class DecoderWeights:
    """FastDecoder's weights: `embed`, `norm`, `head` and, per layer, the dict `layers[i]` ("ln1", "ln2", "o",
    "down", the q/k norms and biases a family has; "qkv" and "gu" fused in the copy, "q", "k", "v", "gate", "up"
    apart on the module's own tensors; an MoE layer's "router" [E, H] and experts "egu" [E, 2I, H], "edown"
    [E, H, I] instead of "gu"/"gate"/"up", "down", and Qwen2-MoE's shared expert "se_gu" (copy) or "se_g", "se_u"
    (in place), "se_down" and its gate "se_gate" [1, H]: in the compute dtype under FP8 rollouts too; under FP8
    rollouts the four matrices in E4M3 with their row scales "qkv_s", "o_s", "gu_s", "down_s":
    align.rollout.fast.fp8). The copy's tensors are views of ONE byte buffer, whose storage
    `release` gives back between rollouts. Reads the layout LayerMath set (dims, biases); a tensor that moved drops
    the captured graphs (CompiledStep._drop_graphs): they hold its old address."""

    def _init_weights(self, module) -> None:
        self.tied = bool(getattr(self.cfg, "tie_word_embeddings", False))
        self.layers = [{} for _ in range(self.n_layers)]
        self.copy_reason = copy_reason(module, self.device, self.dtype, self.precision)
        self._bound = None  # shared weights: the module tensors' addresses the decoder last read
        if self.copy_reason is None:
            self._wbuf = None
        else:
            self._alloc_copy(self._copy_layout())

    def _copy_shapes(self) -> dict:
        """The shape of every tensor of the fused copy: "embed", "norm", "head" (untied) and (layer, name)."""
        cfg, nq, nk, inter = self.cfg, self.nq, self.nk, self.inter
        shapes = {"embed": (cfg.vocab_size, self.hidden), "norm": (self.hidden,)}
        if not self.tied:
            shapes["head"] = (cfg.vocab_size, self.hidden)
        for i in range(self.n_layers):
            shapes.update({(i, "ln1"): (self.hidden,), (i, "ln2"): (self.hidden,), (i, "qkv"): (nq + 2 * nk, self.hidden),
                           (i, "o"): (self.hidden, nq)})
            if i in self.moe_layers:
                E, mi = self.n_experts, self.moe_inter
                shapes.update({(i, "router"): (E, self.hidden), (i, "egu"): (E, 2 * mi, self.hidden),
                               (i, "edown"): (E, self.hidden, mi)})
                if self.shared_inter:  # Qwen2-MoE's shared expert and its gate
                    si = self.shared_inter
                    shapes.update({(i, "se_gu"): (2 * si, self.hidden), (i, "se_down"): (self.hidden, si),
                                   (i, "se_gate"): (1, self.hidden)})
            else:
                shapes.update({(i, "gu"): (2 * inter, self.hidden), (i, "down"): (self.hidden, inter)})
            if self.qk_norm == "head":
                shapes[i, "qn"], shapes[i, "kn"] = (self.head_dim,), (self.head_dim,)
            elif self.qk_norm == "full":
                shapes[i, "qn"], shapes[i, "kn"] = (nq,), (nk,)
            if self.qkv_bias:
                shapes[i, "qkv_b"] = (nq + 2 * nk,)
            if self.o_bias:
                shapes[i, "o_b"] = (self.hidden,)
            if self.mlp_bias and i not in self.moe_layers:
                shapes[i, "gu_b"], shapes[i, "down_b"] = (2 * inter,), (self.hidden,)
        return shapes

    def _copy_layout(self) -> dict:
        """The shape and dtype of every tensor of the copy: the compute dtype, or (`precision` fp8) E4M3 for the
        four matrices of each layer whose dimensions an FP8 GEMM takes, each with its fp32 row scales."""
        out = {}
        for k, shp in self._copy_shapes().items():
            if self.precision == "fp8" and isinstance(k, tuple) and k[1] in MATRICES and fp8.supported(shp):
                out[k], out[k[0], f"{k[1]}_s"] = (shp, fp8.E4M3), (shp[:1], torch.float32)
            else:
                out[k] = (shp, self.dtype)
        return out

    def _alloc_copy(self, layout: dict) -> None:
        """Every weight of the copy a view of ONE byte buffer (offsets 256-byte aligned), so that `release` can
        hand the whole inference copy back to the allocator between rollouts and `load_weights` take it again in
        one piece."""
        align = lambda n: -(-n // 256) * 256  # noqa: E731
        spans, total = {}, 0  # key -> (byte offset, bytes)
        for k, (shp, dt) in layout.items():
            spans[k] = (total, math.prod(shp) * dt.itemsize)
            total += align(spans[k][1])
        self._wbuf = torch.empty(total, device=self.device, dtype=torch.uint8)
        view = {k: self._wbuf[o : o + n].view(layout[k][1]).view(layout[k][0]) for k, (o, n) in spans.items()}
        self.embed, self.norm = view["embed"], view["norm"]
        self.head = self.embed if self.tied else view["head"]
        for k, t in view.items():
            if isinstance(k, tuple):
                self.layers[k[0]][k[1]] = t
        self._wptr = self._wbuf.data_ptr()

    @property
    def shares_weights(self) -> bool:
        return self._wbuf is None

    @torch.no_grad()
    def load_weights(self, module) -> None:
        """The module's current weights for the next rollout: read in place (`shares_weights`), else copied in
        (call with ZeRO-3 params gathered), into the buffer `release` gave back if it did; a LoRA layer's as
        merged, W + (α/r) B A."""
        if self.shares_weights:
            return self._bind(module)
        self._take_weights()
        mm = module.model
        self.embed.copy_(mm.embed_tokens.weight)
        if not self.tied:
            self.head.copy_(module.lm_head.weight)
        self.norm.copy_(mm.norm.weight)
        nq, nk, inter = self.nq, self.nk, self.inter
        for L, layer in zip(self.layers, mm.layers):
            a, m = layer.self_attn, layer.mlp
            L["ln1"].copy_(layer.input_layernorm.weight)
            L["ln2"].copy_(layer.post_attention_layernorm.weight)
            put = lambda k, rows, lin: _put(L, k, rows, effective_weight(lin))  # noqa: E731
            put("qkv", slice(0, nq), a.q_proj)
            put("qkv", slice(nq, nq + nk), a.k_proj)
            put("qkv", slice(nq + nk, None), a.v_proj)
            put("o", slice(None), a.o_proj)
            if "router" in L:  # the experts' 3-D tensors as they are (no LoRA on them)
                L["router"].copy_(m.gate.weight)
                L["egu"].copy_(m.experts.gate_up_proj)
                L["edown"].copy_(m.experts.down_proj)
                if "se_gate" in L:
                    put("se_gu", slice(0, self.shared_inter), m.shared_expert.gate_proj)
                    put("se_gu", slice(self.shared_inter, None), m.shared_expert.up_proj)
                    put("se_down", slice(None), m.shared_expert.down_proj)
                    put("se_gate", slice(None), m.shared_expert_gate)
            else:
                put("gu", slice(0, inter), m.gate_proj)
                put("gu", slice(inter, None), m.up_proj)
                put("down", slice(None), m.down_proj)
            if self.qk_norm:
                L["qn"].copy_(a.q_norm.weight)
                L["kn"].copy_(a.k_norm.weight)
            if self.qkv_bias:
                L["qkv_b"][:nq].copy_(a.q_proj.bias)
                L["qkv_b"][nq : nq + nk].copy_(a.k_proj.bias)
                L["qkv_b"][nq + nk :].copy_(a.v_proj.bias)
            if self.o_bias:
                L["o_b"].copy_(a.o_proj.bias)
            if "gu_b" in L:
                L["gu_b"][:inter].copy_(m.gate_proj.bias)
                L["gu_b"][inter:].copy_(m.up_proj.bias)
                L["down_b"].copy_(m.down_proj.bias)

    def _bind(self, module) -> None:
        """Point the decoder at the module's own tensors (q/k/v and gate/up as separate matrices). Rebound only
        when a tensor moved (the captured graphs hold addresses: they are re-captured then); an optimizer step
        writes in place, so a bound decoder reads each step's weights without any copy."""
        mm = module.model
        named = {"embed": mm.embed_tokens.weight, "norm": mm.norm.weight}
        if not self.tied:
            named["head"] = module.lm_head.weight
        for i, layer in enumerate(mm.layers):
            a, m = layer.self_attn, layer.mlp
            lin = {"q": a.q_proj, "k": a.k_proj, "v": a.v_proj, "o": a.o_proj}
            if hasattr(m, "experts"):
                named[i, "router"], named[i, "egu"], named[i, "edown"] = (m.gate.weight, m.experts.gate_up_proj,
                                                                          m.experts.down_proj)
                if hasattr(m, "shared_expert"):  # Qwen2-MoE
                    se = m.shared_expert
                    named[i, "se_g"], named[i, "se_u"], named[i, "se_down"] = (se.gate_proj.weight, se.up_proj.weight,
                                                                               se.down_proj.weight)
                    named[i, "se_gate"] = m.shared_expert_gate.weight
            else:
                lin.update(gate=m.gate_proj, up=m.up_proj, down=m.down_proj)
            for k, linear in lin.items():
                named[i, k] = linear.weight
                if linear.bias is not None:
                    named[i, f"{k}_b"] = linear.bias
            named[i, "ln1"], named[i, "ln2"] = layer.input_layernorm.weight, layer.post_attention_layernorm.weight
            if self.qk_norm:
                named[i, "qn"], named[i, "kn"] = a.q_norm.weight, a.k_norm.weight
        ptrs = tuple(t.data_ptr() for t in named.values())
        if ptrs == self._bound:
            return
        if self._bound is not None and self._graphs:
            self._drop_graphs("weights")
        self._bound = ptrs
        self.embed, self.norm = named["embed"].detach(), named["norm"].detach()
        self.head = self.embed if self.tied else named["head"].detach()
        for L in self.layers:
            L.clear()
        for k, t in named.items():
            if isinstance(k, tuple):
                self.layers[k[0]][k[1]] = t.detach()

    def weight_bytes(self) -> int:
        """Bytes of the decoder's own weight copy (0: it reads the module's)."""
        if self.shares_weights:
            return 0
        ts = [self.embed, self.norm, *([] if self.tied else [self.head])] + [t for L in self.layers for t in L.values()]
        return sum(t.numel() * t.element_size() for t in ts)

    def _release_weights(self) -> None:
        """The copy's storage back to the allocator (its tensors stay: no recompile); `_take_weights` takes it
        again."""
        if self._wbuf is not None and self._wbuf.untyped_storage().nbytes():
            self._wptr = self._wbuf.data_ptr()
            self._wbuf.untyped_storage().resize_(0)

    def _take_weights(self) -> None:
        """The weight buffer's storage back after `release` (contents undefined: `load_weights` fills it); the
        captured graphs are dropped if it came back at another address."""
        t = self._wbuf
        if t.untyped_storage().nbytes():
            return
        t.untyped_storage().resize_(t.numel() * t.element_size())
        if t.data_ptr() != self._wptr and self._graphs:
            self._drop_graphs("weights")


def _put(L: dict, key: str, rows: slice, w: torch.Tensor) -> None:
    """Rows `rows` of the copy's matrix `key` from the module's weight `w`: copied, or quantised to E4M3 with a
    scale per row where the copy holds the matrix in FP8 (its scales beside it, f"{key}_s")."""
    if f"{key}_s" in L:
        w8, s = fp8.quantize_rows(w)
        L[key][rows].copy_(w8)
        L[f"{key}_s"][rows].copy_(s)
    else:
        L[key][rows].copy_(w)
