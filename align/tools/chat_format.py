"""Your functions (`--tools FILE.py:fn`) in the model's own chat-template tool format, for a model whose chat
template renders tools:

    hermes    Qwen2.5, Qwen3, Hermes: the policy writes <tool_call>{"name": ..., "arguments": {...}}</tool_call>
    llama3    Llama 3.1+: the assistant turn is the call, {"name": ..., "parameters": {...}}, ended by its EOS
    mistral   Mistral: [TOOL_CALLS][{"name": ..., "arguments": {...}}], ended by its EOS

The prompt shows the tools as the template renders them (`apply_chat_template(messages, tools=schemas)`:
`Agent.schemas`). A call is parsed with the family's format. The answer is the template's own rendering of a
`tool` message after the call, up to the next assistant generation prompt (the end of the call's turn included),
tokenised once when it arrives: the tokens a model of that family reads at inference, and nothing the policy wrote
is re-rendered. A model whose template has no tool format keeps align's built-in one (align.tools.functions).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from align.rollout.env import Step

# family: (a text only its template holds, the stop text ending a call: None where the call ends at EOS)
FAMILIES = {"hermes": ("<tool_call>", "</tool_call>"), "llama3": ("<|python_tag|>", None),
            "mistral": ("[TOOL_CALLS]", None)}
CALL_ID = "call0tool"  # Mistral's templates ask for an id of 9 letters and digits


def family(tokenizer) -> str | None:
    """The tool-call format of the tokenizer's chat template (a FAMILIES name), None when it renders no tools."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if not isinstance(template, str) or "tools" not in template:
        return None
    return next((name for name, (marker, _) in FAMILIES.items() if marker in template), None)


def parse_call(fam: str, turn: str) -> tuple[str, dict] | str | None:
    """(name, arguments) of the call `turn` ends with in family `fam`'s format; None when the turn calls no tool (an
    answer); a message when it tries to and the call is malformed."""
    text = turn.strip()
    if fam == "hermes":
        head, sep, _ = text.rpartition("</tool_call>")
        if not sep or "<tool_call>" not in head:
            return None
        body = head.rsplit("<tool_call>", 1)[1]
    elif fam == "llama3":
        body = text.removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return None
    else:
        body = text.removeprefix("[TOOL_CALLS]").strip()
        if not body.startswith("["):
            return None
    try:
        call = json.loads(body)
        call = call[0] if fam == "mistral" else call
        name, arguments = call["name"], call.get("parameters" if fam == "llama3" else "arguments", {})
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            arguments = json.loads(arguments)
        if not isinstance(name, str) or not isinstance(arguments, dict):
            raise TypeError
    except (ValueError, KeyError, TypeError, IndexError, AttributeError):
        return f"error: a call is {_shape(fam)}"
    return name, arguments


def _shape(fam: str) -> str:
    return {"hermes": '<tool_call>{"name": ..., "arguments": {...}}</tool_call>',
            "llama3": '{"name": ..., "parameters": {...}}', "mistral": '[TOOL_CALLS][{"name": ..., "arguments": {...}}]'}[fam]


def render_answer(tokenizer, fam: str, schemas: list, name: str, arguments: dict, result: str) -> str:
    """The text after the policy's call up to the next assistant turn, as the chat template renders a `tool`
    message answering it (from the call's stop text, or from the end of the call's turn where EOS ends it)."""
    call = [{"role": "user", "content": "?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "id": CALL_ID, "function": {"name": name, "arguments": arguments}}]}]
    answer = {"role": "tool", "name": name, "tool_call_id": CALL_ID, "content": result}
    before = tokenizer.apply_chat_template(call, tools=schemas, tokenize=False)
    after = tokenizer.apply_chat_template(call + [answer], tools=schemas, tokenize=False, add_generation_prompt=True)
    stop = FAMILIES[fam][1]
    end = stop or tokenizer.eos_token
    cut = before.rfind(end)
    if cut < 0 or not after.startswith(before[:cut]):
        from align.errors import UserError

        raise UserError(f"the chat template renders a tool call without its {end!r}, or the tool's answer does not "
                        "follow the call it answers: align cannot tell where the answer starts; use a model whose "
                        "template renders tools, or align's built-in format (a template without tools).")
    return after[cut + len(end):]


@dataclass
class ChatTools:
    """Your functions (a Sandbox: `box`) as an environment in chat-template family `fam`'s format (see the
    module's docstring). A malformed call is answered with an error in the tool message (the policy's mistake,
    counted as a failed call); a function that fails ends the episode (stop "tool_error")."""

    box: object
    tokenizer: object
    fam: str

    @property
    def stops(self) -> tuple[str, ...]:
        stop = FAMILIES[self.fam][1]
        return (stop,) if stop else ()

    def reset(self, row: dict) -> str | None:
        return None

    def step(self, turn: str) -> Step:
        call = parse_call(self.fam, turn)
        if call is None:
            return Step(done=True)
        if isinstance(call, str):
            return Step(observation=self._answer("?", {}, call), tool_call=True, tool_error=True)
        status, text = self.box.call(*call)
        if status == "failed":
            return Step(done=True, tool_call=True, tool_error=True, failed=True)
        return Step(observation=self._answer(*call, text), tool_call=True, tool_error=status == "error")

    def _answer(self, name: str, arguments: dict, result: str) -> str:
        return render_answer(self.tokenizer, self.fam, self.box.schemas, name, arguments, result)
