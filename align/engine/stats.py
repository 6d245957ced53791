"""Named per-step statistics, reduced over every micro-batch and rank in ONE all-reduce.

A step fills a `Stats` by name as it goes (no numbered slots), and the engine turns it into the step's metrics:

    stats.mean("loss", nll_sum, n_tokens)    # Σ nll_sum / Σ n_tokens over micro-batches and ranks
    stats.sum("tokens", n_tokens)            # Σ over micro-batches and ranks
    stats.std("reward_std", rewards)         # sample std of the rewards of every rank
    stats.value("kl_coef", beta)             # a number every rank already agrees on
    metrics = stats.reduce(device)           # one float64 all-reduce, one host sync
"""

from __future__ import annotations

import torch

from align import runtime


def _scalar(x) -> torch.Tensor:
    return x.detach().to(torch.float64).reshape(()) if torch.is_tensor(x) else torch.tensor(float(x), dtype=torch.float64)


class Stats:
    def __init__(self):
        self._sums: dict[str, list] = {}  # name -> [kind, sums...]: "mean" [Σ total, Σ count], "sum" [Σ total],
        #                                   "std" [Σx, Σx², n]
        self._values: dict[str, float] = {}
        self._empty: dict[str, float] = {}  # a mean's value over a count of 0, where not 0.0

    def _add(self, name: str, kind: str, *parts) -> None:
        have = self._sums.setdefault(name, [kind] + [0.0] * len(parts))
        if have[0] != kind:
            raise ValueError(f"stat {name!r} is a {have[0]}, not a {kind}")
        for i, p in enumerate(parts, 1):
            have[i] = have[i] + _scalar(p)

    def mean(self, name: str, total, count=1.0, empty: float = 0.0) -> None:
        """Accumulate `total` (a sum over this micro-batch) and its `count`: the metric is Σ total / Σ count, and
        `empty` where Σ count is 0 (math.nan: a mean over nothing, e.g. of the completions that ended when none did)."""
        self._add(name, "mean", total, count)
        if empty != 0.0:
            self._empty[name] = empty

    def sum(self, name: str, total) -> None:
        """Accumulate `total`: the metric is its sum over every micro-batch and rank."""
        self._add(name, "sum", total)

    def std(self, name: str, values: torch.Tensor) -> None:
        """The sample standard deviation of `values` pooled over every call and rank."""
        v = values.detach().to(torch.float64).flatten()
        self._add(name, "std", v.sum(), (v * v).sum(), v.numel())

    def value(self, name: str, v: float) -> None:
        self._values[name] = float(v)

    def reduce(self, device) -> dict[str, float]:
        names = list(self._sums)
        out = {}
        if names:
            flat = torch.stack([p.to(device) if torch.is_tensor(p) else torch.tensor(p, dtype=torch.float64, device=device)
                                for n in names for p in self._sums[n][1:]])
            sums = runtime.all_reduce_sum(flat).tolist()
            i = 0
            for n in names:
                kind = self._sums[n][0]
                if kind == "sum":
                    out[n] = sums[i]
                    i += 1
                elif kind == "mean":
                    total, count = sums[i : i + 2]
                    out[n] = total / count if count else self._empty.get(n, 0.0)
                    i += 2
                else:
                    s, s2, k = sums[i : i + 3]
                    out[n] = max(0.0, (s2 - s * s / k) / (k - 1)) ** 0.5 if k > 1 else 0.0
                    i += 3
        out.update(self._values)
        return out
