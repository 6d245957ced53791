"""`align data make TASK`: generate a dataset (and optionally a held-out split with no prompt in common).

--out FILE.jsonl writes that file (and --test-out); any other --out is a directory artifact (a pipeline's `data`
stage): OUT/data.jsonl, OUT/test.jsonl and artifact.json, read by later stages as `@NAME` (its data.jsonl) or
`@NAME/test.jsonl`.

TASK is one of the built-in tasks (digit_sort, digit_sort_prefs, arithmetic, sort, prefs, text, mul_tool, count_squares), `rg:NAME` for a reasoning-gym task (optional
extra), or `prefs --from-model M --data FILE`: preference pairs a model makes itself — K sampled completions per
prompt of a verifiable file, a correct one as `chosen` and an incorrect one as `rejected` (on-policy pairs, as in
online / iterative DPO recipes); with `--judge J`, ranked by an LLM judge instead (RLAIF: align.judge_pairs).
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

JUDGE_MARGIN = 0.1  # --judge-margin: a pairwise verdict of P(chosen ≻ rejected) ≥ 0.55, or 0.1 of the score scale


@dataclass(frozen=True)
class DataMakeConfig(Options):
    task: str = opt("arithmetic", "Task: digit_sort, digit_sort_prefs, arithmetic, sort, prefs, text, mul_tool, count_squares, "
                                  "rg:NAME (a reasoning-gym task), or judge (SFT demonstrations of a pairwise judge, "
                                  "from --data's preference pairs).")
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
    batch_size: int = opt(64, "prefs --from-model: generation batch (and the judge's).", ge=1)
    chat_template: str = opt("", "prefs --from-model: a Jinja chat template for --from-model's tokenizer, in place "
                                 "of its own (a model without one, or to override it): the prompts are rendered with "
                                 "it ('' : the tokenizer's own).", path=True, user_file=True)
    judge: str = opt("", "prefs --from-model: rank the samples with this LLM judge (an artifact, a model directory "
                         "or a preset) instead of the verifier: 2 --samples are compared pairwise in both orders, "
                         "more are scored pointwise (the best against the worst); with answers in --data the "
                         "verifier only measures the judge's agreement ('' : the verifier ranks).", path=True)
    judge_rubric: str = opt("", "With --judge: its rubric, a text file with {prompt} and, for 2 --samples, {a} and "
                                "{b} (ending where the judge writes A or B), else {completion} (ending where it "
                                "writes a digit 0-9) (default: align.judge's).", path=True, user_file=True)
    judge_margin: float = opt(JUDGE_MARGIN, "With --judge: the least margin a pair keeps, in [0, 1] "
                                            "(pairwise: 2·P(chosen ≻ rejected) − 1; pointwise: the scores' "
                                            "difference); closer pairs are ties and dropped.", ge=0, le=1)

    def validate(self):
        super().validate()
        if self.chat_template:
            if not self.from_model:
                raise UserError("--chat-template is --from-model's: give --from-model MODEL, or drop it.",
                                option="chat_template")
            from align.chat import read_template

            read_template(self.chat_template)
        if self.judge or self.judge_rubric or self.judge_margin != JUDGE_MARGIN:
            check_judge_options(self)

    def rubric(self) -> str:
        """--judge-rubric's text ("" when not given), with the fields its form needs: {a} and {b} for two
        --samples (pairwise), {completion} for more (pointwise)."""
        if not self.judge_rubric:
            return ""
        try:
            text = Path(self.judge_rubric).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"--judge-rubric {self.judge_rubric}: cannot read it ({type(e).__name__}); pass a text "
                            "file.", option="judge_rubric") from None
        pairwise = self.samples == 2 or self.task == "judge"
        need = ("{a}", "{b}") if pairwise else ("{completion}",)
        if missing := [f for f in need if f not in text]:
            form = ("a pairwise judge reads two answers: write {prompt}, {a} and {b}" if pairwise else
                    f"{self.samples} --samples are scored one by one: write {{prompt}} and {{completion}}")
            raise UserError(f"--judge-rubric {self.judge_rubric}: it has no {' or '.join(missing)}; {form} where "
                            "the judge reads them.", option="judge_rubric")
        return text


def run(cfg: DataMakeConfig) -> dict:
    started = time.time()  # the artifact's wall time counts the sampling, not only the writing
    check_out(cfg)
    if cfg.from_model:
        return _model_pairs(cfg, started)
    if cfg.task == "judge":
        return _judge_demos(cfg, started)
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


def _judge_demos(cfg: DataMakeConfig, started: float) -> dict:
    """`align data make judge --data PAIRS`: SFT demonstrations of a pairwise judge (a judge trained on labelled
    comparisons, as JudgeLM or PandaLM): each of --data's first --n pairs (0: all) twice, in both orders, the
    rubric (--judge-rubric, else align.judge's) filled with its prompt and the two answers as the prompt, the
    letter of the chosen answer as the completion and the answer: {prompt, completion, answer}, "A" as often as
    "B". With --test-n, the last N distinct prompts' pairs are the held-out split (`align eval` of a judge trained
    on the rest: its one-order accuracy)."""
    from align import data as D
    from align.judge import PAIR_LABELS, PAIR_RUBRIC, as_text, fill

    if not cfg.data:
        raise UserError("data make judge needs --data: preference pairs {prompt, chosen, rejected} (its "
                        "demonstrations compare their two sides).", option="data")
    pairs = D.load_rows(cfg.data, "preference", limit=cfg.n)
    rubric, rng = cfg.rubric() or PAIR_RUBRIC, random.Random(cfg.seed)
    keys = list(dict.fromkeys(as_text(p["prompt"]) for p in pairs))
    if cfg.test_n >= len(keys):
        raise UserError(f"--test-n {cfg.test_n}: {cfg.data} has {len(keys)} distinct prompts; leave some to train "
                        "on.", option="test_n")
    held = set(keys[len(keys) - cfg.test_n:])

    def demos(p: dict) -> list[dict]:
        q = as_text(p["prompt"])
        return [{"prompt": fill(rubric, prompt=q, a=a, b=b), "completion": label, "answer": label}
                for a, b, label in ((p["chosen"], p["rejected"], PAIR_LABELS[0]),
                                    (p["rejected"], p["chosen"], PAIR_LABELS[1]))]

    rows = [d for p in pairs if as_text(p["prompt"]) not in held for d in demos(p)]
    test = [d for p in pairs if as_text(p["prompt"]) in held for d in demos(p)] if cfg.test_n else None
    rng.shuffle(rows)
    return _write(cfg, rows, test, {"data": describe_inputs_data(cfg.data)}, started, pairs=len(pairs))


def describe_inputs_data(path: str) -> dict:
    """{path: sha256} of a data file (artifact.json's inputs)."""
    from align.artifacts import hash_tree, sha256_file

    p = Path(path)
    return {str(path): sha256_file(p) if p.is_file() else hash_tree(p) if p.is_dir() else "missing"}


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


def check_judge_options(cfg: DataMakeConfig) -> None:
    """--judge and the options that go with it: what it cannot be combined with is refused, naming the flag."""
    if cfg.task == "judge" and not cfg.from_model and not cfg.judge and cfg.judge_margin == JUDGE_MARGIN:
        cfg.rubric()  # the rubric of the judge these demonstrations teach
        return
    if not cfg.judge:
        flag = "--judge-rubric" if cfg.judge_rubric else "--judge-margin"
        raise UserError(f"{flag} goes with --judge: give --judge MODEL, or drop {flag}.",
                        option="judge_rubric" if cfg.judge_rubric else "judge_margin")
    if not cfg.from_model:
        raise UserError("--judge ranks the samples of --from-model: give --from-model MODEL and --data FILE "
                        "(`align data make prefs --from-model M --data F --judge J`).", option="judge")
    if cfg.max_samples:
        raise UserError("--max-samples samples again the prompts the verifier found no pair in; with --judge every "
                        "prompt with two different samples is ranked: drop --max-samples.", option="max_samples")
    if cfg.pair_by != "random":
        raise UserError(f"--pair-by {cfg.pair_by} pairs right answers with wrong ones by the verifier; with --judge "
                        "the judge picks both sides (its best against its worst): drop --pair-by.", option="pair_by")
    if cfg.samples == 2 and cfg.pairs_per_prompt > 1:
        raise UserError(f"--pairs-per-prompt {cfg.pairs_per_prompt}: two --samples make one pair; with --judge give "
                        "--samples 3 or more (scored pointwise) for several pairs per prompt.",
                        option="pairs_per_prompt")
    cfg.rubric()


def _model_pairs(cfg: DataMakeConfig, started: float) -> dict:
    """K samples per prompt from the model, ranked by the verifier (`_verifier_pairs`) or by --judge
    (`_judge_ranked`). With --test-n, the last prompts with a pair are the held-out split, one pair each."""
    from align import data as D
    from align.artifacts import describe_inputs
    from align.rewards import choose_verifier

    if cfg.task != "prefs":
        raise UserError(f"--from-model makes preference pairs: use `align data make prefs`, not {cfg.task!r}.")
    if not cfg.data:
        raise UserError("prefs --from-model needs --data: a verifiable JSONL file {prompt, answer}"
                        + (" (with --judge, {prompt} alone will do)." if cfg.judge else "."))
    if 0 < cfg.max_samples < 2 * cfg.samples:
        raise UserError(f"--max-samples {cfg.max_samples} leaves no second round of --samples {cfg.samples}: give "
                        f"at least {2 * cfg.samples}, or 0 for none.")
    rows = D.load_rows(cfg.data, ("verifiable", "prompts") if cfg.judge else "verifiable", limit=cfg.n)
    check = None
    if "answer" in rows[0]:
        check = choose_verifier(cfg.verifier, rows, where=cfg.data)
        info(check.line + (" — it measures the judge, the judge ranks" if cfg.judge else ""))
    elif cfg.verifier != "auto":
        raise UserError(f"--verifier {cfg.verifier}: with --judge the verifier only measures the judge's agreement, "
                        f"on rows with an 'answer'; {cfg.data} has none: drop --verifier.", option="verifier")
    judge_source = _judge_source(cfg) if cfg.judge else None  # a wrong --judge fails before any sampling
    source, texts, correct = _sample(cfg, rows, check)
    inputs = describe_inputs(source, cfg.data)
    if judge_source is not None:
        inputs["judge"] = describe_inputs(judge_source)["model"]
    notes = {"verifier": check.record()} if check is not None else {}
    if cfg.judge:
        per_prompt, extra = _judge_ranked(cfg, rows, texts, correct, notes)
    else:
        per_prompt, extra = _verifier_pairs(cfg, rows, texts, correct)
    if len(per_prompt) <= cfg.test_n:
        why = (f"two samples the judge separated by --judge-margin {cfg.judge_margin} or more ({extra['judge_ties']} "
               f"ties dropped, {extra['identical_samples']} prompts whose samples were all one text): too few for "
               "the requested split. Lower --judge-margin or sample more (--samples, --n, --temperature)."
               if cfg.judge else "both a correct and an incorrect sample: too few for the requested split. Sample "
               "more (--samples, --max-samples, --n) or use an easier task.")
        raise UserError(f"only {len(per_prompt)} of {len(rows)} prompts had {why}")
    cut = len(per_prompt) - cfg.test_n  # the held-out split: the last prompts with a pair, one pair each
    pairs = [p for group in per_prompt[:cut] for p in group]
    test = [group[0] for group in per_prompt[cut:]] if cfg.test_n else None
    return _write(cfg, pairs, test, inputs, started, notes, prompts=len(rows), prompts_with_pairs=len(per_prompt),
                  **pair_lengths(pairs), **extra)


def _sample(cfg: DataMakeConfig, rows: list[dict], check) -> tuple:
    """(the model's source, each prompt's sampled texts, their verifier grades: [] without a verifier). --samples
    per prompt; with --max-samples, --samples more at a time for the prompts with no (correct, incorrect) pair
    yet (a model that is rarely right finds its rare right answers there), up to that many per prompt."""
    import torch

    from align import data as D
    from align.console import TrainProgress
    from align.models import load_causal_lm, load_tokenizer, resolve
    from align.rollout.generation import Sampling, generate_local
    from align.runtime import quiet_libraries

    quiet_libraries()
    source = resolve(cfg.from_model)
    tok = load_tokenizer(source, chat_template=cfg.chat_template)
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
                if check is not None:
                    correct[i].append(check.check(rows[i], o.text, o.ids))
        rounds += 1
        todo = [i for i in todo if len(set(correct[i])) < 2 and len(texts[i]) + cfg.samples <= cap]
    return source, texts, correct


def _verifier_pairs(cfg: DataMakeConfig, rows: list[dict], texts: list, correct: list) -> tuple:
    """(each prompt's pairs: up to --pairs-per-prompt (correct, incorrect) pairs of a prompt that has both,
    --pair-by's; the summary's figures)."""
    rng, per_prompt = random.Random(cfg.seed), []
    for row, t, c in zip(rows, texts, correct):
        picked = pick_pairs(rng, t, c, cfg.pairs_per_prompt, cfg.pair_by)
        if picked:
            per_prompt.append([{"prompt": row["prompt"], "chosen": a, "rejected": b, "answer": row["answer"]}
                               for a, b in picked])
    drawn, n_correct = sum(map(len, texts)), sum(map(sum, correct))
    extra = {"sample_accuracy": n_correct / drawn, "samples": drawn,
             "first_round_accuracy": sum(sum(c[:cfg.samples]) for c in correct) / (len(rows) * cfg.samples)}
    return per_prompt, extra


def _judge_source(cfg: DataMakeConfig):
    """--judge's model (a causal LM: an artifact, a model directory, a preset or a hub id), its rubric's labels
    checked against its tokenizer (each one token where the rubric ends: align.judge.Judge), or a UserError naming
    the flag."""
    import torch

    from align.judge import Judge
    from align.models import load_tokenizer, resolve

    try:
        source = resolve(cfg.judge)
    except UserError as e:
        raise UserError(f"--judge {cfg.judge}: {str(e).removeprefix(f'{cfg.judge}: ')}", option="judge") from None
    Judge(torch.nn.Identity(), load_tokenizer(source), where=f"--judge {cfg.judge}", **_rubrics(cfg))  # no weights
    return source


def _rubrics(cfg: DataMakeConfig) -> dict:
    """Judge's keyword for --judge-rubric's text: the pairwise rubric for two --samples, else the pointwise one."""
    text = cfg.rubric()
    return ({"pair_rubric": text} if cfg.samples == 2 else {"rubric": text}) if text else {}


def _judge_ranked(cfg: DataMakeConfig, rows: list[dict], texts: list, correct: list, notes: dict) -> tuple:
    """(each prompt's pairs ranked by --judge (align.judge_pairs: pairwise for two samples, pointwise for more),
    those under --judge-margin dropped, with the judge's margin as a column; the summary's figures, the judge's
    agreement with the verifier among them where --data has answers). `notes` (artifact.json's) gets the
    ranker."""
    from align import judge as J
    from align.judge_pairs import agreement, judge_pairs

    pairwise = cfg.samples == 2
    judge = J.load(cfg.judge, where=f"--judge {cfg.judge}", **_rubrics(cfg))
    info(f"data make prefs: judge {cfg.judge} ranks the samples "
         + ("pairwise, in both orders" if pairwise else "by its pointwise scores (the best against the worst)"))
    prompts = [J.as_text(r["prompt"]) for r in rows]
    kept, counts = judge_pairs(judge, prompts, texts, cfg.pairs_per_prompt, cfg.judge_margin)
    per_prompt, verdicts = [], []
    for i, (row, pairs) in enumerate(zip(rows, kept)):
        if pairs:
            grade = dict(zip(texts[i], correct[i]))
            verdicts += [(grade[p["chosen"]], grade[p["rejected"]]) for p in pairs] if correct[i] else []
            per_prompt.append([{"prompt": row["prompt"], "chosen": p.pop("chosen"), "rejected": p.pop("rejected"),
                                **({"answer": row["answer"]} if "answer" in row else {}), **p} for p in pairs])
    drawn, margins = sum(map(len, texts)), [p["judge_margin"] for g in per_prompt for p in g]
    extra = {"ranker": "judge, pairwise" if pairwise else "judge, pointwise", "samples": drawn,
             "judge_ranked": counts["ranked"], "judge_ties": counts["ties"],
             "identical_samples": counts["identical"],
             "judge_margin_mean": round(sum(margins) / len(margins), 4) if margins else None}
    notes["ranker"] = {"judge": cfg.judge, "form": "pairwise" if pairwise else "pointwise",
                       "min_margin": cfg.judge_margin}
    if "verifier" in notes:
        share, n = agreement(verdicts)
        extra.update(sample_accuracy=sum(map(sum, correct)) / drawn,
                     judge_agreement=None if share is None else round(share, 4),
                     judge_agreement_pairs=n)
        notes["verifier"]["role"] = "measures the judge's agreement with the truth; the judge ranks"
    return per_prompt, extra
