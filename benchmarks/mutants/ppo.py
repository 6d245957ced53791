"""Wiring mutations of stages/ppo.py and the PPO parts it calls."""

from benchmarks.mutants import Mutation

M = Mutation
MUTATIONS: list[Mutation] = [
]
