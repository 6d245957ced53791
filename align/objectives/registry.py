"""One registry per kind of training objective, filled by a decorator where each objective is defined:

    @register("advantage", "rloo", help="leave-one-out baseline")
    def rloo_advantages(rewards, valid=None, reduce=None): ...

A kind fixes the signature of its entries (KINDS). A stage reads its choices, its --help text and what each entry
needs (its traits, e.g. a preference loss's `needs_reference`) from here, so a new objective is its function (and
its test): nothing else names it. Pure Python (no torch): importing it is instant. The built-in entries are
registered when their modules are imported (`load`, which `get` and `entries` call); until then `Choices` lists
them from align.objectives.catalog, so `--help` and a config's checks need no torch.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Callable

from align.objectives.catalog import BUILTIN, MODULES

KINDS = {
    "advantage": "fn(rewards [P, G], valid [P, G] | None, reduce) -> advantages [P, G]",
    "policy_loss": "fn(logp, old_logp, adv, mask, eps_low, eps_high) -> (per-token loss, low-clipped, high-clipped)",
    "kl": "fn(logp, ref_logp) -> per-token estimate of KL(π‖π_ref)",
    "preference": "fn(pairs: Pairs, beta, *, label_smoothing, gamma) -> (loss per pair, reward chosen, rejected)",
    "unpaired_preference": "fn(policy, ref, kl_sums, desirable, beta, w_desirable, w_undesirable) -> "
                           "(loss per row, reward, reference point)",
    "shaping": "fn(lengths: list[int], correct: list[bool], *, max_len, cache) -> reward term per completion",
}


# each kind's traits and their values for an entry that does not set them
TRAITS = {
    "advantage": {"group_baseline": True},  # a group whose rewards are all equal gets A = 0 (no signal)
    "policy_loss": {"on_policy": False},  # no importance ratio: one iteration per batch, no KL term
    "preference": {"needs_reference": True, "label_smoothing": False},  # the reference's log-probs; takes ε
    "unpaired_preference": {"needs_reference": True, "label_smoothing": False},
}


@dataclass(frozen=True)
class Entry:
    """A registered objective: its function, a one-line --help summary and its traits."""

    kind: str
    name: str
    fn: Callable
    help: str = ""
    traits: dict = field(default_factory=dict)

    def __getattr__(self, trait: str):
        try:
            return self.__dict__["traits"][trait]
        except KeyError:
            raise AttributeError(f"{self.kind} {self.name!r} has no trait {trait!r}") from None


REGISTRIES: dict[str, dict[str, Entry]] = {kind: {} for kind in KINDS}


def register(kind: str, name: str, *, help: str = "", **traits):
    """Decorator: registers the function as `name` among the objectives of `kind` (one name once per kind)."""
    if kind not in REGISTRIES:
        raise ValueError(f"unknown kind of objective {kind!r}; kinds: {', '.join(REGISTRIES)}")
    load()  # the built-in entries first: their names are taken, and they come first in the listings

    def add(fn: Callable) -> Callable:
        if name in REGISTRIES[kind]:
            raise ValueError(f"{kind} {name!r} is already registered ({REGISTRIES[kind][name].fn.__qualname__})")
        REGISTRIES[kind][name] = Entry(kind, name, fn, help, {**TRAITS.get(kind, {}), **traits})
        return fn

    return add


def unregister(kind: str, name: str) -> None:
    """Remove an entry (a test's temporary objective)."""
    del REGISTRIES[kind][name]


_state = {"loading": False, "loaded": False}


def load() -> None:
    """Import the modules of the built-in entries, which registers them (once; a `register` while they are being
    imported does not start it again)."""
    if _state["loading"] or _state["loaded"]:
        return
    _state["loading"] = True
    try:
        for module in MODULES:
            importlib.import_module(f"align.objectives.{module}")
        _state["loaded"] = True
    finally:
        _state["loading"] = False


def get(kind: str, name: str) -> Entry:
    load()
    try:
        return REGISTRIES[kind][name]
    except KeyError:
        raise KeyError(f"no {kind} objective {name!r}; registered: {', '.join(REGISTRIES[kind])}") from None


def entries(*kinds: str, **traits) -> list[Entry]:
    """The entries of `kinds` whose traits have the given values: per kind the built-in ones in the catalog's order,
    then the others in registration order."""
    load()
    return [e for k in kinds for e in _ordered(k, REGISTRIES[k]) if all(e.traits.get(t) == v for t, v in traits.items())]


def _ordered(kind: str, found: dict) -> list:
    """`found`'s values (name -> entry) of `kind`: the catalog's names first, in its order, then the rest."""
    builtin = [name for name, _, _ in BUILTIN.get(kind, ())]
    return [found[n] for n in builtin if n in found] + [e for n, e in found.items() if n not in builtin]


def listed(*kinds: str, **traits) -> list[tuple[str, str]]:
    """(name, summary) of the entries of `kinds` with the given traits, without importing any objective: the
    catalog's built-in entries, then those registered beside them (a plug-in, a test's)."""
    out = []
    for k in kinds:
        known = {name: (name, text, {**TRAITS.get(k, {}), **t}) for name, text, t in BUILTIN.get(k, ())}
        known |= {e.name: (e.name, e.help, e.traits) for e in REGISTRIES[k].values()}
        out += [(name, text) for name, text, t in _ordered(k, known) if all(t.get(a) == v for a, v in traits.items())]
    return out


class Choices(Sequence):
    """A live view of the names registered in `kinds` (with the given traits): an option's `choices`. It is read
    whenever --help is shown or a value is checked, so an entry registered later (a plug-in, a test) is a choice."""

    def __init__(self, *kinds: str, **traits):
        self.kinds, self.traits = kinds, traits

    def names(self) -> list[str]:
        return [name for name, _ in listed(*self.kinds, **self.traits)]

    def __getitem__(self, i):
        return self.names()[i]

    def __len__(self) -> int:
        return len(self.names())

    def __contains__(self, value) -> bool:
        return value in self.names()

    def __repr__(self) -> str:
        return f"Choices({', '.join(self.names())})"

    def describe(self) -> str:
        """The --help list: 'a (what a is), b (what b is).'"""
        return ", ".join(f"{name} ({text})" if text else name for name, text in listed(*self.kinds, **self.traits)) + "."
