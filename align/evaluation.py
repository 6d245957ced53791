"""Held-out evaluation of a policy on verifiable data: greedy pass@1 and sampled pass@k."""

from __future__ import annotations

from align import runtime
from align.data import encode_prompts
from align.generation import Sampling, generate
from align.passk import mean_pass_at_k
from align.rewards import guess_verifier, verify


def evaluate_policy(eng, tokenizer, rows: list[dict], dist: runtime.Dist, *, ks=(1,), samples: int = 0,
                    sampling: Sampling | None = None, verifier: str = "auto", batch_size: int = 64,
                    gather: bool = True, use_evaluate: bool = False) -> tuple[dict, list[dict]]:
    """Greedy pass@1 (`pass@1/greedy`) and, with `samples` = n > 0, unbiased sampled pass@k for k <= n.

    Returns (metrics, per-problem records). Call on every rank; generation is sharded over the ranks.
    `use_evaluate` computes pass@k through the shipped `evaluate` metric module (align/metrics/pass_at_k).
    """
    sampling = sampling or Sampling()
    verifier = guess_verifier(rows) if verifier == "auto" else verifier
    prompts = encode_prompts(tokenizer, [r["prompt"] for r in rows])
    greedy = Sampling(max_new_tokens=sampling.max_new_tokens, temperature=0.0)
    outs = generate(eng, tokenizer, prompts, greedy, dist, batch_size=batch_size, gather=gather)
    records = [
        {"prompt": r["prompt"], "answer": r["answer"], "greedy": o.text, "greedy_correct": verify(o.text, r["answer"], verifier)}
        for r, o in zip(rows, outs)
    ]
    metrics = {"pass@1/greedy": sum(rec["greedy_correct"] for rec in records) / len(records)}
    metrics["completions/mean_length"] = sum(len(o.ids) for o in outs) / len(outs)
    if samples > 0:
        many = generate(eng, tokenizer, [p for p in prompts for _ in range(samples)], sampling, dist,
                        batch_size=batch_size, gather=gather)
        for i, rec in enumerate(records):
            group = many[i * samples : (i + 1) * samples]
            rec["samples"] = [o.text for o in group]
            rec["n_correct"] = sum(verify(o.text, rec["answer"], verifier) for o in group)
        ks = [k for k in ks if k <= samples]
        ns, cs = [samples] * len(records), [rec["n_correct"] for rec in records]
        if use_evaluate:
            from align.metrics import load_metric

            passk = load_metric("pass_at_k").compute(predictions=cs, references=ns, k=ks)
        else:
            passk = mean_pass_at_k(ns, cs, ks)
        metrics.update({k: v for k, v in passk.items() if v is not None})
    return metrics, records
