"""Shared fixtures for the core tests: a saved tiny model, and a helper to run the `align` CLI in a subprocess."""

from __future__ import annotations

import functools
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# The suite runs two test files at a time (pytest-xdist), and many tests start `align` processes, often two at
# once: one OpenMP thread per process keeps 2 cores from being oversubscribed (the tiny models gain nothing from
# more). A value set by the caller wins.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# runtime.init() (called in-process by test_generation) exports these; a child `align` must not inherit them,
# or it would join the pytest process's gloo group (same MASTER_PORT) instead of starting its own.
_DIST_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@functools.lru_cache(maxsize=None)
def small_data() -> dict[str, Path]:
    """Heads of the shipped data files, once per test process: the full files (20k-50k rows) cost every `align`
    process ~7 s of tokenising that tests of lifecycle and plumbing do not need."""
    d = Path(tempfile.mkdtemp(prefix="align-small-data-"))
    files = {"arith": ("arithmetic/train.jsonl", 256), "arith_test": ("arithmetic/test.jsonl", 16),
             "prefs": ("prefs/train.jsonl", 128), "prefs_test": ("prefs/test.jsonl", 16)}
    out = {}
    for name, (rel, n) in files.items():
        out[name] = d / f"{name}.jsonl"
        out[name].write_text("".join((ROOT / "data" / rel).read_text().splitlines(keepends=True)[:n]))
    return out


def small_sft() -> list[str]:
    """--data / --eval-data flags of a small SFT run."""
    return ["--data", str(small_data()["arith"]), "--eval-data", str(small_data()["arith_test"])]


@functools.lru_cache(maxsize=None)
def parity_reward() -> str:
    """A `--reward` for GRPO runs of a tiny random model: 1 for a completion of odd length in characters, else 0.
    Such a model never solves a math problem (every group's rewards equal, no training signal: RLMonitor stops
    the run); the parity of its random completions differs within most groups."""
    f = Path(tempfile.mkdtemp(prefix="align-reward-")) / "parity.py"
    f.write_text("def parity(prompt, completion, **row):\n    return float(len(completion) % 2)\n")
    return f"{f}:parity"


def processes_mentioning(text: str) -> list[int]:
    """PIDs (other than this one) whose command line contains `text`."""
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if text in cmd and int(d.name) != os.getpid():
                pids.append(int(d.name))
    return pids


def worker_pid(out, rank: int) -> int:
    """The worker process of launcher rank `rank` of the run writing `out`."""
    for pid in processes_mentioning(str(out)):
        try:
            env = dict(kv.split("=", 1) for kv in open(f"/proc/{pid}/environ").read().split("\0") if "=" in kv)
        except OSError:
            continue
        if env.get("RANK") == str(rank) and "TORCHELASTIC_RUN_ID" in env:
            return pid
    raise AssertionError(f"no worker of rank {rank} found")


def run_align(*args, env: dict | None = None, timeout: float = 300, cwd: str | Path | None = None):
    """`python -m align ARGS` in a fresh process; returns the CompletedProcess (text, captured)."""
    child = {k: v for k, v in os.environ.items() if k not in _DIST_ENV}
    child["COLUMNS"] = "500"  # rich wraps at the terminal width: keep each message on one line
    child.update(env or {})
    return subprocess.run([sys.executable, "-m", "align", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=child, cwd=str(cwd) if cwd else None)


def output(proc) -> str:
    return proc.stdout + proc.stderr


def assert_user_error(proc, *needles: str, code: int = 2) -> str:
    """Exit `code`, no traceback, a short message that contains every needle; returns the output."""
    out = output(proc)
    assert proc.returncode == code, f"exit {proc.returncode}, expected {code}:\n{out}"
    assert "Traceback" not in out, out
    for n in needles:
        assert n in out, f"{n!r} not in output:\n{out}"
    # short: the error and at most a couple of library lines (e.g. DeepSpeed's accelerator notice)
    assert len(out.strip().splitlines()) <= 6, out
    return out


def assert_terminated_length(row: dict, max_new_tokens: int) -> None:
    """A GRPO/PPO step's completions/mean_terminated_length is the mean length of the completions that ended with EOS
    (NaN when none did): the cut-off ones are max_new_tokens long, so the mean length of all of them is
    clipped·max_new_tokens + (1 − clipped)·terminated."""
    clipped, term = row["completions/clipped_ratio"], row["completions/mean_terminated_length"]
    if clipped == 1.0:
        assert math.isnan(term), row
        return
    assert 0 <= term <= max_new_tokens, row
    assert row["completions/mean_length"] == pytest.approx(clipped * max_new_tokens + (1 - clipped) * term), row


def assert_same_training(one: Path, two: Path, base: Path, rel: float = 1e-4, weights_rel: float = 1e-3,
                         ignore: tuple = ()) -> None:
    """Two runs of one stage (e.g. on 1 and 2 processes) logged the same metrics at every step (each within `rel`
    of max(1, |value|), the tolerance of the other stages' process-count tests; timings aside) and saved the same
    weights: ‖w₁ − w₂‖ within `weights_rel` of how far training moved them from `base` (the --model both started
    from), ‖w₁ − w₀‖. Not weight by weight: AdamW turns the rounding noise of a ~0 gradient into a step of about
    the lr (measured on GRPO: one weight 5e-5 apart at lr 1e-3, the whole difference 5e-5 of the update's norm).
    `ignore`: metrics left out (those only one of the two logs)."""
    import torch
    from safetensors.torch import load_file

    def rows(out):
        return [{k: v for k, v in json.loads(line).items() if not k.startswith("time/") and "tokens_per_s" not in k
                 and k not in ignore} for line in (out / "metrics.jsonl").read_text().splitlines()]

    a, b = rows(one), rows(two)
    assert [sorted(r) for r in a] == [sorted(r) for r in b] and len(a) > 1
    for x, y in zip(a, b):
        for k, v in x.items():  # NaN (a mean over nothing: no completion ended) equals NaN
            assert (math.isnan(v) and math.isnan(y[k])) or abs(v - y[k]) <= rel * max(1.0, abs(v)), (x["step"], k, v, y[k])
    w1, w2, w0 = (load_file(d / "model.safetensors") for d in (one / "model", two / "model", base))
    assert w1.keys() == w2.keys() == w0.keys()
    apart = torch.cat([(w1[k] - w2[k]).flatten() for k in w1]).norm().item()
    moved = torch.cat([(w1[k] - w0[k]).flatten() for k in w1]).norm().item()
    assert apart <= weights_rel * moved and moved > 0, (apart, moved)


@pytest.fixture
def single_process(monkeypatch):
    """The in-process, one-rank environment runtime.init() sets up (a stage built in the test's own process) —
    restored after the test, and set again here because an earlier test may have restored it away while the
    process group lives on."""
    from align.runtime import free_port

    for key, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1").items():
        monkeypatch.setenv(key, os.environ.get(key, value))
    monkeypatch.setenv("MASTER_PORT", os.environ.get("MASTER_PORT", str(free_port())))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """The `tiny` preset (random init, seed 0) saved with save_pretrained + the shipped tokenizer."""
    import torch

    from align.models import load_causal_lm, load_tokenizer, resolve

    ref = resolve("tiny")
    tok = load_tokenizer(ref)
    model = load_causal_lm(ref, tok, torch.float32, seed=0)
    out = tmp_path_factory.mktemp("tiny_model")
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_reward_model_dir(tmp_path_factory, shipped_tokenizer) -> Path:
    """A tiny sequence classifier (random head, seed 1) saved as a reward model, normalisation offset 0.5."""
    import torch

    from align.models import resolve
    from align.reward_model import OFFSET_KEY, load_sequence_classifier

    rm = load_sequence_classifier(resolve("tiny"), shipped_tokenizer, torch.float32, seed=1)
    rm.config.pad_token_id = shipped_tokenizer.pad_token_id
    setattr(rm.config, OFFSET_KEY, 0.5)
    out = tmp_path_factory.mktemp("tiny_rm")
    rm.save_pretrained(out, safe_serialization=True)
    shipped_tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def shipped_tokenizer():
    from align.models import load_tokenizer, resolve

    return load_tokenizer(resolve("tiny"))


# The files that take longest on 2 CPU cores (pytest --durations, 2026-11-29), longest first: the workers take files
# in collection order, so these start first and the short files fill the end (longest-processing-time-first; xdist's
# default order, by number of tests, could start a 4-minute file last and leave the other worker idle).
LONGEST_FIRST = ["test_exact_resume.py", "test_lora.py", "test_disagg.py", "test_distributed.py", "test_resume.py",
                 "test_reliability.py", "test_rm.py", "test_grpo.py", "test_pipeline.py", "test_ppo.py", "test_dpo.py",
                 "test_trackers.py"]


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order
