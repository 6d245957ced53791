"""`align sft`'s options (stages/sft.py runs them): a module of its own, light (no torch), so `align sft --help`
and a config's checks are instant."""

from __future__ import annotations

from dataclasses import dataclass

from align.config import (ByModel, SupervisedConfig, defaults, held_out_opt, max_tool_tokens_opt, max_turns_opt, opt,
                          tool_timeout_opt, tools_opt, verifier_opt)
from align.paths import DATA_DIR


# the lr of a pretrained model: TRL SFTConfig's
@dataclass(frozen=True)
@defaults(out="runs/sft", max_steps=1500, lr=ByModel(2e-3, pretrained=2e-5), warmup_steps=50, eval_every=500)
class SFTConfig(SupervisedConfig):
    data: str = opt(str(DATA_DIR / "arithmetic/train.jsonl"), "Training data: {prompt, completion}, {messages} or "
                    "{text} (a file, DIR[:SPLIT] or a Hub dataset NAME[:SPLIT]; docs/data.md).", path=True)
    eval_data: str = held_out_opt(str(DATA_DIR / "arithmetic/test.jsonl"), "Held-out data; pass@1 too if it has "
                                                                              "'answer' ('' : none).")
    assistant_only_loss: bool = opt(False, "{messages} data: loss on every assistant turn (each turn's tokens as the "
                                           "chat template renders them, its end of turn included), the system and "
                                           "user turns masked; off: on the last assistant turn only.")
    packing: bool = opt(False, "Pack examples into rows of --max-length (block-diagonal attention); "
                               "--batch-size then counts packed rows.")
    eval_samples: int = opt(200, "Held-out problems for pass@1 (0: skip).", ge=0)
    verifier: str = verifier_opt()
    max_new_tokens: int = opt(48, "Generation budget for pass@1.", ge=1)
    tools: str = tools_opt("The demonstrations call these tools: calculator (their <out>...</out> answers are the "
                           "tool's: no loss, tokenised apart as a rollout holds them; pass@1 runs episodes with the "
                           "tool) ('' : none).")
    max_turns: int = max_turns_opt()
    max_tool_tokens: int = max_tool_tokens_opt()
    tool_timeout: float = tool_timeout_opt()

    def validate(self):
        super().validate()
        if self.tools:
            from align import tools

            tools.check(self.tools)
