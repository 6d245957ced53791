"""Fast rollouts for Llama / Qwen2-architecture policies (dense, and their mixture-of-experts kin): a persistent inference copy, a static KV cache and a
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
and, for `dynamic` RoPE, the model's original context; and the mixture-of-experts models of that layout,
`qwen3_moe`, `qwen2_moe` (Qwen1.5/2-MoE: a gated shared expert beside the routed ones), `olmoe` (q/k RMSNorm over
the whole projection, `clip_qkv`) and `mixtral`, whose experts run grouped (`moe`) and whose chosen experts a rollout
can record for routing replay (align.routing_replay). Anything else decodes through HF `generate`; the log names the
reason once per process. FP8 rollouts keep the experts (Qwen2-MoE's shared one too) in the compute dtype (only the
attention and dense MLP matrices go to E4M3).

The parts (one `FastDecoder` object; each part a class of its own module, its methods reading the others' state):

    support            which models it decodes (family, RoPE, activation, window), ALIGN_FAST_GENERATION
    weights            the inference weights: the module's own tensors or one fused copy (and when to copy)
    layers             the layer math: RMSNorm, RoPE, q/k/v, MLP, attention; the prefill, one layer's decode step
    moe                the mixture-of-experts MLP: the router's top-k, the experts grouped (torch._grouped_mm or gathered)
    cache              the static KV cache and decode state of one (batch, capacity) shape, freed between rollouts
    graphs             the decode step's three compiled pieces and its CUDA graphs, re-captured when an address moved
    decoder            FastDecoder: the parts together, the sampled token, `generate`; `decoder_for`
    decode_attention   the split-KV Triton kernel of the decode step's attention
"""
