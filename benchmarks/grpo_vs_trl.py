"""GRPO, ours vs TRL's GRPOTrainer, on the same GPU, one after the other, in one command.

    python -m benchmarks.grpo_vs_trl --models 135m,0.5b --steps 4 [--nproc 1,2 [--scaling strong,weak]] [--only ours|trl]

Same model directory (random init, bf16), tokenizer, prompts (data/arithmetic/train.jsonl, each prompt templated
the way align does it), G, prompts per step, completion length, micro-batch size (TRL:
per_device_train_batch_size x gradient_accumulation_steps = one generation batch = one optimizer step), sampling
temperature 1, β = 0, one update per rollout batch, gradient checkpointing (TRL's default, on for both) and a
noise reward (every group keeps its variance). Prints per step (median of steps 2..N): generation / reward /
log-prob / backward+step seconds, generated tokens/s, peak GPU memory, ours/TRL ratios, and the decode roofline
(bytes a decode step must read over the card's measured copy bandwidth, vs the achieved time per token).
TRL runs without DeepSpeed (its plain single-GPU path, model and AdamW states in bf16); ours is `align grpo` at
its defaults (one GPU: a ZeRO-0 engine, --precision auto = bf16-pure: bf16 weights, gradients and moments,
AdamW with stochastic rounding; `--ours-extra "--precision bf16-mixed"` gives ours fp32 master weights).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from benchmarks import vs_trl as V

PHASES = ["time/generate", "time/reward", "time/logprobs", "time/update"]


FILLER = ("Read the following notes carefully before you answer; only the last question counts. " * 400).split()


def raw_prompts(n: int, tokens: int = 0) -> list[str]:
    """The arithmetic prompts, each led by filler words so that it has about `tokens` tokens (0: as they are):
    long-context shapes with the same data for both sides."""
    from align import data as D
    from align.models import load_tokenizer, resolve
    from align.paths import DATA_DIR

    rows = [r["prompt"] for r in D.load_rows(str(DATA_DIR / "arithmetic/train.jsonl"), "prompts")[:n]]
    if not tokens:
        return rows
    tok = load_tokenizer(resolve("tiny"))
    out = []
    for r in rows:
        lo, hi = 0, len(FILLER)  # the most filler words that keep the templated prompt within `tokens`
        while lo < hi:
            mid = (lo + hi + 1) // 2
            text = " ".join(FILLER[:mid]) + "\n" + r
            if len(tok(D.prompt_texts(tok, [text])[0], add_special_tokens=False)["input_ids"]) <= tokens:
                lo = mid
            else:
                hi = mid - 1
        out.append(" ".join(FILLER[:lo]) + "\n" + r)
    return out


def prompts_text(n: int, tokens: int = 0) -> list[str]:
    from align import data as D
    from align.models import load_tokenizer, resolve

    tok = load_tokenizer(resolve("tiny"))
    return D.prompt_texts(tok, raw_prompts(n, tokens))


def trl_worker(a) -> None:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from benchmarks.bench_reward import trl_noise

    tok = AutoTokenizer.from_pretrained(a.model)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.bfloat16)
    n = a.prompts * a.generations
    ds = Dataset.from_list([{"prompt": p} for p in prompts_text(a.prompts * a.steps, a.prompt_tokens)])
    args = GRPOConfig(
        output_dir=a.json + ".trl", per_device_train_batch_size=a.micro_batch_size,
        gradient_accumulation_steps=n // a.micro_batch_size, num_generations=a.generations,
        max_completion_length=a.max_new_tokens, max_steps=a.steps, learning_rate=lr(a), bf16=torch.cuda.is_available(), use_cpu=not torch.cuda.is_available(),
        gradient_checkpointing=a.gradient_checkpointing, beta=0.0, num_iterations=1, temperature=1.0,
        logging_steps=1, report_to=[], save_strategy="no", seed=0, log_completions=False,
        dataloader_num_workers=0)
    tr = GRPOTrainer(model=model, reward_funcs=[trl_noise], args=args, train_dataset=ds, processing_class=tok)
    timer = V.StepTimer(tr, {"_generate": "time/generate", "_calculate_rewards": "time/reward",
                             "_get_per_token_logps_and_entropies": "time/logprobs"}, nograd_only={"time/logprobs"})
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    tr.train()
    rows = []
    for r in timer.rows:
        r = dict(r)
        r["time/update"] = r["time/step"] - r["time/generate"] - r["time/reward"] - r["time/logprobs"]
        rows.append(r)
    V.write_json(Path(a.json), {"rows": rows, "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0,
                                "gen_tokens_per_step": None})


def lr(a) -> float:
    """The harness' learning rate: 5e-5, or 1e-8 with --ragged. A ragged model's lengths hang on one EOS logit
    balanced at half the budget, and 5e-5 on the noise reward undid them within a step or two (Qwen2.5-1.5B on a
    GPU: 430-460 of 512 tokens on steps 2-4; the 135M shape on CPU at 48 tokens: 26, 40, 48, 47 where 24 was
    set): the shape it times would drift to unragged. The update's work does not depend on the rate."""
    return 1e-8 if getattr(a, "ragged", False) else 5e-5


def ours_command(model: Path, a, nproc: int, out: Path, prompts: int) -> list[str]:
    """The harness' `align grpo` command on `nproc` processes (`a`: the harness' options)."""
    cmd = [*V.torchrun(nproc), "-m", "align", "grpo", "--model", str(model), "--out", str(out), "--overwrite",
           "--eval-data", "", *(["--data", a.data_file] if a.data_file else []),
           "--max-steps", str(a.steps), "--prompts-per-step", str(prompts), "--num-generations", str(a.generations),
           "--max-new-tokens", str(a.max_new_tokens), "--micro-batch-size", str(a.micro_batch_size * 1),
           "--reward", "benchmarks/bench_reward.py:noise", "--temperature", "1.0", "--beta", "0",
           "--num-iterations", "1", "--lr", str(lr(a))]
    if nproc > 1:
        cmd[cmd.index("--micro-batch-size") + 1] = str(min(a.micro_batch_size, prompts * a.generations // nproc))
    if a.gradient_checkpointing:
        cmd.append("--gradient-checkpointing")
    return cmd + a.ours_extra.split() + (a.multi_extra.split() if nproc > 1 else [])


def ours(model: Path, a, nproc: int, out: Path, env: dict | None = None, scaling: str = "strong") -> dict | None:
    """`align grpo` on `nproc` processes. Weak scaling: `nproc` × --prompts per step, so every GPU keeps the
    1-GPU batch; strong: the same global batch split over the GPUs."""
    prompts = a.prompts * nproc if scaling == "weak" else a.prompts
    cmd = ours_command(model, a, nproc, out, prompts)
    if not V.run(cmd, out.parent / (out.name + ".log"), env=env, gpus=nproc):
        return None
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "time/generate" in r]
    for r in rows:
        r["time/step"] = sum(r[k] for k in PHASES)
        r["tokens"] = r["completions/mean_length"] * prompts * a.generations
    art = json.loads((out / "artifact.json").read_text())
    med = V.median_rows(rows, PHASES + ["time/step", "tokens"])
    return {**med, "peak_gib": max(art["metrics"]["peak_memory_gib_per_rank"]),
            "peak_per_rank": art["metrics"]["peak_memory_gib_per_rank"], "cmd": " ".join(cmd)}


def trl(model: Path, a, out: Path) -> dict | None:
    js = out.with_suffix(".json")
    cmd = [sys.executable, "-m", "benchmarks.grpo_vs_trl", "--trl-worker", "--model", str(model), "--json", str(js),
           "--steps", str(a.steps), "--prompts", str(a.prompts), "--generations", str(a.generations),
           "--max-new-tokens", str(a.max_new_tokens), "--micro-batch-size", str(a.micro_batch_size),
           "--prompt-tokens", str(a.prompt_tokens)]
    if not a.gradient_checkpointing:
        cmd.append("--no-gradient-checkpointing")
    if not V.run(cmd, out.parent / (out.name + ".log")):
        return None
    res = json.loads(js.read_text())
    med = V.median_rows(res["rows"], PHASES + ["time/step"])
    med["tokens"] = a.prompts * a.generations * a.max_new_tokens  # TRL pads to the budget; random weights never stop
    return {**med, "peak_gib": res["peak_gib"], "cmd": " ".join(cmd)}


def attention_mfu(name: str, sequences: int, prompt_len: float, completion_tokens: float, seconds: float) -> float:
    """The update's model FLOPs utilisation counting attention as PaLM does (Chowdhery et al. 2022, appendix B):
    (6·N + 12·L·H·Q·T) FLOPs per trained token, T the mean sequence length (prompt + completion), on the H200's
    989 dense bf16 TFLOP/s. 6·N alone leaves out the score and value matmuls, ~13 % more at 4K tokens and 8B."""
    cfg = V.config(name)
    tokens = sequences * prompt_len + completion_tokens
    hq = cfg.num_attention_heads * (getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    per_token = 6 * V.flop_params(name) + 12 * cfg.num_hidden_layers * hq * tokens / sequences
    return per_token * tokens / seconds / 989e12


def table(name: str, a, o: dict | None, t: dict | None, bw: float | None, prompt_len: float) -> list[str]:
    lines = [f"\n### GRPO {name}: {a.prompts} prompts x G={a.generations}, {a.max_new_tokens} new tokens, micro "
             f"{a.micro_batch_size}, bf16, grad ckpt {'on' if a.gradient_checkpointing else 'off'}, 1 GPU; "
             f"median of steps 2..{a.steps}{'; ours with ' + a.ours_extra if a.ours_extra else ''}",
             "| | ours | TRL | ours/TRL |", "|---|---|---|---|"]
    g = lambda d, k: None if d is None else d.get(k)  # noqa: E731
    for k in PHASES + ["time/step"]:
        lines.append(f"| {k[5:]} (s) | {V.fmt(g(o, k))} | {V.fmt(g(t, k))} | {V.ratio(g(o, k), g(t, k))} |")
    tps = {n: (d["tokens"] / d["time/generate"] if d and d.get("time/generate") else None) for n, d in (("o", o), ("t", t))}
    lines.append(f"| generated tokens/s | {V.fmt(tps['o'], ',.0f')} | {V.fmt(tps['t'], ',.0f')} | {V.ratio(tps['o'], tps['t'])} |")
    nemo = {n: (a.prompts * a.generations * prompt_len + d["tokens"]) / d["time/step"] if d else None
            for n, d in (("o", o), ("t", t))}
    lines.append(f"| tokens/s per GPU (prompt + completion / step) | {V.fmt(nemo['o'], ',.0f')} | "
                 f"{V.fmt(nemo['t'], ',.0f')} | {V.ratio(nemo['o'], nemo['t'])} |")
    mfu = {n: 6 * V.flop_params(name) * (a.prompts * a.generations * prompt_len + d["tokens"]) / d["time/update"] / 989e12
           if d and d.get("time/update") else None for n, d in (("o", o), ("t", t))}
    lines.append(f"| update MFU (6·N·tokens / update time / 989 TFLOP/s; N active for MoE) | {V.fmt(mfu['o'], '.1%')} | "
                 f"{V.fmt(mfu['t'], '.1%')} | {V.ratio(mfu['o'], mfu['t'])} |")
    att = {n: attention_mfu(name, a.prompts * a.generations, prompt_len, d["tokens"], d["time/update"])
           if d and d.get("time/update") else None for n, d in (("o", o), ("t", t))}
    lines.append(f"| update MFU with attention ((6·N + 12·L·H·Q·T)·tokens, PaLM's count) | {V.fmt(att['o'], '.1%')} | "
                 f"{V.fmt(att['t'], '.1%')} | {V.ratio(att['o'], att['t'])} |")
    lines.append(f"| peak GPU memory (GiB) | {V.fmt(g(o, 'peak_gib'), '.2f')} | {V.fmt(g(t, 'peak_gib'), '.2f')} | "
                 f"{V.ratio(g(o, 'peak_gib'), g(t, 'peak_gib'))} |")
    if bw:
        for label, d in (("ours", o), ("TRL", t)):
            if d and d.get("time/generate"):
                r = V.roofline(name, a.prompts * a.generations, prompt_len, a.max_new_tokens, d["time/generate"], bw)
                lines.append(f"decode roofline ({label}): {r['bytes_per_step_mb']:.0f} MB per decode step at "
                             f"{bw / 1e12:.2f} TB/s -> floor {r['floor_ms']:.3f} ms; achieved {r['achieved_ms']:.3f} ms "
                             f"per token (prefill included) = {r['fraction']:.1%} of the floor")
    return lines


def shape_args(ap) -> None:
    """The GRPO batch shape of the harness (8 prompts x G 8, 512 new tokens, micro 16, gradient checkpointing;
    --prompt-tokens: longer prompts)."""
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--micro-batch-size", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=0, help="prompts padded with filler words to about this "
                    "many tokens (0: the arithmetic prompts as they are, ~50 tokens)")
    ap.add_argument("--ragged", action="store_true", help="completions of ragged lengths: the random model's "
                    "completions end at EOS after half of --max-new-tokens on average (vs_trl.ragged)")
    ap.add_argument("--data-file", default="", help=argparse.SUPPRESS)
    ap.add_argument("--no-gradient-checkpointing", dest="gradient_checkpointing", action="store_false")


def long_prompts(a, root: Path) -> None:
    """With --prompt-tokens: ours reads the same long prompts TRL gets from a file (a.data_file)."""
    if a.prompt_tokens:
        a.data_file = str(root / f"prompts-{a.prompt_tokens}.jsonl")
        Path(a.data_file).write_text("".join(json.dumps({"prompt": p, "answer": "0"}) + "\n"
                                             for p in raw_prompts(a.prompts * a.steps, a.prompt_tokens)))


def scaling_row(n: int, d: dict, base: dict) -> str:
    """One row of the scaling table: run `d` on `n` GPUs against the 1-GPU run `base`."""
    thr = d["tokens"] / d["time/step"]
    return (f"| {n} | {d['tokens'] / n:,.0f} | {d['time/step']:.3f} | {thr:,.0f} | "
            f"{thr / (base['tokens'] / base['time/step']):.2f} | {d['time/generate']:.3f} | {d['time/update']:.3f} | "
            f"{', '.join(f'{m:.2f}' for m in d['peak_per_rank'])} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    V.harness_args(ap, models="135m", steps=4)
    shape_args(ap)
    ap.add_argument("--nproc", default="1", help="ours: process counts, e.g. 1,2 (TRL: 1 GPU)")
    ap.add_argument("--multi-extra", default="", help="extra flags for our N>1-process runs only, e.g. "
                    "'--zero-stage 0' (replicas, all-reduced gradients) against the ZeRO-3 default")
    ap.add_argument("--scaling", default="strong",
                    help="N processes: the same prompts per step (strong) or N x as many (weak: each GPU keeps "
                         "the 1-GPU batch); 'strong,weak' runs both against one 1-GPU baseline")
    a = ap.parse_args()
    if not set(a.scaling.split(",")) <= {"strong", "weak"}:
        ap.error(f"--scaling {a.scaling!r}: use strong, weak or strong,weak")
    if a.trl_worker:
        return trl_worker(a)
    root = V.out_root(a.out, "align-grpo-vs-trl-")
    import torch

    bw = V.measure_bandwidth() if torch.cuda.is_available() else None
    if bw:
        print(f"{torch.cuda.get_device_name()}: device copy {bw / 1e12:.2f} TB/s (read + write)", flush=True)
    from align.models import load_tokenizer, resolve

    tok = load_tokenizer(resolve("tiny"))
    prompt_len = statistics.mean(len(x) for x in tok(prompts_text(64, a.prompt_tokens), add_special_tokens=False)["input_ids"])
    long_prompts(a, root)
    report, results = [], {}
    for name in a.models.split(","):
        model = V.make_model(name, root, a.max_new_tokens if a.ragged else 0, prompts_text(16, a.prompt_tokens))
        o = t = None
        nprocs = [int(x) for x in a.nproc.split(",")]
        if a.only in ("both", "ours"):
            o = ours(model, a, nprocs[0], root / f"ours-{name}-n{nprocs[0]}")
        if a.only in ("both", "trl"):
            t = trl(model, a, root / f"trl-{name}")
        report += table(name, a, o, t, bw, prompt_len)
        for scaling in a.scaling.split(",") if nprocs[1:] and o else []:
            rows = [scaling_row(1, o, o)]
            for n in nprocs[1:]:
                on = ours(model, a, n, root / f"ours-{name}-n{n}-{scaling}", scaling=scaling)
                if on:
                    rows.append(scaling_row(n, on, o))
                    results[f"ours-{name}-n{n}-{scaling}"] = on
            engine = a.multi_extra or "the defaults (on GPUs: half decode, one step off)"
            report += [f"\n{scaling} scaling, ours, {name}, N processes with {engine} (throughput = completion tokens "
                       "per step time)",
                       "| GPUs | tokens per GPU per step | step (s) | tokens/s | vs 1 GPU | generate (s) | update (s) | "
                       "peak GiB per rank |", "|---|---|---|---|---|---|---|---|", *rows]
        results[f"ours-{name}"], results[f"trl-{name}"] = o, t
    V.write_json(root / "grpo_vs_trl.json", {"bandwidth": bw, "prompt_len": prompt_len, "results": results,
                                             "argv": sys.argv})
    print("\n".join(report))


if __name__ == "__main__":
    main()
