"""Training objectives, one registry per kind (align.objectives.registry): advantage estimators, policy losses,
KL estimators, preference losses and reward shaping. Importing the package is light (no torch): the built-in
entries are registered when their modules are imported, which `get` and `entries` do on first use; `Choices`
lists them from align.objectives.catalog until then."""

from align.objectives.registry import Choices, Entry, entries, get, load, register, unregister

__all__ = ["Choices", "Entry", "entries", "get", "load", "register", "unregister"]
