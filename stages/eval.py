"""`align eval MODEL --data FILE --k 1,4,8`: greedy pass@1 and sampled pass@k (unbiased estimator)."""

from __future__ import annotations

from dataclasses import dataclass

from align import data as D
from align.artifacts import describe_inputs
from align.config import SamplingConfig, StageConfig, opt, positive_ints
from align.console import info
from align.engine.run import StageRun, seed_all
from align.models import load_causal_lm, load_tokenizer, resolve
from align.paths import DATA_DIR
from align.rewards import REWARDS, verifier_fn
from align.rollout.evaluation import evaluate_policy, fitting_rows, held_out_verifier, verifier_note
from align.rollout.generation import Sampling
from align.tasks import write_jsonl


@dataclass(frozen=True)
class EvalConfig(SamplingConfig, StageConfig):
    out: str = opt("runs/eval", "Output directory (metrics and samples).", path=True)
    data: str = opt(str(DATA_DIR / "arithmetic/test.jsonl"), "Verifiable data: {prompt, answer}.", path=True)
    columns: str = opt("", "Rename columns: old=new,old2=new2 (each old name must be a column of --data).")
    k: str = opt("1,4,8", "pass@k values, comma-separated; samples per problem = max k.")
    limit: int = opt(200, "Evaluate the first N problems (0: all).", ge=0)
    verifier: str = opt("auto", f"How answers are checked: a reward of {', '.join(REWARDS)}, rg:TASK or "
                                "file.py:FUNCTION (per sample or batched, docs/rewards.md) that must return 1, or auto "
                                "(the rows' reasoning-gym task, math when every answer is a number or ends in one, else "
                                "exact).", code=True)
    batch_size: int = opt(64, "Generation batch per process.", ge=1)
    gather: bool = opt(True, "ZeRO-3: gather weights once per generation phase (off: synced_gpus, less memory).")

    def ks(self) -> list[int]:
        return positive_ints(self.k, "--k")

    def validate(self):
        super().validate()
        self.ks()
        if self.verifier != "auto":
            verifier_fn(self.verifier)


def run(cfg: EvalConfig) -> dict:
    ks = cfg.ks()
    source = resolve(cfg.model)
    rows = D.load_rows(cfg.data, "verifiable", cfg.columns, limit=cfg.limit)
    tok = load_tokenizer(source, cfg.trust_remote_code)
    rows = fitting_rows(rows, tok, source, cfg.max_new_tokens, cfg.data)
    verifier = held_out_verifier(cfg.verifier, rows, tok, cfg.data)
    with StageRun(cfg, "eval") as run:
        dist = run.open(describe_inputs(source, cfg.data), notes=verifier_note(verifier))
        seed_all(cfg.seed * 1000 + dist.rank)
        eng = run.frozen(lambda dtype: load_causal_lm(source, tok, dtype, cfg.seed, cfg.trust_remote_code))
        info(f"eval: {len(rows)} problems, {max(ks)} samples each, k = {ks}")
        metrics, records = evaluate_policy(eng, tok, rows, dist, ks=ks, samples=max(ks),
                                           sampling=Sampling(cfg.max_new_tokens, cfg.temperature, cfg.top_k, cfg.top_p,
                                                             seed=cfg.seed),
                                           verifier=verifier, batch_size=cfg.batch_size, gather=cfg.gather,
                                           use_evaluate=True, progress="eval")
        if dist.is_main:
            write_jsonl(records, run.out / "samples.jsonl")
        return run.complete(metrics, f"eval of {cfg.model} on {cfg.data}")
