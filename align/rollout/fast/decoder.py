"""FastDecoder: the fast decoder's parts (align/rollout/fast/__init__.py) together, the token each step
samples, and `generate`: the prompts' prefill, then one decode step per token until every row has ended."""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.nn.functional as F

from align.rollout.fast.cache import KVCache
from align.rollout.fast.graphs import CompiledStep
from align.rollout.fast.layers import LayerMath, rms
from align.rollout.fast.weights import DecoderWeights
from align.rollout.sampling import choose, filter_logits, sampled_logprobs


class FastDecoder(LayerMath, DecoderWeights, KVCache, CompiledStep):
    """Inference copy + static cache + (on CUDA) compiled, graph-captured decode step for one model."""

    def __init__(self, module, device, dtype=None, use_graphs: bool | None = None, check_every: int | None = None,
                 precision: str = ""):
        self.cfg = module.config
        self.device = torch.device(device)
        self.precision = precision  # "fp8": E4M3 linear layers (align.rollout.fast.fp8); "": the compute dtype
        p0 = next(module.parameters())
        from align.models import autocast_dtype

        # --precision bf16-mixed: fp32 weights, bf16 compute -> a bf16 inference copy
        self.dtype = dtype or autocast_dtype(module) or (p0.dtype if p0.numel() else torch.bfloat16)
        cuda = self.device.type == "cuda"
        self.use_graphs = cuda if use_graphs is None else use_graphs
        # how often decode asks whether every row has finished: on a GPU the answer costs a host sync, on a CPU
        # nothing (and every extra step a full batch forward)
        self.check_every = check_every or (32 if cuda else 1)
        self._init_layout(module, cuda)
        self._init_weights(module)  # stable addresses for the life of the decoder
        self._init_graphs()
        self._shape_key = None  # (rows, capacity) of the allocated cache
        # tokens prefilled (batch rows x block width) whole (`full`) and after an episode's kept cache (`appended`)
        self.prefilled = {"full": 0, "appended": 0}
        self.record_routes = False  # `generate(routes=True)`: the MoE layers' chosen experts of every token
        self.last_routes = None

    def release(self) -> None:
        """Free the inference weights and the KV cache between rollouts (the training step
        needs the memory: at 0.5B the weights alone are 0.9 GiB): the tensors stay (no recompile), their storage
        goes. `load_weights` and the next `generate` take it back (the cache zeroed) and re-capture the graphs
        only if the allocator placed a buffer elsewhere."""
        self._release_weights()
        self._release_cache()

    def _step_out(self, x: torch.Tensor, sampling, eos: int, pad: int) -> None:
        """Final norm, LM head, the next token chosen; EOS tracking and the cache / position bookkeeping."""
        logits = F.linear(rms(x, self.norm, self.eps), self.head).float()
        nxt = self._choose(logits, self.sidx + self.key_offset, sampling)
        if not sampling.greedy:  # the sampler's log-probs, as the trainer scores them (rollout/logp_abs_diff)
            self.out_logp.index_copy_(1, self.sidx, sampled_logprobs(logits, nxt, sampling.temperature)[:, None])
        nxt = torch.where(self.finished, torch.full_like(nxt, pad), nxt)
        self.out.index_copy_(1, self.sidx, nxt[:, None])
        self.finished.logical_or_(nxt == eos)
        self.cur_tok.copy_(nxt)
        self.cur_pos.add_(1)
        self.widx.add_(1)
        self.sidx.add_(1)

    def _record_routes(self, j: int, idx_BK: torch.Tensor) -> None:
        """The experts MoE layer j chose for the current tokens (those of output column sidx - 1), in the decode
        step (captured with it)."""
        self.gen_routes[:, :, j].index_copy_(1, (self.sidx - 1).clamp(min=0), idx_BK[:, None].to(self.route_dtype))

    def _choose(self, logits: torch.Tensor, position, sampling) -> torch.Tensor:
        """The token at `position` of each row: argmax, or the exponential race with the row's keyed noise
        (align.rollout.sampling: computed here, inside the compiled step, from the keys and the position alone)."""
        if sampling.greedy:
            return logits.argmax(-1)
        z = filter_logits(logits / sampling.temperature, sampling.top_k, sampling.top_p)
        return choose(z, self.keys, position)

    # ------------------------------------------------------------------ generation
    @torch.no_grad()
    def generate(self, prompts: list[list[int] | None], sampling, eos: int, pad: int, keys=None, offsets=None,
                 stop=None, capacity: int = 0, reuse: bool = False, routes: bool = False) -> list[list[int]]:
        """Tokens generated for each prompt (rows padded after EOS with `pad`, length <= max_new_tokens); `keys`:
        each prompt's sampling key (align.rollout.sampling; default: drawn from torch's RNG).

        A multi-turn episode's turn (align.rollout.generation.fast_turn_sampler): a prompt may be None (an ended
        episode: its row decodes padding); `offsets`, each row's position of its first new token for its keyed
        noise; `stop(tokens [n, steps] on the host) -> rows that ended` (at a tool call's stop text), asked
        whenever the decoder checks for EOS, ends those rows early (the caller cuts their tokens at the stop);
        `capacity`: the cache's least length (an episode's: one shape for all its turns); `reuse`: the rows are
        the previous call's, each context the one the cache holds for that row (its prompt and tokens) up to
        where they part, then new tokens (the environment's answer): only those are prefilled, after the slots
        written so far, and the row's slots past the common part are closed (`_extension`); everything is
        prefilled again when the cache has no room left. `routes` (an MoE model, a whole prefill: not `reuse`):
        `last_routes` then holds each row's chosen experts of its prompt and tokens (`_routes_of`)."""
        n, new = len(prompts), sampling.max_new_tokens
        self.record_routes = bool(routes and self.moe_layers and not reuse)
        live = [p for p in prompts if p is not None]
        plan = self._extension(prompts, new, pad) if reuse else None
        if plan is None:
            P = max(len(p) for p in live)
            ids, mask = self._inputs([p if p is not None else live[-1] for p in prompts], P, new, pad, capacity)
            plan = (ids, mask, None, 0, None, [list(range(P - len(p), P)) if p is not None else None
                                               for p in prompts])
        ids, mask, pos, start, open_before, slots = plan
        self.prefilled["appended" if start else "full"] += ids.numel()
        top = start + ids.shape[1]  # the slot the first decode step writes
        clock = _DebugClock() if os.environ.get("ALIGN_FAST_DEBUG") == "1" else None
        # one runner per attention length the decode steps will need (writing slots top .. top + new - 2), all
        # made before the prefill: a capture's warm-up scribbles on the decode state
        runners = {k: self._runner(sampling, eos, pad, k)
                   for k in sorted({self.attn_len(w) for w in range(top, top + new - 1)})}
        if clock:
            clock.lap()
        self._first_token(ids, mask, sampling, eos, pad, keys, n, offsets, start, pos, open_before)
        dead = [i for i, p in enumerate(prompts) if p is None]
        if dead:  # ended episodes' rows: padding from the first token on
            dead = torch.tensor(dead, device=self.device)
            self.finished[dead], self.out[dead, 0], self.cur_tok[dead] = True, pad, pad
        steps = 1
        while steps < new:
            runners[self.attn_len(top + steps - 1)]()
            steps += 1
            if steps % self.check_every == 0 and self._all_ended(n, steps, stop):
                break
        if clock:
            clock.report(self, n, steps)
        # the sampling log-prob of every generated token (positions after EOS hold garbage: cut with the tokens)
        self.last_logps = None if sampling.greedy else self.out_logp[:n, :steps].tolist()
        rows = self.out[:n, :steps].tolist()
        self.last_routes = self._routes_of(prompts, ids.shape[1], steps) if self.record_routes else None
        self._remember(prompts, rows, slots, top, steps)
        return rows

    def _routes_of(self, prompts: list[list[int] | None], P: int, steps: int) -> list:
        """Each row's routes [len(prompt) + steps, MoE layers, k] on the host (the experts every MoE layer chose
        for each token the model read: the prompt at the prefill, each generated token at the step after; -1 for
        the last token, which no step read), None for an ended episode's row."""
        whole = torch.cat([self.prefill_routes.to(self.route_dtype), self.gen_routes[:, :steps]], 1).cpu()
        return [None if p is None else whole[i, P - len(p):] for i, p in enumerate(prompts)]

    def _all_ended(self, n: int, steps: int, stop) -> bool:
        """Whether every row has ended (EOS, or a row `stop` names: marked finished, so it decodes padding)."""
        if stop is not None:
            ended = stop(self.out[:n, :steps].tolist())
            if ended:
                self.finished[torch.tensor(sorted(ended), device=self.device)] = True
        return bool(self.finished[:n].all())

    def _inputs(self, prompts: list[list[int]], P: int, new: int, pad: int,
                capacity: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """The cache and output buffers for the prompts (rows: a power of two with graphs, the last prompt
        repeated; slots: at least `capacity`) and their left-padded ids and mask [B, P] on the device."""
        n = len(prompts)
        B = n if not self.use_graphs else max(8, 1 << (n - 1).bit_length())  # graph shapes: powers of two
        cap = max(P + new, capacity)
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
        self._outputs(B, new, pad)
        return ids, mask

    def _outputs(self, B: int, new: int, pad: int) -> None:
        if self.out is None or self._out_len < new:
            self.out = torch.full((B, new), pad, dtype=torch.long, device=self.device)
            self.out_logp = torch.zeros(B, new, dtype=torch.float32, device=self.device)
            if self.moe_layers:  # the experts each generated token went to, per MoE layer (`_record_routes`)
                self.gen_routes = torch.full((B, new, len(self.moe_layers), self.top_k), -1, dtype=self.route_dtype,
                                             device=self.device)
            self._out_len = new
            self._graphs, self._warm = {}, set()  # the graphs hold the old `out` (a new shape: compiled again)

    def _first_token(self, ids: torch.Tensor, mask: torch.Tensor, sampling, eos: int, pad: int, keys, n: int,
                     offsets=None, start: int = 0, pos=None, open_before=None) -> None:
        """The prefill of the block `ids` at slots [start, start + P) (after the open slots `open_before` [B,
        start]) and each row's first token; the decode state set for the step that writes slot start + P."""
        B, P = ids.shape
        offsets = [0] * n if offsets is None else list(offsets)
        self.key_offset.copy_(torch.tensor(offsets + offsets[-1:] * (B - n)))
        # the attention mask AFTER the captures: their warm-up opens slots 0-1 (`_step`) for every row
        self.attn_bias.fill_(torch.finfo(torch.float32).min)
        if start:
            self.attn_bias[:, :start].masked_fill_(open_before.to(self.device), 0.0)
        self.attn_bias[:, start : start + P].masked_fill_(mask.bool(), 0.0)
        if not sampling.greedy:
            keys = torch.randint(0, 1 << 32, (n,)).tolist() if keys is None else list(keys)
            self.keys.copy_(torch.tensor(keys + keys[-1:] * (B - n)))
        pos = (mask.long().cumsum(-1) - 1).clamp(min=0) if pos is None else pos
        logits = self._prefill(ids, mask, start, pos)
        first = self._choose(logits, self.key_offset, sampling)
        self.out.fill_(pad)
        if self.moe_layers:
            self.gen_routes.fill_(-1)
        self.out[:, 0] = first
        if not sampling.greedy:
            self.out_logp[:, 0] = sampled_logprobs(logits, first, sampling.temperature)
        self.finished.copy_(first == eos)
        self.cur_tok.copy_(first)
        self.cur_pos.copy_(pos[:, -1] + 1)
        self.widx.fill_(start + P)
        self.sidx.fill_(1)


class _DebugClock:
    """ALIGN_FAST_DEBUG=1: a rollout's time to make its runners (captures) and to prefill and decode, on stderr."""

    def __init__(self):
        self.times: list[float] = []
        self.lap()

    def lap(self) -> None:
        torch.cuda.synchronize()
        self.times.append(time.perf_counter())

    def report(self, dec: FastDecoder, n: int, steps: int) -> None:
        self.lap()
        t0, t1, t2 = self.times
        B, cap = dec._shape_key
        print(f"[fast decoder] rows {n}/{B} cap {cap} graphs {dec.use_graphs} runner {t1 - t0:.2f}s "
              f"prefill+decode {t2 - t1:.2f}s for {steps} tokens = {(t2 - t1) / steps * 1e3:.2f} ms/token; "
              f"graph re-captures {dec.recaptures} {dec.recaptured_for} grad {torch.is_grad_enabled()} dynamo counters {dict(torch._dynamo.utils.counters['stats'])}",
              file=sys.stderr, flush=True)


def decoder_for(module, device, precision: str = "") -> FastDecoder:
    """The module's persistent FastDecoder of that precision (created on first use; one per precision, so that
    FP8 rollouts and the evaluation in the compute dtype each keep theirs), with the module's current weights."""
    attr = "_align_fast_decoder" + (f"_{precision}" if precision else "")
    dec = getattr(module, attr, None)
    if dec is None:
        dec = FastDecoder(module, device, precision=precision)
        object.__setattr__(module, attr, dec)  # plain attribute: not a submodule/param
    dec.load_weights(module)
    return dec
