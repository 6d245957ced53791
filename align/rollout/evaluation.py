"""Held-out evaluation of a policy on verifiable data: greedy pass@1 and sampled pass@k."""

from __future__ import annotations

import math
from pathlib import Path

from align import runtime
from align.console import TrainProgress, info, warn
from align.data import encode_prompts
from align.errors import UserError
from align.models import context_length
from align.passk import mean_pass_at_k
from align.rewards import Verifier, choose_verifier
from align.rollout.generation import Sampling, generate
from align.tasks import write_jsonl
from align.vision import printable

EVAL_SAMPLES = "eval_samples.jsonl"  # a training stage's latest held-out evaluation, one problem a line


def held_out_verifier(setting: str, rows: list[dict], tokenizer, where: str = "") -> Verifier | None:
    """The verifier a stage checks its held-out `rows` with (--verifier `setting`; None without rows), tried on
    their first rows and said in the stage's first lines ("verifier: math (auto: the answers are numbers)")."""
    if not rows:
        return None
    v = choose_verifier(setting, rows, tokenizer, where)
    info(v.line)
    return v


def verifier_note(v: Verifier | None) -> dict:
    """artifact.json's record of the verifier a stage uses (StageRun.open's `notes`): {"verifier": {name, auto,
    why}}; {} for none."""
    return {"verifier": v.record()} if v is not None else {}


def evaluate_policy(eng, tokenizer, rows: list[dict], dist: runtime.Dist, *, ks=(1,), samples: int = 0,
                    sampling: Sampling | None = None, verifier: str | Verifier = "auto", batch_size: int = 64,
                    gather: bool = True, use_evaluate: bool = False,
                    progress: str = "", agent=None) -> tuple[dict, list[dict]]:
    """Greedy pass@1 (`pass@1/greedy`, with its binomial standard error `pass@1/greedy_stderr`) and, with `samples` = n > 0, unbiased sampled pass@k for k <= n, over the
    problems whose prompt leaves room for the answer in the model's context (`problems` counts them).

    Returns (metrics, per-problem records). Call on every rank; generation is sharded over the ranks.
    `use_evaluate` computes pass@k through the shipped `evaluate` metric module (align/metrics/pass_at_k).
    `progress` titles a progress bar over the generations. `verifier`: the stage's (held_out_verifier), or a
    --verifier setting chosen here. `agent` (align.rollout.episode.Agent): every answer is a multi-turn episode
    (pass@k of whole episodes; its last turn is graded, the transcript kept), and `tools/call_frequency` counts the
    greedy episodes' tool calls.
    """
    sampling = sampling or Sampling()
    check = verifier if isinstance(verifier, Verifier) else choose_verifier(verifier, rows)
    extra = agent.limits.max_env_tokens if agent else 0
    rows, prompts = fitting(rows, encode_prompts(tokenizer, [r["prompt"] for r in rows], agent and agent.schemas),
                            context_length(eng.module.config), sampling.max_new_tokens + extra)
    greedy = Sampling(max_new_tokens=sampling.max_new_tokens, temperature=0.0)
    local = -(-len(prompts) // dist.world_size) * (1 + samples)  # this rank's generations
    with TrainProgress(progress, local) if progress else _NoBar() as bar:
        outs = generate(eng, tokenizer, prompts, greedy, dist, batch_size=batch_size, gather=gather,
                        on_batch=bar.advance, agent=agent, rows=rows)
        many = (generate(eng, tokenizer, [p for p in prompts for _ in range(samples)], sampling, dist,
                         batch_size=batch_size, gather=gather, on_batch=bar.advance, agent=agent,
                         rows=[r for r in rows for _ in range(samples)]) if samples > 0 else [])
    records = [
        {"prompt": printable(r["prompt"]), "answer": r["answer"], "greedy": o.text,
         "greedy_correct": check.check(r, o.answer, o.ids),
         **({"greedy_tool_calls": o.episode.tool_calls, "greedy_stop": o.episode.stop} if o.episode else {})}
        for r, o in zip(rows, outs)
    ]
    p = sum(rec["greedy_correct"] for rec in records) / len(records)
    metrics = {"pass@1/greedy": p, "pass@1/greedy_stderr": math.sqrt(p * (1 - p) / len(records)),
               "completions/mean_length": sum(len(o.policy_ids) for o in outs) / len(outs), "problems": len(records)}
    if agent:
        metrics["tools/call_frequency"] = sum(o.episode.tool_calls for o in outs) / len(outs)
    if samples > 0:
        for i, rec in enumerate(records):
            group = many[i * samples : (i + 1) * samples]
            rec["samples"] = [o.text for o in group]
            rec["n_correct"] = sum(check.check(rows[i], o.answer, o.ids) for o in group)
        ks = [k for k in ks if k <= samples]
        ns, cs = [samples] * len(records), [rec["n_correct"] for rec in records]
        if use_evaluate:
            from align.metrics import load_metric

            passk = load_metric("pass_at_k").compute(predictions=cs, references=ns, k=ks)
        else:
            passk = mean_pass_at_k(ns, cs, ks)
        metrics.update({k: v for k, v in passk.items() if v is not None})
    return metrics, records


def save_eval_samples(out: str | Path, step: int, records: list[dict], dist: runtime.Dist) -> None:
    """A training stage's latest held-out evaluation, one problem a line ({"step", "prompt", "answer", "greedy",
    "greedy_correct"}, with "samples" and "n_correct" where it sampled), to OUT/eval_samples.jsonl on the main rank:
    written whole and renamed over the previous one, so the file always holds one complete evaluation."""
    if dist.is_main:
        write_jsonl([{"step": step, **rec} for rec in records], Path(out) / EVAL_SAMPLES)


def fitting(rows: list[dict], prompt_ids: list[list[int]], context: int | None, new_tokens: int, where: str = ""):
    """(rows, prompt ids) whose prompt plus `new_tokens` fits the model's `context` positions; the others are
    dropped with a warning that counts them, and none fitting is an error (`where`: the data file it names)."""
    if context is None:
        return rows, prompt_ids
    keep = [i for i, p in enumerate(prompt_ids) if len(p) + new_tokens <= context]
    if not keep:
        raise UserError(f"{where + ': ' if where else ''}no prompt fits the model's context: {context} positions, "
                        f"the shortest prompt has {min(map(len, prompt_ids))} tokens plus {new_tokens} new ones; "
                        "shorten the prompts or lower --max-new-tokens.")
    if len(keep) < len(rows):
        warn(f"{len(rows) - len(keep)} of {len(rows)} prompts leave no room for {new_tokens} new tokens in the "
             f"model's {context} positions: left out", once=True)  # once, not at every evaluation
    return [rows[i] for i in keep], [prompt_ids[i] for i in keep]


def fitting_rows(rows: list[dict], tokenizer, source, new_tokens: int, where: str = "") -> list[dict]:
    """The held-out rows evaluate_policy will keep (`fitting` on `source`'s context), found before --out is
    touched: data none of whose prompts fit is refused at the start, not at the first evaluation."""
    if not rows:
        return rows
    prompt_ids = encode_prompts(tokenizer, [r["prompt"] for r in rows])
    return fitting(rows, prompt_ids, context_length(source), new_tokens, where)[0]


class _NoBar:
    def __enter__(self):
        return self

    def advance(self, n: int) -> None:
        pass

    def __exit__(self, *exc):
        return False

    def update(self, step, metrics) -> None:
        pass

