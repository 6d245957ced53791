"""A tool called inline, in the policy's own text: the policy's turn ends with OPEN body CLOSE (CLOSE is the stop
text), the tool's answer ANSWER follows in the same text, and the policy goes on. A turn without a call is the
final answer. align.tools.calculator (`<calc>EXPR</calc>`) and align.tools.functions
(`<tool>{"name": ..., "arguments": ...}</tool>`) are two of them; both answer `<out>...</out>`."""

from __future__ import annotations

from dataclasses import dataclass

from align.rollout.env import Step


@dataclass
class TaggedTool:
    open: str
    close: str
    answer: str = "<out>{}</out>"

    @property
    def stops(self) -> tuple[str, ...]:
        return (self.close,)

    def reset(self, row: dict) -> str | None:
        return None

    def step(self, turn: str) -> Step:
        head, sep, _ = turn.rpartition(self.close)
        if not sep or self.open not in head:
            return Step(done=True)
        return self.answer_call(head.rsplit(self.open, 1)[1])

    def answer_call(self, body: str) -> Step:
        """The Step answering a call whose text between the tags is `body`."""
        raise NotImplementedError

    def segments(self, text: str) -> list[tuple[str, bool]]:
        """A demonstration's completion cut into the policy's parts (True) and the tool's answers (False), as an
        episode would hold them: every ANSWER that follows a call is the tool's."""
        head, tail = self.answer.split("{}")
        out, rest = [], text
        while True:
            call = rest.find(self.close)
            if call < 0 or not rest[call + len(self.close):].startswith(head):
                return [*out, (rest, True)] if rest else out
            end = rest.find(tail, call + len(self.close) + len(head))
            if end < 0:
                return [*out, (rest, True)]
            cut = call + len(self.close)
            out += [(rest[:cut], True), (rest[cut:end + len(tail)], False)]
            rest = rest[end + len(tail):]
