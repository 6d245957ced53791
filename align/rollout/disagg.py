"""Disaggregated rollouts (--rollout-gpus N): the last N processes of a run only decode, the others only train.

Ranks. Of W processes (torchrun / --nproc), the first T = W − N are trainers and the last N decoders. The trainers
form the run's own process group — DeepSpeed's ZeRO, every collective of the stage, its checkpoints: for them
`runtime.world_size()` is T and `runtime.rank()` their rank among trainers (`split` rewrites RANK / WORLD_SIZE at the
start, the launcher's values kept in ALIGN_GLOBAL_RANK / ALIGN_GLOBAL_WORLD). A decoder holds a plain copy of the
policy (not ZeRO, the run's compute dtype) and serves requests (`serve`).

The bridge, a process group of trainer 0 and the decoders built on the launcher's store: trainer 0 sends each
request as a JSON message (gloo); the weights follow a "weights" message as one broadcast per bucket of tensors
(gloo on CPU, NCCL on GPU), gathered from the ZeRO-3 shards by every trainer and sent by trainer 0 — every
parameter the first time, then only the trained ones (LoRA: the adapters); a "rollout" message names the step, its
prompts (token ids), the sampling settings and (episodes: --tools / --env) the prompts' data rows, and each decoder
answers with its share of the samples (their ids and the sampler's log-probs; an episode's policy mask, turns and
stop), which trainer 0 hands to the other trainers. A decoder runs its episodes' environments beside it. "stop" ends a decoder.

No wait is unbounded: the bridge's operations fail after --dist-timeout (ALIGN_DIST_TIMEOUT) seconds, and a peer
that dies closes its connections at once, so the survivors fail with that error (the run's status says so).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import time
from datetime import timedelta

import torch

from align import runtime
from align.errors import UserError
from align.rollout.generation import Completion, Sampling, generate_local

BUCKET_BYTES = 256 * 2**20  # a weight broadcast's bucket


def world() -> int:
    """The number of processes the launcher started (trainers and decoders)."""
    return int(os.environ.get("ALIGN_GLOBAL_WORLD") or runtime.world_size())


def require_trainers(n_decoders: int, total: int) -> None:
    """A UserError unless `n_decoders` of `total` processes leave at least one to train."""
    if n_decoders >= total:
        raise UserError(f"--rollout-gpus {n_decoders} leaves no process to train: start more than {n_decoders} "
                        f"processes (--nproc {n_decoders + 1} or more), or --rollout-gpus 0.", option="rollout_gpus")


def split(n_decoders: int) -> bool:
    """Take this process's role: True for a decoder. Rewrites RANK / WORLD_SIZE to the role's own group (before
    anything reads them: call it first)."""
    if "ALIGN_GLOBAL_RANK" in os.environ:  # split already (this process runs a second stage)
        return int(os.environ["ALIGN_GLOBAL_RANK"]) >= world() - n_decoders
    total, rank = runtime.world_size(), runtime.rank()
    require_trainers(n_decoders, total)
    trainers = total - n_decoders
    decoder = rank >= trainers
    os.environ.update(ALIGN_GLOBAL_RANK=str(rank), ALIGN_GLOBAL_WORLD=str(total),
                      RANK=str(rank - trainers if decoder else rank), WORLD_SIZE=str(n_decoders if decoder else trainers))
    if decoder and "TORCHELASTIC_RUN_ID" in os.environ:  # a trainer's runtime.init does this for it
        runtime.die_with_parent()
    return decoder


def _device() -> torch.device:
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


class Bridge:
    """Trainer 0 (bridge rank 0) and the decoders (1..N): messages from rank 0, answers gathered to it, weights."""

    def __init__(self, rank: int, size: int, device: torch.device):
        from torch.distributed import PrefixStore, ProcessGroupGloo

        timeout = timedelta(seconds=int(os.environ.get("ALIGN_DIST_TIMEOUT", 1800)))
        store = runtime.shared_store(timeout)
        self.rank, self.size, self.device = rank, size, device
        self.pg = ProcessGroupGloo(PrefixStore("align/bridge", store), rank, size, timeout)
        self.weights_pg = self.pg
        if device.type == "cuda":
            try:
                from torch.distributed import ProcessGroupNCCL

                self.weights_pg = ProcessGroupNCCL(PrefixStore("align/bridge-nccl", store), rank, size)
            except Exception as e:  # never lose a run to it: the weights go through host memory instead
                from align.console import warn

                warn(f"the decoders' weight broadcast runs over gloo through host memory (NCCL: {type(e).__name__}: "
                     f"{str(e)[:200]})")
                self.device = torch.device("cpu")

    def send(self, msg: dict | None = None) -> dict:
        """Rank 0's `msg`, on every rank."""
        data = _encode(msg) if self.rank == 0 else torch.empty(0, dtype=torch.uint8)
        n = torch.tensor([data.numel()])
        self.pg.broadcast(n, 0).wait()
        if self.rank:
            data = torch.empty(int(n), dtype=torch.uint8)
        self.pg.broadcast(data, 0).wait()
        return msg if self.rank == 0 else json.loads(bytes(data.numpy()))

    def gather(self, obj) -> list | None:
        """Every rank's `obj`, in rank order, on rank 0 (None elsewhere)."""
        data = _encode(obj)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
        self.pg.allgather([sizes], [torch.tensor([data.numel()])]).wait()
        longest = max(int(s) for s in sizes)
        padded = torch.zeros(longest, dtype=torch.uint8)
        padded[: data.numel()] = data
        opts = torch.distributed.GatherOptions()
        opts.rootRank = 0
        out = [[torch.empty(longest, dtype=torch.uint8) for _ in range(self.size)]] if self.rank == 0 else []
        self.pg.gather(out, [padded], opts).wait()
        if self.rank:
            return None
        return [json.loads(bytes(t[: int(s)].numpy())) for t, s in zip(out[0], sizes)]

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Rank 0's `tensor` into every rank's (same shape and dtype, on this rank's device)."""
        self.weights_pg.broadcast(tensor, 0).wait()

    def abort(self) -> None:
        """Drop the bridge at once, pending operations or not (ProcessGroup.abort; shutdown where a backend has no
        abort)."""
        self._end(lambda pg: getattr(pg, "abort", pg.shutdown)())

    def close(self) -> None:
        self._end(lambda pg: pg.shutdown())  # a gloo group left alive aborts the process at interpreter teardown

    def _end(self, how) -> None:
        """`how` on each of the bridge's groups (one when the weights share it); a peer already gone leaves nothing
        to end cleanly."""
        for pg in {id(p): p for p in (self.pg, self.weights_pg)}.values():
            try:
                how(pg)
            except Exception:
                pass


def _encode(obj) -> torch.Tensor:
    return torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)


def trainer_bridge() -> Bridge | None:
    """On trainer 0: its end of the bridge; None on the other trainers. Collective with `serve`'s."""
    if runtime.rank() != 0:
        return None
    n = world() - runtime.world_size()
    return Bridge(0, n + 1, _device())


# ---- weights


def buckets(named: list, limit: int = BUCKET_BYTES) -> list[list[str]]:
    """Consecutive parameter names in buckets of at most `limit` bytes (one tensor may exceed it) of one dtype."""
    out, size, dtype = [], 0, None
    for name, p in named:
        nbytes = getattr(p, "ds_numel", p.numel()) * p.element_size()
        if not out or p.dtype != dtype or size + nbytes > limit:
            out.append([])
            size, dtype = 0, p.dtype
        out[-1].append(name)
        size += nbytes
    return out


def send_weights(module, bridge: Bridge | None, full: bool, step: int) -> None:
    """Every trainer: the policy's weights (all when `full`, else the trained ones) to the decoders, one broadcast per
    bucket; under ZeRO-3 each bucket is gathered from the shards first (collective over the trainers)."""
    import deepspeed

    named = [(n, p) for n, p in module.named_parameters() if full or p.requires_grad]
    params = dict(named)
    plan = buckets(named)
    if bridge is not None:
        bridge.send({"op": "weights", "step": step, "buckets": plan,
                     "dtypes": [str(params[b[0]].dtype).removeprefix("torch.") for b in plan]})
    for names in plan:
        ps = [params[n] for n in names]
        with deepspeed.zero.GatheredParameters(ps, modifier_rank=None):
            if bridge is not None:
                bridge.broadcast(torch.cat([p.data.reshape(-1) for p in ps]).to(bridge.device))


def receive_weights(module, bridge: Bridge, msg: dict) -> None:
    params = dict(module.named_parameters())
    missing = [n for b in msg["buckets"] for n in b if n not in params]
    if missing:
        raise RuntimeError(f"the decoder's model has no parameter {missing[0]!r} of the trainers' policy")
    for names, dtype in zip(msg["buckets"], msg["dtypes"]):
        ps = [params[n] for n in names]
        flat = torch.empty(sum(p.numel() for p in ps), dtype=getattr(torch, dtype), device=bridge.device)
        bridge.broadcast(flat)
        offset = 0
        with torch.no_grad():
            for p in ps:
                p.copy_(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()


# ---- rollouts


def rollout_request(step: int, prompts: list[list[int]], group: int, sampling: Sampling,
                    rows: list[dict] | None = None) -> dict:
    """A "rollout" message; `rows`: the prompts' data rows, from which the decoders' environments are made (episodes:
    --tools / --env)."""
    msg = {"op": "rollout", "step": step, "prompts": prompts, "group": group, "sampling": dataclasses.asdict(sampling)}
    return {**msg, "rows": rows} if rows is not None else msg


def share(n: int, parts: int, i: int) -> range:
    """Decoder i's contiguous share of n samples."""
    per = math.ceil(n / parts)
    return range(min(n, i * per), min(n, (i + 1) * per))


def decode(module, tok, msg: dict, device, index: int, parts: int, agent=None) -> list[dict]:
    """This decoder's share of a rollout request: each sample's Completion (dataclasses.asdict, without its prompt),
    samples keyed by their place in the whole request (the same samples as one process drawing them all); with
    `agent` (and the request's rows), multi-turn episodes, their environments made here."""
    prompts = [p for p in msg["prompts"] for _ in range(msg["group"])]
    mine = share(len(prompts), parts, index)
    todo = [prompts[i] for i in mine]
    rows = None
    if agent is not None:
        every = [r for r in msg["rows"] for _ in range(msg["group"])]
        rows = [every[i] for i in mine]
    out = generate_local(module, tok, todo, Sampling(**msg["sampling"]), max(len(todo), 1), device, indices=mine,
                         agent=agent, rows=rows)
    return [{k: v for k, v in c.to_json().items() if k != "prompt_ids"} for c in out]


def completions(prompts: list[list[int]], group: int, answers: list[dict]) -> list[Completion]:
    """The request's completions, in order, from every decoder's answer."""
    samples = [d for a in answers for d in a["samples"]]
    full = [p for p in prompts for _ in range(group)]
    return [Completion.from_json({**d, "prompt_ids": p}) for p, d in zip(full, samples)]


@contextlib.contextmanager
def lost_decoders():
    """A bridge operation: its failure (a decoder gone, a timeout) said as such."""
    try:
        yield
    except RuntimeError as e:
        raise RuntimeError(f"the decoder ranks (--rollout-gpus) stopped answering: {str(e).strip()[:300]}") from None


class RemoteSampler:
    """The trainers' side of the decoders (align.rollout.queue's sampler): `publish` sends the new weights, `request`
    asks for a rollout, `receive` waits for it and hands every trainer its share."""

    def __init__(self, engine, dist, prompts, sampling, group: int, rows=None):
        self.engine, self.dist, self.prompts, self.sampling, self.group = engine, dist, prompts, sampling, group
        self.rows = rows  # step -> its prompts' data rows (episodes: the decoders make their environments of them)
        self.bridge = trainer_bridge()
        self.published: int | None = None
        self.asked: dict[int, list] = {}

    def publish(self, step: int) -> None:
        if step != self.published:
            with lost_decoders():
                send_weights(self.engine.module, self.bridge, full=self.published is None, step=step)
            self.published = step

    def request(self, step: int) -> None:
        self.asked[step] = self.prompts(step)
        if self.bridge is not None:
            with lost_decoders():
                self.bridge.send(rollout_request(step, self.asked[step], self.group, self.sampling(step),
                                                 self.rows(step) if self.rows else None))

    def receive(self, step: int) -> tuple[list[Completion], float, float]:
        prompts = self.asked.pop(step)
        with lost_decoders():
            answers = self.bridge.gather(None)[1:] if self.bridge is not None else None
        answers = runtime.broadcast_object(answers)
        every = completions(prompts, self.group, answers)
        return (runtime.shard(every, self.dist), max(a["seconds"] for a in answers),
                min(a["idle"] for a in answers))

    def close(self, failed: bool = False) -> None:
        """Tell the decoders to stop (trainer 0) and close the bridge. `failed` (the run is failing): abort the
        bridge instead. A decoder may be mid-exchange (answering a rollout, taking weights) and would never match
        a "stop": that broadcast would block until --dist-timeout, in C, where no signal reaches the handler, and
        the launcher's SIGKILL would come before the run could write its failure. The decoders learn of it when
        the bridge's connections close."""
        if self.bridge is None:
            return
        if failed:
            self.bridge.abort()
        else:
            try:
                self.bridge.send({"op": "stop"})
            except Exception:  # a decoder already gone, or the bridge broken mid-message: the run's error says why
                pass
            self.bridge.close()
        self.bridge = None


def serve(load, tok, dtype: torch.dtype, agent=None) -> None:
    """A decoder's life: `load(dtype)` (the policy's architecture: its weights come from the trainers), then
    requests until "stop". Every answer says how long it took and how long the decoder waited before it. `agent`
    (--tools / --env): each sample a multi-turn episode, its environment beside this decoder (closed at the end)."""
    import signal

    # Ctrl-C / SIGTERM stop the trainers at the end of their step (a checkpoint, then "stop"): the decoder serves
    # that step to its end. It still ends with the trainers: a closed bridge fails its wait at once.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    device = _device()
    n, index = runtime.world_size(), runtime.rank()  # a decoder's RANK / WORLD_SIZE are among the decoders
    bridge = Bridge(index + 1, n + 1, device)
    module = load(dtype).to(device).eval().requires_grad_(False)
    idle, t = 0.0, time.time()
    try:
        while True:
            msg = bridge.send()
            if msg["op"] == "stop":
                return
            if msg["op"] == "weights":
                receive_weights(module, bridge, msg)
                continue
            idle += time.time() - t
            start = time.time()
            samples = decode(module, tok, msg, device, index, n, agent)
            seconds = time.time() - start
            t = time.time()
            bridge.gather({"samples": samples, "seconds": seconds, "idle": idle})
            idle = 0.0
    finally:
        bridge.close()
        if agent is not None:
            agent.close()
