"""align.rollout.fast on CPU (eager: no compile, no CUDA graphs): the fast decoder must reproduce HF
`generate` token for token under greedy decoding, for every family it takes (Llama with default, linear, yarn and
Llama-3 RoPE; Qwen2's q/k/v biases; Qwen3's per-head q/k norms; Mistral), grouped KV heads, tied and untied heads,
with left-padded prompts of different lengths; its logits must equal the HF forward's; and its sampling rules must
behave."""

import pytest
import torch

from align.rollout.fast.decoder import FastDecoder
from align.rollout.fast.support import unsupported_reason
from align.rollout.generation import Sampling, generate_local, use_fast_path
from align.rollout.sampling import filter_logits, prompt_keys

EOS, PAD = 2, 0


class Tok:
    eos_token_id, pad_token_id, bos_token_id = EOS, PAD, 1

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


# RoPE variants whose scaling changes the frequencies at this test's positions (original context 16 tokens)
LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16}
LINEAR = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}
FAMILIES = {  # name: (model_type, extra config)
    "llama": ("llama", {}),
    "llama3": ("llama", {"rope_parameters": LLAMA3}),
    "llama-yarn": ("llama", {"rope_parameters": YARN}),
    "llama-linear": ("llama", {"rope_parameters": LINEAR}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {"head_dim": 24}),  # Qwen3's head_dim is its own (not hidden / heads)
    "mistral": ("mistral", {"sliding_window": None}),
    "mistral-window": ("mistral", {"sliding_window": 64}),
}


def make(kind: str, tied: bool):
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, extra = FAMILIES[kind]
    kw = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=96, vocab_size=97, tie_word_embeddings=tied, max_position_embeddings=256,
              eos_token_id=EOS, pad_token_id=PAD, bos_token_id=1, **extra)
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **kw)).eval()
    with torch.no_grad():  # bigger weights: sharper, more varied greedy continuations
        for name, p in m.named_parameters():
            if p.dim() == 2:
                p.mul_(3.0)
            elif kind in ("qwen2", "qwen3"):  # biases and norm weights away from their init (0, 1)
                p.add_(0.1 * torch.randn_like(p))
    return m


PROMPTS = [[1, 5, 9, 11], [1, 7], [1, 30, 31, 32, 33, 34, 35], [1, 40, 41]]


@pytest.fixture(params=["shared", "copy"])
def weights(request, monkeypatch):
    """The decoder reading the module's own tensors (the default where it can), or keeping its fused copy (as
    under ZeRO-3, LoRA, bf16-mixed)."""
    if request.param == "copy":
        monkeypatch.setenv("ALIGN_FAST_DECODER_COPY", "1")
    return request.param


@pytest.mark.parametrize("kind,tied", [("llama", True), ("llama", False), ("qwen2", True), ("qwen3", True),
                                       ("qwen3", False), ("llama3", False), ("llama-yarn", True),
                                       ("llama-linear", True), ("mistral", False), ("mistral-window", False)])
def test_greedy_matches_hf_generate(kind, tied, weights):
    m = make(kind, tied)
    assert unsupported_reason(m, length=7 + 12) is None
    s = Sampling(max_new_tokens=12, temperature=0.0)
    plain = generate_local(m, Tok(), PROMPTS, s, batch_size=4, device="cpu", fast=False)
    fast = generate_local(m, Tok(), PROMPTS, s, batch_size=4, device="cpu", fast=True)
    assert [c.ids for c in fast] == [c.ids for c in plain]
    assert [c.finished for c in fast] == [c.finished for c in plain]
    assert len({tuple(c.ids) for c in plain}) > 1  # the rows differ: a test that can tell prompts apart
    assert m._align_fast_decoder.shares_weights == (weights == "shared")


@pytest.mark.parametrize("kind", ["llama", "llama3", "llama-yarn", "llama-linear", "qwen2", "qwen3", "mistral"])
def test_prefill_logits_equal_the_hf_forward(kind, weights):
    """The decoder's own forward (fused q/k/v, its RoPE, q/k norms, grouped attention) against the HF forward on
    left-padded prompts, logit for logit at each row's last position (fp32)."""
    m = make(kind, tied=False)
    ids = torch.tensor([[PAD] * 3 + p if len(p) == 4 else [PAD] * (7 - len(p)) + p for p in PROMPTS])
    mask = (torch.arange(7)[None] >= (7 - torch.tensor([len(p) for p in PROMPTS]))[:, None]).long()
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        ref = m(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -1].float()
        dec = FastDecoder(m, "cpu")
        dec.load_weights(m)
        dec._alloc(len(PROMPTS), 32)
        got = dec._prefill(ids, mask)
    assert (got - ref).abs().max() < 1e-4 * ref.abs().max()


def test_rope_scaling_changes_the_logits_here():
    """The RoPE variants above change this test's logits (else the equality tests could not tell a decoder
    that ignores the scaling from one that applies it)."""
    base, scaled = make("llama", False), make("llama3", False)
    scaled.load_state_dict(base.state_dict())
    ids = torch.tensor([list(range(1, 30))])
    with torch.no_grad():
        assert (base(ids).logits - scaled(ids).logits).abs().max() > 1e-2


def test_fallbacks_name_their_reason():
    m = make("mistral-window", False)  # a 64-token window
    assert unsupported_reason(m, length=64) is None
    assert "sliding-window" in unsupported_reason(m, length=65)
    assert not use_fast_path(m, "cpu", fast=True, length=65)
    m = make("llama", False)
    m.config.rope_parameters = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    assert unsupported_reason(m, length=256) is None and "dynamic RoPE" in unsupported_reason(m, length=257)
    m.config.rope_parameters = {"rope_type": "longrope", "rope_theta": 10000.0}
    assert "RoPE type 'longrope'" in unsupported_reason(m)


def test_attention_over_the_written_part_of_the_cache():
    """Decode steps attend to the first attn_len(w) cache slots only: exactly w + 1 eagerly, w + 1 rounded up to
    a bucket on CUDA graphs (the slots past w masked). Both give HF's tokens."""
    m = make("qwen3", False)
    s = Sampling(max_new_tokens=20, temperature=0.0)
    plain = generate_local(m, Tok(), PROMPTS, s, 4, "cpu", fast=False)
    for bucket in (1, 8):
        dec = FastDecoder(m, "cpu")
        dec.bucket = bucket
        dec.load_weights(m)
        rows = dec.generate(PROMPTS, s, EOS, PAD)
        assert [r[: len(c.ids)] for r, c in zip(rows, plain)] == [c.ids for c in plain]
        assert dec.attn_len(7) == 8 and dec.attn_len(8) == (16 if bucket == 8 else 9)
        assert dec.attn_len(10_000) == dec._shape_key[1]  # never past the cache


def test_weights_follow_the_module_and_eos_stops():
    m = make("llama", True)
    s = Sampling(max_new_tokens=10, temperature=0.0)
    first = generate_local(m, Tok(), PROMPTS, s, 4, "cpu", fast=True)
    dec = m._align_fast_decoder
    with torch.no_grad():
        m.model.layers[0].mlp.down_proj.weight.mul_(-1.0)
    again = generate_local(m, Tok(), PROMPTS, s, 4, "cpu", fast=True)
    plain = generate_local(m, Tok(), PROMPTS, s, 4, "cpu", fast=False)
    assert m._align_fast_decoder is dec  # one decoder per module: compiled and captured once
    assert [c.ids for c in again] == [c.ids for c in plain]
    assert [c.ids for c in again] != [c.ids for c in first]
    # a row that emits EOS stops there (trimmed, finished), the rest go on
    eos_tok = plain[0].ids[2]
    tok = Tok()
    tok.eos_token_id = eos_tok
    out = generate_local(m, tok, PROMPTS[:1], s, 4, "cpu", fast=True)
    assert out[0].finished and out[0].ids == plain[0].ids[:3]


def test_sampling_rules():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]])
    k2 = filter_logits(logits.clone(), top_k=2, top_p=1.0)
    assert torch.isfinite(k2).tolist() == [[True, True, False, False, False]] or (k2[0, 2:] < -1e30).all()
    p = logits.softmax(-1)[0]
    # top_p just above p0: keeps the first two tokens
    kp = filter_logits(logits.clone(), top_k=0, top_p=float(p[0]) + 1e-3)
    assert (kp[0, :2] == logits[0, :2]).all() and (kp[0, 2:] < -1e30).all()
    # sampling from the fast path follows the distribution (temperature 1, no filters)
    m = make("llama", True)
    dec = FastDecoder(m, "cpu")
    dec.load_weights(m)
    dec._alloc(20000, 8)
    dec.keys.copy_(torch.tensor(prompt_keys(0, range(20000))))
    draws = dec._choose(logits.expand(20000, 5), 0, Sampling(temperature=1.0))
    freq = torch.bincount(draws, minlength=5).float() / 20000
    assert (freq - p).abs().max() < 0.02
    # top_k=1 sampling is greedy
    s = Sampling(max_new_tokens=6, temperature=0.7, top_k=1)
    a = generate_local(m, Tok(), PROMPTS, s, 4, "cpu", fast=True)
    b = generate_local(m, Tok(), PROMPTS, Sampling(max_new_tokens=6, temperature=0.0), 4, "cpu", fast=False)
    assert [c.ids for c in a] == [c.ids for c in b]


def test_selection(monkeypatch):
    m = make("llama", True)
    assert not use_fast_path(m, "cpu")  # CPU: HF generate unless asked
    assert use_fast_path(m, "cpu", fast=True)
    assert not use_fast_path(m, "cpu", synced_gpus=True, fast=True)
    monkeypatch.setenv("ALIGN_FAST_GENERATION", "0")
    assert not use_fast_path(m, "cpu", fast=True)
    m.config.model_type = "gpt2"
    assert unsupported_reason(m) is not None


def test_engine_wrapper_is_unwrapped():
    """DeepSpeed's unwrap_model_for_generation yields the engine (whose .config is DeepSpeed's, not the model's):
    the fast path must look through it, and keep its decoder on the inner model."""
    m = make("llama", True)

    class Engine(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.module = inner
            self.config = {"zero_optimization": {"stage": 3}}

    eng = Engine(m)
    assert use_fast_path(eng, "cuda")
    s = Sampling(max_new_tokens=6, temperature=0.0)
    a = generate_local(eng, Tok(), PROMPTS, s, 4, "cpu", fast=True)
    b = generate_local(m, Tok(), PROMPTS, s, 4, "cpu", fast=False)
    assert [c.ids for c in a] == [c.ids for c in b] and hasattr(m, "_align_fast_decoder")


def test_kv_cache_is_freed_between_rollouts_and_comes_back_zeroed(monkeypatch):
    monkeypatch.setenv("ALIGN_FAST_DECODER_COPY", "1")
    m = make("qwen2", True)
    s = Sampling(max_new_tokens=10, temperature=0.0)
    plain = generate_local(m, Tok(), PROMPTS, s, 4, "cpu", fast=False)
    first = generate_local(m, Tok(), PROMPTS, s, 4, "cpu", fast=True)
    dec = m._align_fast_decoder
    # freed after the rollout: the cache, and the inference copy of the weights (one buffer, every weight a view)
    assert all(t.untyped_storage().nbytes() == 0 for t in dec.k_cache + dec.v_cache)
    assert all(t.untyped_storage().nbytes() == 0 for L in dec.layers for t in L.values())
    assert dec.embed.untyped_storage().nbytes() == dec.norm.untyped_storage().nbytes() == 0
    dec._restore()
    whole = dec.n_layers * dec.k_cache[0].numel() * dec.k_cache[0].element_size()  # every layer's K: one buffer
    assert all(t.untyped_storage().nbytes() == whole and not t.any() for t in dec.k_cache + dec.v_cache)
    assert len({t.untyped_storage().data_ptr() for t in dec.k_cache + dec.v_cache}) == 2  # K apart from V
    dec.release()
    again = generate_local(m, Tok(), PROMPTS, s, 4, "cpu", fast=True)
    assert [c.ids for c in first] == [c.ids for c in again] == [c.ids for c in plain]


def test_one_compile_serves_every_layer_and_attention_length():
    """The decode step compiles as three pieces (inputs, ONE layer reused by every layer, output) with the
    attention length dynamic: a rollout over several buckets compiles each piece once (counted with a
    counting backend: dynamo's guards are the same on any device), and its tokens are the eager ones."""
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    m = make("qwen3", False)
    s = Sampling(max_new_tokens=20, temperature=0.0)
    eager = FastDecoder(m, "cpu")
    eager.load_weights(m)
    want = eager.generate(PROMPTS, s, EOS, PAD)
    dec = FastDecoder(m, "cpu")
    dec.bucket = 4  # several attention lengths within the rollout
    dec.load_weights(m)
    counter = CompileCounter()
    dec.compile_step(backend=counter)
    assert dec.generate(PROMPTS, s, EOS, PAD) == want
    # its decode steps write slots 7..25 of a 27-slot cache: six attention lengths, the last capped at the cache
    assert dec._shape_key[1] == 27 and sorted({dec.attn_len(w) for w in range(7, 26)}) == [8, 12, 16, 20, 24, 27]
    assert counter.frame_count == 3  # each of the three pieces runs, so each compiled exactly once


@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("temperature,top_k", [(0.7, 0), (1.3, 5)])
def test_sampling_logprobs_are_the_trainers(fast, temperature, top_k):
    """Both decoders return the log-prob of each sampled token under log_softmax(logits / T) of the logits they
    sampled from (before top-k): what align.logprobs scores at T, to fp32 rounding."""
    from align.logprobs import logprobs
    from align.rollout.batch import rollout_batch

    m = make("llama", False)
    s = Sampling(max_new_tokens=8, temperature=temperature, top_k=top_k, seed=3)
    out = generate_local(m, Tok(), PROMPTS, s, 4, "cpu", fast=fast)
    assert all(c.logps is not None and len(c.logps) == len(c.ids) for c in out)
    batch = rollout_batch(out, PAD, "cpu")
    with torch.no_grad():
        trainer, _ = logprobs(m, batch, temperature=temperature)
    sampler = batch["sampler_logp"]
    mask = batch["response_mask"].bool()
    assert (sampler - trainer)[mask].abs().max() < 1e-4
    assert trainer[mask].abs().min() > 1e-3  # real log-probs, not zeros compared with zeros
    greedy = generate_local(m, Tok(), PROMPTS, Sampling(max_new_tokens=4, temperature=0.0), 4, "cpu", fast=fast)
    assert all(c.logps is None for c in greedy)


def test_the_decoder_reads_the_modules_own_weights_in_place():
    """Where the module's tensors are what decoding needs (unsharded, on the device, the compute dtype, no LoRA),
    the decoder holds no copy: its matrices ARE the module's (same storage), an in-place update (an optimizer
    step) is decoded at once, and a tensor that moved is re-read (the captured graphs dropped: they hold addresses).
    Releasing the cache between rollouts leaves the module's weights alone."""
    m = make("qwen2", False)  # q/k/v biases, untied head
    s = Sampling(max_new_tokens=10, temperature=0.0)
    generate_local(m, Tok(), PROMPTS, s, 4, "cpu", fast=True)
    dec = m._align_fast_decoder
    assert dec.copy_reason is None and dec.shares_weights and dec.weight_bytes() == 0
    a = m.model.layers[1].self_attn
    L = dec.layers[1]
    assert L["k"].data_ptr() == a.k_proj.weight.data_ptr() and L["k_b"].data_ptr() == a.k_proj.bias.data_ptr()
    assert dec.head.data_ptr() == m.lm_head.weight.data_ptr() and "qkv" not in L
    assert m.model.layers[0].mlp.up_proj.weight.untyped_storage().nbytes() > 0  # release() freed only the cache
    with torch.no_grad():
        a.v_proj.weight.mul_(-2.0)  # in place, as AdamW steps
    plain = generate_local(m, Tok(), PROMPTS, s, 4, "cpu", fast=False)
    assert [c.ids for c in dec_rows(dec, s)] == [c.ids for c in plain]
    dec._graphs = {"captured": object()}  # as on CUDA: graphs that hold the old addresses
    with torch.no_grad():
        m.model.layers[0].mlp.gate_proj.weight.data = -m.model.layers[0].mlp.gate_proj.weight.data.clone()
    plain = generate_local(m, Tok(), PROMPTS, s, 4, "cpu", fast=False)
    dec.load_weights(m)
    assert dec._graphs == {} and dec.recaptures == 1
    assert [c.ids for c in dec_rows(dec, s)] == [c.ids for c in plain]
    dec.load_weights(m)  # nothing moved: the graphs stay
    assert dec.recaptures == 1


def dec_rows(dec, s):
    from align.rollout.generation import _decode_chunks

    return _decode_chunks(dec, Tok(), PROMPTS, s, 4)


def test_the_decoder_keeps_a_copy_where_it_must(monkeypatch):
    """A copy under ZeRO-3, LoRA, another dtype or device, ALIGN_FAST_DECODER_COPY=1, and on a GPU for a model of
    at most SMALL_COPY_BYTES (=0: none there); none otherwise (a CPU decoder of the module's own tensors)."""
    from align.rollout.fast.weights import SMALL_COPY_BYTES, copies_small, copy_reason

    m = make("llama", True)
    assert copy_reason(m, "cpu", torch.float32) is None
    assert "cuda" in copy_reason(m, "cuda", torch.float32)  # weights on the CPU, decoding on a GPU
    assert copies_small(SMALL_COPY_BYTES) and not copies_small(SMALL_COPY_BYTES + 1)
    monkeypatch.setenv("ALIGN_FAST_DECODER_COPY", "0")
    assert not copies_small(1) and copy_reason(m, "cpu", torch.float32) is None
    assert "bfloat16" in copy_reason(m, "cpu", torch.bfloat16)  # =0 cannot do without a copy here
    assert "bfloat16" in copy_reason(m, "cpu", torch.bfloat16)  # bf16-mixed: fp32 weights, bf16 decoding
    p = next(m.parameters())
    p.ds_id = 0  # a ZeRO-3 parameter: gathered only for the copy
    assert "ZeRO-3" in copy_reason(m, "cpu", torch.float32)
    del p.ds_id
    monkeypatch.setenv("ALIGN_FAST_DECODER_COPY", "1")
    assert copy_reason(m, "cpu", torch.float32) == "ALIGN_FAST_DECODER_COPY"
    monkeypatch.delenv("ALIGN_FAST_DECODER_COPY")
    from peft import LoraConfig, get_peft_model

    lora = get_peft_model(make("llama", True), LoraConfig(r=4, target_modules=["q_proj"]))
    assert "LoRA" in copy_reason(lora.base_model.model, "cpu", torch.float32)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_next_turn_prefills_only_what_the_episode_added(temperature):
    """An episode's next turn (`reuse`): each row keeps what its cache holds up to where the new context parts
    from it (the turn cut at a stop, the tokens decoded past it closed), and only the rest (the turn's last token,
    the environment's answer) is prefilled, after the slots written so far, at its positions in the context. Its
    tokens and log-probs are those of prefilling the whole contexts afresh; an ended episode's row (None) decodes
    padding; without room in the cache, everything is prefilled again (same tokens)."""
    m = make("qwen3", False)
    s = Sampling(max_new_tokens=6, temperature=temperature)
    keys = [3, 4, 5, 6] if temperature else None

    def turn(dec, contexts, reuse, offsets=None, rows=(0, 1, 2, 3)):
        k = keys and [keys[i] for i in rows]
        rows = dec.generate(contexts, s, EOS, PAD, k, offsets=offsets, capacity=64, reuse=reuse)
        return rows, dec.last_logps

    dec = FastDecoder(m, "cpu")
    dec.load_weights(m)
    first, _ = turn(dec, PROMPTS, False)
    cut = [2, 6, 1, 4]  # each row's turn cut at another length (a stop text), an answer of 1-3 tokens after it
    answers = [[50], [51, 52, 53], [54, 55], [56]]
    nxt = [p + r[:c] + a for p, r, c, a in zip(PROMPTS, first, cut, answers)]
    nxt[2] = None  # that episode ended
    offsets = [len(c) - len(p) if c else 0 for c, p in zip(nxt, PROMPTS)]
    before = dict(dec.prefilled)
    got, got_lp = turn(dec, nxt, True, offsets)
    assert dec.prefilled["full"] == before["full"]  # nothing prefilled whole ...
    assert dec.prefilled["appended"] - before["appended"] == 4 * 4  # ... a block of 4 (the last token + 3) per row
    assert got[2] == [PAD] * len(got[2])  # the ended episode's row
    fresh = FastDecoder(m, "cpu")
    fresh.load_weights(m)
    live = [0, 1, 3]
    want, want_lp = turn(fresh, [nxt[i] for i in live], False, [offsets[i] for i in live], live)
    assert [got[i] for i in live] == want
    if temperature:
        for i, w in zip(live, want_lp):
            assert got_lp[i] == pytest.approx(w, abs=1e-4)
    # a cache with no room left for the block and its tokens: the contexts are prefilled whole, the same tokens
    small = FastDecoder(m, "cpu")
    small.load_weights(m)
    small.generate(PROMPTS, s, EOS, PAD, keys, capacity=7 + 6)
    full = small.prefilled["full"]
    again = small.generate(nxt, s, EOS, PAD, keys, offsets=offsets, capacity=7 + 6, reuse=True)
    assert small.prefilled["full"] > full and [again[i] for i in live] == want
