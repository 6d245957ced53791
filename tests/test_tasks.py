"""Procedural tasks: determinism, held-out splits, correct answers, preference pairs, shipped tokenizer."""

import json
import os
import re

import pytest

from align.errors import UserError
from align.rewards import math_reward, sort_reward
from align.tasks import TASKS, make_dataset, row_key, write_jsonl

ROOT = os.path.join(os.path.dirname(__file__), "..")
TOKENIZER = os.path.join(ROOT, "data", "tokenizer")


def eval_expression(expr):
    """Evaluate 'a + b - c' left to right, independently of align.tasks."""
    tokens = expr.split()
    total = int(tokens[0])
    for op, n in zip(tokens[1::2], tokens[2::2]):
        total = total + int(n) if op == "+" else total - int(n)
    return total


@pytest.mark.parametrize("task", TASKS)
def test_deterministic_by_seed(task):
    assert make_dataset(task, 50, seed=7) == make_dataset(task, 50, seed=7)
    assert make_dataset(task, 50, seed=7) != make_dataset(task, 50, seed=8)


@pytest.mark.parametrize("task", TASKS)
def test_rows_unique_and_splits_disjoint(task):
    train = make_dataset(task, 300, seed=3)
    test = make_dataset(task, 100, seed=4, exclude={row_key(r) for r in train})
    assert len(train) == 300 and len(test) == 100
    train_keys, test_keys = {row_key(r) for r in train}, {row_key(r) for r in test}
    assert len(train_keys) == 300 and len(test_keys) == 100
    assert not train_keys & test_keys


def test_exclude_is_respected():
    first = make_dataset("arithmetic", 200, seed=0, levels=(1,))
    again = make_dataset("arithmetic", 200, seed=0, levels=(1,), exclude={r["prompt"] for r in first[:100]})
    assert not {r["prompt"] for r in first[:100]} & {r["prompt"] for r in again}


def test_arithmetic_answers_and_levels():
    rows = make_dataset("arithmetic", 400, seed=1)
    assert {r["level"] for r in rows} == {1, 2, 3, 4}
    assert sum(r["level"] == 1 for r in rows) == 100  # levels cycle evenly
    for r in rows:
        assert set(r) == {"prompt", "completion", "answer", "level"}
        m = re.fullmatch(r"(.+) = (\d+)\. #### (\d+)", r["completion"])
        assert m, r["completion"]
        expr, result, final = m.groups()
        assert eval_expression(expr) == int(result) == int(final) == int(r["answer"]) >= 0
        nums = [int(x) for x in expr.split()[::2]]
        digits, count = {1: (1, 2), 2: (1, 3), 3: (2, 2), 4: (2, 3)}[r["level"]]
        assert len(nums) == count and all(len(str(n)) == digits for n in nums)
        assert all(str(n) in r["prompt"] for n in nums)
        assert r["prompt"].endswith("?")
        assert math_reward(r["completion"], r["answer"]) == 1.0


def test_levels_filter():
    rows = make_dataset("arithmetic", 60, seed=2, levels=(3,))
    assert {r["level"] for r in rows} == {3}


def test_sort_rows():
    rows = make_dataset("sort", 200, seed=4, min_len=3, max_len=6)
    for r in rows:
        nums = [int(x) for x in r["prompt"].removeprefix("Sort in ascending order: ").split()]
        assert 3 <= len(nums) <= 6 and all(0 <= n <= 99 for n in nums)
        assert r["completion"] == r["answer"] == " ".join(map(str, sorted(nums)))
        assert sort_reward(r["completion"], r["answer"]) == 1.0
    short = make_dataset("sort", 20, seed=4, min_len=2, max_len=2, max_value=9)
    assert all(len(r["answer"].split()) == 2 for r in short)


def test_prefs_pairs():
    rows = make_dataset("prefs", 400, seed=5)
    for r in rows:
        assert set(r) == {"prompt", "chosen", "rejected", "answer"}
        assert r["chosen"] != r["rejected"]
        assert math_reward(r["chosen"], r["answer"]) == 1.0
        assert math_reward(r["rejected"], r["answer"]) == 0.0
    # the corruptions vary: some keep the right expression, some change it
    same_expr = sum(r["chosen"].split(" = ")[0] == r["rejected"].split(" = ")[0] for r in rows)
    assert 0 < same_expr < len(rows)


def test_prefs_with_sort():
    rows = make_dataset("prefs", 200, seed=6, sort_frac=0.5)
    sorts = [r for r in rows if r["prompt"].startswith("Sort")]
    assert 0 < len(sorts) < len(rows)
    for r in sorts:
        assert r["chosen"] == r["answer"] != r["rejected"]
        assert sort_reward(r["rejected"], r["answer"]) < 1.0


def test_text_rows():
    rows = make_dataset("text", 50, seed=7)
    assert all(set(r) == {"text"} and r["text"].endswith(".") for r in rows)
    assert any(" so he had " in r["text"] or " so she had " in r["text"] for r in rows)


def test_bad_input_raises_user_error():
    with pytest.raises(UserError, match="valid tasks"):
        make_dataset("poetry", 10, seed=0)
    with pytest.raises(UserError, match="levels"):
        make_dataset("arithmetic", 10, seed=0, levels=(5,))
    with pytest.raises(UserError, match="option"):
        make_dataset("sort", 10, seed=0, colour="red")
    with pytest.raises(UserError, match="unique"):
        make_dataset("sort", 50, seed=0, min_len=1, max_len=1, max_value=3)


JSONL_WRITER = """
import sys
from align.tasks import write_jsonl
path, i = sys.argv[1], 0
print("ready", flush=True)
while True:  # ~1 MB versions of 2000 rows, each readable as a whole
    write_jsonl([{"version": i, "row": j, "text": "x" * 500} for j in range(2000)], path)
    i += 1
"""


def test_write_jsonl_atomic(tmp_path):
    """The rows land in a new folder, no temp file beside them; a writer killed mid-write leaves the previous
    whole file or the new one, and a reader never sees a partial one."""
    from tests.test_atomic import killed_mid_write

    rows = make_dataset("sort", 5, seed=0)
    path = tmp_path / "sub" / "rows.jsonl"
    write_jsonl(rows, path)
    assert [json.loads(line) for line in path.read_text().splitlines()] == rows
    assert os.listdir(path.parent) == ["rows.jsonl"]

    def whole(text):  # exactly the text of the version its first row names
        version = json.loads(text[: text.index("\n")])["version"]
        assert text == "".join(json.dumps({"version": version, "row": j, "text": "x" * 500}) + "\n"
                               for j in range(2000))

    killed_mid_write(tmp_path / "killed" / "rows.jsonl", JSONL_WRITER, whole)


@pytest.fixture(scope="module")
def tok():
    from transformers import PreTrainedTokenizerFast  # lighter import than AutoTokenizer; make_data.py checks that too

    return PreTrainedTokenizerFast.from_pretrained(TOKENIZER)


def test_tokenizer_special_ids(tok):
    names = ["<|pad|>", "<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>"]
    assert tok.convert_tokens_to_ids(names) == [0, 1, 2, 3, 4, 5]
    assert (tok.pad_token, tok.bos_token, tok.eos_token) == ("<|pad|>", "<|bos|>", "<|eos|>")
    assert len(tok) == 512


def test_tokenizer_splits_digits(tok):
    ids = tok.encode("12345", add_special_tokens=False)
    assert tok.convert_ids_to_tokens(ids) == ["1", "2", "3", "4", "5"]
    tokens = tok.convert_ids_to_tokens(tok.encode("Tom has 23 apples. #### 68", add_special_tokens=False))
    assert [t for t in tokens if any(c.isdigit() for c in t)] == ["2", "3", "6", "8"]
    text = "Sam has 7 coins. He loses 3. How many coins does Sam have now?"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_tokenizer_chat_template(tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Sort in ascending order: 3 1"}]
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == "<|bos|><|system|>Be brief.<|user|>Sort in ascending order: 3 1<|assistant|>"
    full = tok.apply_chat_template(messages + [{"role": "assistant", "content": "1 3"}], tokenize=False)
    assert full == "<|bos|><|system|>Be brief.<|user|>Sort in ascending order: 3 1<|assistant|>1 3<|eos|>"
    ids = tok.apply_chat_template(messages[1:], tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert ids[0] == 1 and ids[1] == 4 and ids[-1] == 5
