"""Real task sources: reasoning-gym tasks as data and rewards, self-generated preference pairs, hub ids."""

from __future__ import annotations

import json
import math
import sys

import pytest

from align.errors import UserError
from align.rewards import guess_verifier, parse_rewards, row_fields, verifier_fn, verify
from stages.data_make import DataMakeConfig, pick_pair, pick_pairs, run

rg = pytest.importorskip("reasoning_gym")  # the `tasks` extra; the test extra installs it


def _read(path):
    return [json.loads(line) for line in open(path)]


@pytest.mark.parametrize("task,params", [("basic_arithmetic", ["max_terms=2", "max_digits=1"]), ("chain_sum", [])])
def test_data_make_rg_writes_prompt_answer_rows_the_task_scores_as_correct(tmp_path, task, params):
    out = tmp_path / "d.jsonl"
    summary = run(DataMakeConfig(task=f"rg:{task}", n=30, seed=3, param=params, out=str(out), test_n=10))
    rows, test = _read(out), _read(summary["test_out"])
    assert len(rows) == 30 and len(test) == 10
    assert all({"prompt", "answer", "completion", "rg_task", "rg_metadata"} <= set(r) for r in rows)
    assert all(r["rg_task"] == task for r in rows)
    fn = parse_rewards([f"rg:{task}"])[0].fn
    right = rows[0]
    extra = row_fields(right)
    # the task's own scorer, on the answer in each format the extractor reads
    for completion in (f"Thinking... <answer>{right['answer']}</answer>", f"So: #### {right['answer']}",
                       f"Let me see.\n{right['answer']}"):
        assert fn(right["prompt"], completion, **extra) == 1.0, completion
    assert fn(right["prompt"], "<answer>not it</answer>", **extra) < 1.0
    assert guess_verifier(rows) == f"rg:{task}"
    assert verify(verifier_fn(f"rg:{task}"), right, f"<answer>{right['answer']}</answer>")
    # same seed, same rows
    again = tmp_path / "again.jsonl"
    run(DataMakeConfig(task=f"rg:{task}", n=30, seed=3, param=params, out=str(again)))
    assert _read(again) == rows


def test_rg_splits_share_no_prompt_even_when_the_task_space_repeats(tmp_path):
    # 1-digit sums a + b without signs or brackets: about 100 distinct prompts, so draws repeat often
    params = ["min_terms=2", "max_terms=2", "min_digits=1", "max_digits=1", "operators=['+']",
              "allow_parentheses=false", "allow_negation=false"]
    out = tmp_path / "d.jsonl"
    summary = run(DataMakeConfig(task="rg:basic_arithmetic", n=60, test_n=30, seed=0, param=params, out=str(out)))
    train, test = [r["prompt"] for r in _read(out)], [r["prompt"] for r in _read(summary["test_out"])]
    assert len(set(train)) == 60 and len(set(test)) == 30
    assert not set(train) & set(test)
    from align import rgym

    raw = rgym._dataset("basic_arithmetic", 200, 0, rgym.parse_params(params))
    assert len({e["question"] for e in raw}) < 150  # the check above was needed: the task repeats prompts
    with pytest.raises(UserError, match="distinct problems"):
        run(DataMakeConfig(task="rg:basic_arithmetic", n=500, seed=0, param=params, out=str(tmp_path / "x.jsonl")))


def test_rg_seeds_draw_their_own_items(tmp_path):
    """reasoning-gym makes item i from Random(dataset seed + i): align's --seed 1 must not be --seed 0 shifted by one
    item (it shared 199 of 200 held-out problems with seed 0 when passed straight through). Seed 0 keeps its items."""
    from align import rgym

    made = {}
    for seed in (0, 1, 2):
        out = tmp_path / f"s{seed}.jsonl"
        summary = run(DataMakeConfig(task="rg:number_format", n=40, test_n=20, seed=seed, out=str(out)))
        made[seed] = ({r["prompt"] for r in _read(out)}, {r["prompt"] for r in _read(summary["test_out"])})
    prompts = {s: train | test for s, (train, test) in made.items()}
    assert len(prompts[0]) == len(prompts[1]) == len(prompts[2]) == 60
    assert not prompts[0] & prompts[1] and not prompts[1] & prompts[2] and not prompts[0] & prompts[2]
    # seed 0: the dataset seeds it always used (0 for training, 1,000,003 held out)
    first = lambda s: rgym._dataset("number_format", 1, s, {})[0]["question"]  # noqa: E731
    assert first(0) in made[0][0] and first(1_000_003) in made[0][1]
    assert rgym.dataset_seed(2, held_out=True) == 2 * rgym.SEED_STRIDE + rgym.SPLIT_OFFSET
    assert rgym.dataset_seed(rgym.MAX_SEED, held_out=True) + rgym.SPLIT_OFFSET < 2**32  # numpy's seed limit
    with pytest.raises(UserError, match=f"seeds 0-{rgym.MAX_SEED}"):
        run(DataMakeConfig(task="rg:number_format", n=4, seed=rgym.MAX_SEED + 1, out=str(tmp_path / "x.jsonl")))
    assert not (tmp_path / "x.jsonl").exists()


def test_rg_splits_share_no_problem_however_it_is_worded(tmp_path):
    """basic_arithmetic's natural format asks one expression four ways ("What is 3 + 4?", "Compute 3 + 4."): the
    held-out split (and --exclude) leave out the training split's expressions, not only its prompts."""
    params = ["min_terms=2", "max_terms=2", "min_digits=1", "max_digits=1", "operators=['+']",
              "allow_parentheses=false", "allow_negation=false", "format_style=natural"]
    out = tmp_path / "d.jsonl"
    summary = run(DataMakeConfig(task="rg:basic_arithmetic", n=70, test_n=30, seed=0, param=params, out=str(out)))
    expr = lambda rows: [r["rg_metadata"]["expression"] for r in rows]  # noqa: E731
    train, test = _read(out), _read(summary["test_out"])
    assert len(set(expr(train))) == 70 and len(set(expr(test))) == 30 and not set(expr(train)) & set(expr(test))
    assert len({r["prompt"].split(" ", 1)[0] for r in train}) > 1  # worded several ways
    fresh = run(DataMakeConfig(task="rg:basic_arithmetic", n=12, seed=5, param=params, exclude=str(out),
                               out=str(tmp_path / "fresh.jsonl")))
    assert fresh["rows"] == 12 and not set(expr(_read(tmp_path / "fresh.jsonl"))) & set(expr(train))
    from align import rgym

    raw = rgym._dataset("basic_arithmetic", 400, 0, rgym.parse_params(params))
    by_prompt, by_expr = {e["question"] for e in raw}, {e["metadata"]["expression"] for e in raw}
    assert len(by_prompt) > len(by_expr) + 50  # prompts alone would have let the same sums into both splits


def test_rg_enum_params_are_given_by_their_values(tmp_path):
    """aiw's task_types is a list of an Enum: --param task_types=['friends'] names its members by value."""
    out = tmp_path / "f.jsonl"
    run(DataMakeConfig(task="rg:aiw", n=12, seed=0, param=["task_types=['friends']", "task_type_weights=[1.0]"],
                       out=str(out)))
    rows = _read(out)
    assert {r["rg_metadata"]["task_type"] for r in rows} == {"friends"} and all("friends" in r["prompt"] for r in rows)
    with pytest.raises(UserError, match=r"task_types: \['enemies'\] is not among \['siblings', 'friends'"):
        run(DataMakeConfig(task="rg:aiw", n=5, param=["task_types=['enemies']"], out=str(tmp_path / "x.jsonl")))
    # a combination the config accepts but its items cannot be made from: a user error too, nothing written
    with pytest.raises(UserError, match="bad --param: making item 0 failed"):
        run(DataMakeConfig(task="rg:aiw", n=5, param=["task_types=['friends']"], out=str(tmp_path / "x.jsonl")))
    assert not (tmp_path / "x.jsonl").exists()


def test_rg_bad_task_and_bad_param_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="Did you mean basic_arithmetic"):
        run(DataMakeConfig(task="rg:basic_arithmetc", n=5, out=str(tmp_path / "x.jsonl")))
    with pytest.raises(UserError, match="bad --param"):
        run(DataMakeConfig(task="rg:basic_arithmetic", n=5, param=["no_such_option=1"], out=str(tmp_path / "x.jsonl")))
    with pytest.raises(UserError, match=r"unknown option\(s\) \['x'\] for task 'arithmetic'; valid: none"):
        run(DataMakeConfig(task="arithmetic", n=5, param=["x=1"], out=str(tmp_path / "x.jsonl")))
    assert not (tmp_path / "x.jsonl").exists()


def test_missing_reasoning_gym_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # import reasoning_gym -> ImportError
    with pytest.raises(UserError, match=r"align\[tasks\]"):
        run(DataMakeConfig(task="rg:basic_arithmetic", n=5, out=str(tmp_path / "x.jsonl")))
    with pytest.raises(UserError, match=r"align\[tasks\]"):
        parse_rewards(["rg:basic_arithmetic"])


def test_pick_pair_needs_a_correct_and_an_incorrect_sample():
    import random

    rng = random.Random(0)
    assert pick_pair(rng, ["a", "b"], [True, True]) is None and pick_pair(rng, ["a", "b"], [False, False]) is None
    for _ in range(20):
        chosen, rejected = pick_pair(rng, ["a", "b", "c", "d"], [True, False, True, False])
        assert chosen in ("a", "c") and rejected in ("b", "d")


def test_pick_pairs_pairs_distinct_samples_up_to_k():
    import random

    texts, correct = ["a", "b", "c", "b", "d"], [True, False, False, False, False]
    assert pick_pairs(random.Random(0), texts, [True] * 5, 3) == []
    assert pick_pairs(random.Random(0), texts, correct, 1) == [pick_pair(random.Random(0), texts, correct)]
    three = pick_pairs(random.Random(0), texts, correct, 3)
    assert len(three) == 3 == len(set(three)) and {c for c, _ in three} == {"a"}
    assert sorted(pick_pairs(random.Random(0), texts, correct, 10)) == [("a", "b"), ("a", "c"), ("a", "d")]
    both = pick_pairs(random.Random(1), ["x", "y", "z", "w"], [True, True, False, False], 9)
    assert len(both) in (2, 3) and len(set(both)) == len(both)  # the first pair, then a matching of the two sides
    for c, r in both:
        assert c in "xy" and r in "zw"


def test_length_matched_pairs_take_the_wrong_answers_closest_in_length():
    import random

    texts, correct = ["aaaa", "b", "bbbbb", "b" * 20, "bb"], [True, False, False, False, False]
    assert pick_pairs(random.Random(0), texts, correct, 2, pair_by="length") == [("aaaa", "bbbbb"), ("aaaa", "bb")]
    assert pick_pairs(random.Random(0), texts, correct, 9, pair_by="length")[-1] == ("aaaa", "b" * 20)
    assert pick_pairs(random.Random(0), texts, [False] * 5, 2, pair_by="length") == []
    two = pick_pairs(random.Random(3), ["xx", "yyyyyy", "z", "wwwwwww"], [True, True, False, False], 2,
                     pair_by="length")
    assert sorted(two) == [("xx", "z"), ("yyyyyy", "wwwwwww")]


def test_form_matched_pairs_take_the_wrong_answer_in_the_same_form_a_minimal_pair():
    import random

    from stages.data_make import form_distance, text_distance

    assert text_distance("abc", "abc") == 0.0 and text_distance("abc", "xyz") == 1.0
    assert text_distance("166.35", "169.228") == pytest.approx(1 - 2 * 3 / 13)  # "16" and "." match
    assert form_distance("The brother has 3 sisters.", "The brother has 12 sisters.") == 0.0
    assert form_distance("1.6e+08", "160,837,589.094") == 0.0 < form_distance("7", "7 or 8")
    right = "166.35000000000002"
    wrong = ["169.228000",  # the other candidate: the same form, another number
             "169.228000 166.35000000000002",  # both candidates: more of the right text, another form
             "pick the smallest number of the following candidates: 169.228000 166.35000000000002", "I'm not sure."]
    texts, correct = [wrong[3], right, *wrong[:3]], [False, True, False, False, False]
    assert text_distance(right, wrong[1]) < text_distance(right, wrong[0])  # text alone would pick the list
    assert pick_pairs(random.Random(0), texts, correct, 2, pair_by="form") == [(right, wrong[0]), (right, wrong[1])]
    # by length: the 13-character refusal first (|18 - 13| < |18 - 10|)
    assert pick_pairs(random.Random(0), texts, correct, 2, pair_by="length") == [(right, wrong[3]), (right, wrong[0])]
    assert pick_pairs(random.Random(0), texts, [False] * 5, 2, pair_by="form") == []


VERIFIER = '''
def first_char_even(prompt, completion, **row):
    """Correct when the completion's first character has an even code point: about half of random text."""
    return float(bool(completion) and ord(completion[0]) % 2 == 0)
'''


def test_prefs_from_model_pairs_a_correct_with_an_incorrect_sample(tmp_path, tiny_model_dir):
    (tmp_path / "v.py").write_text(VERIFIER)
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Say something about {i}.", "answer": "x"}) + "\n"
                            for i in range(24)))
    out = tmp_path / "pairs.jsonl"
    summary = run(DataMakeConfig(task="prefs", from_model=str(tiny_model_dir), data=str(data), samples=6,
                                 max_new_tokens=6, verifier=f"{tmp_path / 'v.py'}:first_char_even", test_n=3,
                                 out=str(out), seed=1))
    pairs, test = _read(out), _read(summary["test_out"])
    assert len(pairs) >= 5 and len(test) == 3 and 0 < summary["sample_accuracy"] < 1
    for p in pairs + test:
        assert set(p) == {"prompt", "chosen", "rejected", "answer"}
        assert ord(p["chosen"][0]) % 2 == 0 and not (p["rejected"] and ord(p["rejected"][0]) % 2 == 0)
    assert not {p["prompt"] for p in pairs} & {p["prompt"] for p in test}
    from align import data as D

    assert D.load_rows(out, "preference")  # readable as rm / dpo training data
    more = run(DataMakeConfig(task="prefs", from_model=str(tiny_model_dir), data=str(data), samples=6,
                              max_new_tokens=6, verifier=f"{tmp_path / 'v.py'}:first_char_even", test_n=3,
                              pairs_per_prompt=3, out=str(tmp_path / "more.jsonl"), seed=1))
    many, many_test = _read(tmp_path / "more.jsonl"), _read(more["test_out"])
    assert more["prompts_with_pairs"] == summary["prompts_with_pairs"] == len(pairs) + 3
    assert summary["chosen_mean_chars"] == round(sum(len(p["chosen"]) for p in pairs) / len(pairs), 1)
    assert len(many) > len(pairs) and len(many_test) == 3 == len({p["prompt"] for p in many_test})
    by_prompt = {}
    for p in many:
        by_prompt.setdefault(p["prompt"], []).append((p["chosen"], p["rejected"]))
        assert ord(p["chosen"][0]) % 2 == 0 and not (p["rejected"] and ord(p["rejected"][0]) % 2 == 0)
    assert all(len(v) == len(set(v)) <= 3 for v in by_prompt.values()) and max(map(len, by_prompt.values())) > 1
    assert not set(by_prompt) & {p["prompt"] for p in many_test}


RARE = '''
def first_char_rare(prompt, completion, **row):
    """Correct when the completion's first character's code point is a multiple of 5: a rare right answer."""
    return float(bool(completion) and ord(completion[0]) % 5 == 0)
'''


def test_prefs_from_model_samples_again_where_a_prompt_has_no_pair(tmp_path, tiny_model_dir):
    """--max-samples: a prompt whose first --samples completions are all wrong (or all right) is sampled again,
    --samples at a time, until it has a pair or reaches the cap; the first round is the same as without it."""
    (tmp_path / "v.py").write_text(RARE)
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Tell me about {i}.", "answer": "x"}) + "\n" for i in range(24)))
    common = dict(task="prefs", from_model=str(tiny_model_dir), data=str(data), samples=2, max_new_tokens=4,
                  verifier=f"{tmp_path / 'v.py'}:first_char_rare", seed=3)
    once = run(DataMakeConfig(**common, out=str(tmp_path / "once.jsonl")))
    more = run(DataMakeConfig(**common, max_samples=10, out=str(tmp_path / "more.jsonl")))
    assert once["samples"] == 48 and once["first_round_accuracy"] == more["first_round_accuracy"]
    assert 48 < more["samples"] <= 240 and more["samples"] % 2 == 0
    once_pairs, more_pairs = _read(tmp_path / "once.jsonl"), _read(tmp_path / "more.jsonl")
    assert len(more_pairs) > len(once_pairs)
    assert {p["prompt"] for p in once_pairs} <= {p["prompt"] for p in more_pairs}
    for p in more_pairs:
        assert ord(p["chosen"][0]) % 5 == 0 and not (p["rejected"] and ord(p["rejected"][0]) % 5 == 0)


def test_prefs_from_model_refuses_what_cannot_pair(tmp_path, tiny_model_dir):
    with pytest.raises(UserError, match="--data"):
        run(DataMakeConfig(task="prefs", from_model=str(tiny_model_dir), out=str(tmp_path / "x.jsonl")))
    with pytest.raises(UserError, match="--max-samples 10 leaves no second round of --samples 8"):
        run(DataMakeConfig(task="prefs", from_model=str(tiny_model_dir), data="x.jsonl", max_samples=10,
                           out=str(tmp_path / "x.jsonl")))
    with pytest.raises(UserError, match="--samples must be >= 2"):
        DataMakeConfig(task="prefs", from_model=str(tiny_model_dir), data="x.jsonl", samples=1,
                       out=str(tmp_path / "x.jsonl")).validate()


def test_hub_id_from_the_local_cache_or_a_clear_offline_error(tmp_path, monkeypatch, tiny_model_dir):
    from align.models import resolve

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as C

    monkeypatch.setattr(C, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(C, "HF_HUB_OFFLINE", True)
    with pytest.raises(UserError) as e:
        resolve("SomeOrg/not-cached-135M")
    assert "not in the local Hugging Face cache" in str(e.value) and "--model DIR" in str(e.value)
    assert "--set stages.NAME.model=DIR" in str(e.value)
    # a cached snapshot (the layout huggingface_hub writes) resolves to its directory, as from_pretrained would
    snap = tmp_path / "hub" / "models--SomeOrg--tiny" / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    for f in tiny_model_dir.iterdir():
        (snap / f.name).write_bytes(f.read_bytes())
    (tmp_path / "hub" / "models--SomeOrg--tiny" / "refs").mkdir()
    (tmp_path / "hub" / "models--SomeOrg--tiny" / "refs" / "main").write_text("abc123")
    source = resolve("SomeOrg/tiny")
    assert source.model_dir.resolve() == snap.resolve() and source.kind == "policy"


def test_the_pretrained_pipeline_is_valid_and_resolves_stage_files():
    from align import pipeline as P
    from tests.conftest import ROOT

    p = P.load(ROOT / "pipelines/pretrained.toml")
    assert [s.kind for s in p.stages] == ["data", "eval", "grpo", "data", "data", "rm", "dpo", "ppo"]
    # GRPO from the model, DPO from GRPO's policy on the pairs that policy made, PPO from DPO's; the reward model on
    # the base model's pairs
    assert P.resolve(p, p.stage("grpo"))["model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert P.resolve(p, p.stage("prefs"))["from_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert P.resolve(p, p.stage("policy_pairs"))["from_model"] == str(p.out / "grpo")
    assert P.resolve(p, p.stage("dpo"))["data"] == str(p.out / "policy_pairs")
    # a variant may train the reward model on the policy's pairs (they come before it)
    _, problems = P.parse(ROOT / "pipelines/pretrained.toml", ['stages.rm.data="@policy_pairs"'])
    assert not problems
    assert P.resolve(p, p.stage("dpo"))["model"] == str(p.out / "grpo")
    assert P.resolve(p, p.stage("ppo"))["model"] == str(p.out / "dpo")
    rm = P.resolve(p, p.stage("rm"))
    assert rm["model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"  # a hub id stays an id, not a path
    assert rm["data"] == str(p.out / "prefs") and rm["eval_data"] == str(p.out / "prefs" / "test.jsonl")
    assert P.resolve(p, p.stage("grpo"))["verifier"] == "math"


def test_the_pretrained_benchmark_changes_only_the_task_and_gives_grpo_alone_the_chain_s_steps(tmp_path):
    """benchmarks.pretrained_tasks: the chain is pipelines/pretrained.toml with the task's two keys overridden; the
    baseline is a valid two-stage pipeline (the same tasks stage, the chain's grpo stage from the base model with
    DPO + PPO + GRPO's steps)."""
    import tomllib

    from align import pipeline as P
    from benchmarks import pretrained_tasks as PT
    from tests.conftest import ROOT

    chain, problems = P.parse(ROOT / "pipelines/pretrained.toml", PT.task_overrides("legs"))
    assert not problems
    assert chain.stage("tasks").values["task"] == "rg:leg_counting"
    assert chain.stage("tasks").values["param"] == PT.TASKS["legs"][1]
    pipe = tomllib.loads((ROOT / "pipelines/pretrained.toml").read_text())
    f = tmp_path / "alone.toml"
    (tmp_path / "base").mkdir()
    f.write_text(PT.grpo_alone_toml(pipe, "aiw", str(tmp_path / "base"), tmp_path / "out"))
    alone, problems = P.parse(f)
    assert not problems and [s.name for s in alone.stages] == ["tasks", "grpo_alone"]
    grpo = alone.stage("grpo_alone").values
    want = {k: v for k, v in pipe["stages"]["grpo"].items() if k not in ("stage", "model", "max_steps")}
    assert {k: grpo[k] for k in want} == want and grpo["model"] == str(tmp_path / "base")
    assert grpo["max_steps"] == sum(pipe["stages"][s]["max_steps"] for s in ("dpo", "ppo", "grpo")) == 310
    assert alone.stage("tasks").values["task"] == "rg:aiw"
    # a variant of the recipe (--set) reaches GRPO alone too: its steps follow the chain's
    variant = PT.recipe(str(ROOT / "pipelines/pretrained.toml"), ["stages.grpo.max_steps=200", "stages.grpo.lr=2e-5"])
    f.write_text(PT.grpo_alone_toml(variant, "aiw", str(tmp_path / "base"), tmp_path / "out"))
    alone, problems = P.parse(f)
    assert not problems and alone.stage("grpo_alone").values["max_steps"] == 260
    assert alone.stage("grpo_alone").values["lr"] == 2e-5
    # --variant: a second chain sharing GRPO alone, so it may not change what GRPO alone runs
    path = str(ROOT / "pipelines/pretrained.toml")
    assert PT.parse_variant('alike:stages.prefs.pair_by="form";stages.rm.lr=1e-5', path, []) == (
        "alike", ['stages.prefs.pair_by="form"', "stages.rm.lr=1e-5"])
    for bad in ("fast:stages.grpo.lr=2e-5", "short:stages.dpo.max_steps=20", "no-colon", "1x:stages.rm.lr=1"):
        with pytest.raises(SystemExit):
            PT.parse_variant(bad, path, [])
    rows = PT.summarise(["aiw"], tmp_path / "none", ["", "matched"])
    assert list(rows) == ["aiw", "aiw (matched)"] and rows["aiw (matched)"]["grpo"] is None


def test_the_pretrained_benchmark_stops_its_runs_by_limit_plus_grace():
    """wait_all: at the limit every run's process group gets SIGTERM; one that does not exit within the grace (a
    stage stuck in its checkpoint) is killed, so a device call always gets its results back in time."""
    import subprocess
    import time

    from benchmarks import pretrained_tasks as PT

    stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); " \
               "time.sleep(120)"
    polite = "import time; print('up', flush=True); time.sleep(120)"
    runs = [(name, subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                                    start_new_session=True)) for name, code in (("stubborn", stubborn),
                                                                                 ("polite", polite))]
    for _, p in runs:
        assert p.stdout.readline().strip() == "up"
    t0 = time.monotonic()
    PT.wait_all(runs, limit=0.5, grace=3)
    assert time.monotonic() - t0 < 30
    assert [p.returncode for _, p in runs] == [-9, -15]  # killed after the grace / stopped by its SIGTERM
    assert not any(PT.group_alive(p.pid) for _, p in runs)


def test_the_pretrained_benchmark_runs_the_policy_stages_in_another_order(tmp_path):
    """order=dpo,grpo,ppo: the file's policy stages moved to that order, each reading the one before it, the first
    from the base model; a valid pipeline, GRPO alone unchanged (so a --variant may reorder), the final model the
    last stage's, and the checks along the new order."""
    import json

    from align import pipeline as P
    from benchmarks import pretrained_tasks as PT
    from tests.conftest import ROOT

    path = str(ROOT / "pipelines/pretrained.toml")
    assert PT.split_order(["stages.rm.lr=1e-5", "order=dpo,grpo,ppo"]) == (
        ["dpo", "grpo", "ppo"], ["stages.rm.lr=1e-5"])
    assert PT.split_order(["stages.rm.lr=1e-5"]) == (None, ["stages.rm.lr=1e-5"])
    assert PT.file_order(path) == ["grpo", "dpo", "ppo"]
    for bad in ("order=dpo,grpo", "order=dpo,grpo,grpo", "order=dpo,ppo,grpo,sft"):
        with pytest.raises(SystemExit):
            PT.split_order([bad])
    # the file's pairs come from the GRPO policy: its policy stages cannot move, and the base model goes only to the
    # keys that do not read another stage
    assert PT.reads_policy({"from_model": "@grpo", "data": "@tasks"}) == ["grpo"]
    assert PT.reads_policy({"data": "@dpo/test.jsonl", "model": "m"}) == ["dpo"]
    with pytest.raises(SystemExit, match="'policy_pairs' reads @grpo"):
        PT.recipe(path, ["order=dpo,grpo,ppo"])
    assert PT.recipe(path, ["order=grpo,dpo,ppo"]) == PT.recipe(path, [])  # the file's own order: unchanged
    assert PT.base_model_keys(PT.recipe(path, [])) == [
        "stages.eval_base.model", "stages.grpo.model", "stages.prefs.from_model", "stages.rm.model"]
    # a file whose pairs all come from the base model (the policy stages read by no other stage) reorders
    file, base = tmp_path / "base_pairs.toml", "HuggingFaceTB/SmolLM2-135M-Instruct"
    raw = PT.recipe(path, ["stages.dpo.data=@prefs", "stages.dpo.eval_data=@prefs/test.jsonl"])
    del raw["stages"]["policy_pairs"]
    file.write_text(PT.pipeline_toml(raw))
    pipe = PT.recipe(str(file), ["order=dpo,grpo,ppo"])
    assert list(pipe["stages"]) == ["tasks", "eval_base", "prefs", "rm", "dpo", "grpo", "ppo"]
    assert [pipe["stages"][s]["model"] for s in ("dpo", "grpo", "ppo")] == [base, "@dpo", "@grpo"]
    assert PT.base_model_keys(pipe) == ["stages.eval_base.model", "stages.prefs.from_model", "stages.rm.model",
                                        "stages.dpo.model"]
    f = tmp_path / "chain.toml"
    f.write_text(PT.pipeline_toml(pipe))
    chain, problems = P.parse(f)
    assert not problems and [s.name for s in chain.stages][-3:] == ["dpo", "grpo", "ppo"]
    assert P.resolve(chain, chain.stage("ppo"))["model"] == str(chain.out / "grpo")
    assert PT.parse_variant("early_ppo:order=dpo,ppo,grpo;stages.ppo.lr=1e-6", str(file), []) == (
        "early_ppo", ["order=dpo,ppo,grpo", "stages.ppo.lr=1e-6"])
    # the table reads the final model at the order's last stage, and "every stage >= its input" along the order
    for stage, value in [("eval_base", {"pass@1/greedy": 0.2}), ("rm", {"eval/accuracy": 0.8}),
                         ("dpo", {"pass@1/policy": 0.25}), ("grpo", {"eval/pass@1/greedy": 0.6}),
                         ("ppo", {"eval/pass@1/greedy": 0.55})]:
        (tmp_path / "aiw" / "chain-late" / stage).mkdir(parents=True)
        (tmp_path / "aiw" / "chain-late" / stage / "artifact.json").write_text(json.dumps(
            {"status": "complete", "metrics": value}))
    (tmp_path / "aiw" / "alone" / "grpo_alone").mkdir(parents=True)
    (tmp_path / "aiw" / "alone" / "grpo_alone" / "artifact.json").write_text(json.dumps(
        {"status": "complete", "metrics": {"eval/pass@1/greedy": 0.58}}))
    row = PT.summarise(["aiw"], tmp_path, ["late"], {"late": ["dpo", "grpo", "ppo"]})["aiw (late)"]
    assert row["final"] == 0.55 and row["checks"] == {"every stage >= input - 2 points": False,
                                                      "rm held-out accuracy >= 0.75": True,
                                                      "final >= GRPO alone": False}
    assert "dpo 0.250 → grpo 0.600 → ppo 0.550 | 0.550 | 0.580" in PT.table({"aiw (late)": row})


def test_a_data_stage_feeds_later_stages_in_a_pipeline(tmp_path, tiny_model_dir):
    """tasks (reasoning-gym rows) -> prefs (pairs the model samples) -> rm, each an artifact; `@NAME` reads a
    data artifact's data.jsonl and `@NAME/test.jsonl` its held-out file."""
    from tests.conftest import output, run_align

    (tmp_path / "v.py").write_text(VERIFIER)
    toml = tmp_path / "p.toml"
    toml.write_text(f'''[pipeline]
out = "runs"

[stages.tasks]
stage = "data"
task = "rg:basic_arithmetic"
param = ["max_terms=2", "max_digits=1"]
n = 24
test_n = 8

[stages.prefs]
stage = "data"
task = "prefs"
from_model = "{tiny_model_dir}"
data = "@tasks"
verifier = "{tmp_path / 'v.py'}:first_char_even"
samples = 4
max_new_tokens = 6
test_n = 4
pair_by = "form"

[stages.rm]
model = "{tiny_model_dir}"
data = "@prefs"
eval_data = "@prefs/test.jsonl"
max_steps = 2
batch_size = 4
normalize_samples = 4
''')
    proc = run_align("pipeline", "run", toml, timeout=600)
    assert proc.returncode == 0, output(proc)[-3000:]
    runs = tmp_path / "runs"
    for stage in ("tasks", "prefs", "rm"):
        assert json.loads((runs / stage / "artifact.json").read_text())["status"] == "complete", stage
    assert len(_read(runs / "tasks" / "data.jsonl")) == 24 and len(_read(runs / "prefs" / "test.jsonl")) == 4
    rm = json.loads((runs / "rm" / "artifact.json").read_text())
    assert rm["config"]["eval_data"] == str(runs / "prefs" / "test.jsonl")
    again = run_align("pipeline", "run", toml, timeout=600)  # all up to date: nothing reruns
    assert again.returncode == 0 and output(again).count("up to date, skipped") == 3, output(again)[-3000:]


def test_paired_difference_of_two_runs_on_the_same_held_out_problems(tmp_path):
    """chain − alone on the problems both answered (matched by prompt): d = [1, 0, 0, -1, 1] → mean 0.2, sample
    sd sqrt(0.7), s.e. sqrt(0.7 / 5); a problem only one run answered does not count; a run without the file: None."""
    from benchmarks.pretrained_tasks import paired_difference

    def answers(folder, correct):
        folder.mkdir()
        (folder / "eval_samples.jsonl").write_text("".join(
            json.dumps({"step": 9, "prompt": p, "greedy_correct": c}) + "\n" for p, c in correct.items()))
        return folder

    a = answers(tmp_path / "a", {"p1": True, "p2": True, "p3": False, "p4": False, "p5": True, "only-a": True})
    b = answers(tmp_path / "b", {"p1": False, "p2": True, "p3": False, "p4": True, "p5": False})
    d = paired_difference(a, b)
    assert d["n"] == 5 and d["a_only"] == 2 and d["b_only"] == 1
    assert abs(d["delta"] - 0.2) < 1e-12 and abs(d["se"] - math.sqrt(0.7 / 5)) < 1e-12
    assert paired_difference(a, tmp_path / "missing") is None


def test_answer_positions_names_the_candidate_an_answer_picks(tmp_path, capsys):
    """number_format answers read by value, whatever their form: the second candidate in another notation, the whole
    list ("several", right under the last-number verifier), the same candidate twice (one), none; only the file's
    last evaluation counts."""
    from benchmarks import answer_positions as AP

    prompt = "Now, pick the largest number of the following candidates: 526.007000 5.26274e+02\n"
    assert AP.candidates(prompt) == [526.007, 526.274]
    assert AP.answer_kind(prompt, "526.274") == "second"
    assert AP.answer_kind(prompt, "The largest number is 526.007.") == "first"
    assert AP.answer_kind(prompt, "526.007000 526.274") == "several"
    assert AP.answer_kind(prompt, "526.274000\n\n526.274") == "second"
    assert AP.answer_kind(prompt, "42") == "none" and AP.answer_kind(prompt, "") == "none"
    big = "candidates: 521219524.996000 521,219,525.263 5.212195242210000e+08\n"
    assert AP.answer_kind(big, "521,219,525.263000") == "second" and AP.answer_kind(big, "521219524.221") == "third"

    rows = [{"step": 0, "prompt": prompt, "greedy": "42", "greedy_correct": False},
            {"step": 5, "prompt": prompt, "greedy": "526.274", "greedy_correct": True},
            {"step": 5, "prompt": prompt, "greedy": "526.007000 526.274", "greedy_correct": True},
            {"step": 5, "prompt": prompt, "greedy": "526.007", "greedy_correct": False}]
    f = tmp_path / "eval_samples.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert AP.tally(AP.last_eval(f)) == {"first": (1, 0), "second": (1, 1), "several": (1, 1)}
    assert list(AP.tally(AP.last_eval(f))) == ["first", "second", "several"]
    AP.main([str(f)])
    assert "| 5 | 3 | 2 | first 1 (0), second 1 (1), several 1 (1) |" in capsys.readouterr().out
