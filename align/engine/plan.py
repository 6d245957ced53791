"""The memory plan: what a training stage will hold on each device, estimated before anything is built.

Inputs: each model's config.json (no weights are read), the stage's flags, and the device (free memory from
torch.cuda.mem_get_info on a GPU; total RAM on a CPU, where the plan is informational). Output: a table of terms
per phase of a step and its peak; the run stops (exit 2) before it builds a model or writes --out when the peak
does not fit, naming the smallest change that would (each candidate re-estimated).

What a step holds, per device (ZeRO stage z, w processes; `e` = bytes of an activation element: 2 under every
bf16 precision, 4 under fp32; `r` = bytes of the module's own dtype: 2 for bf16 / bf16-pure, 4 for bf16-mixed /
fp32):

* weights, gradients and optimizer state of a trained model (`per_param`): bytes per trained parameter, then
  ZeRO's sharding: z >= 1 divides the optimizer state by w, z >= 2 also the gradients, z = 3 also the weights.
  Gradients exist from the first backward to the optimiser step only (DeepSpeed sets them to None after it), so
  they count in the update phase, the optimizer state in every phase. --offload-optimizer moves the optimizer
  state and the gradients to the CPU (a `BUCKET`-element gradient bucket stays on the device).
* a mixture-of-experts model (align.moe) counts every expert in its weights, gradients, optimizer state, the
  decoder's copy and ZeRO-3's gathered block (all of them are stored and trained), and the top-k a token runs
  through in its activations and no-gradient passes; the plan's notes give both counts (total and active).
* a frozen model (reference, reward model, teacher): its weights in the module's dtype (r bytes), sharded by w
  under ZeRO-3; on the CPU with PPO's --offload-frozen under ZeRO-3.
* LoRA (--lora-r): the base weights frozen (r bytes), the adapters A [r, in] and B [out, r] on each targeted
  Linear trained in fp32 (`per_param("fp32", z)`); a score head trains in full. The reference of a LoRA policy is
  the policy with its adapters off: no second copy.
* rollout (grpo, ppo, online dpo): align.rollout.fast's inference copy of the policy (every parameter, bf16),
  its KV cache 2 · layers · B · kv_heads · slots · head_dim · 2 bytes (B: the rows rounded up to a power of two,
  at least 8; slots: prompt + new tokens rounded up to 128, + 1), the sampling buffers (4 · B · vocab fp32) and the
  prefill's attention scores (B · heads · P² · (8 + e) + B · P² · 4 bytes, one layer at a time). The copy and
  the cache are freed before the update (`FastDecoder.release`), so the peak is the larger phase, not the sum.
  Under LoRA the frozen base waits in host memory during the rollout (`lora.parked_base`). What the fast decoder
  does not take (fast.support.unsupported_config, a CPU, --no-gather) decodes with transformers' generate: its KV
  cache, no copy; on a GPU it decodes a mixture of experts by gathering each row's top-k experts' weights
  (`hf_moe_decode_bytes`). ZeRO-3 on several processes gathers the policy's whole weights for the rollout.
* GRPO with --rollout-gpus N: the trainers hold no rollout terms; a column of its own ("decoder rank") holds what
  each decoder process does: the policy unsharded in the module's dtype (LoRA: its fp32 adapters too) and the
  rollout terms above for its 1/N of the step's samples, as one process decodes them.
* activations of a training forward (`activation_bytes`): per token and layer 2 · (4h + 2rh) (two RMSNorms:
  their fp32 input and normalised output) + e · (3·nq + 2·nk + 4·i) (q, k, v and the attention output kept by
  SDPA and o_proj; gate, up, silu(gate) and their product kept by the MLP); with gradient checkpointing each
  layer keeps only its input (r·h per token) and one layer is recomputed at a time. A mixture-of-experts layer's
  i is what a token runs through: its top-k experts' widths (+ Qwen2-MoE's shared expert), the active width.
  Compiled blocks save less
  (inductor's partitioner recomputes the pointwise ops: norms, RoPE, silu and the gate product): without
  checkpointing the per-layer term is scaled by COMPILED_SAVED, measured on one H200 (Llama-3.1-8B, 4 × 4,096
  tokens: 69.8 GiB against 102.8 estimated eagerly, 0.68; docs/results-history.md), with a margin.
* logits: the RL and preference stages take log-probs through align.logprobs' fused head — at most
  CHUNK_ELEMENTS fp32 logits at once (`chunked_logit_bytes`); SFT and PPO's ptx loss (and an entropy bonus, a
  likelihood reward head) build the full B × T × V logits (`full_logit_bytes`), as does SFT's held-out loss (64
  rows a forward: its own phase).
* where a step's no-gradient passes (π_old, π_ref, values, reward scores) run, the score phase holds the largest
  one: a layer's widest tensors for its rows (`inference_bytes`) and its logits.
* an LLM judge (grpo --reward judge:MODEL, ppo --judge, dpo --online --judge): loaded whole on every process,
  outside DeepSpeed (bf16 on a GPU, fp32 on a CPU), in every phase; its forward of one batch (align.judge.BATCH
  texts of the rubric, the prompt and the answers) where the stage judges: the score phase (online DPO: the
  rollout's) (`judge_terms`).
"""

from __future__ import annotations

import json
import os
import shlex
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import ClassVar

from align import moe
from align.config import RLConfig, SupervisedConfig, TrainConfig
from align.engine.build import batch_layout
from align.engine.layout import engines
from align.errors import UserError
from align.lora import MOE_ATTENTION

GiB = 1 << 30
COMPILED_SAVED = 0.72  # compiled blocks' saved activations / the eager count (measured 0.68 at 8B, 4K tokens)
BUCKET = 50_000_000  # elements: ds_config's reduce_bucket_size, the gradient bucket an offload keeps on the device
ENV_BUDGET = "ALIGN_DEVICE_MEMORY_BYTES"  # a fake device budget (tests, "what if"): the ONE place it is read
ENV_CHECK = "ALIGN_PLAN_CHECK"  # 0: report only, never stop (as --no-plan-check)
DECODER = "decoder rank"  # GRPO --rollout-gpus: the plan's column of what a decoder process holds


# ---------------------------------------------------------------------------------------------- a model's shape


@dataclass(frozen=True)
class Arch:
    """What the estimate needs of a decoder-only transformer's config (Llama / Qwen / Mistral layout)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    model_type: str = "llama"
    qk_norm_full: bool = False  # OLMoE: q / k RMSNorms over the whole projection (nq, nk), not per head
    experts: int = 0  # mixture of experts: routed experts per sparse layer (0: dense)
    experts_per_tok: int = 0  # top-k
    expert_intermediate: int = 0  # one expert's MLP width
    shared_intermediate: int = 0  # Qwen2-MoE's shared expert's MLP width (0: none), with its h -> 1 gate
    sparse: tuple[bool, ...] = ()  # per layer: its MLP is the MoE block (else a dense MLP of `intermediate`)

    @property
    def moe(self) -> bool:
        return self.experts > 0 and any(self.sparse)

    @property
    def token_intermediate(self) -> float:
        """The MLP width a token runs through, averaged over the layers: `intermediate` in a dense layer, top-k
        experts (+ the shared expert) in a sparse one (the activation and inference terms' width)."""
        widths = [self.experts_per_tok * self.expert_intermediate + self.shared_intermediate if sp
                  else self.intermediate for sp in self.sparse]
        return sum(widths) / len(widths) if widths else self.intermediate
    config: dict | None = field(default=None, compare=False, repr=False)  # for align.rollout.fast.support's rules


def decoder_reason(a: Arch, length: int) -> str | None:
    """Why align.rollout.fast would not decode this model's rollouts of `length` tokens (None: it would)."""
    if a.config is None:
        return None
    from types import SimpleNamespace

    from align.rollout.fast.support import unsupported_config

    return unsupported_config(SimpleNamespace(**a.config), length)


def arch(config: dict) -> Arch:
    """The Arch of a config.json dict (a multimodal config's `text_config`; GPT-2's n_embd / n_layer / n_head)."""
    if "hidden_size" not in config and "n_embd" not in config and isinstance(config.get("text_config"), dict):
        config = {**config["text_config"], "model_type": config["text_config"].get("model_type", "")}
    get = config.get
    hidden = get("hidden_size") or get("n_embd")
    layers, heads = get("num_hidden_layers") or get("n_layer"), get("num_attention_heads") or get("n_head")
    if not (hidden and layers and heads and get("vocab_size")):
        raise UserError("config.json has no hidden_size / num_hidden_layers / num_attention_heads / vocab_size: "
                        "the memory plan cannot size this model.")
    kind = get("model_type") or ""
    if kind in moe.MOE_TYPES:  # a config.json may leave out a value at its class default
        config = {**moe.class_defaults(kind), **config}
        get = config.get
    sparse = tuple(moe.sparse_layers(config)) if moe.is_moe(config) else ()
    return Arch(hidden=hidden, layers=layers, heads=heads, kv_heads=get("num_key_value_heads") or heads,
                head_dim=get("head_dim") or hidden // heads,
                intermediate=get("intermediate_size") or get("n_inner") or 4 * hidden, vocab=get("vocab_size"),
                tied=bool(get("tie_word_embeddings", False)),
                qkv_bias=bool(get("attention_bias") or kind == "qwen2" or (kind == "qwen2_moe" and get("qkv_bias"))),
                o_bias=bool(get("attention_bias")), mlp_bias=bool(get("mlp_bias")), qk_norm=kind.startswith("qwen3"),
                model_type=kind, config=config, qk_norm_full=kind == "olmoe",
                experts=moe.num_experts(config) if sparse else 0, experts_per_tok=moe.top_k(config) if sparse else 0,
                expert_intermediate=moe.expert_intermediate(config) if sparse else 0,
                shared_intermediate=moe.shared_intermediate(config) if sparse else 0, sparse=sparse)


def linear_shapes(a: Arch) -> dict[str, tuple[int, int]]:
    """(in, out) of each Linear of one layer, by its module name."""
    nq, nk = a.heads * a.head_dim, a.kv_heads * a.head_dim
    return {"q_proj": (a.hidden, nq), "k_proj": (a.hidden, nk), "v_proj": (a.hidden, nk), "o_proj": (nq, a.hidden),
            "gate_proj": (a.hidden, a.intermediate), "up_proj": (a.hidden, a.intermediate),
            "down_proj": (a.intermediate, a.hidden)}


def layer_linears(a: Arch, sparse: bool = False) -> list[tuple[str, int, int]]:
    """(module name, in, out) of each Linear of one layer, as peft matches names (a dotted suffix): attention's,
    then a dense layer's MLP, or a sparse layer's shared expert and its gate (Qwen2-MoE). The routed experts are
    fused 3-D parameters and the router a bare weight: no Linear (`moe_params`)."""
    shapes = linear_shapes(a)
    attention = [(n, *shapes[n]) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
    if not sparse:
        return attention + [(n, *shapes[n]) for n in ("gate_proj", "up_proj", "down_proj")]
    si, h = a.shared_intermediate, a.hidden
    shared = [("gate_proj", h, si), ("up_proj", h, si), ("down_proj", si, h), ("shared_expert_gate", h, 1)]
    return attention + (shared if si else [])


def moe_params(a: Arch, active: bool = False) -> int:
    """A sparse layer's router (E·h) and routed experts, 3·h·i' each (gate, up, down): all E of them, or the
    top-k a token runs through (`active`)."""
    return a.experts * a.hidden + (a.experts_per_tok if active else a.experts) * 3 * a.hidden * a.expert_intermediate


def layer_params(a: Arch, sparse: bool | None = None, active: bool = False) -> int:
    """One block: its Linears (+ biases), two RMSNorm gains, Qwen3's q/k norms (OLMoE's over nq and nk); a sparse
    layer (`sparse`; None: sparse where the model has any) adds its router and experts (all, or `active`: top-k)."""
    sparse = a.moe if sparse is None else sparse
    nq, nk = a.heads * a.head_dim, a.kv_heads * a.head_dim
    n = sum(i * o for _, i, o in layer_linears(a, sparse)) + 2 * a.hidden
    n += (nq + 2 * nk) * a.qkv_bias + a.hidden * a.o_bias
    n += 0 if sparse else (2 * a.intermediate + a.hidden) * a.mlp_bias
    n += moe_params(a, active) if sparse else 0
    return n + 2 * a.head_dim * a.qk_norm + (nq + nk) * a.qk_norm_full


def n_params(a: Arch, head: str = "lm", active: bool = False) -> int:
    """Every parameter: embedding V·h, the blocks, the final norm h, and the head: `lm` (V·h unless tied to
    the embedding) or `score` (a sequence classifier's h × 1). A mixture of experts: all experts (what is
    stored, trained and sharded), or `active`: the top-k a token runs through (embedding and head counted, as
    the models' published "active" numbers do)."""
    blocks = (sum(layer_params(a, sp, active) for sp in a.sparse) if a.moe else a.layers * layer_params(a))
    n = a.vocab * a.hidden + blocks + a.hidden
    if head == "lm":
        return n + (0 if a.tied else a.vocab * a.hidden)
    return n + a.hidden


def lora_params(a: Arch, r: int, targets: str = "all-linear") -> int:
    """Adapter parameters: r · (in + out) for every targeted Linear of every layer (all-linear: all but the head; a
    mixture of experts: attention's, align.lora.MOE_ATTENTION)."""
    names = [t.strip() for t in targets.split(",")] if targets != "all-linear" else None
    names = list(MOE_ATTENTION) if names is None and a.moe else names
    per_layer = lambda sparse: sum(r * (i + o) for n, i, o in layer_linears(a, sparse)  # noqa: E731
                                   if names is None or n in names)
    return sum(per_layer(sp) for sp in a.sparse) if a.moe else a.layers * per_layer(False)


# ---------------------------------------------------------------------------------------------- bytes per term


def per_param(precision: str, zero_stage: int) -> tuple[int, int, int]:
    """(weight, gradient, optimizer state) bytes per trained parameter before sharding (build.ds_config):

    bf16-pure  2 + 2 + 4   (bf16 moments; AdamW steps the bf16 module) and, under ZeRO-1/2, + 2 (a bf16 master
               partition; ZeRO-3 steps its own bf16 partition in place)
    bf16       2 + 4 + 12  (bf16 module, fp32 gradients, fp32 master + moments)
    bf16-mixed / fp32: 4 + 4 + 8, and + 4 under ZeRO-1/2 (their fp32 master partition is a copy; ZeRO-3's is the
               fp32 partition itself)."""
    master = zero_stage in (1, 2)
    if precision == "bf16-pure":
        return 2, 2, 4 + 2 * master
    if precision == "bf16":
        return 2, 4, 12
    return 4, 4, 8 + 4 * master


@dataclass(frozen=True)
class Setup:
    """How the run holds its models: the precision and ZeRO stage it runs with (as resolved by align.engine.build),
    the processes, offloads, gradient checkpointing, the device kind."""

    precision: str = "bf16-pure"
    zero_stage: int = 0
    world: int = 1
    offload_optimizer: bool = False
    offload_frozen: bool = False
    checkpointing: bool = False
    device: str = "cuda"
    fast_decoder: bool = True  # ALIGN_FAST_GENERATION
    gather: bool = True  # RL stages' --gather: ZeRO-3 weights gathered for the rollout (else synced_gpus, sharded)
    compiled: bool = False  # the engines' blocks compiled (align.engine.build.compiles)

    @property
    def sharded_rollout(self) -> bool:
        """ZeRO-3 on several processes decoding with --no-gather: sharded weights, transformers' generate."""
        return self.zero_stage == 3 and self.world > 1 and not self.gather

    @property
    def r(self) -> int:
        """Bytes of a module element (weights, residual stream)."""
        return 2 if self.precision in ("bf16", "bf16-pure") else 4

    @property
    def e(self) -> int:
        """Bytes of a matmul's output (autocast under bf16-mixed)."""
        return 4 if self.precision == "fp32" else 2


@dataclass(frozen=True)
class Model:
    """One model of a stage: its shape, head (lm | score), whether it is trained, LoRA rank and targets."""

    role: str
    arch: Arch
    head: str = "lm"
    trained: bool = False
    lora_r: int = 0
    lora_targets: str = "all-linear"

    @property
    def params(self) -> int:
        return n_params(self.arch, self.head)


def model_state(m: Model, s: Setup) -> dict[str, float]:
    """Bytes on one device: {"weights", "gradients", "optimizer"} (the last two 0 for a frozen model)."""
    shard = lambda n, stage: n / s.world if s.zero_stage >= stage else n  # noqa: E731
    if not m.trained:
        gone = s.offload_frozen and s.zero_stage == 3
        return {"weights": 0.0 if gone else shard(m.params * s.r, 3), "gradients": 0.0, "optimizer": 0.0}
    if m.lora_r:  # a frozen base + fp32 adapters (and a score head) trained in full
        trained = lora_params(m.arch, m.lora_r, m.lora_targets) + (m.arch.hidden if m.head == "score" else 0)
        w, g, o = per_param("fp32", s.zero_stage)
        frozen = (m.params - (m.arch.hidden if m.head == "score" else 0)) * s.r
    else:
        trained, frozen = m.params, 0
        w, g, o = per_param(s.precision, s.zero_stage)
    grads = shard(trained * g, 2)
    if s.offload_optimizer:
        grads = min(grads, BUCKET * g)
    return {"weights": shard(frozen + trained * w, 3), "gradients": grads,
            "optimizer": 0.0 if s.offload_optimizer else shard(trained * o, 1)}


def activation_bytes(a: Arch, rows: int, length: int, s: Setup) -> float:
    """Saved activations of one training forward of `rows` × `length` tokens (see the module docstring)."""
    h, nq, nk = a.hidden, a.heads * a.head_dim, a.kv_heads * a.head_dim
    norm = 4 * h + 2 * s.r * h
    per_layer = 2 * norm + s.e * (3 * nq + 2 * nk + 4 * a.token_intermediate)
    tokens = rows * length
    kept = a.layers * s.r * h + per_layer if s.checkpointing else a.layers * per_layer * (COMPILED_SAVED if s.compiled else 1)
    return tokens * (kept + norm + 2 * s.e * h)  # + the final norm and the hidden states the head reads


def inference_bytes(a: Arch, rows: int, length: int, s: Setup) -> float:
    """The transient of a forward without gradients (log-probs of π_old / π_ref, values, reward scores): the
    widest tensors of one layer at a time, gate, up and their product plus the residual stream."""
    return rows * length * (s.e * 3 * a.token_intermediate + 2 * s.r * a.hidden)


def full_logit_bytes(rows: int, length: int, vocab: int, s: Setup, grad: bool = True) -> float:
    """The B × T × V logits of a plain forward: the logits (e), their shifted copy (e), the fp32 upcast (4) and
    cross-entropy's saved fp32 log-softmax (4); without gradients the logits alone."""
    return rows * length * vocab * ((2 * s.e + 8) if grad else s.e)


def chunked_logit_bytes(tokens: int, vocab: int) -> float:
    """align.logprobs' fused head over `tokens` positions: one chunk of fp32 logits (`rows_per_chunk` rows, or
    fewer positions; the backward slices the vocabulary to the same size), their exp and one more temporary."""
    from align.logprobs import rows_per_chunk

    return 3 * min(tokens, rows_per_chunk(vocab)) * vocab * 4


def decode_rows(rows: int, fast: bool) -> int:
    """The decoder's batch: a power of two, at least 8 (CUDA-graph shapes), or the rows themselves."""
    return max(8, 1 << (rows - 1).bit_length()) if fast else rows


def cache_slots(length: int, fast: bool) -> int:
    """The decoder's cache slots for rollouts of `length` tokens: rounded up to 128, plus one spare slot."""
    return -(-length // 128) * 128 + 1 if fast else length


def kv_cache_bytes(a: Arch, rows: int, length: int, s: Setup, fast: bool) -> float:
    """2 (k, v) · layers · B · kv_heads · slots · head_dim · element bytes (FastDecoder._alloc)."""
    return 2 * a.layers * decode_rows(rows, fast) * a.kv_heads * cache_slots(length, fast) * a.head_dim * s.e


def prefill_bytes(a: Arch, rows: int, prompt: int, s: Setup, fast: bool) -> float:
    """The decoder's prefill of one layer: fp32 scores and softmax, their cast and the fp32 bias [B, P, P]; and
    the sampling buffers (noise and three [B, V] fp32 copies of the logits)."""
    b = decode_rows(rows, fast)
    scores = b * a.heads * prompt * prompt * (8 + s.e) + b * prompt * prompt * 4 if fast else 0
    return scores + 4 * b * a.vocab * 4


# ---------------------------------------------------------------------------------------------- a stage's plan


@dataclass
class Plan:
    """Terms (bytes per device) in each phase of a step; the peak is the largest phase's sum."""

    title: str
    phases: tuple[str, ...]
    rows: list[tuple[str, dict[str, float]]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    free: float = 0.0  # bytes the run may use on each device
    enforced: bool = False  # a peak above `free` stops the run

    def add(self, name: str, nbytes: float, *phases: str) -> None:
        """`nbytes` in each of `phases` (when none is named: every phase of a trainer, not DECODER's); zero terms
        are left out."""
        if nbytes > 0:
            self.rows.append((name, {p: float(nbytes) for p in (phases or [q for q in self.phases if q != DECODER])}))

    def subtract(self, name: str, phase: str, nbytes: float) -> None:
        """Take `nbytes` off term `name` in `phase` (what leaves the device for that phase)."""
        self.rows = [(n, {**by, phase: by[phase] - nbytes} if n == name else by) for n, by in self.rows]

    def add_state(self, m: Model, s: Setup, grads_in: str = "update") -> None:
        """A model's weights (every phase), gradients (`grads_in`) and optimizer state (every phase)."""
        st = model_state(m, s)
        self.add(f"{m.role}: weights", st["weights"])
        self.add(f"{m.role}: gradients", st["gradients"], grads_in)
        self.add(f"{m.role}: optimizer state", st["optimizer"])

    def total(self, phase: str) -> float:
        return sum(by.get(phase, 0.0) for _, by in self.rows)

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.total)

    @property
    def peak(self) -> float:
        return self.total(self.peak_phase)

    @property
    def fits(self) -> bool:
        return self.peak <= self.free


@dataclass(frozen=True)
class Device:
    """The device a run's process computes on: kind, the bytes it may use, processes, whether the check stops."""

    kind: str = "cuda"
    free: float = 0.0
    world: int = 1
    enforced: bool = True
    fast_decoder: bool = True
    source: str = ""  # where `free` came from, for the table


@dataclass(frozen=True)
class Data:
    """What the stage's data says about lengths: its longest prompt (RL stages, online DPO) and its longest
    example (sft, rm, dpo: a batch is padded to its longest row); None where unknown."""

    prompt_tokens: int | None = None
    sequence_tokens: int | None = None

    def prompt(self, unknown: int = 256) -> int:
        """The longest prompt; `unknown` when the data did not say (PPO: its --max-prompt-length)."""
        return self.prompt_tokens if self.prompt_tokens is not None else unknown

    def sequence(self, max_length: int, packing: bool = False) -> int:
        """The longest training row: `max_length`, or the data's longest example below it (not when packing)."""
        if self.sequence_tokens and not packing:
            return min(self.sequence_tokens, max_length)
        return max_length


# ---------------------------------------------------------------------------------------------- what a stage says


Family = list[tuple[dict, Device]]  # one kind of change, from its least drastic value: (flags, device) each


@dataclass(frozen=True)
class StagePlan:
    """A training stage's part of the memory plan and of its run's layout: a subclass next to the stage
    (stages/*.py) says what the engine cannot know from TrainConfig's options — its models, its phases, the terms
    of each, its micro-batch, the changes to suggest — and the stage hands it to `run.open`. Bound to the stage's
    config; `changed(...)` is the same stage with other options (a candidate change)."""

    cfg: TrainConfig
    name: ClassVar[str] = ""  # the stage, as the table's title and the messages name it
    # its switches beyond TrainConfig's options (a stage that has the option reads it, with a property)
    offload_frozen: ClassVar[bool] = False  # frozen models' parameters in CPU memory under ZeRO-3 (--offload-frozen)
    checkpointing: ClassVar[bool] = False  # activations recomputed in the backward (--gradient-checkpointing)
    gather: ClassVar[bool] = True  # ZeRO-3 weights gathered for the rollout (an RL stage's --gather)
    decoders: ClassVar[int] = 0  # processes that only decode (--rollout-gpus), not counted among the trainers
    auto_micro: ClassVar[bool] = True  # --micro-batch-size 0 is the stage's choice, which the plan may lower
    lora_within_rollout: ClassVar[bool] = False  # under LoRA (GPU, micro-batch 0): an update no larger than the rollout

    def changed(self, **change) -> StagePlan:
        """This stage with `change` applied to its options (UserError: not a valid combination)."""
        return replace(self, cfg=replace(self.cfg, **change))

    @property
    def offloaded(self) -> bool:
        """Something lives in CPU memory: ZeRO is kept and `--precision auto` is bf16-mixed (layout.engines)."""
        return self.cfg.offload_optimizer or self.offload_frozen

    def models(self) -> dict[str, str]:
        """The models the stage builds, role -> --model-style spec (the stage has checked every path already)."""
        return {"policy": self.cfg.model}

    def phases(self) -> tuple[str, ...]:
        """The phases of a step, each a column of the table."""
        return ("update",)

    def micro_rows(self, world: int, data: Data) -> tuple[int, int]:
        """(the update's micro-batch per process, the batch per process and step it must divide), as the stage
        computes them: rows, or pairs, or episodes."""
        raise NotImplementedError

    def batch(self, world: int, micro_batch_size: int, data: Data) -> tuple[int, int]:
        """(rows per micro-batch, micro-batches per optimiser step) of a run with `micro_batch_size`; UserError
        when they do not divide the stage's batch (checked before anything is written)."""
        raise NotImplementedError

    def terms(self, plan: Plan, models: dict[str, Model], s: Setup, data: Data) -> None:
        """Add what a step of the stage holds to `plan` (the module docstring's terms)."""
        raise NotImplementedError

    def changes(self, device: Device, data: Data) -> Iterator[Family]:
        """The changes to try when the plan does not fit, in order: a smaller micro-batch, LoRA, optimizer offload,
        more processes. A stage with other levers yields its own list."""
        yield micro_changes(self, device, data)
        yield from memory_changes(self.cfg, device)
        yield nproc_changes(self, device)


@dataclass(frozen=True)
class SupervisedPlan(StagePlan):
    """A stage that trains on a fixed dataset: --batch-size examples (or pairs) per step, split evenly over the
    processes, in micro-batches of --micro-batch-size (0: a process's whole share)."""

    cfg: SupervisedConfig

    def micro_rows(self, world: int, data: Data) -> tuple[int, int]:
        n = self.cfg.batch_size // world
        return self.cfg.micro_batch_size or n, n

    def batch(self, world: int, micro_batch_size: int, data: Data) -> tuple[int, int]:
        return batch_layout(self.cfg.batch_size, micro_batch_size, world)


@dataclass(frozen=True)
class RLPlan(StagePlan):
    """An RL stage: its rollout gathers ZeRO-3 weights unless --no-gather."""

    cfg: RLConfig

    @property
    def gather(self) -> bool:
        return self.cfg.gather


def setup(stage: StagePlan, device: Device) -> Setup:
    """The precision and ZeRO stage the run will use (align.engine.layout, as the run resolves them) and its other
    switches."""
    cfg, layout = stage.cfg, engines(stage.cfg, device.kind, device.world, stage.offloaded)
    return Setup(precision=layout.precision, zero_stage=layout.zero_stage, world=device.world,
                 offload_optimizer=cfg.offload_optimizer, offload_frozen=stage.offload_frozen,
                 checkpointing=stage.checkpointing, device=device.kind,
                 fast_decoder=device.fast_decoder and device.kind == "cuda", gather=stage.gather,
                 compiled=layout.compile)


# ---------------------------------------------------------------------------------------------- terms a stage adds


def trained_model(cfg: TrainConfig, role: str, a: Arch, head: str = "lm") -> Model:
    """The Model `cfg` trains in `role` (its LoRA rank and targets)."""
    return Model(role, a, head, True, cfg.lora_r, cfg.lora_targets)


def reference_model(plan: Plan, models: dict, lora_r: int, ref_model: str = "") -> Model | None:
    """The frozen reference (`ref_model`, else the input model), or None where the LoRA policy with its adapters
    off is the reference."""
    if lora_r and not ref_model:
        plan.notes.append("reference = the LoRA policy with its adapters off (no second copy)")
        return None
    return Model("reference", models.get("reference", models["policy"]).arch)


def decoder_copies(a: Arch, lora_r: int, s: Setup) -> bool:
    """Whether the fast decoder keeps a weight copy of its own (align.rollout.fast.weights.copy_reason): under ZeRO-3
    (gathered weights), LoRA (merged weights), weights in another dtype than it decodes in (bf16-mixed) or a model
    small enough that the fused copy is worth its memory; else it reads the module's own tensors
    (ALIGN_FAST_DECODER_COPY=1: a copy all the same; =0: none where it can do without)."""
    from align.rollout.fast.weights import copies_small, copy_forced

    return copy_forced() or s.zero_stage == 3 or bool(lora_r) or s.r != s.e or copies_small(n_params(a) * s.e)


def rollout_terms(plan: Plan, policy: Model, rows: int, prompt: int, new: int, s: Setup, phase: str = "rollout",
            copies: bool | None = None) -> None:
    """The rollout phase's own terms (the decoder's copy if it keeps one, its KV cache, prefill and sampling
    buffers). `copies`: whether the decoder keeps a copy (default: from the policy's LoRA rank and `s`)."""
    a = policy.arch
    why = ("a CPU" if s.device != "cuda" else "--no-gather" if s.sharded_rollout else
           "ALIGN_FAST_GENERATION=0" if not s.fast_decoder else decoder_reason(a, prompt + new))
    fast = why is None
    if fast and (decoder_copies(a, policy.lora_r, s) if copies is None else copies):
        plan.add("rollout: decoder's bf16 copy", n_params(a) * s.e, phase)
    elif fast:
        plan.notes.append("rollout: the fast decoder reads the policy's own weights (no copy)")
    else:
        plan.notes.append(f"rollout: transformers' generate ({why}): a KV cache, no inference copy")
        if a.moe and s.device == "cuda":
            plan.add("rollout: transformers' MoE decode (batched_mm: each row's top-k experts gathered)",
                     hf_moe_decode_bytes(a, rows, s), phase)
    if fast and policy.lora_r and s.zero_stage != 3:  # the frozen base is parked in host memory while decoding
        plan.subtract(f"{policy.role}: weights", phase, (policy.params - a.hidden * (policy.head == "score")) * s.r)
        plan.notes.append("LoRA: the frozen base waits in host memory during the rollout")
    if s.zero_stage == 3 and s.world > 1 and s.gather:
        plan.add("rollout: policy gathered (ZeRO-3)", n_params(a) * s.r * (1 - 1 / s.world), phase)
    plan.add(f"rollout: KV cache ({decode_rows(rows, fast)} rows x {cache_slots(prompt + new, fast)} slots)",
             kv_cache_bytes(a, rows, prompt + new, s, fast), phase)
    plan.add("rollout: prefill and sampling buffers", prefill_bytes(a, rows, prompt, s, fast), phase)


def hf_moe_decode_bytes(a: Arch, rows: int, s: Setup) -> int:
    """transformers' generate on a GPU decodes a mixture of experts with `batched_mm`: every (row, expert) pair of
    a step gathers that expert's weights, rows · k · 3 · h · i_e · e bytes in one layer at a time (gate, up and down;
    its prefill keeps `grouped_mm`, which gathers nothing)."""
    return rows * a.experts_per_tok * 3 * a.hidden * a.expert_intermediate * s.e


def decoder_terms(plan: Plan, policy: Model, decoders: int, samples: int, prompt: int, new: int, s: Setup) -> None:
    """--rollout-gpus: what one decoder rank holds (the DECODER column): the policy in the module's dtype, not
    sharded (LoRA: its base and fp32 adapters), and its share of the rollout's samples decoded as one process
    would."""
    one = replace(s, world=1, zero_stage=0)
    adapters = lora_params(policy.arch, policy.lora_r, policy.lora_targets) if policy.lora_r else 0
    plan.add("decoder: policy weights", policy.params * s.r + adapters * 4, DECODER)
    rollout_terms(plan, replace(policy, role="decoder", lora_r=0), -(-samples // decoders), prompt, new, one, DECODER,
            copies=decoder_copies(policy.arch, policy.lora_r, one))
    plan.notes.append(f"{DECODER}: each of the {decoders} decoder process(es) (--rollout-gpus); the other "
                      "phases are a trainer's")


def zero3_blocks(plan: Plan, models: list[Model], s: Setup) -> None:
    """ZeRO-3 on several processes gathers a block's weights for its forward / backward: ~2 blocks in flight."""
    if s.zero_stage == 3 and s.world > 1 and models:
        plan.add("ZeRO-3: gathered blocks", 2 * max(layer_params(m.arch) for m in models) * s.r)


def update_terms(plan: Plan, a: Arch, rows: int, length: int, s: Setup, logits: str = "chunked") -> None:
    """The update phase's activations of `rows` x `length` tokens and its logits: "full" (a plain forward's fp32
    loss), "chunked" (align.logprobs' fused head) or "none" (a score head)."""
    plan.add(f"activations ({rows} rows x {length} tokens{', checkpointed' if s.checkpointing else ''})",
             activation_bytes(a, rows, length, s), "update")
    if logits == "full":
        plan.add(f"logits ({rows} x {length} x {a.vocab}, fp32 loss)", full_logit_bytes(rows, length, a.vocab, s),
                 "update")
    elif logits == "chunked":
        plan.add("logits (fused log-probs, chunked)", chunked_logit_bytes(rows * length, a.vocab), "update")


def frozen_weights(plan: Plan, models: dict, roles: tuple[str, ...], s: Setup) -> list[Model]:
    """The weights of each of `roles` the stage builds (every phase); returns their Models."""
    found = [models[r] for r in roles if r in models]
    for m in found:
        plan.add(f"{m.role}: weights", model_state(m, s)["weights"])
    return found


def judge_tokens(rubric: str, prompt: int, answers: int) -> int:
    """The tokens of one text an LLM judge reads: its rubric's characters (a bound: a token holds at least one, and
    they leave room for the chat template's own tokens), the prompt's tokens and the answers' (`answers`: the
    tokens of the one or two answers the judge reads at once)."""
    return len(rubric) + prompt + answers


def judge_terms(plan: Plan, models: dict, texts: int, tokens: int, s: Setup, phase: str) -> None:
    """An LLM judge (align.judge.load; the stage's "judge" model, if any): its whole weights on every process, bf16
    on a GPU and fp32 on a CPU (never partitioned by ZeRO-3 nor offloaded), in every phase of a trainer; and in
    `phase`, its forward of one batch of min(`texts`, align.judge.BATCH) texts of `tokens` tokens without
    gradients: a layer's widest tensors and the last position's logits (its own dtype, then fp32)."""
    from align.judge import BATCH

    judge = models.get("judge")
    if judge is None:
        return
    b, a, rows = 2 if s.device == "cuda" else 4, judge.arch, min(texts, BATCH)
    plan.add("judge: weights (whole on every process)", judge.params * b)
    plan.add(f"judge: forward ({rows} texts x {tokens} tokens)",
             rows * tokens * b * (3 * a.intermediate + 2 * a.hidden) + rows * a.vocab * (b + 4), phase)


def score_terms(plan: Plan, models: list[Model], rows: int, length: int, s: Setup) -> None:
    """The score phase: the largest no-grad pass (log-probs, values, reward scores) over a micro-batch."""
    if not models:
        return
    passes = {m.role: inference_bytes(m.arch, rows, length, s) + (
        chunked_logit_bytes(rows * length, m.arch.vocab) if m.role in ("policy", "reference", "teacher") else
        full_logit_bytes(rows, length, m.arch.vocab, s, grad=False) if m.head == "lm" else 0) for m in models}
    role = max(passes, key=passes.get)
    plan.add(f"score: largest forward ({role}, {rows} rows)", passes[role], "score")


def moe_notes(models: dict[str, Model]) -> list[str]:
    """A line per mixture-of-experts model of the stage: its total parameters (every expert: weights, gradients,
    optimizer state) and active ones (top-k per token: activations)."""
    out = []
    for m in models.values():
        a = m.arch
        if a.moe:
            out.append(f"{m.role}: mixture of experts, {n_params(a, m.head) / 1e9:.3g}B parameters in all "
                       f"({a.experts} experts per sparse layer: weights, gradients, optimizer state), "
                       f"{n_params(a, m.head, active=True) / 1e9:.3g}B active per token (top-{a.experts_per_tok}: "
                       "activations)")
    return out


def estimate(stage: StagePlan, models: dict[str, Model], device: Device, data: Data = Data()) -> Plan:
    """The plan of `stage` (its config and terms) on `device`: `models` maps a role (policy, reference, reward
    model, value, teacher) to its Model (frozen; the stage decides what it trains); `data`, the lengths of the
    data."""
    s = setup(stage, device)
    lora = stage.cfg.lora_r
    plan = Plan(f"memory plan: {stage.name}, {s.precision}, ZeRO-{s.zero_stage}, {device.world} process(es)"
                f"{', LoRA r ' + str(lora) if lora else ''}", stage.phases(), free=device.free,
                enforced=device.enforced)
    stage.terms(plan, models, s, data)
    plan.notes += moe_notes(models)
    if s.precision == "bf16-pure" and s.zero_stage == 0:
        from align.optim import CHUNK

        plan.add("optimizer step scratch (fp32 chunks)", 36 * CHUNK, "update")
    return plan


# ---------------------------------------------------------------------------------------------- what to change


def flags(change: dict) -> str:
    """--flag value for every changed setting ("--nproc 2 --zero-stage 3")."""
    out = []
    for k, v in change.items():
        flag = "--" + k.replace("_", "-")
        out.append(flag if v is True else f"--no-{flag[2:]}" if v is False else f"{flag} {shlex.quote(str(v))}")
    return " ".join(out)


def micro_changes(stage: StagePlan, device: Device, data: Data) -> Family:
    """Each smaller micro-batch that divides the stage's batch, the largest first."""
    micro, n = stage.micro_rows(device.world, data)
    return [({"micro_batch_size": d}, device) for d in range(micro - 1, 0, -1) if n % d == 0]


def memory_changes(cfg: TrainConfig, device: Device) -> Iterator[Family]:
    """LoRA (rank 16), then the optimizer state offloaded to the CPU (with ZeRO and fp32 master weights)."""
    if not cfg.lora_r:
        yield [({"lora_r": 16}, device)]
    if not cfg.offload_optimizer:
        change = {"offload_optimizer": True, **({"zero_stage": 3} if cfg.zero_stage == 0 else {}),
                  **({"precision": "bf16-mixed"} if cfg.precision == "bf16-pure" else {})}
        yield [(change, device)]


def rollout_changes(cfg: RLConfig, device: Device, minibatch: bool = False) -> Iterator[Family]:
    """An RL stage's rollout made smaller: fewer prompts per step (each a multiple of the processes; `minibatch`:
    PPO's --minibatch-size no larger), then fewer new tokens (at least 16)."""
    fewer = [cfg.prompts_per_step >> k for k in range(1, 8) if (cfg.prompts_per_step >> k) >= device.world
             and (cfg.prompts_per_step >> k) % device.world == 0]
    yield [({"prompts_per_step": p, **({"minibatch_size": min(cfg.minibatch_size, p)} if minibatch else {})}, device)
           for p in fewer]
    yield [({"max_new_tokens": t}, device) for t in (cfg.max_new_tokens >> k for k in range(1, 6)) if t >= 16]


def nproc_changes(stage: StagePlan, device: Device) -> Family:
    """2, 4 or 8 times the training processes (ZeRO-3 where the run has no ZeRO); decoders are counted in
    --nproc too."""
    more = {"zero_stage": 3} if stage.cfg.zero_stage == 0 else {}
    return [({"nproc": device.world * k + stage.decoders, **more}, replace(device, world=device.world * k))
            for k in (2, 4, 8)]


def _try(stage: StagePlan, models: dict, change: dict, device: Device, data: Data) -> Plan | None:
    """The plan with `change` applied to the stage's options (None: not a valid combination of flags)."""
    try:
        return estimate(stage.changed(**{k: v for k, v in change.items() if k != "nproc"}), models, device, data)
    except UserError:
        return None


def smallest_change(stage: StagePlan, models: dict, device: Device, data: Data = Data()) -> tuple[str, Plan] | None:
    """(flags, plan) of the first candidate change (in the stage's `changes` order, each family from its least
    drastic value) whose plan fits; failing every single change, the families' most drastic values added up in
    the same order, each kept only if it lowers the peak, until the plan fits; None when nothing tried fits."""
    families = [f for f in stage.changes(device, data) if f]
    for family in families:
        for change, d in family:
            p = _try(stage, models, change, d, data)
            if p is not None and p.fits:
                return flags(change), p
    together, dev, best = {}, device, estimate(stage, models, device, data)
    for family in families:
        change, d = family[-1]
        d = d if d is not device else dev
        p = _try(stage, models, {**together, **change}, d, data)
        if p is not None and p.peak < best.peak:
            together, dev, best = {**together, **change}, d, p
            if p.fits:
                return flags(together), p
    return None


# ---------------------------------------------------------------------------------------------- the run's inputs


def read_config(spec: str) -> dict:
    """A --model value's config.json (nothing else is read): a preset's fields, an artifact's model/, a directory,
    or a hub id's cached snapshot."""
    from align.models import HUB_ID, PRESETS, hub_snapshot

    if spec in PRESETS and not Path(spec).exists():
        from align.models import load_tokenizer, resolve

        return {**PRESETS[spec], "vocab_size": len(load_tokenizer(resolve(spec))), "tie_word_embeddings": True,
                "model_type": "llama"}
    path = Path(spec)
    if not path.exists() and HUB_ID.fullmatch(spec):
        path = hub_snapshot(spec)
    if (path / "artifact.json").is_file():
        path = path / "model"
    try:
        return json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"{path / 'config.json'}: cannot read it for the memory plan ({e}).") from None


def model_of(role: str, spec: str) -> Model:
    """The frozen Model of `spec` in `role`: a reward model has the head its config names (scalar: a score head,
    as align.reward_model loads it), the value network a score head, the others their LM head."""
    from align.reward_model import head_of

    config = read_config(spec)
    score = role == "value" or (role == "reward model" and head_of(config)[0] == "scalar")
    return Model(role, arch(config), "score" if score else "lm")


def device_for(cfg: TrainConfig, decoders: int = 0) -> Device:
    """This process's device: ALIGN_DEVICE_MEMORY_BYTES when set (a budget the check enforces, on any device),
    else the free memory of its GPU (torch.cuda.mem_get_info), else total RAM (informational). `decoders`: the
    run's processes that only decode (a trainer's WORLD_SIZE counts the trainers, align.disagg)."""
    import torch

    from align.rollout.fast.support import enabled_by_env

    world = int(os.environ.get("WORLD_SIZE") or cfg.nproc * cfg.nnodes - decoders)
    kind = "cuda" if torch.cuda.is_available() else "cpu"
    fake = os.environ.get(ENV_BUDGET)
    if fake:
        try:
            free = int(float(fake))
        except ValueError:
            raise UserError(f"{ENV_BUDGET}={fake!r}: give the device's memory in bytes (e.g. 80e9).") from None
        return Device(kind, free, world, True, enabled_by_env(), ENV_BUDGET)
    if kind == "cuda":
        index = int(os.environ.get("LOCAL_RANK", 0))
        free, total = torch.cuda.mem_get_info(index)
        return Device(kind, free, world, True, enabled_by_env(),
                      f"free on {torch.cuda.get_device_name(index)}, {total / GiB:.0f} GiB")
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return Device(kind, ram, world, False, enabled_by_env(), "RAM, informational on a CPU")


# ---------------------------------------------------------------------------------------------- the check


def gib(nbytes: float) -> str:
    return f"{nbytes / GiB:.2f} GiB"


def show(plan: Plan, source: str = "") -> None:
    """The plan as one table: a row per term, a column per phase (GiB per device, MiB for a small model), the
    totals, the verdict."""
    from align.console import table

    unit, scale = ("GiB", GiB) if plan.peak >= GiB else ("MiB", 1 << 20)
    cell = lambda by, p: f"{by[p] / scale:.2f}" if p in by else "-"  # noqa: E731
    rows = [[name, *(cell(by, p) for p in plan.phases)] for name, by in plan.rows]
    rows.append(["total", *(f"{plan.total(p) / scale:.2f}" for p in plan.phases)])
    verdict = "fits" if plan.fits else "does NOT fit" if plan.enforced else "above it (informational)"
    footer = [f"peak {gib(plan.peak)} ({plan.peak_phase} phase) of {gib(plan.free)}{f' ({source})' if source else ''}"
              f": {verdict}", *(f"  note: {n}" for n in plan.notes)]
    table(f"{plan.title} ({unit} per device)", ["term", *plan.phases], rows, footer)


def preflight(stage: StagePlan, data: Data = Data()) -> int | None:
    """The memory plan of a training stage, before it builds a model or writes --out: printed on a GPU (and with
    --plan, which then exits 0); when the peak does not fit, a micro-batch left to the stage
    (--micro-batch-size 0) is made smaller to fit, else the run stops with exit 2 naming the smallest change that
    would fit (--no-plan-check / ALIGN_PLAN_CHECK=0 runs anyway). Returns the micro-batch size the plan chose for
    the run's layout (None: the one asked for)."""
    cfg = stage.cfg
    try:
        models = {role: model_of(role, spec) for role, spec in stage.models().items()}
        device = device_for(cfg, stage.decoders)
        plan = estimate(stage, models, device, data)
    except UserError as e:
        if cfg.plan:
            raise
        from align.console import warn

        warn(f"memory plan skipped: {e}")
        return None
    plan, planned = _lora_within_rollout(stage, models, device, data, plan)
    if planned is not None:  # what follows judges the run with the micro-batch chosen
        stage = stage.changed(micro_batch_size=planned)
    if plan.fits or not device.enforced:
        if cfg.plan or device.kind == "cuda":
            show(plan, device.source)
            hint = replicas_hint(stage, models, device, data)
            if hint:
                from align.console import info

                info(hint)
        if cfg.plan:
            raise SystemExit(0)
        return planned
    smaller = _does_not_fit(stage, models, device, plan, data)
    return planned if smaller is None else smaller


REPLICA_MARGIN = 0.8  # replicas are suggested when their plan's peak is at most this share of the free memory


def replicas_hint(stage: StagePlan, models: dict, device: Device, data: Data = Data()) -> str | None:
    """Several GPU processes under ZeRO-3 whose whole training state would fit on each GPU: a line suggesting
    --zero-stage 0 (replicas: blocks compiled, no gather hooks; DeepSpeed all-reduces the gradients), else None.
    ZeRO-3's per-block gathers cost more than they save for such a model (GRPO at 0.5B on two H200s: 1.32× one
    GPU's throughput under ZeRO-3, 1.92× as replicas)."""
    s = setup(stage, device)
    if device.kind != "cuda" or device.world < 2 or s.zero_stage != 3 or stage.cfg.deepspeed \
            or s.offload_optimizer or s.offload_frozen:
        return None
    replicas = estimate(stage.changed(zero_stage=0), models, device, data)
    if replicas.peak > REPLICA_MARGIN * device.free:
        return None
    return (f"memory plan: as replicas (--zero-stage 0) each of the {device.world} processes would hold the whole "
            f"training state, {gib(replicas.peak)} at its peak, within this GPU's {gib(device.free)}: faster than "
            "ZeRO-3 for a model that fits (blocks compiled, no per-block gathers; docs/gpu.md)")


def _lora_within_rollout(stage: StagePlan, models: dict, device: Device, data: Data,
                         plan: Plan) -> tuple[Plan, int | None]:
    """A stage whose update can be kept within its rollout (`lora_within_rollout`: GRPO) under LoRA on a GPU with
    the micro-batch left to the stage (0): the largest micro-batch whose update needs no more memory than the
    rollout already takes, so the run peaks at its rollout (LoRA is chosen for memory: its update's activations
    would otherwise be the peak). Returns the plan and the micro-batch size chosen (None: none)."""
    cfg = stage.cfg
    if (not stage.lora_within_rollout or device.kind != "cuda" or not cfg.lora_r or cfg.micro_batch_size
            or "rollout" not in plan.phases):
        return plan, None
    auto, n = stage.micro_rows(device.world, data)
    ceiling = plan.total("rollout")
    for rows in sorted((d for d in range(1, auto + 1) if n % d == 0), reverse=True):
        trial = estimate(stage.changed(micro_batch_size=rows), models, device, data)
        if trial.total("update") <= ceiling or rows == 1:
            if rows < auto:
                from align.console import info

                info(f"memory plan: LoRA: micro-batches of {rows} rows (not {auto}), so the update needs no more "
                     f"memory than the rollout ({gib(ceiling)}); --micro-batch-size N sets it")
            return trial, rows
    return plan, None


def _does_not_fit(stage: StagePlan, models: dict, device: Device, plan: Plan, data: Data) -> int | None:
    """The plan does not fit: a micro-batch left to the stage is made smaller (returned), else exit 2 naming the
    smallest change that fits (a warning only with the check off)."""
    from align.console import info, warn

    cfg = stage.cfg
    found = smallest_change(stage, models, device, data)
    # one process only: ranks see different free memory, and their micro-batches must agree; the micro-batch alone
    # (a change that adds checkpointing or LoRA to it is the user's to make, not a micro-batch to shrink)
    auto = (found is not None and found[0].split()[0] == "--micro-batch-size" and len(found[0].split()) == 2
            and cfg.micro_batch_size == 0 and stage.auto_micro and device.world == 1)
    if auto:  # the stage's own choice of micro-batch, made smaller: the same update, in more passes
        was, rows = stage.micro_rows(device.world, data)[0], int(found[0].split()[-1])
        show(found[1], device.source)
        info(f"memory plan: micro-batches of {rows} rows (--micro-batch-size 0 chose {was}, which does not fit)")
        if cfg.plan:
            raise SystemExit(0)
        return rows
    show(plan, device.source)
    if cfg.plan:
        raise SystemExit(0)
    need = f"needs ~{gib(plan.peak)} per device ({plan.peak_phase} phase), {gib(plan.free)} available"
    fix = (f"the smallest change that fits: {found[0]} (peak ~{gib(found[1].peak)})" if found else
           "no change tried fits (micro-batch, checkpointing, LoRA, offload, rollout size, up to 8x the processes)")
    skip = "--no-plan-check (or ALIGN_PLAN_CHECK=0) runs it anyway, if the estimate is wrong"
    if not cfg.plan_check or os.environ.get(ENV_CHECK, "1").lower() in ("0", "false", "no", "off"):
        warn(f"memory plan: {stage.name} {need}; {fix}. Running anyway (plan check off).")
        return None
    message = f"memory plan: {stage.name} {need} ({device.source}); {fix}. {skip}."
    if os.environ.get("RANK", "0") != "0":  # the CLI prints rank 0's errors; this rank's plan may differ
        from align.console import console

        console.print(f"error (rank {os.environ['RANK']}): {message}", markup=False, soft_wrap=True)
    raise UserError(message)
