"""The `align` command line, built from align.registry. A command's module is imported only when it runs (or
shows its --help), so `align --help` is instant."""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
from typing import Optional

import click
import typer
from rich.markup import escape
from typer.core import TyperCommand, TyperGroup

from align import config as C
from align import registry
from align.console import console
from align.errors import Terminated, UserError

TYPER = dict(no_args_is_help=True, rich_markup_mode="rich", pretty_exceptions_enable=False, add_completion=False,
             context_settings={"help_option_names": ["-h", "--help"]})


def relaunch(cfg, stage: str) -> None:
    """`--nproc N` / `--nnodes M`: re-run this very command under torchrun (N processes here; with M > 1 this
    machine is node --node-rank of M, meeting the others at --master-addr:--master-port), then exit with its code.
    torchrun dies with this process (SIGTERM to it, even when this one is SIGKILLed) and stops its workers; a
    SIGTERM to this process is passed on."""
    nproc, nnodes = getattr(cfg, "nproc", 1), getattr(cfg, "nnodes", 1)
    if (nproc <= 1 and nnodes <= 1) or "LOCAL_RANK" in os.environ or getattr(cfg, "plan", False):
        return  # --plan: one process prints the plan of nproc x nnodes
    import signal
    from pathlib import Path

    from align.engine import outdir
    from align.runtime import die_with_parent, free_port, launch_env

    if getattr(cfg, "out", None) and cfg.node_rank == 0:  # the run's lock is node 0's: the others find it taken
        outdir.check(cfg, stage)  # exit 2 here rather than a worker's failure through torchrun
        outdir.refuse_if_locked(Path(cfg.out))

    own = ("--nproc", "--nnodes", "--node-rank", "--master-addr", "--master-port")
    argv, skip = [], False
    for a in sys.argv[1:]:  # drop the launch flags: torchrun would take --nproc for an abbreviation of its own
        if skip:
            skip = False
        elif a in own:
            skip = True
        elif not a.startswith(tuple(f"{o}=" for o in own)):
            argv.append(a)
    nodes = ([f"--nnodes={nnodes}", f"--node_rank={cfg.node_rank}", f"--master_addr={cfg.master_addr}",
              f"--master_port={cfg.master_port}"] if nnodes > 1 else [f"--master_port={free_port()}"])
    launch = [f"--nproc_per_node={nproc}", *nodes]
    cmd = [sys.executable, "-m", "torch.distributed.run", *launch, "-m", "align", *argv]
    from align.reward_http import redact_arg  # a reward URL's credentials not shown

    console.print(f"[dim]launching {nproc} process(es){f' on node {cfg.node_rank} of {nnodes}' if nnodes > 1 else ''}: "
                  f"torchrun {' '.join(launch)} -m align {' '.join(map(redact_arg, argv))}[/]")
    import time

    started = time.time()
    proc = subprocess.Popen(cmd, env=launch_env(nproc), preexec_fn=die_with_parent)
    signal.signal(signal.SIGTERM, lambda signum, frame: proc.send_signal(signal.SIGTERM))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches torchrun and the workers themselves
    code = proc.wait()
    if code and getattr(cfg, "out", None) and cfg.node_rank == 0:
        from align.artifacts import fail_if_running

        if fail_if_running(Path(cfg.out), started, f"the run's processes ended with exit code {code} before rank 0 "
                           "could say why (a process was killed or lost, and the launcher stopped the others); see "
                           "the log above. --resume continues from the latest checkpoint."):
            console.print(f"[red]{cfg.out}: marked failed (artifact.json still said running)[/]")
    raise SystemExit(code)


def literal(text: str) -> str:
    """A help text rich shows as written: markup escaped (a literal [...] stays), emoji codes (:name:) broken with
    an invisible word joiner."""
    from rich.emoji import Emoji

    text = escape(text)
    return text if Emoji.replace(text) == text else re.sub(r":(?=[^\s:]+:)", ":\u2060", text)


def panels(cmd: registry.Command) -> dict[str, str]:
    """The --help panel of each option of `cmd`: its own options (those its config class declares) under
    "<command> options", then the groups of align.config.GROUPS in their order."""
    own = f"{' '.join(cmd.words)} options"
    cfg_cls = cmd.config_class()
    return {f.name: C.GROUPS.get(C.group_of(cfg_cls, f.name), own) for f in C.help_order(cfg_cls)}


def build_command(cmd: registry.Command) -> click.Command:
    """The click command whose options are the fields of the command's config dataclass (defaults < --config
    TOML < flags), running `cmd.run(config)`; --help lists them in panels (`panels`), the command's own first."""
    cfg_cls = cmd.config_class()
    params = [inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context)]
    types = C.field_types(cfg_cls)
    panel = panels(cmd)
    for f in C.help_order(cfg_cls):
        t = types[f.name]
        flag = "--" + f.name.replace("_", "-")
        h = literal(C.help_text(f))
        default_value = f.default_factory() if C.is_list(t) else f.default
        if f.name in cmd.positional:
            default = typer.Argument(default_value, help=h, show_default=True)
        elif t is bool:
            default = typer.Option(f.default, f"{flag}/--no-{flag[2:]}", help=h, rich_help_panel=panel[f.name])
        else:  # an automatic default says what it becomes in its help (C.help_text)
            default = typer.Option(default_value, flag, help=h, rich_help_panel=panel[f.name],
                                   show_default="auto" not in f.metadata)
        params.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=t))
    params.append(inspect.Parameter("config", inspect.Parameter.KEYWORD_ONLY, annotation=Optional[str],
                                    default=typer.Option(None, "--config", help="TOML file with this command's "
                                                         "options (flags win).", rich_help_panel=C.GROUPS["run"])))

    def command(ctx: typer.Context, **kw):
        toml = kw.pop("config")
        explicit = {k: v for k, v in kw.items()
                    if getattr(ctx.get_parameter_source(k), "name", "DEFAULT") != "DEFAULT"}
        cfg = C.build(cfg_cls, toml, explicit)
        relaunch(cfg, cmd.kind)
        cmd.run(cfg)

    command.__signature__ = inspect.Signature(params)
    command.__doc__ = cmd.help
    app = typer.Typer(**TYPER)
    app.command(cmd.words[-1], help=literal(cmd.help), cls=StageCommand)(command)
    built = typer.main.get_command(app)
    built.first_panel = next(iter(panel.values()), None)
    return built


class StageCommand(TyperCommand):
    """A registry command's --help: its panels (`panels`) in two columns — the flag with its type, then what it
    does — rather than typer's six, whose column of --no-... flags leaves the help text a third of the width;
    --help itself in the first panel."""

    first_panel: str | None = None

    def get_help_option(self, ctx):
        option = super().get_help_option(ctx)
        if option is not None:
            option.opts = sorted(option.opts, key=len)  # click keeps the names in a set: "-h, --help" every time
        if option is not None and self.first_panel:
            option.rich_help_panel = self.first_panel
        return option

    def format_help(self, ctx, formatter) -> None:
        from typer import rich_utils

        default = getattr(rich_utils, "_print_options_panel", None)
        if default is None or not hasattr(rich_utils, "_get_parameter_help"):  # another typer: its own layout
            return super().format_help(ctx, formatter)
        rich_utils._print_options_panel = two_column_panel
        try:
            return super().format_help(ctx, formatter)
        finally:
            rich_utils._print_options_panel = default


def two_column_panel(*, name: str, params: list, ctx, markup_mode, console) -> None:
    """One --help panel (typer.rich_utils' hook): each option's flags (a switch's --no- form below it) and type,
    then its help with the default."""
    from rich.panel import Panel
    from rich.table import Table
    from rich.text import Text
    from typer import rich_utils

    if not params:
        return
    table = Table(highlight=True, show_header=False, expand=True, box=None, pad_edge=False, padding=(0, 1))
    table.add_column(no_wrap=True)
    table.add_column(ratio=1)
    for param in params:
        label = Text(", ".join(param.opts) if param.opts else param.human_readable_name, style="bold cyan")
        if param.secondary_opts:
            label.append("\n" + ", ".join(param.secondary_opts), style="bold magenta")
        elif not getattr(param, "is_flag", False) and param.display_type_rich(ctx=ctx):
            label.append(f" {param.display_type_rich(ctx=ctx)}", style="yellow")
        table.add_row(label, rich_utils._get_parameter_help(param=param, ctx=ctx, markup_mode=markup_mode))
    console.print(Panel(table, border_style="dim", title=name, title_align="left"))


class Listing(click.Command):
    """A registry command as `--help` lists it (name and help), before its module is imported."""

    def __init__(self, cmd: registry.Command):
        super().__init__(cmd.words[-1], help=cmd.help)
        self.entry = cmd


class LazyGroup(TyperGroup):
    """Lists its registry commands without importing them; builds the one that is invoked."""

    def __init__(self, *args, prefix: tuple[str, ...] = (), **kwargs):
        super().__init__(*args, **kwargs)
        for cmd in registry.COMMANDS:
            if cmd.words[:-1] == prefix:
                self.add_command(Listing(cmd))
            elif cmd.words[: len(prefix)] == prefix and len(cmd.words) == len(prefix) + 2:
                word = cmd.words[len(prefix)]
                if word not in self.commands:
                    self.add_command(LazyGroup(name=word, prefix=(*prefix, word), help=registry.GROUPS[word],
                                               rich_markup_mode="rich", no_args_is_help=True))

    def list_commands(self, ctx) -> list[str]:
        return sorted(self.commands, key=lambda name: name == "pipeline")  # registry order, pipeline last

    def resolve_command(self, ctx, args):
        name, cmd, rest = super().resolve_command(ctx, args)
        return name, (build_command(cmd.entry) if isinstance(cmd, Listing) else cmd), rest


def app() -> click.Group:
    from align import pipeline_cli

    root = typer.Typer(name="align", cls=LazyGroup, help="Align causal language models: SFT -> reward model -> "
                       "PPO-ptx -> DPO -> GRPO, on DeepSpeed ZeRO-3.", **TYPER)
    root.add_typer(pipeline_cli.app, name="pipeline", help=registry.GROUPS["pipeline"])
    group = typer.main.get_command(root)
    literal_help(group.commands["pipeline"])
    return group


def literal_help(cmd: click.Command) -> None:
    """Pass the help texts of a click command, its parameters and subcommands through `literal` (in place): the
    typer-built pipeline commands, whose texts name TOML tables such as [stages.NAME]."""
    cmd.help = literal(cmd.help) if cmd.help else cmd.help
    for param in cmd.params:
        if getattr(param, "help", None):
            param.help = literal(param.help)
    for sub in getattr(cmd, "commands", {}).values():
        literal_help(sub)


def main() -> None:
    from align.compile_cache import use_persistent_cache

    use_persistent_cache()  # before anything imports torch's compiler (runtime.init sets it too, for library use)
    # The deepspeed launcher passes --local_rank=N; torchrun sets LOCAL_RANK. Accept both.
    for a in list(sys.argv[1:]):
        if a.startswith("--local_rank") or a.startswith("--local-rank"):
            sys.argv.remove(a)
            if "=" in a:
                os.environ.setdefault("LOCAL_RANK", a.split("=", 1)[1])
    clean = False
    try:
        app()(prog_name="align")  # standalone: usage errors exit 2 with click's message
    except SystemExit as e:
        clean = e.code in (0, None)
        raise
    except UserError as e:
        if os.environ.get("RANK", "0") == "0":
            console.print("[bold red]error:[/]", escape(str(e)))
        raise SystemExit(e.exit_code)
    except KeyboardInterrupt:
        console.print("[yellow]interrupted[/]")
        raise SystemExit(130)
    except Terminated as e:
        console.print("[yellow]terminated[/]")
        raise SystemExit(e.exit_code)
    finally:
        if "align.runtime" in sys.modules:  # a stage ran (--help and usage errors never import torch)
            sys.modules["align.runtime"].shutdown(clean)
            if clean and int(os.environ.get("WORLD_SIZE", "1")) > 1:
                # A finished worker of a multi-process run leaves here, without the interpreter's teardown: the
                # artifact is complete, the lock released and the process group ended, yet threads of the
                # communication libraries still alive at teardown have aborted finished workers (SIGABRT,
                # "terminate called without an active exception": 1 run in ~5 of the 2-process tests under
                # load), turning a successful run's exit 0 into a launcher-reported crash.
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(0)
