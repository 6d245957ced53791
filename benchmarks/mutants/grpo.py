"""Wiring mutations of stages/grpo.py, the off-policy queue (align/async_rl.py) and the rollout."""

from benchmarks.mutants import Mutation

M = Mutation
MUTATIONS: list[Mutation] = [
]
