"""Training objectives, one registry per kind (align.objectives.registry): advantage estimators, policy losses,
KL estimators, preference losses and reward shaping. Importing the package registers every built-in entry."""

from align.objectives import advantages, kl, policy, preference, shaping  # importing them registers their entries
from align.objectives.registry import Choices, Entry, entries, get, register, unregister

__all__ = ["Choices", "Entry", "advantages", "entries", "get", "kl", "policy", "preference", "register", "shaping",
           "unregister"]
