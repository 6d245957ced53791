"""`align export RUN --to DIR`: a run's model as a plain transformers model directory (an adapter saved
alone merged into its base, as every stage loads it), its tokenizer and chat template, and a model card (README.md) of its
lineage: the stages it came from, their data hashes, key metrics and RLMonitor events, read from artifact.json files.

DIR is written whole or not at all: into a temporary directory beside it, renamed into place at the end. A DIR that
exists and is not empty is refused without --overwrite.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from align.config import Options, opt
from align.errors import UserError

KEY_METRICS = 8  # per stage in the model card


@dataclass(frozen=True)
class ExportConfig(Options):
    run: str = opt("", "The run to export: a stage's --out directory (a complete artifact holding a policy).")
    to: str = opt("", "The directory to write: model weights (safetensors), tokenizer, chat template, README.md.")
    overwrite: bool = opt(False, "Replace a --to directory that is not empty.")
    max_shard_size: str = opt("5GB", "The largest safetensors file (transformers' max_shard_size).")


def run(cfg: ExportConfig) -> Path:
    from align.console import info
    from align.models import resolve

    if not cfg.run or not cfg.to:
        raise UserError("align export RUN --to DIR: name the run (a stage's --out) and the directory to write.")
    dest = Path(cfg.to)
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())) and not cfg.overwrite:
        raise UserError(f"--to {dest}: exists and is not empty; choose another directory or pass --overwrite.")
    source = resolve(cfg.run)  # a complete, untampered policy artifact (or a UserError saying what it is)
    if source.artifact is None:
        raise UserError(f"{cfg.run}: not an align run (no artifact.json); it is a model directory already.")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}.tmp"))
    try:
        _write(source, Path(cfg.run), tmp, cfg.max_shard_size)
        if dest.exists():
            shutil.rmtree(dest) if dest.is_dir() else dest.unlink()
        os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    info(f"exported {cfg.run} → {dest}")
    return dest


def _write(source, run_dir: Path, out: Path, max_shard_size: str) -> None:
    import torch

    from align.models import load_causal_lm, load_tokenizer

    tok = load_tokenizer(source)
    model = load_causal_lm(source, tok, torch.float32)  # an adapter saved alone (--no-merge) merged into its base
    for k in [k for k in vars(model.config) if k.startswith("align_")]:
        delattr(model.config, k)  # align's own bookkeeping; a plain causal LM has none
    model.save_pretrained(out, safe_serialization=True, max_shard_size=max_shard_size)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(out)
    tok.save_pretrained(out)
    (out / "README.md").write_text(model_card(run_dir, has_template=bool(getattr(tok, "chat_template", None))))
    out.chmod(0o755)


def _short(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def model_card(run_dir: Path, has_template: bool) -> str:
    """README.md: what the model is and how it was made, stage by stage (upstream first)."""
    from align.lineage import chain

    stages = chain(run_dir)
    me = stages[-1]
    lines = ["---", "library_name: transformers", "tags:", "- align", *[f"- {s['stage']}" for s in stages
                                                                       if s.get("stage")], "---", "",
             f"# {run_dir.resolve().name}", "",
             f"A causal language model post-trained with align ({' → '.join(str(s['stage']) for s in stages)}), "
             "exported as a plain transformers model (any LoRA adapter merged).", "",
             "```python", "from transformers import AutoModelForCausalLM, AutoTokenizer",
             'model = AutoModelForCausalLM.from_pretrained("PATH")', 'tokenizer = AutoTokenizer.from_pretrained("PATH")',
             "```", "", f"Chat template: {'included (tokenizer_config.json)' if has_template else 'none'}.", "",
             "## Lineage", ""]
    for i, s in enumerate(stages, 1):
        lines += [f"### {i}. {s['stage']} ({s['status']})", "", f"- run: `{s['out']}`"]
        if s.get("model"):
            lines.append(f"- model: `{s['model']}`")
        for path, digest in s.get("data", {}).items():
            lines.append(f"- data: `{path}` sha256 `{digest}`")
        if s.get("git_commit"):
            lines.append(f"- align commit: `{s['git_commit']}`")
        numbers = [(k, v) for k, v in s.get("metrics", {}).items() if isinstance(v, (int, float))
                   and not isinstance(v, bool)][:KEY_METRICS]
        if numbers:
            lines += ["", "| metric | value |", "|---|---|", *[f"| {k} | {_short(v)} |" for k, v in numbers]]
        events = s.get("events", [])
        lines += ["", f"RLMonitor events: {len(events) or 'none'}"]
        lines += [f"- step {e['step']} {e['severity']} `{e['rule']}`: {e.get('detail', '')}" for e in events]
        lines.append("")
    if me.get("status") != "complete":
        lines.append(f"Note: the exported run's status is {me.get('status')!r}.")
    return "\n".join(lines) + "\n"
