"""The Python API: each `align` command as a function of its options, the same code path as the command line.

    import align

    sft = align.sft(model="tiny", max_steps=100, out="runs/sft")
    print(sft.metrics["eval/pass@1"])
    grpo = align.grpo(model=sft.path, reward=my_reward, max_steps=30, out="runs/grpo")

A function takes the command's options as keyword arguments, named as its flags (`max_steps` for `--max-steps`)
and checked as the flags are (`config=` a TOML file, as `--config`; the arguments win over it); it runs the
command in this process and returns its `Artifact`. A stage's bad option or data raises `align.errors.UserError`
(what the command line prints before it exits with 2). `reward=` takes what `--reward` takes, and Python
functions as well: per sample `fn(prompt, completion, **row) -> float` or batched TRL-style
`fn(prompts, completions, **columns) -> list[float]`, alone, in a list, or as `(fn, weight)`.

Functions: sft, rm_train, rm_eval, rm_score, ppo, dpo, grpo, eval, model_init, data_make, report, export
(`align.api.NAMES`); `load(path)` reads an earlier run's Artifact. Several
processes (`nproc` > 1) need the command line (`align ... --nproc N`), which launches them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from align import config as C
from align import registry
from align.artifacts import read_artifact
from align.errors import UserError


@dataclass(frozen=True)
class Artifact:
    """What a command wrote: its folder (`path`, what a later stage's `model=` takes), and from its artifact.json
    the stage, status, resolved config, inputs and final metrics (`record`: the whole of it)."""

    path: Path
    record: dict = field(repr=False)

    @property
    def stage(self) -> str:
        return self.record.get("stage", "")

    @property
    def status(self) -> str:
        return self.record.get("status", "")

    @property
    def metrics(self) -> dict:
        return self.record.get("metrics", {})

    @property
    def config(self) -> dict:
        return self.record.get("config", {})

    @property
    def model_dir(self) -> Path:
        """model/: a save_pretrained folder that plain transformers loads."""
        return self.path / "model"

    def __str__(self) -> str:  # a path where a later call takes one
        return str(self.path)

    def __fspath__(self) -> str:
        return str(self.path)


def _option_value(name: str, value):
    """An argument as its flag's value: a Python reward function (or `(fn, weight)`) becomes a --reward spec that
    names it; an Artifact or a Path the folder's path; one string where the option repeats, a list of one."""
    if name in ("reward", "verifier") or callable(value):
        values = value if isinstance(value, list) else [value]
        specs = [_spec(*v) if isinstance(v, tuple) else _spec(v) for v in values]
        return specs if isinstance(value, list) or name == "reward" else specs[0]
    if isinstance(value, (Artifact, Path)):
        return str(value)
    return value


def _spec(reward, weight: float = 1.0) -> str:
    """One --reward spec: a Python function registered in this process (rewards.python_reward), or a spec given
    as text ("math", "file.py:fn") with its weight."""
    from align.rewards import python_reward

    if callable(reward):
        return python_reward(reward, weight)
    return reward if weight == 1.0 else f"{reward}:{weight:g}"


def run_command(words: tuple[str, ...], config: str | None = None, **options) -> Artifact | None:
    """Run the registry command `words` with `options` (keyword arguments named as its flags) in this process:
    defaults < `config` TOML < options, each checked as its flag is. Returns the artifact it wrote (None for a
    command that writes none)."""
    cmd = next((c for c in registry.COMMANDS if c.words == words), None)
    if cmd is None:
        raise UserError(f"no command {' '.join(words)!r}.")
    cls = cmd.config_class()
    known = {f.name for f in C.fields(cls)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise UserError(f"align.{'_'.join(words)}(): unknown option {unknown[0]!r} (known: {', '.join(sorted(known))}).")
    explicit = {k: _option_value(k, v) for k, v in options.items()}
    explicit = {k: [v] if C.is_list(C.field_types(cls)[k]) and isinstance(v, str) else v for k, v in explicit.items()}
    cfg = C.build(cls, config, explicit)
    if getattr(cfg, "nproc", 1) > 1 or getattr(cfg, "nnodes", 1) > 1:
        raise UserError("several processes (nproc/nnodes > 1) need the command line: `align "
                        f"{' '.join(words)} --nproc N ...` launches them.")
    from align import runtime
    from align.compile_cache import use_persistent_cache

    use_persistent_cache()  # as the command line does, before anything imports torch's compiler
    clean = False
    try:
        cmd.run(cfg)
        clean = True
    finally:
        runtime.shutdown(clean)
    out = getattr(cfg, "out", "")
    record = read_artifact(Path(out)) if out and Path(out).is_dir() else None
    return Artifact(Path(out), record) if record is not None else None


def _command(words: tuple[str, ...]):
    def command(config: str | None = None, **options) -> Artifact | None:
        return run_command(words, config, **options)

    cmd = next(c for c in registry.COMMANDS if c.words == words)
    command.__name__ = command.__qualname__ = "_".join(words)
    command.__doc__ = f"`align {' '.join(words)}`: {cmd.help} Options: as `align {' '.join(words)} --help` lists " \
                      "them, as keyword arguments (max_steps=... for --max-steps). Returns the Artifact."
    return command


NAMES = {"_".join(c.words): c.words for c in registry.COMMANDS}
globals().update({name: _command(words) for name, words in NAMES.items()})


def load(path: str | Path) -> Artifact:
    """The Artifact of a folder an earlier run wrote (its artifact.json)."""
    record = read_artifact(Path(path))
    if record is None:
        raise UserError(f"{path}: no artifact.json; not an align artifact.")
    return Artifact(Path(path), record)
