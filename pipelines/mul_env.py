"""An environment of your own for pipelines/tools.toml (`--env pipelines/mul_env.py:MulEnv`): the calculator's
job written as a plain class, with the same tags the SFT model learned from its demonstrations. A turn that ends
in a call <calc>A * B</calc> is answered <out>PRODUCT</out>; any other turn is the answer, graded 1 when its last
number is the row's answer. align runs it in a sandbox (no network, memory and time limits); no import of align."""

import re

CALL = re.compile(r"<calc>\s*(-?\d+)\s*\*\s*(-?\d+)\s*</calc>\s*$")


class MulEnv:
    stops = ("</calc>",)  # a call's closing tag ends the policy's turn

    def reset(self, row):
        self.answer = str(row["answer"])
        return None  # no opening observation: the prompt is the question

    def step(self, turn):
        call = CALL.search(turn)
        if call:
            a, b = (int(x) for x in call.groups())
            return f"<out>{a * b}</out>", None, False
        numbers = re.findall(r"-?\d+", turn)
        return None, float(bool(numbers) and numbers[-1] == self.answer), True
