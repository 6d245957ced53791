"""DPO, ours vs TRL's DPOTrainer, on the same GPU, one after the other, in one command.

    python -m benchmarks.dpo_vs_trl --models 0.5b --steps 8 --batch-size 64 --micro-batch-size 16

Same model directory (random init, bf16), tokenizer, pairs (data/prefs/train.jsonl, prompts templated the way
align does it), global batch and micro-batch, max length 256, β 0.1, sigmoid loss, live frozen reference model,
no gradient checkpointing. Prints the median step time (steps 2..N), pairs/s, peak GPU memory and ours/TRL.
TRL runs without DeepSpeed (model and AdamW states in bf16); ours is `align dpo` at its defaults (one GPU: ZeRO-0,
bf16-pure — TRL's bf16 layout, with stochastic rounding — unless --ours-extra says otherwise).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks import vs_trl as V


def pairs() -> list[dict]:
    from align import data as D
    from align.models import load_tokenizer, resolve
    from align.paths import DATA_DIR

    tok = load_tokenizer(resolve("tiny"))
    rows = D.load_rows(str(DATA_DIR / "prefs/train.jsonl"), "preference")
    prompts = D.prompt_texts(tok, [r["prompt"] for r in rows])
    return [{"prompt": p, "chosen": r["chosen"], "rejected": r["rejected"]} for p, r in zip(prompts, rows)]


def trl_worker(a) -> None:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    cuda = torch.cuda.is_available()
    tok = AutoTokenizer.from_pretrained(a.model)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.bfloat16)
    args = DPOConfig(output_dir=a.json + ".trl", per_device_train_batch_size=a.micro_batch_size,
                     gradient_accumulation_steps=a.batch_size // a.micro_batch_size, max_steps=a.steps,
                     learning_rate=5e-7, bf16=cuda, use_cpu=not cuda, gradient_checkpointing=False, beta=0.1,
                     loss_type=["sigmoid"], max_length=256, report_to=[], save_strategy="no", logging_steps=1,
                     precompute_ref_log_probs=False, seed=0, dataloader_num_workers=0)
    tr = DPOTrainer(model=model, args=args, train_dataset=Dataset.from_list(pairs()), processing_class=tok)
    timer = V.StepTimer(tr, {})
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    tr.train()
    V.write_json(Path(a.json), {"rows": timer.rows, "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0})


def main() -> None:
    ap = argparse.ArgumentParser()
    V.harness_args(ap, models="0.5b", steps=8)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--micro-batch-size", type=int, default=16)
    a = ap.parse_args()
    if a.trl_worker:
        return trl_worker(a)
    root = V.out_root(a.out, "align-dpo-vs-trl-")
    report, results = [], {}
    for name in a.models.split(","):
        model = V.make_model(name, root)
        o = t = None
        if a.only in ("both", "ours"):
            out = root / f"ours-dpo-{name}"
            cmd = [sys.executable, "-m", "align", "dpo", "--model", str(model), "--out", str(out), "--overwrite",
                   "--eval-data", "", "--eval-samples", "0", "--max-steps", str(a.steps), "--batch-size", str(a.batch_size),
                   "--micro-batch-size", str(a.micro_batch_size), "--beta", "0.1", "--loss", "sigmoid",
                   "--max-length", "256", "--lr", "5e-7", *a.ours_extra.split()]
            if V.run(cmd, out.parent / (out.name + ".log")):
                rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
                rows = [r for r in rows if "time/step" in r]
                art = json.loads((out / "artifact.json").read_text())
                o = {**V.median_rows(rows, ["time/step"]), "peak_gib": max(art["metrics"]["peak_memory_gib_per_rank"]),
                     "cmd": " ".join(cmd)}
        if a.only in ("both", "trl"):
            js = root / f"trl-dpo-{name}.json"
            cmd = [sys.executable, "-m", "benchmarks.dpo_vs_trl", "--trl-worker", "--model", str(model), "--json",
                   str(js), "--steps", str(a.steps), "--batch-size", str(a.batch_size), "--micro-batch-size",
                   str(a.micro_batch_size)]
            if V.run(cmd, js.with_suffix(".log")):
                res = json.loads(js.read_text())
                t = {**V.median_rows(res["rows"], ["time/step"]), "peak_gib": res["peak_gib"], "cmd": " ".join(cmd)}
        g = lambda d, k: None if d is None else d.get(k)  # noqa: E731
        pps = {n: (a.batch_size / d["time/step"] if d and d.get("time/step") else None) for n, d in (("o", o), ("t", t))}
        report += [f"\n### DPO {name}: {a.batch_size} pairs per step (micro {a.micro_batch_size}), bf16, live reference, "
                   f"1 GPU; median of steps 2..{a.steps}{'; ours with ' + a.ours_extra if a.ours_extra else ''}",
                   "| | ours | TRL | ours/TRL |", "|---|---|---|---|",
                   f"| step (s) | {V.fmt(g(o, 'time/step'))} | {V.fmt(g(t, 'time/step'))} | {V.ratio(g(o, 'time/step'), g(t, 'time/step'))} |",
                   f"| pairs/s | {V.fmt(pps['o'], '.1f')} | {V.fmt(pps['t'], '.1f')} | {V.ratio(pps['o'], pps['t'])} |",
                   f"| peak GPU memory (GiB) | {V.fmt(g(o, 'peak_gib'), '.2f')} | {V.fmt(g(t, 'peak_gib'), '.2f')} | "
                   f"{V.ratio(g(o, 'peak_gib'), g(t, 'peak_gib'))} |"]
        results[f"ours-{name}"], results[f"trl-{name}"] = o, t
    V.write_json(root / "dpo_vs_trl.json", {"results": results, "argv": sys.argv})
    print("\n".join(report))


if __name__ == "__main__":
    main()
