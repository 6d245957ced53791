"""Wiring mutations of stages/rm.py, stages/sft.py, the reward model's normalisation and the data order."""

from benchmarks.mutants import Mutation

M = Mutation
MUTATIONS: list[Mutation] = [
]
