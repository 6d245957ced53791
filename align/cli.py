"""The `align` command line. Heavy libraries are imported inside commands so `align --help` is instant."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from typing import Optional

import typer
from rich.markup import escape

from align import config as C
from align.console import console
from align.errors import NotImplementedStage, UserError

app = typer.Typer(
    name="align",
    help="Align causal language models: SFT -> reward model -> PPO-ptx -> DPO -> GRPO, on DeepSpeed ZeRO-3.",
    no_args_is_help=True,
    rich_markup_mode="rich",
    pretty_exceptions_enable=False,
    add_completion=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
model_app = typer.Typer(help="Create models.", no_args_is_help=True)
data_app = typer.Typer(help="Generate datasets.", no_args_is_help=True)
rm_app = typer.Typer(help="Bradley-Terry reward model: train, eval, score.", no_args_is_help=True)
pipeline_app = typer.Typer(help="Run a chain of stages from a TOML file.", no_args_is_help=True)
app.add_typer(model_app, name="model")
app.add_typer(data_app, name="data")
app.add_typer(rm_app, name="rm")
app.add_typer(pipeline_app, name="pipeline")


def relaunch(nproc: int) -> None:
    """`--nproc N`: re-run this very command under torchrun with N processes, then exit with its code."""
    if nproc <= 1 or "LOCAL_RANK" in os.environ:
        return
    from align.runtime import free_port, launch_env

    argv, skip = [], False
    for a in sys.argv[1:]:  # drop --nproc: torchrun would take it for an abbreviation of its own flag
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            argv.append(a)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           f"--master_port={free_port()}", "-m", "align", *argv]
    console.print(f"[dim]launching {nproc} processes: torchrun --nproc_per_node={nproc} -m align {' '.join(argv)}[/]")
    raise SystemExit(subprocess.call(cmd, env=launch_env(nproc)))


def stage_command(parent: typer.Typer, name: str, cfg_cls, help: str, positional: tuple[str, ...] = ()):
    """Register a command whose options are the fields of `cfg_cls`; decorate the runner `fn(cfg)`."""

    def decorate(fn):
        params = [inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context)]
        annotations = {"ctx": typer.Context}
        types = C.field_types(cfg_cls)
        for f in C.fields(cfg_cls):
            t = types[f.name]
            flag = "--" + f.name.replace("_", "-")
            h = f.metadata.get("help", "")
            default_value = f.default_factory() if C.is_list(t) else f.default
            if f.name in positional:
                default = typer.Argument(default_value, help=h, show_default=True)
            elif t is bool:
                default = typer.Option(f.default, f"{flag}/--no-{flag[2:]}", help=h)
            else:
                default = typer.Option(default_value, flag, help=h)
            params.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=t))
            annotations[f.name] = t
        params.append(inspect.Parameter(
            "config", inspect.Parameter.KEYWORD_ONLY, annotation=Optional[str],
            default=typer.Option(None, "--config", help="TOML file with this command's options (flags win)."),
        ))
        annotations["config"] = Optional[str]

        def command(ctx: typer.Context, **kw):
            toml = kw.pop("config")
            explicit = {
                k: v for k, v in kw.items()
                if getattr(ctx.get_parameter_source(k), "name", "DEFAULT") != "DEFAULT"
            }
            cfg = C.build(cfg_cls, toml, explicit)
            relaunch(getattr(cfg, "nproc", 1))
            fn(cfg)

        command.__signature__ = inspect.Signature(params)
        command.__annotations__ = annotations
        command.__doc__ = help
        command.__name__ = name
        parent.command(name, help=help)(command)
        return fn

    return decorate


def not_implemented(parent: typer.Typer, name: str, what: str, issue: int) -> None:
    def command(args: Optional[list[str]] = typer.Argument(None, hidden=True)):
        raise NotImplementedStage(f"`align {what}` is not implemented yet (planned in issue #{issue}).")

    parent.command(name, help=f"{what} (not implemented yet: issue #{issue})",
                   context_settings={"ignore_unknown_options": True, "allow_extra_args": True})(command)


def main() -> None:
    # The deepspeed launcher passes --local_rank=N; torchrun sets LOCAL_RANK. Accept both.
    for a in list(sys.argv[1:]):
        if a.startswith("--local_rank") or a.startswith("--local-rank"):
            sys.argv.remove(a)
            if "=" in a:
                os.environ.setdefault("LOCAL_RANK", a.split("=", 1)[1])
    from align import commands  # noqa: F401  (registers the commands)

    try:
        app()  # standalone: usage errors exit 2 with click's message
    except UserError as e:
        if os.environ.get("RANK", "0") == "0":
            console.print("[bold red]error:[/]", escape(str(e)))
        raise SystemExit(e.exit_code)
    except NotImplementedStage as e:
        console.print("[bold yellow]not implemented:[/]", escape(str(e)))
        raise SystemExit(e.exit_code)
    except KeyboardInterrupt:
        console.print("[yellow]interrupted[/]")
        raise SystemExit(130)
