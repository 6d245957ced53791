"""`align eval MODEL --data FILE --k 1,4,8`: greedy pass@1 and sampled pass@k (unbiased estimator)."""

from __future__ import annotations

from dataclasses import dataclass

from align.config import StageConfig, opt
from align.errors import UserError
from align.paths import DATA_DIR


@dataclass
class EvalConfig(StageConfig):
    out: str = opt("runs/eval", "Output directory (metrics and samples).", path=True)
    data: str = opt(str(DATA_DIR / "arithmetic/test.jsonl"), "Verifiable data: {prompt, answer}.", path=True)
    columns: str = opt("", "Rename columns: old=new,old2=new2.")
    k: str = opt("1,4,8", "pass@k values, comma-separated; samples per problem = max k.")
    limit: int = opt(200, "Evaluate the first N problems (0: all).")
    temperature: float = opt(1.0, "Sampling temperature for pass@k.")
    top_k: int = opt(0, "Top-k sampling (0: off).")
    top_p: float = opt(1.0, "Top-p sampling (1: off).")
    max_new_tokens: int = opt(48, "Max new tokens per completion.")
    verifier: str = opt("auto", "How answers are checked: math, sort, exact, auto.")
    batch_size: int = opt(64, "Generation batch per process.")
    gather: bool = opt(True, "ZeRO-3: gather weights once per generation phase (off: synced_gpus, less memory).")

    def ks(self) -> list[int]:
        try:
            ks = sorted({int(x) for x in self.k.split(",") if x.strip()})
        except ValueError:
            raise UserError(f"--k must be comma-separated integers like 1,4,8, not {self.k!r}.") from None
        if not ks or ks[0] < 1:
            raise UserError("--k values must be >= 1.")
        return ks

    def validate(self):
        self.ks()
        if self.verifier not in ("auto", "math", "sort", "exact"):
            raise UserError(f"--verifier must be auto, math, sort or exact, not {self.verifier!r}.")


def run(cfg: EvalConfig) -> dict:
    import json
    from pathlib import Path

    import torch

    from align import data as D
    from align import runtime
    from align.artifacts import ArtifactWriter
    from align.config import as_dict
    from align.console import info, summary_table
    from align.evaluation import evaluate_policy
    from align.generation import Sampling
    from align.models import load_causal_lm, load_tokenizer, resolve
    from align.stage_io import describe_inputs

    ks = cfg.ks()
    ref = resolve(cfg.model)
    rows = D.load_rows(cfg.data, "verifiable", cfg.columns, limit=cfg.limit)
    dist = runtime.init()
    torch.manual_seed(cfg.seed * 1000 + dist.rank)
    writer = ArtifactWriter(cfg.out, "eval", as_dict(cfg), describe_inputs(ref, cfg.data), dist.is_main)
    tok = load_tokenizer(ref, cfg.trust_remote_code)
    dtype = runtime.compute_dtype(dist, cfg.precision)
    ds = runtime.ds_config(zero_stage=cfg.zero_stage, micro_batch=1, grad_accum=1, world_size=dist.world_size,
                           dtype=dtype, user_config=cfg.deepspeed)
    loader = runtime.ZeroLoader(ds)  # noqa: F841
    eng = runtime.engine(load_causal_lm(ref, tok, dtype, cfg.seed, cfg.trust_remote_code), ds)
    sampling = Sampling(cfg.max_new_tokens, cfg.temperature, cfg.top_k, cfg.top_p)
    info(f"eval: {len(rows)} problems, {max(ks)} samples each, k = {ks}")
    metrics, records = evaluate_policy(eng, tok, rows, dist, ks=ks, samples=max(ks), sampling=sampling,
                                       verifier=cfg.verifier, batch_size=cfg.batch_size, gather=cfg.gather,
                                       use_evaluate=True)
    if dist.is_main:
        with open(Path(cfg.out) / "samples.jsonl", "w") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")
    writer.log(0, metrics)
    writer.complete(metrics)
    summary_table(f"eval of {cfg.model} on {cfg.data}", metrics)
    return metrics
