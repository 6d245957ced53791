"""The one generation path: eval now, every RL stage's rollouts later.

Batched sampling with a KV cache, left padding, stop at EOS, temperature / top-k / top-p. Under ZeRO-3
the weights are gathered once per generation phase (see runtime.gathered_for_generation); with
`gather=False` they stay sharded and every rank joins every forward (`synced_gpus`).

Sampling draws each prompt's random numbers from a key of its own (align.rollout.sampling): with `Sampling.seed` set,
prompt i's samples depend on (seed, i) alone — i its index in the list given to `generate` (over every rank) —
not on the batch size, the number of processes or the other prompts.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace

import torch

from align import runtime, vision
from align.data import pad
from align.lora import bare
from align.rollout.completion import Completion, EpisodeInfo  # noqa: F401 (re-exported)
from align.rollout.episode import Agent, TurnSampler, first_stop, run_episodes, stopped
from align.rollout.sampling import sampled_logprobs


@dataclass
class Sampling:
    max_new_tokens: int = 64
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    seed: int | None = None  # prompt i's samples depend on (seed, i) alone; None: a seed drawn from torch's RNG
    precision: str = ""  # the fast decoder's linear layers: "" the model's compute dtype, "fp8" E4M3 (rollouts)
    routes: bool = False  # record each token's experts (an MoE policy, the fast decoder): --routing-replay

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0


def _generation_config(tokenizer, s: Sampling):
    """HF's greedy search: sampling is the keyed race of `_keyed_sampler`, whose scores make the sampled token the
    argmax."""
    from transformers import GenerationConfig

    return GenerationConfig(do_sample=False, max_new_tokens=s.max_new_tokens, eos_token_id=tokenizer.eos_token_id,
                            pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, use_cache=True,
                            suppress_tokens=vision.never_sampled(tokenizer))


def sampling_keys(s: Sampling, indices) -> list[int] | None:
    """The sampling key of each prompt index (None for greedy decoding): from `s.seed`, else from a seed drawn from
    torch's RNG (this process's)."""
    if s.greedy:
        return None
    from align.rollout.sampling import prompt_keys

    return prompt_keys(s.seed if s.seed is not None else int(torch.randint(0, 2**62, ())), indices)


def _keyed_sampler(s: Sampling, keys: list[int], prompt_len: int, device, logps: list, offsets: list[int] | None = None):
    """A logits processor for HF's greedy search that samples: temperature, top-k / top-p, then the race of
    align.rollout.sampling with each row's key; the sampled token is given score 0, every other one -inf. Each step's
    sampling log-probs ([B]) are appended to `logps`. `offsets`: each row's position of its first new token (an
    episode's tokens so far; default 0)."""
    from transformers import LogitsProcessor, LogitsProcessorList

    from align.rollout.sampling import choose, filter_logits

    key_t = torch.tensor(keys, device=device)
    offset_t = None if offsets is None else torch.tensor(offsets, dtype=torch.int64, device=device)

    class KeyedSampler(LogitsProcessor):
        def __call__(self, input_ids, scores):
            z = filter_logits(scores.float() / s.temperature, s.top_k, s.top_p)
            step = input_ids.shape[1] - prompt_len
            tok = choose(z, key_t, step if offset_t is None else offset_t + step)
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
                  length: int | None = None, precision: str = "", routes: bool = False) -> bool:
    """The compiled static-cache decoder (align.rollout.fast) is used on CUDA by default for the models it
    supports (`fast.support.SUPPORTED`) and rollouts of up to `length` tokens; `fast=False` or
    ALIGN_FAST_GENERATION=0 selects HF `generate`; `fast=True` forces it (also on CPU, eagerly: tests), as FP8
    rollouts (`precision` fp8: only the fast decoder has them) and routing replay (`routes`: only the fast decoder
    records them) ask for it. Never with `synced_gpus` (sharded weights). On a GPU the choice and its reason are
    logged once per process; FP8 rollouts and routing replay that cannot have it are warned about."""
    from align.rollout.fast import support

    module = bare(module)
    off = ("sharded weights (--no-gather)" if synced_gpus else "off (ALIGN_FAST_GENERATION)" if fast is False
           or not support.enabled_by_env() else None)
    why = off or support.unsupported_reason(module, length)
    if precision == "fp8" and why:
        from align.console import warn

        warn(f"FP8 rollouts decode in the fast decoder, which this rollout cannot use ({why}): it decodes in the "
             "model's own dtype.", once=True)
    if routes and (off or why):
        from align.console import warn

        warn(f"--routing-replay: these rollouts decode through HF generate ({off or why}), which records no "
             "routes: the trainer routes their tokens itself (no replay).", once=True)
    if off:
        return False
    wanted = bool(fast) or torch.device(device).type == "cuda" or precision == "fp8" or routes
    if wanted:
        from align.console import info

        info(f"rollouts: HF generate ({why})" if why else f"rollouts: fast decoder ({support.describe(module)}"
             f"{', FP8 linear layers' if precision == 'fp8' else ''})", once=True)
    return wanted and why is None


def _fast_failed(e: Exception) -> None:
    """The fast decoder raised: its traceback and a warning, and HF generate for the rest of this process."""
    import os
    import traceback

    from align.console import warn

    traceback.print_exc()
    warn(f"fast generation failed ({type(e).__name__}: {e}); falling back to HF generate for this process")
    os.environ["ALIGN_FAST_GENERATION"] = "0"


@torch.no_grad()
def generate_local(module, tokenizer, prompts: list[list[int]], s: Sampling, batch_size: int,
                   device, synced_gpus: bool = False, fast: bool | None = None, on_batch=None,
                   indices=None, agent=None, rows: list[dict] | None = None) -> list[Completion]:
    """Generate for this rank's prompts with a plain (already gathered or unsharded) module. `indices`: each
    prompt's index for its sampling key (default 0, 1, ...). `agent` (align.rollout.episode.Agent): multi-turn
    episodes instead, rows[i] prompt i's data row."""
    keys = sampling_keys(s, range(len(prompts)) if indices is None else indices)
    if agent is not None:
        return generate_episodes(module, tokenizer, prompts, rows, s, agent, batch_size, device, keys, on_batch,
                                 fast=False if synced_gpus else fast)
    length = max((len(p) for p in prompts), default=0) + s.max_new_tokens
    if use_fast_path(module, device, synced_gpus, fast, length, s.precision, s.routes):
        if fast:  # forced (tests): errors surface
            return _generate_fast(module, tokenizer, prompts, s, batch_size, device, on_batch, keys)
        try:
            return _generate_fast(module, tokenizer, prompts, s, batch_size, device, on_batch, keys)
        except Exception as e:  # never lose a run to the fast path: say so once, then use HF generate
            _fast_failed(e)
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
                                  logits_processor=sampler, **vision.generate_images(chunk, device))
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


@contextlib.contextmanager
def fast_decoder(module, device, precision: str = ""):
    """The module's fast decoder (align.rollout.fast) of that precision for one rollout: LoRA's base weights
    parked while its merged copy decodes, its KV cache released after (the update needs the memory) and the base
    weights restored."""
    from align.lora import parked_base
    from align.rollout.fast.decoder import decoder_for

    dec = decoder_for(bare(module), device, precision)
    parked = parked_base(module, device)  # LoRA: the base W is not read while the decoder's merged copy decodes
    if parked:
        parked.park()
    try:
        yield dec
    finally:
        dec.release()  # the KV cache is not needed until the next rollout
        if parked:
            parked.restore()


def _generate_fast(module, tokenizer, prompts, s: Sampling, batch_size: int, device, on_batch=None,
                   keys=None) -> list[Completion]:
    with fast_decoder(module, device, s.precision) as dec:
        return _decode_chunks(dec, tokenizer, prompts, s, batch_size, on_batch, keys)


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
        rows = dec.generate(chunk + [chunk[-1]] * fill, s, eos, pad_id, None if ck is None else ck + ck[-1:] * fill,
                            routes=s.routes)
        lp = dec.last_logps or [None] * len(rows)
        routes = dec.last_routes or [None] * len(rows)
        for p, row, row_lp, r in zip(chunk, rows, lp, routes):
            resp, finished = trim_at_eos(row, eos, pad_id)
            out.append(Completion(p, resp, tokenizer.decode(resp, skip_special_tokens=True), finished,
                                  None if row_lp is None else row_lp[: len(resp)],
                                  routes=None if r is None else r[: len(p) + len(resp)].clone()))
        if on_batch:
            on_batch(len(chunk))
    return out


def hf_turn_sampler(module, tokenizer, s, keys: list[int] | None, device) -> TurnSampler:
    """A TurnSampler over HF `generate` (align.rollout.generation's path): the contexts left-padded into one batch,
    sampled with the keyed race at each row's position after its prompt (greedy when `keys` is None, no
    log-probs), a row stopped at EOS, at a stop text (`stopped`) or at its budget."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    from align.models import autocast_dtype
    from align.runtime import eager

    amp = autocast_dtype(module)

    class StopTexts(StoppingCriteria):
        def __init__(self, start: int, stops: tuple[str, ...]):
            self.start, self.stops, self.at = start, stops, {}

        def __call__(self, input_ids, scores, **kwargs):
            done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
            for i, row in enumerate(input_ids[:, self.start:].tolist()):
                if i in self.at or stopped(tokenizer, row, self.stops):
                    self.at.setdefault(i, len(row))
                    done[i] = True
            return done

    @torch.no_grad()
    def sample_turns(contexts, which, offsets, budgets, stops):
        ids = torch.tensor(pad(contexts, tokenizer.pad_token_id, side="left"), device=device)
        mask = torch.tensor(pad([[1] * len(c) for c in contexts], 0, side="left"), device=device)
        width, step_logps = ids.shape[1], []
        keyed = None if keys is None else _keyed_sampler(s, [keys[w] for w in which], width, device, step_logps,
                                                         offsets=offsets)
        stop = StopTexts(width, stops)
        cfg = _generation_config(tokenizer, replace(s, max_new_tokens=max(budgets)))
        with torch.autocast(torch.device(device).type, dtype=amp or torch.bfloat16, enabled=amp is not None), eager():
            gen = module.generate(input_ids=ids, attention_mask=mask, generation_config=cfg, logits_processor=keyed,
                                  stopping_criteria=StoppingCriteriaList([stop]) if stops else None)
        lp = torch.stack(step_logps, 1).tolist() if step_logps else None
        out = []
        for i, (row, budget) in enumerate(zip(gen[:, width:].tolist(), budgets)):
            n, why = budget, "length"
            if tokenizer.eos_token_id in row[:budget]:
                n, why = row.index(tokenizer.eos_token_id) + 1, "eos"
            if stop.at.get(i, budget + 1) <= n:
                n, why = stop.at[i], "stop"
            out.append((row[:n], lp[i][:n] if lp else [0.0] * n, why))
        return out

    return sample_turns


def fast_turn_sampler(dec, tokenizer, s, keys: list[int] | None, width: int, capacity: int) -> TurnSampler:
    """A TurnSampler over the fast decoder (align.rollout.fast): episode i of the batch decodes in row i of the
    decoder, every round at the same width (ended episodes' rows decode padding: one graph shape for the whole
    episode) in a cache sized for the whole episode (`capacity`). The first round prefills the prompts; a later
    one only what the episode added since (the environment's answer: FastDecoder.generate's `reuse`). Keyed noise
    at each row's position after its prompt. A row ends at EOS, at a stop text (the decoder asks between steps;
    the turn is cut at the token that completed it, as HF's path cuts it) or at its budget."""
    eos = tokenizer.eos_token_id
    first = [True]

    def ended_at_stop(stops):
        seen: dict[int, int] = {}

        def ended(rows: list[list[int]]) -> list[int]:  # rows whose tokens since the last look complete a stop
            done = [i for i, row in enumerate(rows)
                    if eos not in row and first_stop(tokenizer, row, stops, seen.get(i, 0))]
            seen.update((i, len(row)) for i, row in enumerate(rows))
            return done

        return ended

    def sample_turns(contexts, which, offsets, budgets, stops):
        n = max(width, max(which) + 1)
        at: list = [None] * n
        row_offsets, row_keys = [0] * n, [0] * n
        for j, w in enumerate(which):
            at[w], row_offsets[w] = contexts[j], offsets[j]
            row_keys[w] = keys[w] if keys is not None else 0
        rows = dec.generate(at, replace(s, max_new_tokens=max(budgets)), eos, tokenizer.pad_token_id,
                            None if keys is None else row_keys, offsets=row_offsets,
                            stop=ended_at_stop(stops) if stops else None, capacity=capacity, reuse=not first[0])
        first[0] = False
        lp = dec.last_logps
        out = []
        for w, budget in zip(which, budgets):
            row = rows[w]
            n, why = min(budget, len(row)), "length"
            if eos in row[:n]:
                n, why = row.index(eos) + 1, "eos"
            cut = first_stop(tokenizer, row[:n], stops)
            if cut is not None:  # (HF's path: a stop text completed by the EOS token itself is a stop too)
                n, why = cut, "stop"
            out.append((row[:n], lp[w][:n] if lp else [0.0] * n, why))
        return out

    return sample_turns


def generate_episodes(module, tokenizer, prompts: list[list[int]], rows: list[dict], s: Sampling, agent: Agent,
                      batch_size: int, device, keys: list[int] | None, on_batch=None, fast: bool | None = None) -> list:
    """Episodes of `agent` after each prompt (rows[i] its data row), `batch_size` at a time, on the fast decoder
    where it applies (use_fast_path: CUDA, a supported model), else HF `generate`; returned as rollout
    Completions (Episode.completion)."""
    if any(isinstance(p, vision.ImagePrompt) for p in prompts):
        from align.errors import UserError

        raise UserError("--tools / --env episodes read text prompts; rows with images are not supported there.")
    if s.routes:
        from align.console import warn

        warn("--routing-replay: multi-turn episodes record no routes: the trainer routes their tokens itself.",
             once=True)
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    lim = agent.limits
    # the cache holds an episode's turns in place (fast_turn_sampler): room for every turn at its full budget (a
    # turn decodes until its batch's longest row ends), each answer and each turn's last token prefilled after it
    turns = max(lim.max_tokens, lim.max_turns * lim.turn_tokens)
    capacity = max((len(p) for p in prompts), default=0) + turns + lim.max_env_tokens + lim.max_turns + 1
    width = min(batch_size, len(prompts))

    def episodes(chunk: slice, dec) -> list:
        ck = None if keys is None else keys[chunk]
        sampler = (fast_turn_sampler(dec, tokenizer, s, ck, width, capacity) if dec
                   else hf_turn_sampler(module, tokenizer, s, ck, device))
        return run_episodes(sampler, encode, decode, [agent.make_env(r) for r in rows[chunk]], rows[chunk],
                            prompts[chunk], lim)

    def run(dec) -> None:  # the batches not done yet, on `dec` (None: HF generate)
        for i in range(len(out), len(prompts), batch_size):
            eps = episodes(slice(i, i + batch_size), dec)
            out.extend(ep.completion(decode) for ep in eps)
            if on_batch:
                on_batch(len(eps))

    was_training = module.training
    module.eval()
    out: list = []
    try:
        if use_fast_path(module, device, fast=fast, length=capacity, precision=s.precision):
            try:
                with fast_decoder(module, device, s.precision) as dec:
                    run(dec)
            except Exception as e:
                if fast:  # the fast path forced (tests): its errors surface
                    raise
                _fast_failed(e)  # never lose a run to the fast path: the batch it failed in and the rest on HF
        run(None)
    finally:
        module.train(was_training)
    return out


def generate_on_rank(eng, tokenizer, prompts: list[list[int]], s: Sampling, dist: runtime.Dist,
                     batch_size: int = 64, gather: bool = True, on_batch=None, indices=None, agent=None,
                     rows: list[dict] | None = None) -> list[Completion]:
    """Generate for THIS rank's `prompts` with a DeepSpeed engine: under ZeRO-3 its weights are gathered once for
    the whole phase (`gather=False`: they stay sharded and every rank joins every forward, so every rank must
    pass as many prompts). `indices`: the prompts' places in the global list, for their sampling keys; by default
    this rank's prompts are its contiguous share of equal shares (runtime.shard): rank · len(prompts) + i.
    `agent`, `rows`: multi-turn episodes (generate_local)."""
    synced = runtime.is_zero3(eng) and not gather and dist.world_size > 1
    if indices is None:
        indices = range(dist.rank * len(prompts), (dist.rank + 1) * len(prompts))
    with runtime.gathered_for_generation(eng, gather) as module:
        return generate_local(module, tokenizer, prompts, s, batch_size, dist.device, synced_gpus=synced,
                              on_batch=on_batch, indices=indices, agent=agent, rows=rows)


def generate(eng, tokenizer, prompts: list[list[int]], s: Sampling, dist: runtime.Dist,
             batch_size: int = 64, gather: bool = True, on_batch=None, agent=None,
             rows: list[dict] | None = None) -> list[Completion]:
    """Generate for ALL `prompts` across the ranks (each rank takes an equal shard) and return them in order on
    every rank. Call on every rank. `on_batch(n)` is called after each batch of n of this rank's prompts.
    `agent`, `rows`: multi-turn episodes (generate_local)."""
    local = generate_on_rank(eng, tokenizer, runtime.shard(prompts, dist, pad=True), s, dist, batch_size, gather,
                             on_batch, agent=agent, rows=runtime.shard(rows, dist, pad=True) if agent else None)
    return [c for part in runtime.all_gather_objects(local) for c in part][: len(prompts)]
