"""The fast decoder's layer math, as HF's Llama / Qwen2 / Qwen3 / Mistral forward computes it, and its
mixture-of-experts variants' (Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral): RMSNorm, RoPE (the frequencies and scale of the
model's own rotary module), q/k/v with Qwen3's per-head q/k norm or OLMoE's over the whole projection (and its q/k/v
clip), the SiLU MLP or the experts' (align.rollout.fast.moe; Qwen2-MoE's gated shared expert added), grouped-query
attention; the eager prefill of the prompts
and one layer's step for one token per row."""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F

from align.rollout.fast import decode_attention, moe
from align.rollout.fast.fp8 import fp8_linear
from align.moe import num_experts


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """HF Llama/Qwen2 RMSNorm: normalise in fp32, cast back, then scale."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    rot = torch.cat((-x[..., h:], x[..., :h]), dim=-1)
    return x * cos + rot * sin


class LayerMath:
    """FastDecoder's math: the model's layout (`_init_layout`), and the forward over the weights (`embed`,
    `layers`, ...: DecoderWeights) that fills and reads the KV cache (`k_cache`, `v_cache`, the write slot
    `widx`: KVCache)."""

    def _init_layout(self, module, cuda: bool) -> None:
        """The model's dimensions, RoPE and per-layer options (from its config and first layer), and the decode
        step's attention kernel."""
        cfg = self.cfg
        self.n_layers = cfg.num_hidden_layers
        self.n_heads = cfg.num_attention_heads
        self.n_kv = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.hidden = cfg.hidden_size
        self.eps = cfg.rms_norm_eps
        # RoPE frequencies and cos/sin scale as the model's own rotary module computed them (default, linear,
        # llama3, yarn; `dynamic` below its original context, where it equals the default)
        rotary = module.model.rotary_emb
        self.inv_freq = rotary.original_inv_freq.detach().float().to(self.device)
        self.rope_scale = float(getattr(rotary, "attention_scaling", 1.0) or 1.0)
        self.scale = 1.0 / math.sqrt(self.head_dim)
        layers = module.model.layers
        a = layers[0].self_attn
        self.nq, self.nk = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        # q/k RMSNorm before RoPE: Qwen3's over each head ("head"), OLMoE's over the whole projection ("full")
        self.qk_norm = "" if not hasattr(a, "q_norm") else "full" if a.q_norm.weight.numel() == self.nq else "head"
        self.clip_qkv = getattr(cfg, "clip_qkv", None)  # OLMoE: q, k (after their norm) and v clamped to ±clip
        self.qkv_bias = a.q_proj.bias is not None
        self.o_bias = a.o_proj.bias is not None
        self.inter = cfg.intermediate_size
        self.vocab = cfg.vocab_size
        self._init_moe(layers)
        dense = [layer.mlp for layer in layers if not hasattr(layer.mlp, "experts")]
        self.mlp_bias = bool(dense) and dense[0].gate_proj.bias is not None
        # the decode step's attention: the split-KV kernel on a GPU (align.rollout.fast.decode_attention), SDPA
        # elsewhere (ALIGN_DECODE_ATTN=sdpa: SDPA on a GPU too)
        self.split_kv = (cuda and self.dtype in (torch.bfloat16, torch.float16)
                         and os.environ.get("ALIGN_DECODE_ATTN", "split") != "sdpa"
                         and decode_attention.supports(self.head_dim, self.n_heads // self.n_kv))

    def _init_moe(self, layers) -> None:
        """The mixture-of-experts layout: which layers route to experts (`moe_layers`, in order: column j of the
        recorded routes is moe_layers[j]), E experts of intermediate size `moe_inter`, top `top_k`, the family's
        gate normalisation (align.rollout.fast.moe.route), and whether torch._grouped_mm runs them here."""
        cfg = self.cfg
        self.moe_layers = [i for i, layer in enumerate(layers) if hasattr(layer.mlp, "experts")]
        if not self.moe_layers:
            return
        self.n_experts, self.top_k = num_experts(cfg), cfg.num_experts_per_tok
        self.moe_inter = layers[self.moe_layers[0]].mlp.experts.gate_up_proj.shape[1] // 2
        mixtral = cfg.model_type == "mixtral"
        self.renorm = mixtral or bool(getattr(cfg, "norm_topk_prob", False))
        self.fp32_gate = mixtral  # Mixtral's router returns fp32 weights; Qwen3-MoE's and OLMoE's the logits' dtype
        self.route_dtype = torch.int8 if self.n_experts <= 127 else torch.int16
        self.grouped = moe.grouped_mm_works(self.device.type, self.dtype, self.hidden, self.moe_inter)
        # Qwen2-MoE's shared expert beside the routed ones (a SwiGLU MLP of this width and its sigmoid gate; 0: none)
        block = layers[self.moe_layers[0]].mlp
        self.shared_inter = block.shared_expert.gate_proj.out_features if hasattr(block, "shared_expert") else 0

    def _rope(self, pos: torch.Tensor):
        freqs = pos[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.rope_scale).to(self.dtype), (emb.sin() * self.rope_scale).to(self.dtype)

    def _qk(self, L, q: torch.Tensor, k: torch.Tensor):
        """Qwen3's per-head q/k RMSNorm (q [..., H, D], k [..., KV, D]) or OLMoE's over all heads at once (then its
        clip); identity for the other families."""
        if self.qk_norm == "head":
            return rms(q, L["qn"], self.eps), rms(k, L["kn"], self.eps)
        if self.qk_norm == "full":
            q = rms(q.flatten(-2), L["qn"], self.eps).view(q.shape)
            k = rms(k.flatten(-2), L["kn"], self.eps).view(k.shape)
        return self._clip(q), self._clip(k)

    def _clip(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.clip_qkv is None else t.clamp(-self.clip_qkv, self.clip_qkv)

    @staticmethod
    def _lin(L, key: str, h):
        """h·W_keyᵀ + b_key: in FP8 where the copy holds W_key so (its row scales f"{key}_s" beside it)."""
        if f"{key}_s" in L:
            return fp8_linear(h, L[key], L[f"{key}_s"], L.get(f"{key}_b"))
        return F.linear(h, L[key], L.get(f"{key}_b"))

    def _qkv(self, L, h):
        """q, k, v of h: one fused matmul on the decoder's copy, three on the module's own weights."""
        if "qkv" in L:
            q, k, v = self._lin(L, "qkv", h).split([self.nq, self.nk, self.nk], dim=-1)
        else:
            q, k, v = (F.linear(h, L[k], L.get(f"{k}_b")) for k in ("q", "k", "v"))
        return q, k, self._clip(v)

    def _mlp(self, L, h):
        if "gu" in L:
            g, u = self._lin(L, "gu", h).split(self.inter, dim=-1)
        else:
            g, u = F.linear(h, L["gate"], L.get("gate_b")), F.linear(h, L["up"], L.get("up_b"))
        return self._lin(L, "down", F.silu(g) * u)

    def _ffn(self, L, h):
        """The layer's MLP of h [..., H]: (out, None), or for an MoE layer (out, the chosen experts [..., k])."""
        if "router" not in L:
            return self._mlp(L, h), None
        x = h.reshape(-1, self.hidden)
        idx, w = moe.route(F.linear(x, L["router"]), self.top_k, self.renorm, self.fp32_gate)
        y = (moe.experts_grouped if self.grouped else moe.experts_gathered)(x, L["egu"], L["edown"], idx, w)
        if "se_gate" in L:  # Qwen2-MoE: + its shared expert
            y = y + self._shared_expert(L, x)
        return y.view(h.shape), idx.view(*h.shape[:-1], self.top_k)

    def _shared_expert(self, L, x):
        """Qwen2-MoE's shared expert term of x [N, H], as its HF sparse block adds it to the routed experts' sum:
        sigmoid(x·w_gᵀ) · down(silu(gate(x)) · up(x)), w_g the `shared_expert_gate` [1, H], gate/up/down the
        `shared_expert` MLP of width shared_intermediate ("se_gu" fused in the copy, "se_g"/"se_u" apart on the
        module's tensors); in the compute dtype, FP8 rollouts too (as the routed experts)."""
        if "se_gu" in L:
            g, u = F.linear(x, L["se_gu"]).split(self.shared_inter, dim=-1)
        else:
            g, u = F.linear(x, L["se_g"]), F.linear(x, L["se_u"])
        return torch.sigmoid(F.linear(x, L["se_gate"])) * F.linear(F.silu(g) * u, L["se_down"])

    def _prefill(self, ids: torch.Tensor, mask: torch.Tensor, start: int = 0,
                 pos: torch.Tensor | None = None) -> torch.Tensor:
        """ids/mask [B, P] (left-padded): a block of tokens written to cache slots [start, start + P), each
        attending to the cache's open slots before `start` (`attn_bias`: an episode's earlier turns, kept in the
        cache) and causally to the block's own; `pos` [B, P]: their RoPE positions (default: 0, 1, ... from each
        row's first token). Returns the block's last position's logits [B, V]."""
        B, P = ids.shape
        if pos is None:
            pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
        cos, sin = self._rope(pos)  # [B, P, D]
        cos, sin = cos[:, None], sin[:, None]
        causal = torch.ones(P, P, dtype=torch.bool, device=ids.device).tril()
        allowed = causal[None] & mask.bool()[:, None, :]  # [B, Pq, Pk]
        bias = torch.zeros(B, P, P, device=ids.device, dtype=torch.float32)
        bias = bias.masked_fill(~allowed, torch.finfo(torch.float32).min)
        if start:  # the cached slots before the block: open or closed per row, alike for every query position
            bias = torch.cat([self.attn_bias[:, None, :start].expand(B, P, start), bias], -1)
        bias = bias[:, None, None]  # [B, 1, 1, Pq, start + Pk]
        G, end = self.n_heads // self.n_kv, start + P
        x = F.embedding(ids, self.embed)
        routes = []  # each MoE layer's chosen experts [B, P, k]
        for li, L in enumerate(self.layers):
            h = rms(x, L["ln1"], self.eps)
            q, k, v = self._qkv(L, h)
            q, k = self._qk(L, q.view(B, P, self.n_heads, self.head_dim), k.view(B, P, self.n_kv, self.head_dim))
            q, k = q.transpose(1, 2), k.transpose(1, 2)
            v = v.view(B, P, self.n_kv, self.head_dim).transpose(1, 2)
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
            self.k_cache[li][:, :, start:end].copy_(k)
            self.v_cache[li][:, :, start:end].copy_(v)
            k, v = self.k_cache[li][:, :, :end], self.v_cache[li][:, :, :end]
            qg = q.reshape(B, self.n_kv, G, P, self.head_dim)
            s = torch.matmul(qg, k[:, :, None].transpose(-1, -2)).float() * self.scale + bias
            pr = s.softmax(-1).to(self.dtype)
            o = torch.matmul(pr, v[:, :, None])  # [B, KV, G, P, D]
            o = o.reshape(B, self.n_heads, P, self.head_dim).transpose(1, 2).reshape(B, P, self.nq)
            x = x + self._lin(L, "o", o)
            y, idx = self._ffn(L, rms(x, L["ln2"], self.eps))
            x = x + y
            if idx is not None:
                routes.append(idx)
        self.prefill_routes = torch.stack(routes, 2) if routes else None  # [B, P, MoE layers, k]
        x = rms(x[:, -1], self.norm, self.eps)
        return F.linear(x, self.head).float()

    def _step_in(self):
        """The current tokens' embeddings and RoPE cos/sin (the decode step's first compiled piece)."""
        cos, sin = self._rope(self.cur_pos)  # [B, D]
        return F.embedding(self.cur_tok, self.embed), cos[:, None], sin[:, None]

    def _layer_step(self, L: dict, kc: torch.Tensor, vc: torch.Tensor, x: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor, bias: torch.Tensor):
        """One layer for one token per row: writes k/v at slot widx, attends to the first n = bias.shape[1]
        slots (`bias` is attn_bias[:, :n], n > widx). Returns x, or for an MoE layer (x, its experts [B, k])."""
        B, n, G = x.shape[0], bias.shape[1], self.n_heads // self.n_kv
        h = rms(x, L["ln1"], self.eps)
        q, k, v = self._qkv(L, h)
        q, k = self._qk(L, q.view(B, self.n_heads, self.head_dim), k.view(B, self.n_kv, self.head_dim))
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        kc.index_copy_(2, self.widx, k[:, :, None])
        vc.index_copy_(2, self.widx, v.view(B, self.n_kv, 1, self.head_dim))
        # grouped-query attention for one token: the G query heads of a KV head are its G "query positions"
        # ([B, KV, G, D] against [B, KV, n, D]), so one fused attention kernel reads each K/V slot once, with no
        # copy of K/V per query head and no [B, H, n] score tensor in memory
        qg = q.view(B, self.n_kv, G, self.head_dim)
        if self.split_kv:  # one program per (row, KV head, 128 cache slots), combined by log-sum-exp
            o = decode_attention.attention(qg, kc[:, :, :n], vc[:, :, :n], bias, self.scale).reshape(B, self.nq)
        else:
            o = F.scaled_dot_product_attention(qg, kc[:, :, :n], vc[:, :, :n],
                                               attn_mask=bias[:, None, None, :].to(q.dtype),
                                               scale=self.scale).reshape(B, self.nq)
        x = x + self._lin(L, "o", o)
        y, idx = self._ffn(L, rms(x, L["ln2"], self.eps))
        return x + y if idx is None else (x + y, idx)
