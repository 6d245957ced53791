"""pass@k: the unbiased estimator of Chen et al. 2021 (Codex paper, arXiv:2107.03374).

The one place the math lives; the `evaluate` module in align/metrics/pass_at_k wraps it.
"""

import operator


def pass_at_k(n: int, c: int, k: int) -> float:
    """Chance that at least one of k samples, drawn without replacement from n samples of which
    c are correct, is correct: 1 - C(n-c, k) / C(n, k).

    Computed as 1 - prod_{i=n-c+1..n} (1 - k/i), which avoids huge binomial coefficients.
    Needs 0 <= c <= n and 1 <= k <= n (ValueError otherwise).
    """
    n, c, k = operator.index(n), operator.index(c), operator.index(k)
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0  # every k-subset contains a correct sample
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1 - k / i
    return 1.0 - miss


def mean_pass_at_k(ns: list, cs: list, ks: list) -> dict:
    """{"pass@k": mean over problems} for each k, given per-problem sample counts ns and correct
    counts cs. pass@k is None when some problem has fewer than k samples (or there are no
    problems): every reported pass@k averages over the same full set of problems."""
    if len(ns) != len(cs):
        raise ValueError(f"got {len(ns)} sample counts but {len(cs)} correct counts")
    out = {}
    for k in ks:
        ok = len(ns) > 0 and all(n >= k for n in ns)
        out[f"pass@{k}"] = sum(pass_at_k(n, c, k) for n, c in zip(ns, cs)) / len(ns) if ok else None
    return out
