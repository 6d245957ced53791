"""GRPO with an LLM judge as the reward, on a real model: does the judge move what its rubric asks for?

    python -m benchmarks.judge_gpu --model /root/smollm2 --out /root/judge --seed 0

The rubric asks for something a function can measure: an answer of at most --words words that ends in a number
(`short_numeric`). The judge is the same small model, fine-tuned as a judge (`align sft` on the filled rubric ->
"9" / "0"): prompted as it comes, a 135M model's verdicts are close to chance. Its training answers are the
policy's own samples on training prompts (T 1), their first sentences and short synthetic answers, labelled by
`short_numeric`, balanced; none come from the held-out prompts.

Then, on reasoning-gym basic_arithmetic (two terms of 1-2 digits, `+`):
  - judge:    `align grpo --reward judge:J --reward math:0` — the judge alone is the reward (math is logged as gold)
  - judge+math: `align grpo --reward math --reward judge:J:0.5` — the judge's style on top of correctness
  - math:     `align grpo --reward math` — what correctness alone does to the measure (--control)
Held-out (200 prompts the judge never saw) greedy answers before and after: the measure's rate, pass@1 (math: the
last number), both at once, mean words; and the judge's agreement with the measure on those answers (score >= 0.5
against short_numeric). Prints a table; writes OUT/summary.json.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

RUBRIC = """Score the response below: 9 if it is at most {words} words long and ends with a number, 0 otherwise.

Request:
{{prompt}}

Response:
{{completion}}

Answer with one digit, the score, and nothing else.
"""
TEMPLATES = ["{x}", "{x}.", "The answer is {x}.", "{a} + {b} = {x}", "The sum is {x}.", "It equals {x}.",
             "So the answer is {x}", "Adding them gives {x}.", "I don't know.", "Let me think about it.",
             "The answer is a number.", "We add the two numbers together."]
NUMBER_AT_END = re.compile(r"-?\d+(?:\.\d+)?\W*$")


def words(text: str) -> int:
    return len(text.split())


def short_numeric(text: str, max_words: int) -> bool:
    """The measure: at most `max_words` words, ending in a number (trailing punctuation allowed)."""
    text = text.strip()
    return 0 < words(text) <= max_words and NUMBER_AT_END.search(text) is not None


def correct(text: str, answer: str) -> bool:
    """The `math` verifier's check (align.rewards.math_reward, as `--reward math` and `align eval` score)."""
    from align.rewards import math_reward

    return math_reward(text, str(answer)) == 1.0


def align(*args) -> None:
    cmd = [sys.executable, "-m", "align", *map(str, args)]
    print("$ align " + " ".join(map(str, args)), flush=True)
    p = subprocess.run(cmd, capture_output=True, text=True, check=False)
    tail = [line for line in (p.stdout + p.stderr).splitlines() if "it/s]" not in line and line.strip()]
    print("\n".join(tail[-12:]), flush=True)
    if p.returncode:
        sys.exit(f"align {args[0]} failed ({p.returncode})")


def start(*args) -> subprocess.Popen:
    print("$ align " + " ".join(map(str, args)), flush=True)
    return subprocess.Popen([sys.executable, "-m", "align", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def finish(p: subprocess.Popen, name: str) -> None:
    text = p.communicate()[0]
    tail = [line for line in text.splitlines() if "it/s]" not in line and line.strip()]
    print(f"-- {name}\n" + "\n".join(tail[-40:]), flush=True)
    if p.returncode:
        sys.exit(f"align {name} failed ({p.returncode})")


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_jsonl(rows: list[dict], path: Path) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def sample(model_dir: str, prompts: list[str], n: int, max_new: int, seed: int) -> list[list[str]]:
    """n samples (T 1) of each prompt from the model, through its chat template (HF generate)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from align.chat import prompt_text

    torch.manual_seed(seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tok = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    tok.pad_token = tok.pad_token or tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
    model.to(device).eval()
    out = []
    for i in range(0, len(prompts), 128):
        batch = [prompt_text(tok, p) for p in prompts[i:i + 128]]
        enc = tok(batch, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
        with torch.no_grad():
            ids = model.generate(**enc, do_sample=True, temperature=1.0, max_new_tokens=max_new,
                                 num_return_sequences=n, pad_token_id=tok.pad_token_id or tok.eos_token_id)
        texts = tok.batch_decode(ids[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        out += [texts[j * n:(j + 1) * n] for j in range(len(batch))]
    return out


def candidates(row: dict, samples: list[str], rng: random.Random) -> list[str]:
    """A prompt's judge-training answers: the model's samples, their first sentences, two short synthetic ones."""
    a, b = re.findall(r"\d+", row["prompt"])[:2] or ("1", "2")
    first = [s.strip().split(". ")[0].strip() + "." for s in samples if s.strip()]
    fake = []
    for _ in range(2):
        x = int(row["answer"]) + rng.choice([0, 0, rng.randint(-10, 10)])
        fake.append(rng.choice(TEMPLATES).format(x=x, a=a, b=b))
    return [s.strip() for s in samples] + first + fake


def judge_rows(rows: list[dict], samples: list[list[str]], rubric: str, max_words: int, seed: int) -> list[dict]:
    """SFT rows for the judge: the filled rubric -> "9" / "0" by the measure, classes balanced."""
    rng = random.Random(seed)
    pos, neg = [], []
    for row, ss in zip(rows, samples):
        for c in candidates(row, ss, rng):
            label = short_numeric(c, max_words)
            item = {"prompt": rubric.replace("{prompt}", row["prompt"]).replace("{completion}", c),
                    "completion": "9" if label else "0", "answer": "9" if label else "0"}
            (pos if label else neg).append(item)
    rng.shuffle(neg)
    out = pos + neg[:len(pos)]
    rng.shuffle(out)
    return out


def judged(judge_dir: str, rubric: str, prompts: list[str], answers: list[str]) -> list[float]:
    import torch

    from align import judge as J

    j = J.load(judge_dir, rubric)
    if torch.cuda.is_available():
        j.model.to("cuda")
    return j.scores(prompts, answers)


def measure(rows: list[dict], texts: list[str], scores: list[float], max_words: int) -> dict:
    lab = [short_numeric(t, max_words) for t in texts]
    ok = [correct(t, r["answer"]) for r, t in zip(rows, texts)]
    return {"short_numeric": statistics.mean(lab), "pass@1": statistics.mean(ok),
            "short_and_correct": statistics.mean(a and b for a, b in zip(lab, ok)),
            "mean words": statistics.mean(words(t) for t in texts),
            "judge mean": statistics.mean(scores),
            "judge agreement": statistics.mean((s >= 0.5) == y for s, y in zip(scores, lab))}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", default="runs/judge_gpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--words", type=int, default=10, help="The rubric's and the measure's word limit.")
    ap.add_argument("--n", type=int, default=2000, help="Training prompts.")
    ap.add_argument("--test-n", type=int, default=200, help="Held-out prompts.")
    ap.add_argument("--judge-prompts", type=int, default=600, help="Training prompts the judge's answers come from.")
    ap.add_argument("--judge-steps", type=int, default=150)
    ap.add_argument("--steps", type=int, default=60, help="GRPO steps.")
    ap.add_argument("--runs", default="judge,judge+math", help="Of judge, judge+math, math.")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--data", default="", help="A directory with train.jsonl and test.jsonl made beforehand (a "
                    "machine without reasoning-gym); default: made here.")
    args, extra = ap.parse_known_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    train, test = out / "train.jsonl", out / "test.jsonl"
    if args.data:
        for f in (train, test):  # prompt and answer only: no reasoning-gym metadata to look up
            write_jsonl([{"prompt": r["prompt"], "answer": r["answer"]} for r in read_jsonl(Path(args.data) / f.name)], f)
    else:
        align("data", "make", "rg:basic_arithmetic", "--n", args.n, "--test-n", args.test_n, "--seed", 0, "--out", train,
              "--test-out", test, "--param", "min_terms=2", "--param", "max_terms=2", "--param", "max_digits=2",
              "--param", "operators=['+']", "--param", "allow_parentheses=false", "--param", "allow_negation=false")
    rubric = RUBRIC.format(words=args.words)
    (out / "rubric.txt").write_text(rubric)
    rows = read_jsonl(train)[:args.judge_prompts]
    samples = sample(args.model, [r["prompt"] for r in rows], 2, args.max_new_tokens, args.seed)
    jrows = judge_rows(rows, samples, rubric, args.words, args.seed)
    cut = len(jrows) // 10
    write_jsonl(jrows[cut:], out / "judge_train.jsonl")
    write_jsonl(jrows[:cut], out / "judge_test.jsonl")
    print(f"judge data: {len(jrows)} rows (half '9'), {cut} held out; {time.time() - t0:.0f} s", flush=True)
    jdir = out / "judge"
    if not (jdir / "artifact.json").exists():  # (a rerun on the same machine keeps the judge)
      align("sft", "--model", args.model, "--data", out / "judge_train.jsonl", "--eval-data", out / "judge_test.jsonl",
          "--max-steps", args.judge_steps, "--batch-size", 32, "--lr", 2e-5, "--max-new-tokens", 2, "--eval-every", 0,
          "--eval-samples", cut, "--seed", args.seed, "--out", jdir, "--overwrite")
    judge_acc = json.loads((jdir / "artifact.json").read_text())["metrics"].get("eval/pass@1")

    held = read_jsonl(test)[:args.test_n]
    prompts = [r["prompt"] for r in held]
    align("eval", args.model, "--data", test, "--k", 1, "--limit", args.test_n, "--max-new-tokens",
          args.max_new_tokens, "--verifier", "math", "--out", out / "eval_base", "--overwrite")
    base = [r["greedy"] for r in read_jsonl(out / "eval_base" / "samples.jsonl")]
    table = {"before": measure(held, base, judged(str(jdir), rubric, prompts, base), args.words)}
    rewards = {"judge": ["--reward", f"judge:{jdir}", "--reward", "math:0"],
               "judge+math": ["--reward", "math", "--reward", f"judge:{jdir}:0.5"],
               "math": ["--reward", "math"]}
    runs = {name: out / f"grpo_{name.replace('+', '_')}" for name in args.runs.split(",")}
    t1 = time.time()
    procs = {name: start("grpo", "--model", args.model, "--data", train, "--eval-data", test, "--eval-samples",
                         args.test_n, *rewards[name],
                         *(["--judge-rubric", out / "rubric.txt"] if "judge" in name else []),
                         "--max-steps", args.steps, "--lr", 1e-5, "--max-new-tokens", args.max_new_tokens,
                         "--eval-every", args.steps, "--eval-k", 1, "--seed", args.seed, "--out", run, "--overwrite",
                         *extra)
             for name, run in runs.items()}  # side by side on the one GPU
    for name, run in runs.items():
        finish(procs[name], f"grpo ({name})")
        after = read_jsonl(run / "eval_samples.jsonl")
        by_prompt = {r["prompt"]: r["greedy"] for r in after}
        texts = [by_prompt[p] for p in prompts]
        table[f"after GRPO ({name})"] = {**measure(held, texts, judged(str(jdir), rubric, prompts, texts), args.words),
                                         "wall s": time.time() - t1}
    keys = ["short_numeric", "short_and_correct", "pass@1", "mean words", "judge mean", "judge agreement"]
    print(f"\njudge: accuracy {judge_acc} on its {cut} held-out rows; rubric: <= {args.words} words, ends in a number")
    print("| policy | " + " | ".join(keys) + " |\n|" + "---|" * (len(keys) + 1))
    for name, m in table.items():
        print(f"| {name} | " + " | ".join(f"{m[k]:.3f}" for k in keys) + " |")
    (out / "summary.json").write_text(json.dumps({"judge_accuracy": judge_acc, "words": args.words,
                                                  "table": table, "wall_s": time.time() - t0}, indent=1))


if __name__ == "__main__":
    main()
