"""Tools a policy calls during its rollouts (`--tools`), each an environment of align.rollout.env.

    --tools calculator          the built-in calculator: the policy writes <calc>EXPR</calc>, the tool answers
                                <out>VALUE</out> in the same text (align.tools.calculator), the policy goes on
    --tools FILE.py:fn1,fn2     your functions, run in a sandbox (align.tools.sandbox: no network, memory and time
                                limits); called as <tool>{"name": ..., "arguments": {...}}</tool> (align.tools.functions)
    --env FILE.py:NAME          your environment class, one object per episode, in a sandbox too
                                (align.tools.environments)

`agent(...)` makes the stage's Agent (an environment per episode, its limits, what to close at the end);
`segments(...)` cuts a demonstration into the policy's text and the tools' answers, so SFT learns the policy's part
only and tokenises it as a rollout would.
"""

from __future__ import annotations

import atexit
from pathlib import Path

from align.errors import UserError

BUILTIN = ("calculator",)


def parse(spec: str, flag: str = "--tools") -> tuple[str, list[str]] | None:
    """(file, [function names]) of a FILE.py:fn1,fn2 spec (--env: FILE.py:NAME); None for a built-in; UserError for
    anything else."""
    if spec in BUILTIN and flag == "--tools":
        return None
    path, sep, names = spec.rpartition(":")
    fns = [n.strip() for n in names.split(",")] if sep else []
    if flag == "--env" and (not sep or not path.endswith(".py") or len(fns) != 1 or not fns[0].isidentifier()):
        raise UserError(f"--env {spec!r}: give your environment class as FILE.py:NAME (docs/tools.md).")
    if not sep or not path.endswith(".py") or not fns or not all(n.isidentifier() for n in fns):
        raise UserError(f"{flag} {spec!r}: unknown tool; give a built-in ({', '.join(BUILTIN)}) or your functions "
                        "as FILE.py:fn1,fn2.")
    if not Path(path).is_file():
        raise UserError(f"{flag} {spec}: no such file {path!r}.")
    return path, fns


def check(spec: str, flag: str = "--tools", env: str = "") -> None:
    """A --tools value align can run ('' : none): a built-in, or a file of functions on a machine that can isolate
    them (said up front, before any model is built); with `env` (--env FILE.py:NAME) the same for an environment,
    which takes the place of tools. UserError naming what to do otherwise."""
    if spec and env:
        raise UserError("--tools and --env: give one (an environment answers the policy's turns itself).")
    if spec and parse(spec, flag) is not None or env and parse(env, "--env"):
        from align.tools.sandbox import require_isolation

        require_isolation("--env" if env else flag)


def agent(spec: str, max_new_tokens: int, max_turns: int, max_tool_tokens: int, timeout: float = 10.0,
          env: str = "", tokenizer=None):
    """The Agent of --tools `spec` or --env `env` (None for neither): its environment per episode, a turn's and
    the episode's policy tokens within --max-new-tokens, at most --max-turns turns and --max-tool-tokens of the
    environment's tokens. Your functions or environment get one sandbox for the stage (closed by Agent.close, and
    at exit)."""
    if not spec and not env:
        return None
    from align.rollout.env import Agent, Limits
    from align.tools.sandbox import Sandbox

    check(spec, env=env)
    limits = Limits(max_turns=max_turns, turn_tokens=max_new_tokens, max_tokens=max_new_tokens,
                    max_env_tokens=max_tool_tokens)
    if env:
        from align.tools.environments import SandboxEnv

        path, (name,) = parse(env, "--env")
        box = Sandbox(path, [name], timeout=timeout, flag="--env", kind="env")
        atexit.register(box.close)
        stops = tuple(box.about.get("stops", ()))
        return Agent(env, lambda row: SandboxEnv(box, stops), limits, close=box.close)
    user = parse(spec)
    if user is None:
        from align.tools.calculator import CalculatorEnv

        return Agent(spec, lambda row: CalculatorEnv(), limits)
    box = Sandbox(user[0], user[1], timeout=timeout)
    atexit.register(box.close)
    from align.tools.chat_format import ChatTools, family

    fam = family(tokenizer) if tokenizer is not None else None
    if fam:  # the model's own tool format: its template shows the tools and renders their answers
        return Agent(spec, lambda row: ChatTools(box, tokenizer, fam), limits, close=box.close, schemas=box.schemas)
    from align.tools.functions import FunctionsEnv

    return Agent(spec, lambda row: FunctionsEnv(box=box), limits, close=box.close)


def segments(spec: str, text: str) -> list[tuple[str, bool]]:
    """`text` (a demonstration) cut into the policy's parts (True) and the tools' answers (False)."""
    if parse(spec) is None:
        from align.tools.calculator import CalculatorEnv

        return CalculatorEnv().segments(text)
    from align.tools.functions import FunctionsEnv

    return FunctionsEnv(box=None).segments(text)
