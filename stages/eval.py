"""`align eval MODEL --data FILE --k 1,4,8`: greedy pass@1 and sampled pass@k (unbiased estimator)."""

from __future__ import annotations

from align import data as D
from align import tools
from align.artifacts import describe_inputs
from align.console import info
from align.engine.run import StageRun, seed_all
from align.models import load_causal_lm, load_tokenizer, resolve
from align.rollout.evaluation import evaluate_policy, fitting_rows, held_out_verifier, verifier_note
from align.rollout.generation import Sampling
from align.tasks import write_jsonl
from stages.eval_config import EvalConfig  # the options (light: no torch), re-exported


def run(cfg: EvalConfig) -> dict:
    ks = cfg.ks()
    source = resolve(cfg.model)
    rows = D.load_rows(cfg.data, "verifiable", cfg.columns, limit=cfg.limit)
    tok = load_tokenizer(source, cfg.trust_remote_code, cfg.chat_template)
    agent = tools.agent(cfg.tools, cfg.max_new_tokens, cfg.max_turns, cfg.max_tool_tokens, cfg.tool_timeout,
                        cfg.env, tokenizer=tok)
    rows = fitting_rows(rows, tok, source, cfg.max_new_tokens + (cfg.max_tool_tokens if agent else 0), cfg.data)
    verifier = held_out_verifier(cfg.verifier, rows, tok, cfg.data)
    try:
        return _evaluate(cfg, ks, source, rows, tok, verifier, agent)
    finally:
        if agent:
            agent.close()


def _evaluate(cfg: EvalConfig, ks, source, rows, tok, verifier, agent) -> dict:
    with StageRun(cfg, "eval") as run:
        run.choose_verifier(verifier)
        dist = run.open(describe_inputs(source, cfg.data), notes=verifier_note(verifier))
        seed_all(cfg.seed * 1000 + dist.rank)
        eng = run.frozen(lambda dtype: load_causal_lm(source, tok, dtype, cfg.seed, cfg.trust_remote_code))
        info(f"eval: {len(rows)} problems, {max(ks)} samples each, k = {ks}"
             f"{f', tools {cfg.tools or cfg.env} (up to {cfg.max_turns} turns)' if agent else ''}")
        metrics, records = evaluate_policy(eng, tok, rows, dist, ks=ks, samples=max(ks),
                                           sampling=Sampling(cfg.max_new_tokens, cfg.temperature, cfg.top_k, cfg.top_p,
                                                             seed=cfg.seed),
                                           verifier=verifier, batch_size=cfg.batch_size, gather=cfg.gather,
                                           use_evaluate=True, progress="eval", agent=agent)
        if dist.is_main:
            write_jsonl(records, run.out / "samples.jsonl")
        return run.complete(metrics, f"eval of {cfg.model} on {cfg.data}")
