"""Disk space for what a run saves: the bytes of a checkpoint and of the final model, measured from the tensors
the engines hold, checked against the free space of the filesystem they go to before anything is written.

A run checks once before training (its peak: the final model, the checkpoints it keeps and the one it writes)
and again before each save. Every rank reports its own share (under ZeRO each rank writes its shard of the
optimiser state); the shares are summed per filesystem (host, device), so processes writing to one disk are
checked together. Every rank takes the same decision from the same gathered numbers.
"""

from __future__ import annotations

import errno
import os
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path

from align.artifacts import ARTIFACT_FILE
from align.errors import UserError

# what the pickles and safetensors headers, the tokenizer and the run's logs add to the tensors' bytes
SLACK_FRACTION, SLACK_BYTES = 0.01, 64 * 2**20
# the end of a write that failed for want of space: OSError codes and the messages of torch's zip writer
# (PyTorchStreamWriter: "unexpected pos", "file write failed") and of safetensors (an io error "StorageFull")
FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
FULL_MESSAGES = ("no space left", "unexpected pos", "file write failed", "iostream error", "storagefull",
                 "disk quota", "os error 28")


class DiskFull(UserError):
    """Not enough free space for a save (found before writing, or when a write failed): nothing partial is left."""


class NoRoom(DiskFull):
    """Found before anything was written, from numbers every rank shares: every rank raises it together."""


def existing(path: Path) -> Path:
    """`path` or its nearest existing ancestor (the filesystem a file written there lands on)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def free_bytes(path: Path) -> int:
    return shutil.disk_usage(existing(path)).free


def filesystem(path: Path) -> tuple[str, int]:
    """Which disk `path` is on: (host, device number); two ranks with the same key share its free space."""
    return socket.gethostname(), os.stat(existing(path)).st_dev


def is_disk_full(exc: BaseException) -> bool:
    """Did a write fail because the disk (or a quota, or the file size limit) ran out?"""
    if isinstance(exc, OSError) and exc.errno in FULL_ERRNOS:
        return True
    return any(m in str(exc).lower() for m in FULL_MESSAGES)


def fmt(n: float) -> str:
    """Bytes as `df -h` counts them (binary units)."""
    return f"{n / 2**30:,.2f} GiB" if n >= 2**30 else f"{n / 2**20:,.1f} MiB"


# ---- what a save holds

def _stored(obj, seen: set) -> int:
    """Bytes torch.save writes for the tensors in `obj`: each storage once and whole (a view saves all of its
    storage), storages already counted in `seen` not again."""
    import torch

    if isinstance(obj, torch.Tensor):
        st = obj.untyped_storage()
        key = (st.data_ptr(), st.nbytes(), str(obj.device))
        if key in seen or st.nbytes() == 0:
            return 0
        seen.add(key)
        return st.nbytes()
    if isinstance(obj, dict):
        return sum(_stored(v, seen) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_stored(v, seen) for v in obj)
    return 0


def _optimizer_bytes(opt, seen: set) -> int:
    """The optimiser's state as it is saved, from its tensors; before the first step (torch's AdamW creates its
    moments then) it counts the two moments AdamW will create for each tensor it steps, each like the tensor.
    Those are the base optimiser's parameters; ZeRO-3 hands them to it only during a step (its flat fp32
    partitions)."""
    n = _stored(opt.state_dict(), seen)
    base = getattr(opt, "optimizer", opt)
    stepped = ([p for g in base.param_groups for p in g["params"]] or
               list(getattr(opt, "fp32_partitioned_groups_flat", [])))
    return n + sum(2 * p.numel() * p.element_size() for p in stepped if not base.state.get(p))


def checkpoint_bytes(eng) -> int:
    """The bytes this rank writes for DeepSpeed engine `eng`'s checkpoint: the module's state (the ranks that
    save it: one under data parallelism), the ZeRO shards of frozen parameters, and the optimiser state (in the
    module's file without ZeRO, one shard per rank with it)."""
    seen: set = set()
    n = 0
    if eng.save_non_zero_checkpoint:
        # ZeRO-3 partitions every parameter before it saves: the module's file holds placeholders (and buffers)
        zero3 = {id(p) for p in eng.module.parameters() if hasattr(p, "ds_id")}
        n += _stored([v for v in eng.module_state_dict(keep_vars=True).values() if id(v) not in zero3], seen)
        if eng.zero_optimization_partition_gradients():  # ZeRO-2/3 keep the frozen parameters' shards too
            n += _stored([getattr(p, "ds_tensor", p) for p in eng.module.parameters() if not p.requires_grad], seen)
        if not eng.zero_optimization() and eng.optimizer is not None:
            n += _optimizer_bytes(eng.optimizer, seen)
    if eng.save_zero_checkpoint and eng.optimizer is not None:
        n += _optimizer_bytes(eng.optimizer, seen)
    return n


def model_bytes(module, merge: bool = True) -> int:
    """The bytes of the saved model/ of `module` (full tensors, ZeRO-3 partitioned or not, in their dtype): its
    parameters and persistent buffers; a LoRA model: the merged model and the adapter, with --no-merge the
    adapter alone."""
    from align.lora import is_peft

    def size(p) -> int:
        return getattr(p, "ds_numel", p.numel()) * p.element_size()

    trained = sum(size(p) for p in module.parameters() if p.requires_grad)
    if is_peft(module) and not merge:
        return trained
    full = sum(size(p) for p in module.parameters()) + sum(b.numel() * b.element_size() for b in module.buffers())
    return full + (trained if is_peft(module) else 0)


# ---- the check

@dataclass
class Share:
    """One rank's part of a save: `ckpt` bytes of each checkpoint into `ckpt_fs`, `model` bytes into `model_fs`."""

    ckpt_fs: tuple
    ckpt_free: int
    ckpt: int
    model_fs: tuple
    model_free: int
    model: int


def gather(ckpt_dir: Path, ckpt: int, model_dir: Path, model: int) -> list[Share]:
    """Every rank's share (a collective: every rank calls it)."""
    from align import runtime

    mine = Share(filesystem(ckpt_dir), free_bytes(ckpt_dir), ckpt, filesystem(model_dir), free_bytes(model_dir),
                 model)
    return runtime.all_gather_objects(mine)


@dataclass
class Shortage:
    """A filesystem that cannot take what is asked of it: `need` bytes more than are on it now, `free` free; at
    the moment of the peak it holds the model (`model` bytes, 0 if not there yet) and `checkpoints` checkpoints of
    `ckpt` bytes (`present` of them there already, `writers` processes writing a shard of each)."""

    need: int
    free: int
    model: int
    checkpoints: int
    ckpt: int
    present: int
    writers: int

    def what(self) -> str:
        """'the model 14.19 GiB + 2 checkpoints of 42.57 GiB (1 already on disk; 8 processes write ~5.32 GiB of
        each)'."""
        parts = [f"the model {fmt(self.model)}"] if self.model else []
        if self.checkpoints and self.ckpt:
            notes = [f"{self.present} already on disk"] if self.present else []
            if self.writers > 1:
                notes.append(f"{self.writers} processes write ~{fmt(self.ckpt / self.writers)} of each")
            note = f" ({'; '.join(notes)})" if notes else ""
            parts.append(f"{self.checkpoints} checkpoint{'s' * (self.checkpoints > 1)} of {fmt(self.ckpt)}{note}")
        return " + ".join(parts)


def shortage(shares: list[Share], checkpoints: int = 0, model: bool = False, present: int = 0,
             mid_peak: int = 0) -> Shortage | None:
    """The first filesystem without room for the final model (`model`) beside `checkpoints` checkpoints, or for
    `mid_peak` checkpoints before the model is written, `present` of them on disk already; None if all fit."""
    disks: dict = {}
    for s in shares:
        d = disks.setdefault(s.ckpt_fs, {"free": s.ckpt_free, "ckpt": 0, "model": 0, "writers": 0})
        d["ckpt"] += s.ckpt
        d["writers"] += s.ckpt > 0
        if model:
            disks.setdefault(s.model_fs, {"free": s.model_free, "ckpt": 0, "model": 0, "writers": 0})["model"] += s.model
    for d in disks.values():
        end, mid = d["model"] + checkpoints * d["ckpt"], mid_peak * d["ckpt"]
        need = max(end, mid) - present * d["ckpt"]
        need = int(need * (1 + SLACK_FRACTION)) + SLACK_BYTES if need > 0 else 0
        if need > d["free"]:
            at_end = end >= mid
            return Shortage(need, d["free"], d["model"] if at_end else 0, checkpoints if at_end else mid_peak,
                            d["ckpt"], present, d["writers"])
    return None


def run_peak(present: int, writes: int, final: bool, keep: int) -> tuple[int, int]:
    """(the most checkpoints on disk during the `writes` saves before the end, the checkpoints on disk at the end
    while the final one is written): `present` exist at the start; a save writes its checkpoint beside the
    ones kept and then deletes all but the newest `keep`."""
    on_disk, peak = present, 0
    for _ in range(min(writes, keep + 1)):  # after keep + 1 saves the count no longer changes
        peak = max(peak, on_disk + 1)
        on_disk = min(on_disk + 1, keep)
    if writes > keep + 1:
        peak = max(peak, keep + 1)
    return peak, on_disk + (1 if final else 0)


class Untouched:
    """--out as it was before a run wrote to it, put back when the run refuses to start after all (the disk
    check before training, which needs the built engines): a directory the run made is removed, the files an
    ArtifactWriter writes at the start (artifact.json, metrics.jsonl, health.jsonl) get their old bytes back."""

    FILES = (ARTIFACT_FILE, "metrics.jsonl", "health.jsonl")

    def __init__(self, out: Path):
        self.out = Path(out)
        self.existed = self.out.exists()
        self.saved = {n: (self.out / n).read_bytes() for n in self.FILES if (self.out / n).is_file()}

    def restore(self) -> None:
        if not self.existed:
            shutil.rmtree(self.out, ignore_errors=True)
            return
        for name in self.FILES:
            if name in self.saved:
                tmp = self.out / f"{name}.restore"
                tmp.write_bytes(self.saved[name])
                os.replace(tmp, self.out / name)
            else:
                (self.out / name).unlink(missing_ok=True)
