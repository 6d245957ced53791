"""Run an `align` command in this process with a hook at the end of every step (for the profilers)."""

from __future__ import annotations


def run_with_step_hook(args: list[str], hook) -> None:
    """`align ARGS` in this process; `hook(step)` runs at the end of each step, before the engine logs it
    (`step` is 1-based: it is called after optimiser step `step - 1`)."""
    from align.engine.run import StageRun

    original = StageRun._end_step

    def end_step(run, step, *rest):
        hook(step)
        return original(run, step, *rest)

    StageRun._end_step = end_step
    from align import cli

    try:
        cli.app()(args, prog_name="align", standalone_mode=False)
    except SystemExit:
        pass
    finally:
        StageRun._end_step = original
