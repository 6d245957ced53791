"""digit_sort, the default pipeline's task: a demonstrator whose one error (leaving out the 0) is systematic, its
preference pairs, `align data make`'s --param / --exclude for it, and the shipped files."""

import json
from pathlib import Path

import pytest

from align.errors import UserError
from align.rewards import guess_verifier, sort_reward, verifier_fn, verify
from align.tasks import FLAW_RATE, make_dataset, row_key
from stages.data_make import DataMakeConfig, run

DATA = Path(__file__).resolve().parent.parent / "data" / "digit_sort"


def digits(row):
    return [int(x) for x in row["prompt"].split(":")[1].split()]


def read(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def test_the_demonstrator_errs_only_by_leaving_out_the_zero_at_its_rate():
    rows = make_dataset("digit_sort", 2000, seed=0)
    zero = [r for r in rows if 0 in digits(r)]
    for r in rows:
        nums = digits(r)
        assert 3 <= len(nums) <= 6 and len(set(nums)) == len(nums)
        assert r["answer"] == " ".join(map(str, sorted(nums)))
        if r["flawed"]:
            assert 0 in nums and r["completion"] == " ".join(str(x) for x in sorted(nums) if x)
        else:
            assert r["completion"] == r["answer"]
    assert 0.35 < len(zero) / len(rows) < 0.6  # about half the lists hold a 0
    rate = sum(r["flawed"] for r in zero) / len(zero)
    assert abs(rate - FLAW_RATE) < 0.04, rate  # ~900 lists with a 0: 1.5 points of standard error
    assert not any(r["flawed"] for r in make_dataset("digit_sort", 300, seed=0, flaw_rate=0.0))
    always = make_dataset("digit_sort", 300, seed=0, flaw_rate=1.0)
    assert all(r["flawed"] == (0 in digits(r)) for r in always)


def test_the_verifier_rejects_the_flaw_and_accepts_the_answer():
    rows = make_dataset("digit_sort", 300, seed=1)
    assert guess_verifier(rows) == "exact"  # what eval, sft, ppo and grpo pick for these rows
    check = verifier_fn("exact")
    flawed = [r for r in rows if r["flawed"]]
    assert flawed
    assert all(verify(check, r, r["answer"]) for r in rows)
    assert not any(verify(check, r, r["completion"]) for r in flawed)
    assert all(verify(check, r, r["completion"]) for r in rows if not r["flawed"])
    assert all(sort_reward(r["completion"], r["answer"]) == 0.0 for r in flawed)  # every position shifted


def test_pairs_put_the_correct_list_over_the_demonstrators_error_its_mirror_or_a_slip():
    pairs = make_dataset("digit_sort_prefs", 400, seed=2)
    check = verifier_fn("exact")
    for p in pairs:
        nums = digits(p)
        assert p["chosen"] == p["answer"] == " ".join(map(str, sorted(nums)))
        assert verify(check, p, p["chosen"]) and not verify(check, p, p["rejected"])
        assert (p["flaw"] == "no_zero") == (0 in nums)
        if p["flaw"] == "no_zero":  # the demonstrator's error
            assert p["rejected"] == " ".join(str(x) for x in sorted(nums) if x)
        elif p["flaw"] == "extra_zero":  # its mirror: a 0 the list does not hold
            assert p["rejected"] == "0 " + p["answer"]
        else:
            assert p["flaw"] == "slip" and not p["rejected"].startswith("0")
    kinds = [p["flaw"] for p in pairs]
    assert 0.35 < kinds.count("no_zero") / len(pairs) < 0.6
    assert 0.35 < kinds.count("extra_zero") / (len(pairs) - kinds.count("no_zero")) < 0.65


def test_data_make_digit_sort_takes_param_and_exclude(tmp_path):
    first = tmp_path / "a.jsonl"
    summary = run(DataMakeConfig(task="digit_sort", n=400, seed=3, out=str(first), param=["flaw_rate=0.5"]))
    rows = read(first)
    assert rows == make_dataset("digit_sort", 400, seed=3, flaw_rate=0.5)
    assert summary["demonstrator_accuracy"] == round(1 - sum(r["flawed"] for r in rows) / 400, 4)
    zero = [r for r in rows if r["answer"].startswith("0")]
    assert summary["flaw_rate_on_zero_lists"] == round(sum(r["flawed"] for r in zero) / len(zero), 4)
    # a fresh held-out set with another seed: none of the first file's prompts, here nor in its own split
    second = tmp_path / "b.jsonl"
    run(DataMakeConfig(task="digit_sort", n=300, seed=4, out=str(second), exclude=str(first), test_n=50))
    fresh = read(second) + read(tmp_path / "b.test.jsonl")
    assert len(fresh) == 350 and not {row_key(r) for r in fresh} & {row_key(r) for r in rows}
    with pytest.raises(UserError, match=r"unknown option\(s\) \['colour'\] for task 'digit_sort'"):
        run(DataMakeConfig(task="digit_sort", n=5, out=str(tmp_path / "c.jsonl"), param=["colour=red"]))
    with pytest.raises(UserError, match="flaw_rate must be in"):
        run(DataMakeConfig(task="digit_sort", n=5, out=str(tmp_path / "c.jsonl"), param=["flaw_rate=2"]))
    assert not (tmp_path / "c.jsonl").exists()


def test_a_data_artifact_s_wall_time_counts_the_generation(tmp_path, monkeypatch):
    """A data stage generates first and opens its artifact to write: artifact.json's `started` and `wall_seconds`
    count from when the stage began (here the clock the stage read at its start is 100 s back), not from the
    writing."""
    import json
    import time
    from types import SimpleNamespace

    import stages.data_make as DM

    monkeypatch.setattr(DM, "time", SimpleNamespace(time=lambda: time.time() - 100))
    run(DataMakeConfig(task="digit_sort", n=20, out=str(tmp_path / "d"), test_n=5))
    art = json.loads((tmp_path / "d" / "artifact.json").read_text())
    assert art["status"] == "complete" and 100 <= art["wall_seconds"] < 160
    began = time.mktime(time.strptime(art["started"], "%Y-%m-%dT%H:%M:%S%z"))
    ended = time.mktime(time.strptime(art["finished"], "%Y-%m-%dT%H:%M:%S%z"))
    assert 99 <= ended - began <= 160


def test_the_shipped_files_are_the_generator_s_and_their_held_out_prompts_are_unseen():
    """data/digit_sort as scripts/make_data.py writes it (seeds 5000/5001, 6000/6001)."""
    files = {name: read(DATA / f"{name}.jsonl") for name in ("train", "test", "prefs", "prefs_test")}
    assert files["test"] == make_dataset("digit_sort", 500, seed=5001)
    assert files["prefs_test"][:50] == make_dataset("digit_sort_prefs", 50, seed=6001,
                                                    exclude={row_key(r) for r in files["test"]})
    assert [len(files[n]) for n in ("train", "test", "prefs", "prefs_test")] == [20000, 500, 5000, 300]
    held_out = {row_key(r) for r in files["test"] + files["prefs_test"]}
    assert not held_out & {row_key(r) for r in files["train"] + files["prefs"]}
    demo = sum(r["completion"] == r["answer"] for r in files["train"]) / 20000
    assert 0.58 < demo < 0.66  # the demonstrator's accuracy the default pipeline's SFT imitates
