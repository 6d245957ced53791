"""Training objectives, one registry per kind (align.objectives.registry): advantage estimators, policy losses,
KL estimators, preference losses and reward shaping. Importing the package registers every built-in entry."""

from align.objectives import advantages, kl, policy, preference, shaping  # noqa: F401  (they register)
from align.objectives.registry import Choices, Entry, entries, get, register, unregister  # noqa: F401
