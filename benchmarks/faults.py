"""Faults injected into a run in this process, for RLMonitor's tests and benchmark (benchmarks.monitor_bench):
a stale decoder weight copy, a NaN loss. Each is a context manager that patches align for its duration."""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def stale_decoder(onset: int):
    """Rollouts from step `onset` on (0-based: the `onset`-th call of align.rollout.batch's generation) decode with the
    weights the policy had at step onset − 1: a decoder copy not refreshed after the updates since, as when an
    inference engine's weight sync breaks. HF-generate path (CPU); the trainer keeps training the real weights."""
    import torch

    import align.rollout.batch as R
    from align import runtime
    from align.rollout.generation import generate_local

    original, calls, frozen = R.generate_on_rank, [0], {}

    def generate_on_rank(eng, tokenizer, prompts, s, dist, batch_size=64, gather=True, on_batch=None, indices=None,
                         agent=None, rows=None):
        k = calls[0]
        calls[0] += 1
        if k < onset - 1:
            return original(eng, tokenizer, prompts, s, dist, batch_size, gather, on_batch, indices, agent, rows)
        if indices is None:
            indices = range(dist.rank * len(prompts), (dist.rank + 1) * len(prompts))
        with runtime.gathered_for_generation(eng, gather) as module, torch.no_grad():
            params = dict(module.named_parameters())
            if k == onset - 1:
                frozen.update({n: p.detach().clone() for n, p in params.items()})
            live = {n: p.detach().clone() for n, p in params.items()} if k >= onset else {}
            for n, p in params.items():
                if live:
                    p.copy_(frozen[n])
            try:
                return generate_local(module, tokenizer, prompts, s, batch_size, dist.device, on_batch=on_batch,
                                      indices=indices, agent=agent, rows=rows)
            finally:
                for n, t in live.items():
                    params[n].copy_(t)

    R.generate_on_rank = generate_on_rank
    try:
        yield
    finally:
        R.generate_on_rank = original


@contextlib.contextmanager
def stale_fast_decoder(onset: int):
    """The fast decoder (align.rollout.fast, forced on CPU) stops refreshing its weight copy from its `onset`-th
    load on (0-based): every later rollout decodes with the weights of load onset − 1. The decoder is made to
    keep a copy (ALIGN_FAST_DECODER_COPY), as it does under ZeRO-3, LoRA or bf16-mixed: one that reads the
    policy's own tensors cannot go stale."""
    import os

    import align.rollout.generation as G
    from align.rollout.fast.decoder import FastDecoder

    load, use_fast, calls = FastDecoder.load_weights, G.use_fast_path, [0]

    def load_weights(self, module):
        calls[0] += 1
        if calls[0] <= onset:
            return load(self, module)
        self._take_weights()  # storage back after release(): it holds the old copy's bytes no more, so keep one
        self._wbuf.copy_(self._stale)

    def keep_copy(self, module):
        load_weights(self, module)
        if calls[0] <= onset:
            self._stale = self._wbuf.clone()

    def use_fast_path(module, device, synced_gpus=False, fast=None, length=None, precision="", routes=False):
        return use_fast(module, device, synced_gpus, True if fast is None else fast, length, precision, routes)

    FastDecoder.load_weights, G.use_fast_path = keep_copy, use_fast_path
    before, os.environ["ALIGN_FAST_DECODER_COPY"] = os.environ.get("ALIGN_FAST_DECODER_COPY"), "1"
    try:
        yield
    finally:
        FastDecoder.load_weights, G.use_fast_path = load, use_fast
        if before is None:
            os.environ.pop("ALIGN_FAST_DECODER_COPY")
        else:
            os.environ["ALIGN_FAST_DECODER_COPY"] = before


@contextlib.contextmanager
def nan_loss(onset: int):
    """A NaN loss at step `onset` (0-based), once (a transient overflow): every Trained.backward of the first run of
    that step multiplies its loss by NaN; a rerun of the step (after a rollback) is clean."""
    from align.engine import run as RUN
    from align.engine.build import Trained

    backward, step_fn, state = Trained.backward, RUN.StageRun._step, {"step": 0, "runs": 0}

    def _step(self, algo, step):
        state["step"] = step
        state["runs"] += step == onset
        return step_fn(self, algo, step)

    def nan_backward(self, loss):
        return backward(self, loss * float("nan") if state["step"] == onset and state["runs"] == 1 else loss)

    RUN.StageRun._step, Trained.backward = _step, nan_backward
    try:
        yield
    finally:
        RUN.StageRun._step, Trained.backward = step_fn, backward


FAULTS = {"stale_decoder": stale_decoder, "stale_fast_decoder": stale_fast_decoder, "nan": nan_loss}


def main(argv: list[str]) -> None:
    """python -m benchmarks.faults FAULT ONSET ALIGN_ARGS...: `align ALIGN_ARGS` in this process with FAULT injected
    from 0-based step ONSET (FAULT none: no fault); exits as align does."""
    import sys

    from align import cli

    fault, onset = argv[0], int(argv[1])
    sys.argv = ["align", *argv[2:]]
    with contextlib.nullcontext() if fault == "none" else FAULTS[fault](onset):
        cli.main()


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
