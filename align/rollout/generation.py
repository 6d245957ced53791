"""The one generation path: eval now, every RL stage's rollouts later.

Batched sampling with a KV cache, left padding, stop at EOS, temperature / top-k / top-p. Under ZeRO-3
the weights are gathered once per generation phase (see runtime.gathered_for_generation); with
`gather=False` they stay sharded and every rank joins every forward (`synced_gpus`).

Sampling draws each prompt's random numbers from a key of its own (align.rollout.sampling): with `Sampling.seed` set,
prompt i's samples depend on (seed, i) alone — i its index in the list given to `generate` (over every rank) —
not on the batch size, the number of processes or the other prompts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from align import runtime
from align.data import pad
from align.rollout.sampling import sampled_logprobs


@dataclass
class Sampling:
    max_new_tokens: int = 64
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    seed: int | None = None  # prompt i's samples depend on (seed, i) alone; None: a seed drawn from torch's RNG

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0


@dataclass
class Completion:
    prompt_ids: list[int]
    ids: list[int]  # response tokens, up to and including EOS when the model stopped
    text: str  # decoded response without special tokens
    finished: bool  # emitted EOS within max_new_tokens
    # the sampler's log-probability of each response token: log_softmax(logits / T)[token] of the logits it sampled
    # from, at the temperature it sampled at, before top-k / top-p (what the trainer scores); None when greedy
    logps: list[float] | None = None
    # a multi-turn episode's (align.rollout.episode): 1 on the tokens the policy sampled, 0 on the environment's;
    # None: every response token is the policy's
    policy_mask: list[int] | None = None


def _generation_config(tokenizer, s: Sampling):
    """HF's greedy search: sampling is the keyed race of `_keyed_sampler`, whose scores make the sampled token the
    argmax."""
    from transformers import GenerationConfig

    return GenerationConfig(do_sample=False, max_new_tokens=s.max_new_tokens, eos_token_id=tokenizer.eos_token_id,
                            pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, use_cache=True)


def sampling_keys(s: Sampling, indices) -> list[int] | None:
    """The sampling key of each prompt index (None for greedy decoding): from `s.seed`, else from a seed drawn from
    torch's RNG (this process's)."""
    if s.greedy:
        return None
    from align.rollout.sampling import prompt_keys

    return prompt_keys(s.seed if s.seed is not None else int(torch.randint(0, 2**62, ())), indices)


def _keyed_sampler(s: Sampling, keys: list[int], prompt_len: int, device, logps: list):
    """A logits processor for HF's greedy search that samples: temperature, top-k / top-p, then the race of
    align.rollout.sampling with each row's key; the sampled token is given score 0, every other one -inf. Each step's
    sampling log-probs ([B]) are appended to `logps`."""
    from transformers import LogitsProcessor, LogitsProcessorList

    from align.rollout.sampling import choose, filter_logits

    key_t = torch.tensor(keys, device=device)

    class KeyedSampler(LogitsProcessor):
        def __call__(self, input_ids, scores):
            z = filter_logits(scores.float() / s.temperature, s.top_k, s.top_p)
            tok = choose(z, key_t, input_ids.shape[1] - prompt_len)
            logps.append(sampled_logprobs(scores, tok, s.temperature))
            return torch.full_like(scores, float("-inf")).scatter_(1, tok[:, None], 0.0)

    return LogitsProcessorList([KeyedSampler()])


def trim_at_eos(ids: list[int], eos_id: int, pad_id: int) -> tuple[list[int], bool]:
    """Cut a generated row after its first EOS (kept). Without EOS the row is returned as is (generate pads
    only after EOS, so such a row has no padding)."""
    if eos_id in ids:
        return ids[: ids.index(eos_id) + 1], True
    return ids, False


def use_fast_path(module, device, synced_gpus: bool = False, fast: bool | None = None,
                  length: int | None = None) -> bool:
    """The compiled static-cache decoder (align.rollout.fast) is used on CUDA by default for the models it
    supports (`fast.support.SUPPORTED`) and rollouts of up to `length` tokens; `fast=False` or
    ALIGN_FAST_GENERATION=0 selects HF `generate`; `fast=True` forces it (also on CPU, eagerly: tests). Never with
    `synced_gpus` (sharded weights). On a GPU the choice and its reason are logged once per process."""
    from align.rollout.fast import support

    module = support.bare(module)
    if synced_gpus or fast is False or not support.enabled_by_env():
        return False
    wanted = bool(fast) or torch.device(device).type == "cuda"
    why = support.unsupported_reason(module, length)
    if wanted:
        from align.console import info

        info(f"rollouts: HF generate ({why})" if why else f"rollouts: fast decoder ({support.describe(module)})",
             once=True)
    return wanted and why is None


@torch.no_grad()
def generate_local(module, tokenizer, prompts: list[list[int]], s: Sampling, batch_size: int,
                   device, synced_gpus: bool = False, fast: bool | None = None, on_batch=None,
                   indices=None) -> list[Completion]:
    """Generate for this rank's prompts with a plain (already gathered or unsharded) module. `indices`: each
    prompt's index for its sampling key (default 0, 1, ...)."""
    keys = sampling_keys(s, range(len(prompts)) if indices is None else indices)
    length = max((len(p) for p in prompts), default=0) + s.max_new_tokens
    if use_fast_path(module, device, synced_gpus, fast, length):
        if fast:  # forced (tests): errors surface
            return _generate_fast(module, tokenizer, prompts, s, batch_size, device, on_batch, keys)
        try:
            return _generate_fast(module, tokenizer, prompts, s, batch_size, device, on_batch, keys)
        except Exception as e:  # never lose a run to the fast path: say so once, then use HF generate
            import os
            import traceback

            from align.console import warn

            traceback.print_exc()
            warn(f"fast generation failed ({type(e).__name__}: {e}); falling back to HF generate for this process")
            os.environ["ALIGN_FAST_GENERATION"] = "0"
    from align.models import autocast_dtype
    from align.runtime import eager

    cfg = _generation_config(tokenizer, s)
    amp = autocast_dtype(module)  # --precision bf16-mixed: generate under the autocast the engine's forward uses
    was_training = module.training
    module.eval()
    out: list[Completion] = []
    for i in range(0, len(prompts), batch_size):
        chunk = prompts[i : i + batch_size]
        ids = torch.tensor(pad(chunk, tokenizer.pad_token_id, side="left"), device=device)
        mask = torch.tensor(pad([[1] * len(p) for p in chunk], 0, side="left"), device=device)
        step_logps: list = []
        sampler = None if keys is None else _keyed_sampler(s, keys[i : i + batch_size], ids.shape[1], device, step_logps)
        with torch.autocast(torch.device(device).type, dtype=amp or torch.bfloat16, enabled=amp is not None), eager():
            gen = module.generate(input_ids=ids, attention_mask=mask, generation_config=cfg, synced_gpus=synced_gpus,
                                  logits_processor=sampler)
        lp = torch.stack(step_logps, 1).tolist() if step_logps else [None] * len(chunk)
        for p, row, row_lp in zip(chunk, gen[:, ids.shape[1] :].tolist(), lp):
            resp, finished = trim_at_eos(row, tokenizer.eos_token_id, tokenizer.pad_token_id)
            if not finished:
                resp = resp[: s.max_new_tokens]
            out.append(Completion(p, resp, tokenizer.decode(resp, skip_special_tokens=True), finished,
                                  None if row_lp is None else row_lp[: len(resp)]))
        if on_batch:
            on_batch(len(chunk))
    module.train(was_training)
    return out


def _generate_fast(module, tokenizer, prompts, s: Sampling, batch_size: int, device, on_batch=None,
                   keys=None) -> list[Completion]:
    from align.lora import parked_base
    from align.rollout.fast.decoder import decoder_for
    from align.rollout.fast.support import bare

    dec = decoder_for(bare(module), device)
    parked = parked_base(module, device)  # LoRA: the base W is not read while the decoder's merged copy decodes
    if parked:
        parked.park()
    try:
        return _decode_chunks(dec, tokenizer, prompts, s, batch_size, on_batch, keys)
    finally:
        dec.release()  # the KV cache is not needed until the next rollout
        if parked:
            parked.restore()


def _decode_chunks(dec, tokenizer, prompts, s: Sampling, batch_size: int, on_batch=None,
                   keys=None) -> list[Completion]:
    eos, pad_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    out: list[Completion] = []
    # CUDA graphs: every chunk as wide as the first (a short last chunk would compile and capture a new shape)
    width = min(batch_size, len(prompts)) if dec.use_graphs else 0
    for i in range(0, len(prompts), batch_size):
        chunk = prompts[i : i + batch_size]
        fill = width - len(chunk)  # rows repeating the last prompt (and its key): dropped below
        ck = None if keys is None else keys[i : i + batch_size]
        rows = dec.generate(chunk + [chunk[-1]] * fill, s, eos, pad_id, None if ck is None else ck + ck[-1:] * fill)
        lp = dec.last_logps or [None] * len(rows)
        for p, row, row_lp in zip(chunk, rows, lp):
            resp, finished = trim_at_eos(row, eos, pad_id)
            out.append(Completion(p, resp, tokenizer.decode(resp, skip_special_tokens=True), finished,
                                  None if row_lp is None else row_lp[: len(resp)]))
        if on_batch:
            on_batch(len(chunk))
    return out


def generate_on_rank(eng, tokenizer, prompts: list[list[int]], s: Sampling, dist: runtime.Dist,
                     batch_size: int = 64, gather: bool = True, on_batch=None, indices=None) -> list[Completion]:
    """Generate for THIS rank's `prompts` with a DeepSpeed engine: under ZeRO-3 its weights are gathered once for
    the whole phase (`gather=False`: they stay sharded and every rank joins every forward, so every rank must
    pass as many prompts). `indices`: the prompts' places in the global list, for their sampling keys; by default
    this rank's prompts are its contiguous share of equal shares (runtime.shard): rank · len(prompts) + i."""
    synced = runtime.is_zero3(eng) and not gather and dist.world_size > 1
    if indices is None:
        indices = range(dist.rank * len(prompts), (dist.rank + 1) * len(prompts))
    with runtime.gathered_for_generation(eng, gather) as module:
        return generate_local(module, tokenizer, prompts, s, batch_size, dist.device, synced_gpus=synced,
                              on_batch=on_batch, indices=indices)


def generate(eng, tokenizer, prompts: list[list[int]], s: Sampling, dist: runtime.Dist,
             batch_size: int = 64, gather: bool = True, on_batch=None) -> list[Completion]:
    """Generate for ALL `prompts` across the ranks (each rank takes an equal shard) and return them in order on
    every rank. Call on every rank. `on_batch(n)` is called after each batch of n of this rank's prompts."""
    local = generate_on_rank(eng, tokenizer, runtime.shard(prompts, dist, pad=True), s, dist, batch_size, gather,
                             on_batch)
    return [c for part in runtime.all_gather_objects(local) for c in part][: len(prompts)]
