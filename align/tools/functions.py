"""Users' tools (`--tools FILE.py:fn1,fn2`) as an environment, in align's built-in call format:

    the policy writes   <tool>{"name": "lookup", "arguments": {"key": "x"}}</tool>
    the tool answers    <out>RESULT</out>          (then the policy goes on, in the same text)

The functions run in a Sandbox (align.tools.sandbox: its own process, no network, memory and time limits). A call
that is not that JSON or names no tool is answered `<out>error: ...</out>` and counted as a failed call (the
policy's mistake, shown to it). A function that raises, hangs past --tool-timeout, crashes, runs out of memory or
returns what is not text or a number ends the episode (stop "tool_error"): the stage scores it as
--on-reward-error says (skip: out of its group; otherwise 0), counts it in rewards/errors, and the run goes on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from align.rollout.env import Step
from align.tools.sandbox import Sandbox
from align.tools.tagged import TaggedTool


@dataclass
class FunctionsEnv(TaggedTool):
    box: Sandbox | None = None
    open: str = "<tool>"
    close: str = "</tool>"

    def answer_call(self, body: str) -> Step:
        try:
            call = json.loads(body)
            name, arguments = call["name"], call.get("arguments", {})
        except (ValueError, KeyError, TypeError, AttributeError):
            return Step(observation=self.answer.format('error: a call is {"name": ..., "arguments": {...}}'),
                        tool_call=True, tool_error=True)
        status, text = self.box.call(str(name), arguments)
        if status == "failed":
            return Step(done=True, tool_call=True, tool_error=True, failed=True)
        return Step(observation=self.answer.format(text), tool_call=True, tool_error=status == "error")
