"""DeepSpeed runtime: process group, ZeRO configs, engines, saving, and gathering for generation.

Every training stage goes through here. One process or many (torchrun / deepspeed launcher / --nproc),
CUDA with NCCL and bf16 when a GPU is present, CPU with gloo and fp32 otherwise.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch

from align.config import PRECISIONS
from align.errors import UserError


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
    on 2 GPUs while one process used every core. Give each process its share of the cores instead (a value the
    user set is kept)."""
    env = dict(os.environ)
    if nproc > 1 and "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // nproc))
    return env


def offload_threads_hint(local_world: int, threads: int, cores: int) -> str | None:
    """A warning when CPU Adam would run on fewer threads than this process's share of the cores (torchrun's
    default OMP_NUM_THREADS=1 under a launcher that is not `align --nproc`), else None."""
    share = max(1, cores // max(1, local_world))
    if threads >= share:
        return None
    return (f"--offload-optimizer: the CPU Adam step runs on {threads} thread(s) per process, {share} cores "
            f"are this process's share; set OMP_NUM_THREADS={share} (torchrun sets 1) or launch with align --nproc.")


def init(timeout_s: int | None = None) -> Dist:
    """Start (once) the process group DeepSpeed needs, even for a single process.

    `timeout_s` (default: $ALIGN_DIST_TIMEOUT or 1800) bounds how long a rank waits for its peers."""
    global _DIST
    timeout_s = timeout_s or int(os.environ.get("ALIGN_DIST_TIMEOUT", 1800))
    if _DIST is not None:
        return _DIST
    if "RANK" not in os.environ:  # single process: DeepSpeed would otherwise try MPI discovery
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    cuda = torch.cuda.is_available()
    if not cuda:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    quiet_libraries()
    import deepspeed
    import deepspeed.ops

    if not cuda:
        # Skip the shared-memory comm op: it JIT-compiles for up to a minute on every start and
        # plain gloo is as fast at our sizes. Internal switch; deepspeed is pinned in pyproject.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if cuda:
        torch.cuda.set_device(local_rank)
        # cuDNN's fused attention builds an execution plan on the CPU for every new (batch, length, mask)
        # shape: ~4 ms per call, measured on H100 with variable-length training batches (benchmarks/RESULTS.md);
        # flash / memory-efficient attention launch in microseconds.
        torch.backends.cuda.enable_cudnn_sdp(False)
    backend = "nccl" if cuda else "gloo"
    deepspeed.init_distributed(dist_backend=backend, timeout=timedelta(seconds=timeout_s), verbose=False)
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    _DIST = Dist(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), local_rank, device, backend)
    return _DIST


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


def compute_dtype(dist: Dist, precision: str = "auto") -> torch.dtype:
    """bf16 on CUDA and fp32 on CPU ("auto"), or what --precision asks for (bf16 mixed precision keeps fp32
    master weights in the optimizer; bf16-pure keeps them in bf16, see ds_config)."""
    if precision not in PRECISIONS:
        raise UserError(f"--precision must be one of {', '.join(PRECISIONS)}, not {precision!r}.")
    if precision == "auto":
        return torch.bfloat16 if dist.device.type == "cuda" else torch.float32
    return torch.bfloat16 if precision.startswith("bf16") else torch.float32


def ds_config(
    *,
    zero_stage: int,
    micro_batch: int,
    grad_accum: int,
    world_size: int,
    dtype: torch.dtype,
    grad_clip: float = 1.0,
    user_config: str | None = None,
    precision: str = "auto",
    offload_optimizer: bool = False,
) -> dict:
    """The DeepSpeed config for one engine. A user's --deepspeed JSON wins key by key.

    --precision bf16-pure: ZeRO's master weights, gradients and Adam moments in bf16 (DeepSpeed's
    bf16_master_weights_and_grads + bf16_optimizer_states): 2 + 2 + 2 + 4 = 10 bytes per trained parameter
    instead of 2 + 4 (fp32 grads) + 4 (fp32 master) + 8 (fp32 moments), with the coarser updates of bf16
    (small updates can round away). With ZeRO stage 0 there is no ZeRO optimizer to hold a master copy:
    DeepSpeed's mixed precision is off and AdamW updates the bf16 module itself (2 + 2 + 4 = 8 bytes, a plain
    bf16 PyTorch loop such as TRL's).
    offload_optimizer: ZeRO-Offload — master weights, gradients and moments live in (pinned) CPU memory and
    torch's AdamW steps there; the GPU keeps only the compute-dtype parameters and a small gradient bucket."""
    cfg = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": grad_accum,
        "train_batch_size": micro_batch * grad_accum * world_size,
        "gradient_clipping": grad_clip,
        "zero_optimization": {
            "stage": zero_stage,
            "overlap_comm": False,
            "contiguous_gradients": True,
            "stage3_gather_16bit_weights_on_model_save": True,
            # ZeRO-3's memory-efficient linear re-implements F.linear in Python autograd: 2x slower steps
            # on small models for a saving that only matters for huge activations.
            "memory_efficient_linear": False,
            # DeepSpeed's default: tensors under 100k elements stay whole on every rank (gathering them each
            # forward costs more than they weigh). Set 0 in --deepspeed to shard everything.
            "stage3_param_persistence_threshold": 100_000,
            # DeepSpeed's 5e8-element gradient bucket would be 1-2 GB on the GPU; 5e7 is as fast at our sizes.
            "reduce_bucket_size": 50_000_000,
            "allgather_bucket_size": 50_000_000,
        },
        "bf16": {"enabled": dtype == torch.bfloat16},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if precision == "bf16-pure" and dtype == torch.bfloat16:
        if zero_stage == 0:  # no ZeRO optimizer: AdamW steps the bf16 module itself (bf16 grads and moments)
            cfg["bf16"] = {"enabled": False}
        else:
            cfg["bf16"].update(bf16_master_weights_and_grads=True, bf16_optimizer_states=True)
    if offload_optimizer:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
        cfg["zero_force_ds_cpu_optimizer"] = False  # torch AdamW where DeepSpeedCPUAdam cannot be built (CPU-only)
    if user_config:
        path = Path(user_config)
        try:
            user = json.loads(path.read_text())
        except FileNotFoundError:
            raise UserError(f"{path}: DeepSpeed config not found (--deepspeed).") from None
        except json.JSONDecodeError as e:
            raise UserError(f"{path}:{e.lineno}: not valid JSON ({e.msg}).") from None
        cfg = _deep_merge(cfg, user)
    return cfg


def _deep_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


class ZeroLoader:
    """Keeps the transformers<->DeepSpeed link alive so `from_pretrained` loads straight into ZeRO-3 shards."""

    def __init__(self, cfg: dict):
        self.hf = None
        if cfg["zero_optimization"]["stage"] == 3:
            from transformers.integrations.deepspeed import HfDeepSpeedConfig

            self.hf = HfDeepSpeedConfig(cfg)


def engine(model: torch.nn.Module, cfg: dict, optimizer=None, lr_scheduler=None):
    """Wrap `model` in a DeepSpeed engine; without an optimizer it is an inference-only (frozen) engine."""
    import deepspeed

    if optimizer is None:
        model.requires_grad_(False)
        cfg = frozen_config(cfg)
    elif "offload_optimizer" in cfg["zero_optimization"]:
        hint = offload_threads_hint(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), torch.get_num_threads(),
                                    len(os.sched_getaffinity(0)))
        if hint:
            from align.console import warn

            warn(hint)
    if cfg["zero_optimization"]["stage"] == 3:
        set_block_leaves(model)
    eng, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=lr_scheduler, config=cfg)
    if optimizer is None:
        eng.eval()
    return eng


def frozen_config(cfg: dict) -> dict:
    """The config of an inference-only engine built beside a trained one: ZeRO stages 1 and 2 partition only
    gradients and optimiser states, which a frozen model has none of (stage 0: a plain replica); no optimiser
    offload and no master-weight settings."""
    zero = {k: v for k, v in cfg["zero_optimization"].items() if k != "offload_optimizer"}
    if zero["stage"] in (1, 2):
        zero["stage"] = 0
    return {**cfg, "zero_optimization": zero, "bf16": {"enabled": cfg["bf16"]["enabled"]}}


def set_block_leaves(model: torch.nn.Module) -> None:
    """ZeRO-3 fetches and releases each transformer block's parameters as one unit (the block classes the model
    names in `_no_split_modules`): one pair of hooks per block instead of one per Linear / norm inside it,
    ~10× fewer Python hook calls per forward and backward, the step's main CPU cost on one GPU."""
    from deepspeed.utils import set_z3_leaf_modules

    names = set(getattr(model, "_no_split_modules", None) or [])
    classes = list({type(m) for m in model.modules() if type(m).__name__ in names})
    if classes:
        set_z3_leaf_modules(model, classes)


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


def save_model(eng, tokenizer, out_dir: Path, dist: Dist, extra_config: dict | None = None) -> None:
    """Write a plain `save_pretrained` directory (safetensors + tokenizer) on rank 0.

    Under ZeRO-3, `module.save_pretrained()` alone would write empty shards; the consolidated state dict
    must be gathered on every rank first.
    """
    if is_zero3(eng):
        state = eng._zero3_consolidated_16bit_state_dict()
    else:
        state = {k: v.detach().cpu() for k, v in eng.module.state_dict().items()} if dist.is_main else None
    if dist.is_main:
        module = eng.module
        if extra_config:
            for k, v in extra_config.items():
                setattr(module.config, k, v)
        module.save_pretrained(out_dir, state_dict=state, safe_serialization=True)
        tokenizer.save_pretrained(out_dir)
    barrier()


def barrier() -> None:
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.barrier()


def all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.all_reduce(x)
    return x


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


def peak_memory_gib(dist: Dist) -> float:
    if dist.device.type == "cuda":
        return torch.cuda.max_memory_allocated(dist.device) / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB -> GiB (process RSS)
