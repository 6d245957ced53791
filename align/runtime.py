"""Distributed runtime: the process group, collectives, sharding over ranks, saving a model, and gathering
ZeRO-3 weights for generation (engines are built in align.engine.build).

One process or many (torchrun / deepspeed launcher / --nproc), CUDA with NCCL when a GPU is present, CPU with
gloo otherwise.
"""

from __future__ import annotations

import contextlib
import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch



@dataclass
class Dist:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


_DIST: Dist | None = None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_env(nproc: int) -> dict[str, str]:
    """Environment for `nproc` processes started on this machine. torchrun pins every process to one OpenMP
    thread unless OMP_NUM_THREADS is set; that left DeepSpeed's CPU Adam (`--offload-optimizer`) single-threaded
    on 2 GPUs while one process used every core. Give each process its share of the cores instead. torchrun,
    told to stop (SIGTERM), SIGKILLs its workers 30 s later: too soon for a large model to finish its step and
    write its checkpoint, so the workers get SHUTDOWN_GRACE_S. Values the user set are kept."""
    env = dict(os.environ)
    if nproc > 1 and "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // nproc))
    env.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(SHUTDOWN_GRACE_S))
    return env


SHUTDOWN_GRACE_S = 600  # a stopped multi-process run's time to finish its step and checkpoint before SIGKILL


def die_with_parent() -> None:
    """Linux: this process gets SIGTERM when its parent dies, even by SIGKILL, so no worker outlives its launcher
    (a run stopped by SIGTERM marks its artifact failed). Elsewhere: nothing."""
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the parent died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


def world_size() -> int:
    """The number of processes of this run, known before the process group starts (from the launcher's env)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    """This process's rank, known before the process group starts."""
    return int(os.environ.get("RANK", "0"))


def attention_backends() -> None:
    """The scaled_dot_product_attention backends every run uses on a GPU (benchmarks that time a piece of a stage
    call this too): cuDNN's fused attention builds an execution plan on the CPU for every new (batch, length,
    mask) shape, ~4 ms per call, measured on H100 with variable-length training batches
    (docs/results-history.md); flash / memory-efficient attention launch in microseconds."""
    torch.backends.cuda.enable_cudnn_sdp(False)


def init(timeout_s: int | None = None) -> Dist:
    """Start (once) the process group DeepSpeed needs, even for a single process.

    `timeout_s` (default: $ALIGN_DIST_TIMEOUT or 1800) bounds how long a rank waits for its peers."""
    global _DIST
    timeout_s = timeout_s or int(os.environ.get("ALIGN_DIST_TIMEOUT", 1800))
    if _DIST is not None:
        return _DIST
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a worker of torchrun: it must not outlive the launcher
        die_with_parent()
    if "RANK" not in os.environ:  # single process: DeepSpeed would otherwise try MPI discovery
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    cuda = torch.cuda.is_available()
    if not cuda:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from align.compile_cache import use_persistent_cache

    use_persistent_cache()  # before anything compiles: compiled code outlives the process
    quiet_libraries()
    deepspeed = import_deepspeed()
    import deepspeed.ops

    if not cuda:
        # Skip the shared-memory comm op: it JIT-compiles for up to a minute on every start and
        # plain gloo is as fast at our sizes. Internal switch; deepspeed is pinned in pyproject.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if cuda:
        torch.cuda.set_device(local_rank)
        attention_backends()
    backend = "nccl" if cuda else "gloo"
    if "ALIGN_GLOBAL_RANK" in os.environ:  # --rollout-gpus: the trainers' own group, on the launcher's store
        torch.distributed.init_process_group(backend, store=torch.distributed.PrefixStore("align/trainers",
                                             shared_store(timedelta(seconds=timeout_s))), rank=rank(),
                                             world_size=world_size(), timeout=timedelta(seconds=timeout_s))
    deepspeed.init_distributed(dist_backend=backend, timeout=timedelta(seconds=timeout_s), verbose=False)
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    _DIST = Dist(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), local_rank, device, backend)
    return _DIST


_STORE = None


def shared_store(timeout: timedelta):
    """The launcher's key-value store, shared by every process of the run whatever its role (align.rollout.disagg: the
    trainers' group and the bridge to the decoders are built on it)."""
    global _STORE
    if _STORE is None:
        from torch.distributed import rendezvous

        _STORE, _, _ = next(rendezvous("env://", rank=int(os.environ["ALIGN_GLOBAL_RANK"]),
                                       world_size=int(os.environ["ALIGN_GLOBAL_WORLD"]), timeout=timeout))
    return _STORE


def shutdown(clean: bool) -> None:
    """End the process group before the interpreter exits: a gloo group left alive aborts the process at
    interpreter teardown (SIGABRT, "terminate called without an active exception": its worker threads still hold
    work when Python is gone), turning a finished run's exit 0 into a crash; NCCL warns and may leave a peer
    waiting. After a clean run every rank meets at a barrier first (no rank closes its sockets while a peer still
    reads the last collective); after a failure NCCL is left to the launcher (its teardown is collective and a
    failed peer may never join), gloo's is local and is destroyed."""
    global _DIST
    import sys

    td = sys.modules.get("torch.distributed")  # not imported: nothing was started (e.g. --help)
    if td is None or not td.is_available() or not td.is_initialized():
        return
    gloo = td.get_backend() == "gloo"
    if clean and td.get_world_size() > 1:
        td.barrier()
    if clean or gloo:
        td.destroy_process_group()
        _DIST = None
        groups = sys.modules.get("deepspeed.utils.groups")
        if groups is not None and hasattr(groups, "_WORLD_GROUP"):
            # DeepSpeed keeps its clone of the world group across process groups: a stage run later in this
            # process (a library user, the tests) would hand ZeRO the destroyed one ("is not registered")
            groups._WORLD_GROUP = None


def import_deepspeed():
    """deepspeed, imported without the optional `import mlflow` of its autotuner (which align never runs): with
    MLflow installed (the `mlflow` extra, the test extra) that import alone is ~1.7 s of every stage's start on a CPU.
    A process that imported mlflow already (a tracker) keeps it; `import mlflow` works as usual afterwards."""
    import sys

    if "deepspeed" in sys.modules:
        return sys.modules["deepspeed"]
    hide = "mlflow" not in sys.modules
    if hide:
        sys.modules["mlflow"] = None  # `import mlflow` raises ImportError: the autotuner sets has_mlflow = False
    try:
        import deepspeed
    finally:
        if hide and sys.modules.get("mlflow", 0) is None:
            del sys.modules["mlflow"]
    return deepspeed


def quiet_libraries() -> None:
    """Library chatter (deprecation notes from DeepSpeed's collectives, tqdm bars) would bury our progress bar."""
    import logging
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module="deepspeed")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)


def is_zero3(eng) -> bool:
    return eng.zero_optimization_partition_weights()


@contextlib.contextmanager
def gathered_for_generation(eng, gather: bool = True):
    """Yield the bare module ready for fast generation.

    ZeRO-3 with `gather=True`: gather the full weights once and lift ZeRO's per-module hooks for the whole
    generation phase (no collective per forward, ranks may decode different lengths). `gather=False` is the
    fallback for models that do not fit whole on one device: hooks stay, and `generate` must run with
    `synced_gpus=True` so every rank joins every forward.
    """
    if not is_zero3(eng) or not gather:
        yield eng.module
        return
    from deepspeed.runtime.zero.stage3 import unwrap_model_for_generation

    with unwrap_model_for_generation(eng) as module:
        yield module


def save_model(eng, tokenizer, out_dir: Path, dist: Dist, extra_config: dict | None = None,
               merge: bool = True, max_shard_size: int | str = "5GB") -> None:
    """Write a plain `save_pretrained` directory (safetensors + tokenizer, weights in files of at most
    `max_shard_size` with an index when there are several) on rank 0; a LoRA model: its adapter in adapter/ and,
    with `merge`, the merged model (align.lora.save).

    Under ZeRO-3, `module.save_pretrained()` alone would write empty shards; the consolidated state dict
    must be gathered on every rank first.
    """
    if is_zero3(eng):
        state = eng._zero3_consolidated_16bit_state_dict()
    else:
        state = {k: v.detach().cpu() for k, v in eng.module.state_dict().items()} if dist.is_main else None
    if dist.is_main:
        from align import lora

        module = eng.module
        if extra_config:
            for k, v in extra_config.items():
                setattr(module.config, k, v)
        if lora.is_peft(module):
            lora.save(module, state, Path(out_dir), merge, max_shard_size)
        else:
            module.save_pretrained(out_dir, state_dict=state, safe_serialization=True, max_shard_size=max_shard_size)
        tokenizer.save_pretrained(out_dir)
        from align.vision import save_processor

        save_processor(tokenizer, out_dir)  # a vision-language model's image processor
    barrier()


def barrier() -> None:
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.barrier()


def all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.all_reduce(x)
    return x


def broadcast_object(obj):
    """Rank 0's `obj` on every rank."""
    if not (torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1):
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def all_gather_objects(obj):
    if not (torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1):
        return [obj]
    out = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, obj)
    return out


def partition_stats(eng) -> dict:
    """Parameter elements per rank, outside forward/backward. `shard`: the ZeRO-3 partition a rank owns
    (~1/world of each tensor); `resident`: full tensors kept materialised (ZeRO-3 keeps tensors under
    stage3_param_persistence_threshold whole on every rank; 0 when everything is sharded)."""
    params = list(eng.module.parameters())
    full = sum(getattr(p, "ds_numel", p.numel()) for p in params)
    shard = sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in params)
    resident = sum(p.data.numel() for p in params if hasattr(p, "ds_tensor"))
    return {"params": full, "shard_per_rank": all_gather_objects(shard),
            "resident_per_rank": all_gather_objects(resident)}


_PEAK_BEFORE_RESET = 0  # CUDA bytes: the process's peak up to the last reset_peak (rollout.timed)


def reset_peak() -> None:
    """Start measuring a phase's CUDA peak, keeping the process's overall peak for peak_memory_gib."""
    global _PEAK_BEFORE_RESET
    _PEAK_BEFORE_RESET = max(_PEAK_BEFORE_RESET, torch.cuda.max_memory_allocated())
    torch.cuda.reset_peak_memory_stats()


def peak_memory_gib(dist: Dist) -> float:
    if dist.device.type == "cuda":
        return max(_PEAK_BEFORE_RESET, torch.cuda.max_memory_allocated(dist.device)) / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB -> GiB (process RSS)


def shard(items: list, dist: Dist, pad: bool = False) -> list:
    """This rank's contiguous share of `items`. pad=False: len(items) must divide by the world size (a global
    batch). pad=True: equal shards, the last item repeated to fill them — under ZeRO-3 every rank must make the
    same number of forwards (each gathers parameters collectively); `gather(..., n)` drops the repeats."""
    world = dist.world_size
    if not pad:
        if len(items) % world:
            raise ValueError(f"{len(items)} items do not split over {world} ranks")
        per = len(items) // world
        return items[dist.rank * per : (dist.rank + 1) * per]
    per = -(-len(items) // world)
    padded = items + items[-1:] * (per * world - len(items))
    return padded[dist.rank * per : (dist.rank + 1) * per]


def gather(local: torch.Tensor, n: int) -> torch.Tensor:
    """Every rank's `shard(..., pad=True)` results, concatenated in rank order on every rank, first n rows."""
    return torch.cat(all_gather_objects(local.cpu()))[:n]


def eager():
    """A context in which compiled blocks run eagerly (HF generate: its growing KV cache would recompile)."""
    return torch.compiler.set_stance("force_eager")
