"""`align data make TASK`: generate a dataset (and optionally a held-out split with no prompt in common).

--out FILE.jsonl writes that file (and --test-out); any other --out is a directory artifact (a pipeline's `data`
stage): OUT/data.jsonl, OUT/test.jsonl and artifact.json, read by later stages as `@NAME` (its data.jsonl) or
`@NAME/test.jsonl`.

TASK is one of the built-in tasks (digit_sort, digit_sort_prefs, arithmetic, sort, prefs, text, mul_tool), `rg:NAME` for a reasoning-gym task (optional
extra), or `prefs --from-model M --data FILE`: preference pairs a model makes itself — K sampled completions per
prompt of a verifiable file, a correct one as `chosen` and an incorrect one as `rejected` (on-policy pairs, as in
online / iterative DPO recipes).
"""

from __future__ import annotations

import difflib
import random
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from align import tasks
from align.config import SEED_MAX, Options, opt
from align.console import info, summary_table
from align.errors import UserError


@dataclass(frozen=True)
class DataMakeConfig(Options):
    task: str = opt("arithmetic", "Task: digit_sort, digit_sort_prefs, arithmetic, sort, prefs, text, mul_tool, or rg:NAME "
                                  "(a reasoning-gym task).")
    n: int = opt(1000, "Rows to generate (prefs --from-model: prompts to sample, 0 = all of --data).", ge=0)
    seed: int = opt(0, "Random seed.", ge=0, le=SEED_MAX)
    out: str = opt("data.jsonl", "Output JSONL file, or a directory: an artifact with data.jsonl and test.jsonl.",
                   path=True)
    overwrite: bool = opt(False, "Replace the files (or the complete artifact) already at --out / --test-out.")
    test_n: int = opt(0, "Also write a held-out split of N rows, disjoint from the main one (no shared prompt).",
                     ge=0)
    test_out: str = opt("", "Held-out output file (default: OUT with .test.jsonl).", path=True)
    levels: str = opt("1,2,3,4", "arithmetic/prefs difficulty levels: 1-digit/2 operands .. 2-digit/3 operands.")
    param: list[str] = opt([], "Task option KEY=VALUE (repeatable), e.g. --param flaw_rate=0.5 (digit_sort) or "
                               "--param max_terms=3 (rg:basic_arithmetic).")
    exclude: str = opt("", "Leave out the prompts of this JSONL file (e.g. the training split, for a fresh held-out "
                           "set made with another --seed).", path=True)
    from_model: str = opt("", "prefs: sample the pairs from this model (a directory, artifact or hub id).",
                          path=True)
    data: str = opt("", "prefs --from-model: verifiable prompts {prompt, answer} to sample on.", path=True)
    samples: int = opt(8, "prefs --from-model: completions sampled per prompt (a pair needs a correct and an "
                               "incorrect one).", ge=2)
    max_samples: int = opt(0, "prefs --from-model: prompts with no pair after --samples (all correct or all wrong) "
                              "are sampled again, --samples at a time, up to this many per prompt; 0 = no second "
                              "round.", ge=0)
    pairs_per_prompt: int = opt(1, "prefs --from-model: up to this many (correct, incorrect) pairs per training "
                                   "prompt, each pairing a different incorrect (or correct) sample; held-out prompts "
                                   "keep one.", ge=1)
    pair_by: str = opt("random", "prefs --from-model: which wrong answers a right one is paired with: random; length "
                                 "(the closest in length: a reward model or DPO cannot prefer the right side by its "
                                 "length); form (the same form with another number first, then the most alike in "
                                 "text: minimal pairs).", choices=("random", "length", "form"))
    max_new_tokens: int = opt(128, "prefs --from-model: longest completion.", ge=1)
    temperature: float = opt(1.0, "prefs --from-model: sampling temperature.", gt=0)
    verifier: str = opt("auto", "prefs --from-model: how completions are graded (see `align eval --help`).",
                        code=True)
    batch_size: int = opt(64, "prefs --from-model: generation batch.", ge=1)


def run(cfg: DataMakeConfig) -> dict:
    started = time.time()  # the artifact's wall time counts the sampling, not only the writing
    check_out(cfg)
    if cfg.from_model:
        return _model_pairs(cfg, started)
    from align import rgym

    params, excluded = rgym.parse_params(cfg.param), excluded_prompts(cfg)
    if cfg.task.startswith("rg:"):
        return _reasoning_gym(cfg, params, excluded, started)
    try:
        levels = tuple(int(x) for x in cfg.levels.split(","))
    except ValueError:
        raise UserError(f"--levels must be comma-separated integers 1..4, not {cfg.levels!r}.") from None
    opts = {**params, "levels": levels} if cfg.task in ("arithmetic", "prefs") else params
    rows = tasks.make_dataset(cfg.task, cfg.n, cfg.seed, exclude=excluded, **opts)
    test = None
    if cfg.test_n:
        taken = excluded | {tasks.row_key(r) for r in rows}
        # the held-out split from its own stream, as reasoning-gym tasks' (a Random(seed) stream per split)
        test = tasks.make_dataset(cfg.task, cfg.test_n, cfg.seed + rgym.SPLIT_OFFSET, exclude=taken, **opts)
    return _write(cfg, rows, test, started=started, **flaw_summary(rows))


def excluded_prompts(cfg: DataMakeConfig) -> set:
    """The prompts (or texts) of --exclude's rows; an empty set without --exclude."""
    if not cfg.exclude:
        return set()
    from align.data import read_rows

    rows = read_rows(cfg.exclude)
    if rows and not any(k in rows[0] for k in ("prompt", "text")):
        raise UserError(f"--exclude {cfg.exclude}: its rows have no 'prompt' (or 'text') column to leave out.")
    if rows and "rg_metadata" in rows[0]:  # reasoning-gym rows: their prompts and problems, however worded
        from align import rgym

        return rgym.row_keys(rows)
    return {tasks.row_key(r) for r in rows}


def flaw_summary(rows: list[dict]) -> dict:
    """digit_sort: how often the demonstrator is right (its accuracy) and how often it leaves the 0 out."""
    if not rows or "flawed" not in rows[0]:
        return {}
    flawed = sum(r["flawed"] for r in rows)
    return {"demonstrator_accuracy": round(1 - flawed / len(rows), 4),
            "flaw_rate_on_zero_lists": round(flawed / max(1, sum(" 0" in " " + r["answer"] for r in rows)), 4)}


def is_artifact(out: str) -> bool:
    return Path(out).suffix.lower() not in (".jsonl", ".json")


def held_out_path(cfg: DataMakeConfig) -> str:
    """Where a file --out's held-out split goes."""
    return cfg.test_out or str(Path(cfg.out).with_suffix("")) + ".test.jsonl"


def check_out(cfg: DataMakeConfig) -> None:
    """Before anything is generated: an existing file is replaced only with --overwrite (an artifact --out: the
    rules of every stage's --out)."""
    if is_artifact(cfg.out):
        from align.engine import outdir

        outdir.check(cfg, "data")
        return
    for flag, path in (("--out", cfg.out), ("--test-out", held_out_path(cfg)))[: 1 + bool(cfg.test_n)]:
        if Path(path).is_dir():
            raise UserError(f"{flag} {path}: is a directory; give a .jsonl file (an --out without .jsonl or .json "
                            "is written as an artifact directory).")
        if Path(path).exists() and not cfg.overwrite:
            raise UserError(f"{flag} {path}: the file exists; pass --overwrite to replace it, or choose another "
                            f"{flag}.")


def _write(cfg: DataMakeConfig, rows: list[dict], test: list[dict] | None, inputs: dict | None = None,
           started: float | None = None, notes: dict | None = None, **extra) -> dict:
    """The rows (and the held-out `test` rows) to --out: an artifact (with `inputs` and `notes`, artifact.json's
    other keys) or JSONL files; `extra`: the summary's other figures."""
    if is_artifact(cfg.out):
        return _write_artifact(cfg, rows, test, inputs or {}, started, notes, **extra)
    tasks.write_jsonl(rows, Path(cfg.out))
    summary = {"task": cfg.task, "rows": len(rows), "out": cfg.out, **extra}
    if test is not None:
        tasks.write_jsonl(test, Path(held_out_path(cfg)))
        summary.update(test_rows=len(test), test_out=held_out_path(cfg))
    summary_table("data make", summary)
    return summary


def _write_artifact(cfg: DataMakeConfig, rows: list[dict], test: list[dict] | None, inputs: dict,
                    started: float | None, notes: dict | None = None, **extra) -> dict:
    from align.engine.run import StageRun

    with StageRun(cfg, "data") as run:
        run.open(inputs, distributed=False, started=started, notes=notes)
        tasks.write_jsonl(rows, run.out / "data.jsonl")
        summary = {"task": cfg.task, "rows": len(rows), **extra}
        if test is not None:
            tasks.write_jsonl(test, run.out / "test.jsonl")
            summary["test_rows"] = len(test)
        return run.complete(summary, f"data make {cfg.task} → {cfg.out}")


def _reasoning_gym(cfg: DataMakeConfig, params: dict, excluded: set, started: float) -> dict:
    from align import rgym

    name = cfg.task[3:]
    rows = rgym.make_rows(name, cfg.n, cfg.seed, params, exclude=excluded)
    test = rgym.make_rows(name, cfg.test_n, cfg.seed, params, exclude=excluded | rgym.row_keys(rows),
                          held_out=True) if cfg.test_n else None
    return _write(cfg, rows, test, started=started)


def _sides(texts: list[str], correct: list[bool], distinct: bool = False) -> tuple[list[str], list[str]]:
    """(the correct texts, the incorrect ones), in order; `distinct`: each text once."""
    good = [t for t, c in zip(texts, correct) if c]
    bad = [t for t, c in zip(texts, correct) if not c]
    return (list(dict.fromkeys(good)), list(dict.fromkeys(bad))) if distinct else (good, bad)


def pick_pair(rng: random.Random, texts: list[str], correct: list[bool]) -> tuple[str, str] | None:
    """(chosen, rejected): a correct and an incorrect completion of one prompt, drawn at random; None when the
    samples are all correct or all wrong (no preference to learn from them)."""
    good, bad = _sides(texts, correct)
    if not good or not bad:
        return None
    return rng.choice(good), rng.choice(bad)


def pick_pairs(rng: random.Random, texts: list[str], correct: list[bool], k: int = 1,
               pair_by: str = "random") -> list[tuple[str, str]]:
    """Up to k distinct (chosen, rejected) pairs of one prompt: the first is pick_pair's; the others pair the
    distinct correct and incorrect texts in a shuffled order, cycling the shorter side (a prompt with one right
    answer among eight samples gives it against up to k different wrong ones: InstructGPT's several comparisons
    per prompt). pair_by "length" / "form": each right answer against the closest wrong ones instead
    (_closest_pairs). [] when the samples are all correct or all wrong."""
    if pair_by != "random":
        return _closest_pairs(rng, texts, correct, k, PAIR_DISTANCES[pair_by])
    first = pick_pair(rng, texts, correct)
    if first is None:
        return []
    pairs = [first]
    if k > 1:
        good, bad = _sides(texts, correct, distinct=True)
        rng.shuffle(good)
        rng.shuffle(bad)
        for i in range(max(len(good), len(bad))):
            pair = (good[i % len(good)], bad[i % len(bad)])
            if len(pairs) < k and pair not in pairs:
                pairs.append(pair)
    return pairs


def length_distance(a: str, b: str) -> float:
    """|len(a) − len(b)| in characters: length-balanced pairs (Singhal et al. 2023: a reward model learns whatever
    separates its pairs, length first)."""
    return abs(len(a) - len(b))


NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?(?:[eE][-+]?\d+)?")


def text_distance(a: str, b: str) -> float:
    """1 − difflib's similarity ratio 2·M / (len(a) + len(b)), M the characters of the matching blocks: 0 for equal
    texts, 1 for texts with nothing in common."""
    return 1.0 - difflib.SequenceMatcher(None, a, b, autojunk=False).ratio()


def form_distance(a: str, b: str) -> float:
    """text_distance of the two texts' forms: every number written as "#" ("The brother has 3 sisters." and "...
    12 sisters." are one form, distance 0)."""
    return text_distance(NUMBER.sub("#", a), NUMBER.sub("#", b))


# pair_by -> the distances a right answer's wrong partner is chosen by: the nearest by the first, among those the
# nearest by the next. "form": minimal pairs, the wrong answer in the same form with another number ("166.35" vs
# "169.228", "... 3 sisters." vs "... 2 sisters."), then the most alike in text. They differ where the answer does,
# so a reward model or DPO learns what the verifier checks, not a format, a length or a habit most right answers
# share (the first of the candidates a prompt lists, say).
PAIR_DISTANCES = {"length": (length_distance,), "form": (form_distance, text_distance)}


def pair_lengths(pairs: list[dict]) -> dict:
    """Mean characters of the chosen and the rejected sides: how much length alone separates the pairs."""
    if not pairs:
        return {}
    return {"chosen_mean_chars": round(sum(len(p["chosen"]) for p in pairs) / len(pairs), 1),
            "rejected_mean_chars": round(sum(len(p["rejected"]) for p in pairs) / len(pairs), 1)}


def _closest_pairs(rng: random.Random, texts: list[str], correct: list[bool], k: int,
                   distances: tuple[Callable[[str, str], float], ...]) -> list[tuple[str, str]]:
    """Up to k distinct pairs, the distinct right answers in a shuffled order (cycling), each against the not yet
    paired wrong answer nearest to it by the first of `distances`, ties settled by the next ones, then at random
    (each distance computed once per pair of texts, and the later ones only for the ties)."""
    good, bad = _sides(texts, correct, distinct=True)
    if not good or not bad:
        return []
    rng.shuffle(good)
    pairs, known = [], {}

    def dist(j: int, g: str, b: str) -> float:
        if (j, g, b) not in known:
            known[j, g, b] = distances[j](g, b)
        return known[j, g, b]

    for i in range(max(len(good), len(bad))):
        if len(pairs) == k:
            break
        g = good[i % len(good)]
        if nearest := [b for b in bad if (g, b) not in pairs]:
            for j in range(len(distances)):
                best = min(dist(j, g, b) for b in nearest)
                nearest = [b for b in nearest if dist(j, g, b) == best]
            pairs.append((g, min(nearest, key=lambda b: rng.random())))
    return pairs


def _model_pairs(cfg: DataMakeConfig, started: float) -> dict:
    """K samples per prompt from the model, graded by the verifier, up to --pairs-per-prompt (correct, incorrect)
    pairs per prompt that has both; with --max-samples, K more at a time for the prompts that have no pair yet (a
    model that is rarely right finds its rare right answers there), up to that many per prompt. With --test-n, the
    last prompts with a pair are the held-out split, one pair each."""
    import torch

    from align import data as D
    from align.console import TrainProgress
    from align.models import load_causal_lm, load_tokenizer, resolve
    from align.rewards import choose_verifier
    from align.rollout.generation import Sampling, generate_local
    from align.runtime import quiet_libraries

    if cfg.task != "prefs":
        raise UserError(f"--from-model makes preference pairs: use `align data make prefs`, not {cfg.task!r}.")
    if not cfg.data:
        raise UserError("prefs --from-model needs --data: a verifiable JSONL file {prompt, answer}.")
    if 0 < cfg.max_samples < 2 * cfg.samples:
        raise UserError(f"--max-samples {cfg.max_samples} leaves no second round of --samples {cfg.samples}: give "
                        f"at least {2 * cfg.samples}, or 0 for none.")
    rows = D.load_rows(cfg.data, "verifiable", limit=cfg.n)
    check = choose_verifier(cfg.verifier, rows, where=cfg.data)
    info(check.line)
    quiet_libraries()
    source = resolve(cfg.from_model)
    tok = load_tokenizer(source)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = load_causal_lm(source, tok, dtype, cfg.seed).to(device)
    torch.manual_seed(cfg.seed)
    prompts = D.encode_prompts(tok, [r["prompt"] for r in rows])
    cap = max(cfg.max_samples, cfg.samples)
    info(f"data make prefs: {len(rows)} prompts x {cfg.samples} samples from {cfg.from_model}"
         + (f", up to {cap} for a prompt with no pair yet" if cap > cfg.samples else ""))
    texts, correct = [[] for _ in rows], [[] for _ in rows]
    todo, rounds = list(range(len(rows))), 0
    while todo:  # round r samples --samples more of every prompt still without a pair
        batch = [prompts[i] for i in todo for _ in range(cfg.samples)]
        with TrainProgress("sample" if not rounds else f"resample {len(todo)}", len(batch)) as bar:
            sampling = Sampling(cfg.max_new_tokens, cfg.temperature, seed=cfg.seed + rounds)
            outs = generate_local(model, tok, batch, sampling, cfg.batch_size, device, on_batch=bar.advance)
        for j, i in enumerate(todo):
            for o in outs[j * cfg.samples:(j + 1) * cfg.samples]:
                texts[i].append(o.text)
                correct[i].append(check.check(rows[i], o.text, o.ids))
        rounds += 1
        todo = [i for i in todo if len(set(correct[i])) < 2 and len(texts[i]) + cfg.samples <= cap]
    rng, per_prompt = random.Random(cfg.seed), []
    for row, t, c in zip(rows, texts, correct):
        picked = pick_pairs(rng, t, c, cfg.pairs_per_prompt, cfg.pair_by)
        if picked:
            per_prompt.append([{"prompt": row["prompt"], "chosen": a, "rejected": b, "answer": row["answer"]}
                               for a, b in picked])
    drawn, n_correct = sum(map(len, texts)), sum(map(sum, correct))
    if len(per_prompt) <= cfg.test_n:
        raise UserError(f"only {len(per_prompt)} of {len(rows)} prompts had both a correct and an incorrect sample: "
                        "too few for the requested split. Sample more (--samples, --max-samples, --n) or use an "
                        "easier task.")
    cut = len(per_prompt) - cfg.test_n  # the held-out split: the last prompts with a pair, one pair each
    pairs = [p for group in per_prompt[:cut] for p in group]
    test = [group[0] for group in per_prompt[cut:]] if cfg.test_n else None
    from align.artifacts import describe_inputs

    return _write(cfg, pairs, test, describe_inputs(source, cfg.data), started, {"verifier": check.record()},
                  prompts=len(rows),
                  prompts_with_pairs=len(per_prompt), **pair_lengths(pairs), sample_accuracy=n_correct / drawn,
                  samples=drawn,
                  first_round_accuracy=sum(sum(c[:cfg.samples]) for c in correct) / (len(rows) * cfg.samples))
