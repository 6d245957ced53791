"""`align eval`'s options (stages/eval.py runs them): a module of its own, light (no torch), so `align eval
--help` and a config's checks are instant."""

from __future__ import annotations

from dataclasses import dataclass

from align.config import (SamplingConfig, StageConfig, env_opt, max_tool_tokens_opt, max_turns_opt, opt,
                          positive_ints, tool_timeout_opt, tools_opt)
from align.paths import DATA_DIR
from align.rewards import REWARDS, verifier_fn


@dataclass(frozen=True)
class EvalConfig(SamplingConfig, StageConfig):
    out: str = opt("runs/eval", "Output directory (metrics and samples).", path=True)
    data: str = opt(str(DATA_DIR / "arithmetic/test.jsonl"), "Verifiable data: {prompt, answer}.", path=True)
    columns: str = opt("", "Rename columns: old=new,old2=new2 (each old name must be a column of --data).")
    k: str = opt("1,4,8", "pass@k values, comma-separated; samples per problem = max k.")
    limit: int = opt(200, "Evaluate the first N problems (0: all).", ge=0)
    verifier: str = opt("auto", f"How answers are checked: a reward of {', '.join(REWARDS)}, rg:TASK or "
                                "file.py:FUNCTION (per sample or batched, docs/rewards.md) that must return 1, or auto "
                                "(the rows' reasoning-gym task, math when every answer is a number or ends in one, else "
                                "exact).", code=True)
    batch_size: int = opt(64, "Generation batch per process.", ge=1)
    gather: bool = opt(True, "ZeRO-3: gather weights once per generation phase (off: synced_gpus, less memory).")
    tools: str = tools_opt("Tools the model may call: calculator (see `align grpo --help`); every answer is then a "
                           "multi-turn episode, graded on its last turn ('' : none).")
    max_turns: int = max_turns_opt()
    max_tool_tokens: int = max_tool_tokens_opt()
    tool_timeout: float = tool_timeout_opt()
    env: str = env_opt()

    def ks(self) -> list[int]:
        return positive_ints(self.k, "--k")

    def validate(self):
        super().validate()
        self.ks()
        if self.tools or self.env:
            from align import tools

            tools.check(self.tools, env=self.env)
        if self.verifier != "auto":
            verifier_fn(self.verifier)
