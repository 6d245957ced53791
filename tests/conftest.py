"""Shared fixtures for the core tests: a saved tiny model, and a helper to run the `align` CLI in a subprocess."""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from align.pipeline import RUN_IMPORTS

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


def align_env(env: dict | None = None) -> dict:
    """The environment of an `align` process a test starts: this one's without the distributed variables (a child
    must start its own group), wide lines, and `env`."""
    child = {k: v for k, v in os.environ.items() if k not in _DIST_ENV and k != "PYTEST_CURRENT_TEST"}
    child["COLUMNS"] = "500"  # rich wraps at the terminal width: keep each message on one line
    child.update(env or {})
    return child


def run_align(*args, env: dict | None = None, timeout: float = 300, cwd: str | Path | None = None,
              fresh: bool = False):
    """`python -m align ARGS` in a process of its own (an AlignProcess; `fresh`: always a new interpreter);
    returns the CompletedProcess (text, captured)."""
    return run_command([sys.executable, "-m", "align", *map(str, args)], align_env(env), timeout, cwd, fresh)


def run_command(cmd: list[str], env: dict, timeout: float = 600, cwd: str | Path | None = None,
                fresh: bool = False) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout), `python -m M ...`
    for a module M of FORKED run as an AlignProcess unless `fresh`."""
    if fresh or cmd[:2] != [sys.executable, "-m"] or cmd[2] not in FORKED:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                              cwd=str(cwd) if cwd else None)
    proc = AlignProcess(cmd[3:], env, cwd=cwd, module=cmd[2])
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


# The modules run_command forks (`python -m M`): the CLI, the CLI with a fault injected into align (patches of
# module and class attributes looked up when called: the same in a process that imported align before), and
# torchrun's launcher (its workers are new interpreters, started by it as ever; the launcher saves torch's import).
FORKED = ("align", "benchmarks.faults", "torch.distributed.run")
# What every `align` process imports: ~3.5 s of CPU before it does anything, most of a tiny stage's run.
PRELOAD = ["torch", "transformers", "deepspeed", "align.cli", "stages.sft", "stages.eval", "stages.rm", "stages.dpo",
           "stages.grpo", "stages.ppo", "stages.model_init", "tests.conftest",
           # imported only once a stage runs (align/pipeline.py: RUN_IMPORTS, as `align pipeline run`'s fork server
           # does; and `align pipeline`'s CLI): ~2.5 s of CPU in every forked process without them
           *RUN_IMPORTS, "align.pipeline_cli",
           "tests.forkserver_frozen"]  # last: freezes what the imports above created (gc.freeze)
# Variables an `align` process reads once it runs, never at import: a process forked from the fork server sees
# them as a new interpreter would, whatever the server's were; and those that an `align` process sets in itself
# (with setdefault, to one value), which a test process that ran a stage or a library in-process holds too.
RUN_TIME_ENV = {"COLUMNS", "LINES", "ALIGN_DIST_TIMEOUT", "ALIGN_DEVICE_MEMORY_BYTES", "PYTEST_CURRENT_TEST", *_DIST_ENV,
                "DS_ACCELERATOR", "TRANSFORMERS_NO_ADVISORY_WARNINGS",  # align.runtime
                "TORCHINDUCTOR_CACHE_DIR", "MLFLOW_ALLOW_FILE_STORE",  # align.compile_cache, align.trackers
                "PYTORCH_NVML_BASED_CUDA_CHECK", "KMP_DUPLICATE_LIB_OK"}  # DeepSpeed's and scikit-learn's imports
_SERVER_ENV: dict[str, str] = {}  # the fork server's environment


@functools.lru_cache(maxsize=None)
def align_processes():
    """A multiprocessing fork server (one per test process) that imported PRELOAD once, started in an environment
    without the variables of RUN_TIME_ENV (rich fixes its width at import when COLUMNS is set). A process forked
    from it has the boundary of a new interpreter (its own distributed group, memory, signals, exit code and
    output), as `align pipeline run` starts its stages (align/pipeline.py: stage_processes)."""
    import ctypes
    import multiprocessing
    from multiprocessing import forkserver

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    getenv = ctypes.CDLL(None).getenv  # the process's environment, which a library may have set past os.environ
    getenv.restype = ctypes.c_char_p
    saved = {k: getenv(k.encode()) for k in RUN_TIME_ENV}
    _SERVER_ENV.update({k: v for k, v in os.environ.items() if k not in RUN_TIME_ENV})
    try:
        for k in RUN_TIME_ENV:
            os.unsetenv(k)
        forkserver.ensure_running()
    finally:
        for k, v in saved.items():
            if v is not None:
                os.putenv(k, v.decode())
    return ctx


@pytest.fixture(scope="session", autouse=True)
def _align_fork_server():
    """The fork server, started before a test could start multiprocessing's (one per process, which a pipeline run
    in a test's own process and tests/test_disk.py use too) in the environment of its moment. ALIGN_TEST_FORKSERVER=lazy
    (the mutation benchmark, which runs a few tests at a time): started by the first test that runs `align`."""
    if os.environ.get("ALIGN_TEST_FORKSERVER") != "lazy":
        align_processes()


def _forked_align(module: str, argv: list[str], env: dict, cwd: str | None, stdout: str, stderr: str | None,
                  new_session: bool = False) -> None:
    """In the forked process: what `python -m MODULE ARGV` does in a new one, its output written to files (stderr
    None: into stdout's), its exit code (SystemExit's; 1 and a traceback for an uncaught exception) the process's;
    `new_session`: in a session (and process group) of its own, as subprocess.Popen's start_new_session."""
    import atexit
    import runpy
    import threading
    import traceback

    if new_session:
        os.setsid()

    for fd, path in ((1, stdout), (2, stderr)):
        if path is None:
            os.dup2(1, fd)
            continue
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    os.environ.clear()
    os.environ.update(env)
    if cwd:
        os.chdir(cwd)
    sys.path.insert(0, os.getcwd())  # as `python -m` puts it first
    sys.argv = [module, *argv]
    code = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code
    except BaseException:
        traceback.print_exc()
        code = 1
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    for t in threading.enumerate():  # the interpreter's exit: it waits for them, then runs the atexit functions
        if t is not threading.main_thread() and not t.daemon:
            t.join()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code & 0xFF)


class AlignProcess:
    """`python -m align ARGS` (or `python -m MODULE ARGS`, a module of FORKED) with the part of subprocess.Popen's
    interface the tests use (args, pid, poll, wait, communicate, kill, send_signal, returncode; text output; stdout
    and stderr piped apart or, `stderr_to_stdout`, together; `env` its whole environment, None: this process's;
    `new_session`: a process group of its own, which os.killpg(pid, ...) ends). Forked from `align_processes`' server, which paid
    the imports, where that is what a new interpreter would be (`env` differs from the server's only in
    RUN_TIME_ENV); else a new interpreter (subprocess.Popen)."""

    def __init__(self, args, env: dict | None = None, cwd: str | Path | None = None, stderr_to_stdout: bool = False,
                 module: str = "align", new_session: bool = False):
        argv = [str(a) for a in args]
        self.args = [sys.executable, "-m", module, *argv]
        env = dict(os.environ if env is None else env)
        self.returncode, self._popen, self._dir = None, None, None
        align_processes()
        if any(env.get(k) != _SERVER_ENV.get(k) for k in set(env) | set(_SERVER_ENV) if k not in RUN_TIME_ENV):
            self._popen = subprocess.Popen(self.args, stdout=subprocess.PIPE, text=True, env=env,
                                           stderr=subprocess.STDOUT if stderr_to_stdout else subprocess.PIPE,
                                           cwd=str(cwd) if cwd else None, start_new_session=new_session)
            self.pid = self._popen.pid
            return
        self._dir = Path(tempfile.mkdtemp(prefix="align-run-"))
        self._files = [self._dir / "stdout", None if stderr_to_stdout else self._dir / "stderr"]
        self._proc = align_processes().Process(target=_forked_align, args=(
            module, argv, env, str(cwd) if cwd else None, *(str(f) if f else None for f in self._files), new_session))
        self._proc.start()
        self.pid = self._proc.pid

    def poll(self):
        if self.returncode is None:
            self.returncode = self._popen.poll() if self._popen else self._proc.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self._popen:
            self.returncode = self._popen.wait(timeout)
            return self.returncode
        self._proc.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def communicate(self, timeout: float | None = None):
        if self._popen:
            said = self._popen.communicate(timeout=timeout)
            self.returncode = self._popen.returncode
            return said
        self.wait(timeout)
        said = tuple(f.read_text(errors="replace") if f and f.exists() else None for f in self._files)
        shutil.rmtree(self._dir, ignore_errors=True)
        return said

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(9)


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


def save_tiny_model(out: Path, seed: int, silent_head: bool = False) -> Path:
    """The `tiny` preset (random init with `seed`) saved in `out` with save_pretrained + the shipped tokenizer.
    `silent_head`: the output rows of every token that decodes to nothing (special and template tokens, EOS too)
    zeroed, so that greedy continuations are visible text of exactly --max-new-tokens tokens (the random tiny
    model's greedy repeats a template token, which decodes to '')."""
    import torch

    from align.models import load_causal_lm, load_tokenizer, resolve

    ref = resolve("tiny")
    tok = load_tokenizer(ref)
    model = load_causal_lm(ref, tok, torch.float32, seed=seed)
    if silent_head:
        silent = [i for i in range(len(tok)) if tok.decode([i], skip_special_tokens=True).strip() == ""]
        with torch.no_grad():
            model.get_output_embeddings().weight[silent] = 0
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


# Tiny random mixture-of-experts models of transformers' MoE families (hidden 32, 2 layers, 4 experts, top-2), with
# the shipped tokenizer: each family's own config keys for its experts.
MOE_SHAPE = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 max_position_embeddings=512, num_experts_per_tok=2, tie_word_embeddings=True)
MOE_FAMILIES = {
    "qwen3_moe": dict(num_experts=4, moe_intermediate_size=32, intermediate_size=64, head_dim=8),
    "olmoe": dict(num_experts=4, intermediate_size=32),
    "mixtral": dict(num_local_experts=4, intermediate_size=32, head_dim=8),
    "qwen2_moe": dict(num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                      intermediate_size=64),
}


def moe_config(family: str, tokenizer):
    """The tiny config of MoE `family` (a key of MOE_FAMILIES) for `tokenizer`'s vocabulary and special tokens."""
    from transformers import AutoConfig

    return AutoConfig.for_model(family, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                                **MOE_SHAPE, **MOE_FAMILIES[family])


def save_tiny_moe(out: Path, family: str, seed: int = 0) -> Path:
    """A random-init tiny MoE causal LM of `family` (seed `seed`) saved with save_pretrained + the shipped
    tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM

    from align.models import load_tokenizer, resolve

    tok = load_tokenizer(resolve("tiny"))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(moe_config(family, tok), dtype=torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


def greedy_ids(model, prompt_ids: list, max_new: int, eos: int) -> list:
    """`model`'s greedy continuation of ONE prompt, token by token by argmax over its full forward (unpadded, no
    cache): at most `max_new` tokens, EOS included when it comes."""
    import torch

    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(max_new):
            ids.append(int(model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
            if ids[-1] == eos:
                break
    return ids[len(prompt_ids):]


@contextlib.contextmanager
def applied_lrs(*optimizers):
    """[the learning rate each optimizer step applied (its first group's), ...] per optimizer, while the block
    runs (a pre-step hook: the rate the step uses)."""
    got = [[] for _ in optimizers]
    hooks = [opt.register_step_pre_hook(lambda o, args, kw, out=out: out.append(o.param_groups[0]["lr"]))
             for opt, out in zip(optimizers, got)]
    try:
        yield got
    finally:
        for h in hooks:
            h.remove()


def decay_groups(optimizer) -> set[tuple]:
    """{(weight decay, what the group holds: "matrices" (every parameter ≥ 2-D), "1-d" (norms, biases), "mixed" or
    "empty", betas)} of each parameter group."""
    def kind(params):
        dims = [p.ndim for p in params]
        return ("empty" if not dims else "matrices" if min(dims) >= 2 else "1-d" if max(dims) < 2 else "mixed")
    return {(g["weight_decay"], kind(g["params"]), g["betas"]) for g in optimizer.param_groups}


def eos_prone(model_dir: Path, prompt_ids: list[int], a: float, out: Path | None = None):
    """The model saved in `model_dir` (fp32, dropout off) with its (tied) EOS output row set along its mean last
    hidden state of `prompt_ids`, scaled by `a`: EOS becomes likely, so samples of one batch end at different steps.
    With `out`: also saved there (with `model_dir`'s tokenizer) for a stage to load."""
    import torch

    from align.models import load_causal_lm, load_tokenizer, resolve

    source = resolve(str(model_dir))
    tok = load_tokenizer(source)
    m = load_causal_lm(source, tok, torch.float32, 0).eval()
    with torch.no_grad():
        u = m(input_ids=torch.tensor([prompt_ids]), output_hidden_states=True).hidden_states[-1][0].mean(0)
        m.get_output_embeddings().weight[tok.eos_token_id] = a * u / u.norm() ** 2
    if out is not None:
        m.save_pretrained(out, safe_serialization=True)
        tok.save_pretrained(out)
    return m


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """The `tiny` preset (random init, seed 0) saved with save_pretrained + the shipped tokenizer."""
    return save_tiny_model(tmp_path_factory.mktemp("tiny_model"), seed=0)


@pytest.fixture(scope="session")
def other_model_dir(tmp_path_factory) -> Path:
    """A second tiny model (the `tiny` preset initialised with seed 1): a --ref-model or teacher unlike the first."""
    return save_tiny_model(tmp_path_factory.mktemp("tiny_model_seed1"), seed=1)


@pytest.fixture(scope="session")
def chatty_model_dir(tmp_path_factory) -> Path:
    """The tiny model (seed 0) whose greedy answers are visible text (save_tiny_model's `silent_head`)."""
    return save_tiny_model(tmp_path_factory.mktemp("tiny_chatty"), seed=0, silent_head=True)


@contextlib.contextmanager
def stage_in_process(cfg, stage: str, cls):
    """`cls(cfg, run)` (a stage's class, e.g. GRPO) built in this process under a StageRun of `stage` with `cfg`
    validated; transformers' global DeepSpeed config is unset afterwards (the next test builds its own)."""
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    from align.engine.run import StageRun

    cfg.validate()
    try:
        with StageRun(cfg, stage) as run:
            yield cls(cfg, run)
    finally:
        unset_hf_deepspeed_config()


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
def moe_model_dirs(tmp_path_factory) -> dict[str, Path]:
    """Each MoE family of MOE_FAMILIES as a saved tiny model (seed 0): {family: directory}."""
    return {f: save_tiny_moe(tmp_path_factory.mktemp(f"tiny_{f}"), f) for f in MOE_FAMILIES}


@pytest.fixture(scope="session")
def shipped_tokenizer():
    from align.models import load_tokenizer, resolve

    return load_tokenizer(resolve("tiny"))


# The files that take longest on 2 CPU cores (pytest --durations, 2026-12-05), longest first: the workers take files
# in collection order, so these start first and the short files fill the end (longest-processing-time-first; xdist's
# default order, by number of tests, could start a 3-minute file last and leave the other worker idle).
LONGEST_FIRST = ["test_exact_resume.py", "test_disagg.py", "test_api.py", "test_lora.py", "test_distributed.py",
                 "test_moe_train.py", "test_reliability.py", "test_grpo.py", "test_golden.py", "test_pipeline.py", "test_dpo.py", "test_rm.py",
                 "test_ppo.py", "test_resume.py", "test_sandbox.py", "test_trl_formats_train.py", "test_disk.py",
                 "test_dpo_online.py", "test_gpu_paths.py", "test_task_sources.py", "test_trackers.py"]


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


# ALIGN_SUITE_RECORD=DIR (CI, .ci/run): each test process writes DIR/PID.json with the ids of the tests that passed in
# it and the modules it imported, so that the mutation benchmark run right after the suite needs no unmutated pass of
# its own (`python -m benchmarks.mutations --after-suite DIR`: every test a mutation names must be among them).
_PASSED: list[str] = []


def pytest_runtest_logreport(report):
    if report.when == "call" and report.passed and os.environ.get("ALIGN_SUITE_RECORD"):
        _PASSED.append(report.nodeid)


def pytest_sessionfinish(session, exitstatus):
    d = os.environ.get("ALIGN_SUITE_RECORD")
    if d:
        Path(d).mkdir(parents=True, exist_ok=True)
        (Path(d) / f"{os.getpid()}.json").write_text(json.dumps({"passed": _PASSED, "modules": sorted(sys.modules)}))
