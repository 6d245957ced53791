"""Fast rollouts for Llama / Qwen2-architecture policies: a persistent inference copy, a static KV cache and a
decode step that is compiled once (one layer's code serves every layer) and replayed as one CUDA graph per
generated token.

Why: batched RL rollouts of small models are bound by kernel launches and Python, not by the GPU (HF
`generate` spends ~0.8 ms per layer per decode step). Here one decode step over the whole batch is a single
CUDA-graph replay: embedding, every layer, the LM head, sampling (temperature / top-k / top-p), EOS tracking
and all cache / position bookkeeping run on the device, with no host work between tokens.

* Weights: when the policy's own tensors are what decoding needs — unsharded (not ZeRO-3), on the device, in
  the compute dtype, no LoRA adapters to merge — the decoder reads them in place: no second copy of the model
  during the rollout, and each optimizer step (in place) is what the next rollout's graphs replay with.
  Otherwise (ZeRO-3, bf16-mixed's fp32 weights, LoRA, a model of at most SMALL_COPY_BYTES on a GPU, or
  ALIGN_FAST_DECODER_COPY=1; =0 reads the module's weights wherever it can) it keeps an inference
  copy, unsharded, in the compute dtype, with q/k/v and gate/up fused into one matrix each, whose tensors keep
  their addresses for the life of the process; `load_weights` copies the current (ZeRO-3 gathered, LoRA
  merged) weights in before each rollout.
* Attention reads the grouped KV heads directly ([B, KV, G, D] x [B, KV, L, D]): no copy of K/V per query head.
* Prompts are left-padded; the prefill runs eagerly; decode stops early once every row has emitted EOS (checked
  every `check_every` tokens on a GPU, every token on a CPU).
* On CPU (tests) the same code runs eagerly, without compile or graphs: `tests/test_fast_generate.py` checks
  that its greedy tokens equal HF `generate`'s.

Supported: the Llama family's decoder layout with SiLU MLPs — `llama` (Llama 2/3.x: default, `linear`, `dynamic`,
`yarn` and `llama3` RoPE), `qwen2` (q/k/v biases), `qwen3` (per-head q/k RMSNorm before RoPE) and `mistral` — when
the rollout fits any sliding window (`mistral`'s `sliding_window`, or a Qwen model's with `use_sliding_window`)
and, for `dynamic` RoPE, the model's original context. Anything else decodes through HF `generate`; the log names
the reason once per process.
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F

from align.lora import effective_weight, is_peft
from align.rollout.fast import decode_attention
from align.rollout.sampling import choose, sampled_logprobs

SUPPORTED = ("llama", "qwen2", "qwen3", "mistral")
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")  # computed by the model's own rotary module


def enabled_by_env() -> bool:
    return os.environ.get("ALIGN_FAST_GENERATION", "1").lower() not in ("0", "false", "no", "off")


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


def copy_reason(module, device, dtype) -> str | None:
    """Why the decoder keeps its own copy of the module's weights (None: it decodes from them in place)."""
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


def bare(module):
    """The HF model inside a DeepSpeed engine (DeepSpeed's unwrap_model_for_generation yields the engine) and
    inside a peft model (its LoRA layers stay in it: `load_weights` applies their adapters)."""
    inner = getattr(module, "module", None)
    module = inner if isinstance(inner, torch.nn.Module) and hasattr(inner, "config") else module
    return module.get_base_model() if is_peft(module) else module


def rope_type(cfg) -> str:
    for rp in (getattr(cfg, "rope_parameters", None), getattr(cfg, "rope_scaling", None)):
        if isinstance(rp, dict) and (rp.get("rope_type") or rp.get("type")):
            return rp.get("rope_type") or rp.get("type")
    return "default"


def sliding_window(cfg) -> int | None:
    """The attention window the HF forward applies (None: full causal attention). Mistral applies
    `sliding_window` to every layer; Qwen2/Qwen3 only with `use_sliding_window` (to some layers)."""
    window = getattr(cfg, "sliding_window", None)
    if not window:
        return None
    if getattr(cfg, "model_type", None) == "mistral":
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
    """What the fast path runs, for the log: 'qwen3 (q/k norm), llama3 RoPE'."""
    cfg = module.config
    extra = " (q/k norm)" if hasattr(module.model.layers[0].self_attn, "q_norm") else ""
    return f"{cfg.model_type}{extra}, {rope_type(cfg)} RoPE"


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """HF Llama/Qwen2 RMSNorm: normalise in fp32, cast back, then scale."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    rot = torch.cat((-x[..., h:], x[..., :h]), dim=-1)
    return x * cos + rot * sin


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Top-k then top-p (nucleus) filtering of [B, V] fp32 logits (already divided by the temperature); the
    same rule as HF's warpers: keep the smallest set whose probability reaches top_p, always the top token."""
    neg = torch.finfo(logits.dtype).min
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, neg)
    if top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, descending=False, dim=-1)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        remove_sorted = cum <= (1 - top_p)
        remove_sorted[:, -1] = False
        remove = remove_sorted.scatter(1, idx, remove_sorted)
        logits = logits.masked_fill(remove, neg)
    return logits


class FastDecoder:
    """Inference copy + static cache + (on CUDA) compiled, graph-captured decode step for one model."""

    def __init__(self, module, device, dtype=None, use_graphs: bool | None = None, check_every: int | None = None):
        cfg = module.config
        self.cfg = cfg
        self.device = torch.device(device)
        p0 = next(module.parameters())
        from align.models import autocast_dtype

        # --precision bf16-mixed: fp32 weights, bf16 compute -> a bf16 inference copy
        self.dtype = dtype or autocast_dtype(module) or (p0.dtype if p0.numel() else torch.bfloat16)
        cuda = self.device.type == "cuda"
        self.use_graphs = cuda if use_graphs is None else use_graphs
        # how often decode asks whether every row has finished: on a GPU the answer costs a host sync, on a CPU
        # nothing (and every extra step a full batch forward)
        self.check_every = check_every or (32 if cuda else 1)
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
        # ---- inference weights (stable addresses)
        layer0 = module.model.layers[0]
        a, m = layer0.self_attn, layer0.mlp
        self.qk_norm = hasattr(a, "q_norm")  # Qwen3: RMSNorm over each head's q and k before RoPE
        self.qkv_bias = a.q_proj.bias is not None
        self.o_bias = a.o_proj.bias is not None
        self.mlp_bias = m.gate_proj.bias is not None
        nq, nk = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        self.nq, self.nk = nq, nk
        inter = cfg.intermediate_size
        self.inter = inter
        e = dict(device=self.device, dtype=self.dtype)
        self.tied = bool(getattr(cfg, "tie_word_embeddings", False))
        shapes = {"embed": (cfg.vocab_size, self.hidden), "norm": (self.hidden,)}
        if not self.tied:
            shapes["head"] = (cfg.vocab_size, self.hidden)
        for i in range(self.n_layers):
            shapes.update({(i, "ln1"): (self.hidden,), (i, "ln2"): (self.hidden,), (i, "qkv"): (nq + 2 * nk, self.hidden),
                           (i, "o"): (self.hidden, nq), (i, "gu"): (2 * inter, self.hidden), (i, "down"): (self.hidden, inter)})
            if self.qk_norm:
                shapes[i, "qn"], shapes[i, "kn"] = (self.head_dim,), (self.head_dim,)
            if self.qkv_bias:
                shapes[i, "qkv_b"] = (nq + 2 * nk,)
            if self.o_bias:
                shapes[i, "o_b"] = (self.hidden,)
            if self.mlp_bias:
                shapes[i, "gu_b"], shapes[i, "down_b"] = (2 * inter,), (self.hidden,)
        self.layers = [{} for _ in range(self.n_layers)]
        self.copy_reason = copy_reason(module, self.device, self.dtype)
        self._bound = None  # shared weights: the module tensors' addresses the decoder last read
        if self.copy_reason is None:
            self._wbuf = None
        else:
            # every weight a view of ONE buffer (offsets 64-element aligned), so that `release` can hand the whole
            # inference copy back to the allocator between rollouts and `load_weights` take it again in one piece
            align = lambda n: -(-n // 64) * 64  # noqa: E731
            offsets, total = {}, 0
            for k, shp in shapes.items():
                offsets[k] = total
                total += align(math.prod(shp))
            self._wbuf = torch.empty(total, **e)
            view = {k: self._wbuf[o : o + math.prod(shapes[k])].view(shapes[k]) for k, o in offsets.items()}
            self.embed, self.norm = view["embed"], view["norm"]
            self.head = self.embed if self.tied else view["head"]
            for k, t in view.items():
                if isinstance(k, tuple):
                    self.layers[k[0]][k[1]] = t
            self._wptr = self._wbuf.data_ptr()
        self.recaptures = 0  # CUDA graphs re-captured because a buffer came back at another address
        self.recaptured_for: dict[str, int] = {}  # ... by what moved: "weights", "cache"
        self._side = None  # the warm-up stream of every capture
        self.bucket = int(os.environ.get("ALIGN_DECODE_BUCKET", 256)) if self.use_graphs else 1  # see attn_len
        # the decode step's attention: the split-KV kernel on a GPU (align.rollout.fast.decode_attention), SDPA elsewhere
        # (ALIGN_DECODE_ATTN=sdpa: SDPA on a GPU too)
        self.split_kv = (cuda and self.dtype in (torch.bfloat16, torch.float16)
                         and os.environ.get("ALIGN_DECODE_ATTN", "split") != "sdpa"
                         and decode_attention.supports(self.head_dim, self.n_heads // self.n_kv))
        self.vocab = cfg.vocab_size
        self._shape_key = None
        self._graphs: dict = {}
        self._warm: set = set()  # graph keys whose step has been compiled and run
        self._compiled = None

    # ------------------------------------------------------------------ weights
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
            L["qkv"][:nq].copy_(effective_weight(a.q_proj))
            L["qkv"][nq : nq + nk].copy_(effective_weight(a.k_proj))
            L["qkv"][nq + nk :].copy_(effective_weight(a.v_proj))
            L["o"].copy_(effective_weight(a.o_proj))
            L["gu"][:inter].copy_(effective_weight(m.gate_proj))
            L["gu"][inter:].copy_(effective_weight(m.up_proj))
            L["down"].copy_(effective_weight(m.down_proj))
            if self.qk_norm:
                L["qn"].copy_(a.q_norm.weight)
                L["kn"].copy_(a.k_norm.weight)
            if self.qkv_bias:
                L["qkv_b"][:nq].copy_(a.q_proj.bias)
                L["qkv_b"][nq : nq + nk].copy_(a.k_proj.bias)
                L["qkv_b"][nq + nk :].copy_(a.v_proj.bias)
            if self.o_bias:
                L["o_b"].copy_(a.o_proj.bias)
            if self.mlp_bias:
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
            lin = {"q": a.q_proj, "k": a.k_proj, "v": a.v_proj, "o": a.o_proj, "gate": m.gate_proj, "up": m.up_proj,
                   "down": m.down_proj}
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
        n = self.embed.numel() + (0 if self.tied else self.head.numel()) + self.norm.numel()
        n += sum(t.numel() for L in self.layers for t in L.values())
        return n * self.embed.element_size()

    # ------------------------------------------------------------------ state for one (batch, capacity) shape
    def _alloc(self, B: int, cap: int) -> None:
        if self._shape_key == (B, cap):
            return
        d = self.device
        # one spare slot, never attended to: no slice [:, :n] of the cache or the bias is contiguous, so one
        # compile serves every attention length n (a contiguous slice takes other code paths: a recompile)
        # every layer's K one buffer, every layer's V another (a layer's k and v never share a storage: the compiled
        # layer writes both): two pieces for `release` to give back and the next rollout to take again, which the
        # allocator returns at their old addresses far more often than 2 x layers pieces (a moved one costs a
        # re-capture of every graph)
        self._kbuf = torch.zeros(self.n_layers, B, self.n_kv, cap + 1, self.head_dim, device=d, dtype=self.dtype)
        self._vbuf = torch.zeros_like(self._kbuf)
        self.k_cache, self.v_cache = list(self._kbuf.unbind(0)), list(self._vbuf.unbind(0))
        self.attn_bias = torch.zeros(B, cap + 1, device=d, dtype=torch.float32)
        self.cur_tok = torch.zeros(B, dtype=torch.long, device=d)
        self.cur_pos = torch.zeros(B, dtype=torch.long, device=d)
        self.widx = torch.zeros(1, dtype=torch.long, device=d)  # cache slot the next token is written to
        self.sidx = torch.zeros(1, dtype=torch.long, device=d)  # column of `out` the next token goes to
        self.finished = torch.zeros(B, dtype=torch.bool, device=d)
        self.keys = torch.zeros(B, dtype=torch.long, device=d)  # each row's sampling key (align.rollout.sampling)
        self.out = None
        self.out_logp = None
        self.last_logps = None  # the last `generate`'s sampling log-probs per row (None when greedy)
        self._out_len = 0
        if d.type == "cuda":
            for t in self.k_cache + self.v_cache + [self.attn_bias]:
                torch._dynamo.mark_static_address(t)  # unguarded: a new address re-records, never recompiles
        self._shape_key = (B, cap)
        self._graphs, self._warm = {}, set()
        self._released = False

    def _big(self) -> list[torch.Tensor]:
        return [self._kbuf, self._vbuf]

    def release(self) -> None:
        """Free the inference weights and the KV cache between rollouts (the training step
        needs the memory: at 0.5B the weights alone are 0.9 GiB): the tensors stay (no recompile), their storage
        goes. `load_weights` and the next `generate` take it back (the cache zeroed) and re-capture the graphs
        only if the allocator placed a buffer elsewhere."""
        if self._wbuf is not None and self._wbuf.untyped_storage().nbytes():
            self._wptr = self._wbuf.data_ptr()
            self._wbuf.untyped_storage().resize_(0)
        if self._shape_key is None or self._released:
            return
        self._ptrs = [t.data_ptr() for t in self._big()]
        for t in self._big():
            t.untyped_storage().resize_(0)
        self._released = True

    def _take_weights(self) -> None:
        """The weight buffer's storage back after `release` (contents undefined: `load_weights` fills it); the
        captured graphs are dropped if it came back at another address."""
        t = self._wbuf
        if t.untyped_storage().nbytes():
            return
        t.untyped_storage().resize_(t.numel() * t.element_size())
        if t.data_ptr() != self._wptr and self._graphs:
            self._drop_graphs("weights")

    def _restore(self) -> None:
        if not self._released:
            return
        for t in self._big():
            t.untyped_storage().resize_(t.numel() * t.element_size())
            t.zero_()  # masked cache slots are multiplied by 0: they must not hold NaN/inf garbage
        if [t.data_ptr() for t in self._big()] != self._ptrs and self._graphs:
            self._drop_graphs("cache")
        self._released = False

    def _drop_graphs(self, why: str) -> None:
        """The captured graphs hold addresses that moved (`why`: the weights or the cache): re-captured on use."""
        self._graphs = {}
        self.recaptures += 1
        self.recaptured_for[why] = self.recaptured_for.get(why, 0) + 1

    def kv_cache_bytes(self, rows: int, length: int) -> int:
        return 2 * self.n_layers * rows * self.n_kv * length * self.head_dim * torch.finfo(self.dtype).bits // 8

    # ------------------------------------------------------------------ model math
    def _rope(self, pos: torch.Tensor):
        freqs = pos[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.rope_scale).to(self.dtype), (emb.sin() * self.rope_scale).to(self.dtype)

    def _qk(self, L, q: torch.Tensor, k: torch.Tensor):
        """Qwen3's per-head q/k RMSNorm (q [..., H, D], k [..., KV, D]); identity for the other families."""
        if not self.qk_norm:
            return q, k
        return _rms(q, L["qn"], self.eps), _rms(k, L["kn"], self.eps)

    def _qkv(self, L, h):
        """q, k, v of h: one fused matmul on the decoder's copy, three on the module's own weights."""
        if "qkv" in L:
            return F.linear(h, L["qkv"], L.get("qkv_b")).split([self.nq, self.nk, self.nk], dim=-1)
        return tuple(F.linear(h, L[k], L.get(f"{k}_b")) for k in ("q", "k", "v"))

    def _mlp(self, L, h):
        if "gu" in L:
            g, u = F.linear(h, L["gu"], L.get("gu_b")).split(self.inter, dim=-1)
        else:
            g, u = F.linear(h, L["gate"], L.get("gate_b")), F.linear(h, L["up"], L.get("up_b"))
        return F.linear(F.silu(g) * u, L["down"], L.get("down_b"))

    def _prefill(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """ids/mask [B, P] (left-padded). Fills cache slots [0, P) and returns the last position's logits [B, V]."""
        B, P = ids.shape
        pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
        cos, sin = self._rope(pos)  # [B, P, D]
        cos, sin = cos[:, None], sin[:, None]
        causal = torch.ones(P, P, dtype=torch.bool, device=ids.device).tril()
        allowed = causal[None] & mask.bool()[:, None, :]  # [B, Pq, Pk]
        bias = torch.zeros(B, 1, 1, P, P, device=ids.device, dtype=torch.float32)
        bias = bias.masked_fill(~allowed[:, None, None], torch.finfo(torch.float32).min)
        G = self.n_heads // self.n_kv
        x = F.embedding(ids, self.embed)
        for li, L in enumerate(self.layers):
            h = _rms(x, L["ln1"], self.eps)
            q, k, v = self._qkv(L, h)
            q, k = self._qk(L, q.view(B, P, self.n_heads, self.head_dim), k.view(B, P, self.n_kv, self.head_dim))
            q, k = q.transpose(1, 2), k.transpose(1, 2)
            v = v.view(B, P, self.n_kv, self.head_dim).transpose(1, 2)
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            self.k_cache[li][:, :, :P].copy_(k)
            self.v_cache[li][:, :, :P].copy_(v)
            qg = q.reshape(B, self.n_kv, G, P, self.head_dim)
            s = torch.matmul(qg, k[:, :, None].transpose(-1, -2)).float() * self.scale + bias
            pr = s.softmax(-1).to(self.dtype)
            o = torch.matmul(pr, v[:, :, None])  # [B, KV, G, P, D]
            o = o.reshape(B, self.n_heads, P, self.head_dim).transpose(1, 2).reshape(B, P, self.nq)
            x = x + F.linear(o, L["o"], L.get("o_b"))
            x = x + self._mlp(L, _rms(x, L["ln2"], self.eps))
        x = _rms(x[:, -1], self.norm, self.eps)
        return F.linear(x, self.head).float()

    # One decode step is three compiled pieces: the step's inputs, ONE transformer layer (the same compiled code
    # for every layer: its weights and cache are arguments) and the step's end. Compiling one layer instead of
    # the unrolled model keeps the first step's compile short at any depth; the CUDA graph still holds the whole
    # step, so a token costs one replay either way.
    def _step_in(self):
        """The current tokens' embeddings and RoPE cos/sin."""
        cos, sin = self._rope(self.cur_pos)  # [B, D]
        return F.embedding(self.cur_tok, self.embed), cos[:, None], sin[:, None]

    def _layer_step(self, L: dict, kc: torch.Tensor, vc: torch.Tensor, x: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """One layer for one token per row: writes k/v at slot widx, attends to the first n = bias.shape[1]
        slots (`bias` is attn_bias[:, :n], n > widx)."""
        B, n, G = x.shape[0], bias.shape[1], self.n_heads // self.n_kv
        h = _rms(x, L["ln1"], self.eps)
        q, k, v = self._qkv(L, h)
        q, k = self._qk(L, q.view(B, self.n_heads, self.head_dim), k.view(B, self.n_kv, self.head_dim))
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
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
        x = x + F.linear(o, L["o"], L.get("o_b"))
        return x + self._mlp(L, _rms(x, L["ln2"], self.eps))

    def _step_out(self, x: torch.Tensor, sampling, eos: int, pad: int) -> None:
        """Final norm, LM head, the next token chosen; EOS tracking and the cache / position bookkeeping."""
        logits = F.linear(_rms(x, self.norm, self.eps), self.head).float()
        nxt = self._choose(logits, self.sidx, sampling)
        if not sampling.greedy:  # the sampler's log-probs, as the trainer scores them (rollout/logp_abs_diff)
            self.out_logp.index_copy_(1, self.sidx, sampled_logprobs(logits, nxt, sampling.temperature)[:, None])
        nxt = torch.where(self.finished, torch.full_like(nxt, pad), nxt)
        self.out.index_copy_(1, self.sidx, nxt[:, None])
        self.finished.logical_or_(nxt == eos)
        self.cur_tok.copy_(nxt)
        self.cur_pos.add_(1)
        self.widx.add_(1)
        self.sidx.add_(1)

    def _choose(self, logits: torch.Tensor, position, sampling) -> torch.Tensor:
        """The token at `position` of each row: argmax, or the exponential race with the row's keyed noise
        (align.rollout.sampling: computed here, inside the compiled step, from the keys and the position alone)."""
        if sampling.greedy:
            return logits.argmax(-1)
        z = filter_logits(logits / sampling.temperature, sampling.top_k, sampling.top_p)
        return choose(z, self.keys, position)

    def _step(self, sampling, eos: int, pad: int, bias: torch.Tensor, fns=None) -> None:
        """Everything one generated token needs, on the device (this is what the CUDA graph holds); `fns`: the
        compiled (step_in, layer_step, step_out), else eager."""
        step_in, layer_step, step_out = fns or (self._step_in, self._layer_step, self._step_out)
        # open cache slot widx for attention: outside the compiled pieces (an in-place write to a view argument
        # with a dynamic length failed AOT functionalization on torch 2.11), inside the CUDA graph all the same
        self.attn_bias.index_fill_(1, self.widx, 0.0)
        x, cos, sin = step_in()
        for L, kc, vc in zip(self.layers, self.k_cache, self.v_cache):
            x = layer_step(L, kc, vc, x, cos, sin, bias)
        step_out(x, sampling, eos, pad)

    def attn_len(self, w: int) -> int:
        """Cache slots the decode step that writes slot `w` attends to: w + 1 rounded up to a multiple of `bucket`
        (CUDA graphs: one graph per bucket, 256 slots; eager: 1, exactly w + 1), so attention reads the written part
        of the cache, not all of it (at 4K tokens that halves the bytes a decode step reads)."""
        return min(self._shape_key[1], -(-(w + 1) // self.bucket) * self.bucket)

    def _bias(self, n: int) -> torch.Tensor:
        """attn_bias[:, :n], its length dynamic for the compiler (one compile serves every bucket)."""
        b = self.attn_bias[:, :n]
        torch._dynamo.maybe_mark_dynamic(b, 1)
        return b

    def compile_step(self, backend="inductor") -> None:
        """Compile the decode step's three pieces (on CUDA before the first capture; tests: any backend)."""
        self._compiled = tuple(torch.compile(f, fullgraph=True, backend=backend)
                               for f in (self._step_in, self._layer_step, self._step_out))

    def _run_step(self, sampling, eos: int, pad: int, bias: torch.Tensor) -> None:
        if self._compiled is None:
            return self._step(sampling, eos, pad, bias)
        with torch._dynamo.config.patch(automatic_dynamic_shapes=False):  # only the attention length is dynamic
            self._step(sampling, eos, pad, bias, self._compiled)

    def _runner(self, sampling, eos: int, pad: int, n: int):
        """A callable doing one `_step` over n cache slots: a CUDA-graph replay on CUDA, eager elsewhere."""
        key = (sampling.greedy, sampling.temperature, sampling.top_k, sampling.top_p, eos, pad, n)
        bias = self._bias(n)
        body = lambda: self._run_step(sampling, eos, pad, bias)  # noqa: E731
        if not self.use_graphs:
            return body
        if key in self._graphs:
            return self._graphs[key].replay
        if self._compiled is None:
            self.compile_step()

        # warm up (compiles) on a side stream, then capture; the state it leaves is reset by the next prefill
        saved = [t.clone() for t in (self.cur_tok, self.cur_pos, self.widx, self.sidx, self.finished)]
        if self._side is None:  # ONE side stream for the decoder's life: cuBLAS keeps a workspace (32 MiB on
            self._side = torch.cuda.Stream()  # Hopper) per stream it ran on, so a new stream per capture leaks one
        if not self._graphs:  # one memory pool for the live graphs (run one at a time); a new one once all are
            self._pool = torch.cuda.graph_pool_handle()  # dropped: the allocator frees a pool no graph holds
        s = self._side
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            # a re-capture (an address moved) of a step that ran before needs one warm-up run, not the first's two
            for _ in range(1 if key in self._warm else 2):
                self.widx.zero_(), self.sidx.zero_()
                body()
        torch.cuda.current_stream().wait_stream(s)
        self._warm.add(key)
        self.widx.zero_(), self.sidx.zero_()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self._pool):
            body()
        for t, v in zip((self.cur_tok, self.cur_pos, self.widx, self.sidx, self.finished), saved):
            t.copy_(v)
        self._graphs[key] = g
        return g.replay

    # ------------------------------------------------------------------ generation
    @torch.no_grad()
    def generate(self, prompts: list[list[int]], sampling, eos: int, pad: int, keys=None) -> list[list[int]]:
        """Tokens generated for each prompt (rows padded after EOS with `pad`, length <= max_new_tokens); `keys`:
        each prompt's sampling key (align.rollout.sampling; default: drawn from torch's RNG)."""
        n = len(prompts)
        B = n if not self.use_graphs else max(8, 1 << (n - 1).bit_length())  # graph shapes: powers of two
        P = max(len(p) for p in prompts)
        cap = P + sampling.max_new_tokens
        cap = -(-cap // 128) * 128 if self.use_graphs else cap  # few shapes: one compile per (B, cap)
        if self._shape_key is not None and self._shape_key[0] == B and self._shape_key[1] >= cap:
            cap = self._shape_key[1]  # keep the captured graphs: a larger cache is fine
        self._alloc(B, cap)
        self._restore()
        rows = prompts + [prompts[-1]] * (B - n)
        ids = torch.full((B, P), pad, dtype=torch.long)
        mask = torch.zeros(B, P, dtype=torch.long)
        for i, p in enumerate(rows):
            ids[i, P - len(p) :] = torch.tensor(p)
            mask[i, P - len(p) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        if self.out is None or self._out_len < sampling.max_new_tokens:
            self.out = torch.full((B, sampling.max_new_tokens), pad, dtype=torch.long, device=self.device)
            self.out_logp = torch.zeros(B, sampling.max_new_tokens, dtype=torch.float32, device=self.device)
            self._out_len = sampling.max_new_tokens
            self._graphs, self._warm = {}, set()  # the graphs hold the old `out` (a new shape: compiled again)
        dbg = os.environ.get("ALIGN_FAST_DEBUG") == "1"
        if dbg:
            import sys
            import time

            torch.cuda.synchronize()
            t0 = time.perf_counter()
        # one runner per attention length the decode steps will need (writing slots P .. P + max_new - 2), all
        # made before the prefill: a capture's warm-up scribbles on the state
        runners = {n: self._runner(sampling, eos, pad, n)
                   for n in sorted({self.attn_len(w) for w in range(P, P + sampling.max_new_tokens - 1)})}
        if dbg:
            torch.cuda.synchronize()
            t1 = time.perf_counter()
        # the attention mask AFTER the captures: their warm-up opens slots 0-1 (`_step`) for every row
        self.attn_bias.fill_(torch.finfo(torch.float32).min)
        self.attn_bias[:, :P].masked_fill_(mask.bool(), 0.0)
        if not sampling.greedy:
            keys = torch.randint(0, 1 << 32, (n,)).tolist() if keys is None else list(keys)
            self.keys.copy_(torch.tensor(keys + keys[-1:] * (B - n)))
        logits = self._prefill(ids, mask)
        first = self._choose(logits, 0, sampling)
        self.out.fill_(pad)
        self.out[:, 0] = first
        if not sampling.greedy:
            self.out_logp[:, 0] = sampled_logprobs(logits, first, sampling.temperature)
        self.finished.copy_(first == eos)
        self.cur_tok.copy_(first)
        self.cur_pos.copy_(mask.sum(-1))
        self.widx.fill_(P)
        self.sidx.fill_(1)
        steps = 1
        while steps < sampling.max_new_tokens:
            runners[self.attn_len(P + steps - 1)]()
            steps += 1
            if steps % self.check_every == 0 and bool(self.finished[:n].all()):
                break
        if dbg:
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            print(f"[fast_generate] rows {n}/{B} cap {cap} graphs {self.use_graphs} runner {t1 - t0:.2f}s "
                  f"prefill+decode {t2 - t1:.2f}s for {steps} tokens = {(t2 - t1) / steps * 1e3:.2f} ms/token; "
                  f"graph re-captures {self.recaptures} {self.recaptured_for} grad {torch.is_grad_enabled()} dynamo counters {dict(torch._dynamo.utils.counters['stats'])}",
                  file=sys.stderr, flush=True)
        # the sampling log-prob of every generated token (positions after EOS hold garbage: cut with the tokens)
        self.last_logps = None if sampling.greedy else self.out_logp[:n, :steps].tolist()
        return self.out[:n, :steps].tolist()


def decoder_for(module, device) -> FastDecoder:
    """The module's persistent FastDecoder (created on first use), with the module's current weights in it."""
    dec = getattr(module, "_align_fast_decoder", None)
    if dec is None:
        dec = FastDecoder(module, device)
        object.__setattr__(module, "_align_fast_decoder", dec)  # plain attribute: not a submodule/param
    dec.load_weights(module)
    return dec
