"""The mutation benchmark's mutations: one-line changes of the code that a test must catch.

`formulas`: the math (align/objectives) and RLMonitor's checks. `ppo`, `grpo`, `preference` (DPO and its variants), `supervised` (RM, SFT, the data order), `vision` (image rows): the
wiring of each stage to its formulas (which model is the reference, which terms carry gradient, which signs, which
tokens count, which order the data comes in). Each module holds a list MUTATIONS; ALL is every one of them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutation:
    name: str
    file: str
    original: str  # must occur exactly once in `file`
    replacement: str
    tests: tuple[str, ...]  # test files or node ids (FILE::TEST) that must fail under the mutation


def all_mutations() -> list[Mutation]:
    from benchmarks.mutants import formulas, grpo, ppo, preference, supervised, vision

    return [*formulas.MUTATIONS, *ppo.MUTATIONS, *grpo.MUTATIONS, *preference.MUTATIONS, *supervised.MUTATIONS,
            *vision.MUTATIONS]
