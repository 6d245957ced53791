"""Wiring mutations of stages/dpo.py: DPO and its variants (IPO, SimPO, ORPO, KTO, RPO, online DPO)."""

from benchmarks.mutants import Mutation

M = Mutation
MUTATIONS: list[Mutation] = [
]
