"""align.data: loading every format, column mapping, UserError messages, SFT tokenisation and collation."""

import json

import pytest
import torch

from align import data as D
from align.errors import UserError

ROWS = [
    {"question": "What is 1 + 2?", "solution": "1 + 2 = 3. #### 3", "answer": "3"},
    {"question": "What is 4 + 5?", "solution": "4 + 5 = 9. #### 9", "answer": "9"},
    {"question": "What is 7 - 3?", "solution": "7 - 3 = 4. #### 4", "answer": "4"},
]
SFT_ROWS = [{"prompt": r["question"], "completion": r["solution"]} for r in ROWS]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def tok(shipped_tokenizer):
    return shipped_tokenizer


@pytest.fixture(scope="module")
def tok_no_template():
    """The shipped tokenizer with its chat template removed (plain-text prompts: BOS + text)."""
    from align.models import load_tokenizer, resolve

    t = load_tokenizer(resolve("tiny"))
    t.chat_template = None
    return t


# ---------------------------------------------------------------------------------------------- formats


def test_load_rows_jsonl_json_parquet_and_disk(tmp_path):
    import datasets

    ds = datasets.Dataset.from_list(SFT_ROWS)
    paths = {
        "jsonl": write_jsonl(tmp_path / "d.jsonl", SFT_ROWS),
        "json": tmp_path / "d.json",
        "json_data": tmp_path / "d2.json",
        "parquet": tmp_path / "d.parquet",
        "disk": tmp_path / "disk",
        "dict": tmp_path / "dict",
    }
    paths["json"].write_text(json.dumps(SFT_ROWS, indent=1))
    paths["json_data"].write_text(json.dumps({"data": SFT_ROWS}))
    ds.to_parquet(str(paths["parquet"]))
    ds.save_to_disk(str(paths["disk"]))
    datasets.DatasetDict({"train": ds, "test": ds.select([0])}).save_to_disk(str(paths["dict"]))
    for name, p in paths.items():
        assert D.load_rows(p, "sft") == SFT_ROWS, name
    assert D.load_rows(paths["jsonl"], "sft", limit=2) == SFT_ROWS[:2]


def test_jsonl_skips_blank_lines(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps(SFT_ROWS[0]) + "\n\n   \n" + json.dumps(SFT_ROWS[1]) + "\n")
    assert D.load_rows(p, "sft") == SFT_ROWS[:2]


def test_columns_mapping(tmp_path):
    p = write_jsonl(tmp_path / "raw.jsonl", ROWS)
    rows = D.load_rows(p, "sft", "question=prompt,solution=completion")
    assert [(r["prompt"], r["completion"]) for r in rows] == [(r["question"], r["solution"]) for r in ROWS]
    assert "question" not in rows[0] and rows[0]["answer"] == "3"
    # the dict form (from a pipeline TOML) is the same mapping
    assert D.load_rows(p, "sft", {"question": "prompt", "solution": "completion"}) == rows
    # mapping onto an existing column replaces it
    q = write_jsonl(tmp_path / "both.jsonl", [{"prompt": "old", "q": "new", "completion": "c"}])
    assert D.load_rows(q, "sft", "q=prompt") == [{"prompt": "new", "completion": "c"}]
    q = write_jsonl(tmp_path / "first.jsonl", [{"q": "new", "prompt": "old", "completion": "c"}])  # whatever the order
    assert D.load_rows(q, "sft", "q=prompt") == [{"prompt": "new", "completion": "c"}]


def test_parse_columns():
    assert D.parse_columns("a=b, c = d") == {"a": "b", "c": "d"}
    assert D.parse_columns("") == {} and D.parse_columns(None) == {}


# ----------------------------------------------------------------------------------------------- errors


def raises(match, fn, *a, **kw):
    with pytest.raises(UserError, match=match) as e:
        fn(*a, **kw)
    return str(e.value)


def test_columns_leave_held_out_data_that_already_has_the_new_name(tmp_path):
    """--columns question=prompt renames your training data; the shipped held-out data (already `prompt`) is read
    as it is instead of failing. The main data must have every old name: a mapping that renames nothing there is
    refused, as is one neither side of which exists in held-out data."""
    from align.paths import DATA_DIR

    test = DATA_DIR / "arithmetic/test.jsonl"
    rows = D.load_rows(test, "verifiable", "question=prompt", limit=2, held_out=True)
    assert "prompt" in rows[0] and "question" not in rows[0]
    with pytest.raises(UserError, match="--columns maps 'question', but the data has no such column"):
        D.load_rows(test, "verifiable", "question=prompt")
    with pytest.raises(UserError, match="--columns maps 'quest'"):
        D.load_rows(test, "verifiable", "quest=promptt", held_out=True)


def test_a_hub_dataset_id_goes_to_datasets_and_a_missing_data_file_is_not_found(monkeypatch):
    """A name that is no local path and could be a Hub dataset id is loaded with datasets.load_dataset (its split,
    train by default); a failure (offline here) is one line naming it; a missing path with a data file's suffix
    is a missing file."""
    import datasets

    calls = []

    def fake(name, split):
        calls.append((name, split))
        if name == "nobody/nothing":
            raise ConnectionError("Couldn't reach 'nobody/nothing' on the Hub (OfflineModeIsEnabled)\nmore lines")
        return datasets.Dataset.from_list([{"prompt": "p", "completion": split}])

    monkeypatch.setattr(datasets, "load_dataset", fake)
    assert D.read_rows("openai/gsm8k") == [{"prompt": "p", "completion": "train"}]
    assert D.read_rows("openai/gsm8k:test") == [{"prompt": "p", "completion": "test"}]
    assert calls == [("openai/gsm8k", "train"), ("openai/gsm8k", "test")]
    with pytest.raises(UserError, match=r"^nobody/nothing: no such file or folder, and not a Hugging Face Hub "
                                        r"dataset that could be loaded \(Couldn't reach 'nobody/nothing' on the Hub "
                                        r"\(OfflineModeIsEnabled\)\)\. Give a local file") as e:
        D.read_rows("nobody/nothing")
    assert "\n" not in str(e.value)
    with pytest.raises(UserError, match="data file not found.$"):
        D.read_rows("missing/file.jsonl")


def test_missing_file(tmp_path):
    msg = raises("data file not found", D.load_rows, tmp_path / "nope.jsonl", "sft")
    assert "nope.jsonl" in msg


def test_jsonl_line_not_json_names_file_and_line(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text(json.dumps(SFT_ROWS[0]) + "\n" + json.dumps(SFT_ROWS[1]) + "\n{\"prompt\": oops}\n")
    msg = raises("not valid JSON", D.load_rows, p, "sft")
    assert f"{p}:3:" in msg


def test_jsonl_line_not_an_object(tmp_path):
    p = tmp_path / "list.jsonl"
    p.write_text(json.dumps(SFT_ROWS[0]) + "\n[1, 2]\n")
    assert f"{p}:2:" in raises("expected a JSON object", D.load_rows, p, "sft")


def test_json_file_not_json_names_line(tmp_path):
    p = tmp_path / "bad.json"
    p.write_text("[\n  {\"prompt\": \"a\", \"completion\": \"b\"},\n  {oops}\n]\n")
    assert f"{p}:3:" in raises("not valid JSON", D.load_rows, p, "sft")


def test_json_not_a_list(tmp_path):
    p = tmp_path / "obj.json"
    p.write_text(json.dumps({"prompt": "a"}))
    raises("expected a JSON list", D.load_rows, p, "sft")


def test_missing_column_names_it(tmp_path):
    p = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "answer": "1"}])
    msg = raises("no 'completion' column for sft data", D.load_rows, p, "sft")
    assert "columns: prompt, answer" in msg and "--columns" in msg
    msg = raises("no 'chosen', 'rejected' column", D.load_rows, p, "preference")


def test_row_without_value_names_row_and_column(tmp_path):
    p = write_jsonl(tmp_path / "d.jsonl", [SFT_ROWS[0], {"prompt": "only a prompt"}, SFT_ROWS[1]])
    raises(r"row 2 has no value in column 'completion'", D.load_rows, p, "sft")


def test_columns_maps_missing_column(tmp_path):
    p = write_jsonl(tmp_path / "d.jsonl", SFT_ROWS)
    msg = raises("--columns maps 'question'", D.load_rows, p, "sft", "question=query")
    assert "no such column" in msg and "prompt, completion" in msg


@pytest.mark.parametrize("spec", ["question", "question=prompt,solution"])
def test_bad_columns_spec(tmp_path, spec):
    p = write_jsonl(tmp_path / "d.jsonl", ROWS)
    raises("not of the form old=new", D.load_rows, p, "sft", spec)


def test_empty_dataset(tmp_path):
    p = tmp_path / "empty.jsonl"
    p.write_text("")
    assert str(p) in raises("the dataset is empty", D.load_rows, p, "sft")
    q = tmp_path / "empty.json"
    q.write_text("[]")
    raises("the dataset is empty", D.load_rows, q, "sft")


def test_unknown_format(tmp_path):
    p = tmp_path / "d.csv"
    p.write_text("prompt,completion\na,b\n")
    msg = raises("unsupported data format '.csv'", D.load_rows, p, "sft")
    assert ".jsonl" in msg


def test_dir_that_is_not_a_dataset(tmp_path):
    raises("not a datasets save_to_disk directory", D.load_rows, tmp_path, "sft")


def test_dataset_dict_without_train(tmp_path):
    import datasets

    ds = datasets.Dataset.from_list(SFT_ROWS)
    datasets.DatasetDict({"test": ds}).save_to_disk(str(tmp_path / "dd"))
    raises("without a 'train' split", D.load_rows, tmp_path / "dd", "sft")


# --------------------------------------------------------------------------------------- messages rows


def test_messages_rows(tmp_path, tok):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"},
            {"role": "assistant", "content": "#### 4"}]
    p = write_jsonl(tmp_path / "chat.jsonl", [{"messages": msgs}])
    rows = D.load_rows(p, "sft")
    assert rows == [{"messages": msgs}]
    (ex,) = D.sft_examples(tok, rows, max_length=128)
    # prompt = the template with a generation prompt; completion = last assistant turn + EOS
    assert tok.decode(ex["input_ids"]) == "<|bos|><|system|>Be brief.<|user|>What is 2 + 2?<|assistant|>#### 4<|eos|>"
    assert tok.decode(ex["input_ids"]) == tok.apply_chat_template(msgs, tokenize=False)
    completion = [t for t in ex["labels"] if t != -100]
    assert tok.decode(completion) == "#### 4<|eos|>"


def test_messages_row_must_end_with_assistant(tok):
    rows = [{"messages": [{"role": "user", "content": "hi"}]}]
    with pytest.raises(UserError, match="must end with an assistant message"):
        D.sft_examples(tok, rows, 64)


# ----------------------------------------------------------------------------------------- sft_examples


def test_sft_examples_labels_mask_exactly_the_prompt(tok):
    exs = D.sft_examples(tok, SFT_ROWS, max_length=256)
    assert len(exs) == len(SFT_ROWS)
    for row, ex in zip(SFT_ROWS, exs):
        p = D.encode_prompts(tok, [row["prompt"]])[0]
        c = tok(row["completion"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        assert ex["input_ids"] == p + c
        assert ex["labels"] == [-100] * len(p) + c
        assert ex["n_labels"] == len(c) == sum(t != -100 for t in ex["labels"])
        assert ex["input_ids"][-1] == tok.eos_token_id == 2
        assert p[0] == tok.bos_token_id and p[-1] == tok.convert_tokens_to_ids("<|assistant|>")
        assert tok.decode(ex["input_ids"]) == f"<|bos|><|user|>{row['prompt']}<|assistant|>{row['completion']}<|eos|>"


def test_sft_examples_truncates_prompt_from_the_left(tok):
    row = SFT_ROWS[0]
    p = D.encode_prompts(tok, [row["prompt"]])[0]
    c = D.encode_completions(tok, [row["completion"]])[0]
    assert len(p) > 3
    (ex,) = D.sft_examples(tok, [row], max_length=len(c) + 3)
    assert ex["input_ids"] == p[-3:] + c  # the prompt's END survives, the completion is whole
    assert ex["labels"] == [-100] * 3 + c
    # exactly one prompt token left: still kept
    (ex,) = D.sft_examples(tok, [row], max_length=len(c) + 1)
    assert ex["input_ids"] == p[-1:] + c
    # a full-length example is not cut at all
    (ex,) = D.sft_examples(tok, [row], max_length=len(p) + len(c))
    assert ex["input_ids"] == p + c


def test_sft_examples_drops_too_long_completion(tok):
    long_row = {"prompt": "Q", "completion": "1 2 3 4 5 6 7 8 9 " * 4}
    c_long = D.encode_completions(tok, [long_row["completion"]])[0]
    max_length = len(c_long)  # the completion alone fills the window: no prompt token left -> dropped
    exs = D.sft_examples(tok, [SFT_ROWS[0], long_row, SFT_ROWS[1]], max_length=max_length)
    assert len(exs) == 2
    assert all(len(e["input_ids"]) <= max_length for e in exs)
    assert [tok.decode([t for t in e["labels"] if t != -100]) for e in exs] == [
        SFT_ROWS[0]["completion"] + "<|eos|>", SFT_ROWS[1]["completion"] + "<|eos|>"]


# --------------------------------------------------------------------------------------------- prompts

PROMPTS = ["What is 1 + 2?", "  leading and trailing spaces  ", "", "line one\nline two", "<|user|> spoof",
           "ünïcödé ✓"]


@pytest.mark.parametrize("which", ["shipped", "no_template"])
def test_prompt_texts_fast_path_equals_per_row(which, tok, tok_no_template):
    t = tok if which == "shipped" else tok_no_template
    mixed = PROMPTS + [[{"role": "system", "content": "sys"}, {"role": "user", "content": "u"}]]
    assert D.prompt_texts(t, mixed) == [D.prompt_text(t, p) for p in mixed]
    assert D.prompt_texts(t, []) == []


def test_prompt_text_with_and_without_template(tok, tok_no_template):
    assert D.prompt_text(tok, "hi") == "<|bos|><|user|>hi<|assistant|>"
    assert D.prompt_text(tok_no_template, "hi") == "<|bos|>hi"
    assert D.prompt_text(tok_no_template, [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]) == \
        "<|bos|>a\nb"
    assert D.encode_prompts(tok_no_template, ["hi"])[0] == [tok.bos_token_id] + tok("hi", add_special_tokens=False)["input_ids"]


def test_prompt_texts_fast_path_with_a_transforming_template(tok_no_template):
    import copy

    t = copy.deepcopy(tok_no_template)
    t.chat_template = ("{% for m in messages %}<|user|>{{ m['content'] | trim }}{% endfor %}"
                       "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    prompts = ["no spaces", "  padded  "]
    assert D.prompt_texts(t, prompts) == [D.prompt_text(t, p) for p in prompts]


# --------------------------------------------------------------------------------------------- collate


def test_collate_sft_pads_right():
    exs = [
        {"input_ids": [1, 4, 10, 11, 2], "labels": [-100, -100, 10, 11, 2], "n_labels": 3},
        {"input_ids": [1, 12, 2], "labels": [-100, 12, 2], "n_labels": 2},
    ]
    b = D.collate_sft(exs, pad_id=0)
    assert b["input_ids"].tolist() == [[1, 4, 10, 11, 2], [1, 12, 2, 0, 0]]
    assert b["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]
    assert b["labels"].tolist() == [[-100, -100, 10, 11, 2], [-100, 12, 2, -100, -100]]
    assert all(v.dtype == torch.int64 for v in b.values())


def test_pad_left_and_right():
    assert D.pad([[1], [2, 3, 4]], 0) == [[1, 0, 0], [2, 3, 4]]
    assert D.pad([[1], [2, 3, 4]], 9, side="left") == [[9, 9, 1], [2, 3, 4]]


def test_load_rows_takes_the_first_format_the_renamed_columns_fit(tmp_path):
    """`align dpo --loss kto` reads ("unpaired", "preference"): renamed pair columns are pairs; labelled rows are
    unpaired; data that fits neither is refused naming what the first format lacks."""
    import json

    from align import data as D

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"question": "1+1?", "good": "2", "bad": "3"}) + "\n")
    rows = D.load_rows(pairs, ("unpaired", "preference"), "question=prompt,good=chosen,bad=rejected")
    assert rows == [{"prompt": "1+1?", "chosen": "2", "rejected": "3"}]
    unpaired = tmp_path / "unpaired.jsonl"
    unpaired.write_text(json.dumps({"prompt": "1+1?", "completion": "2", "label": True}) + "\n")
    assert D.load_rows(unpaired, ("unpaired", "preference"))[0]["label"] is True
    with pytest.raises(UserError, match="no 'prompt', 'completion', 'label' column for unpaired data"):
        D.load_rows(pairs, ("unpaired", "preference"))


def test_unpaired_rows_cut_the_prompt_from_the_left_to_fit(shipped_tokenizer):
    """KTO's rows: prompt + completion longer than max_length keep the prompt's END (the template's tail that leads
    into the completion) and the whole completion + EOS, as pairs and SFT examples do."""
    row = {"prompt": "word " * 40 + "What is 2+2?", "completion": "It is 4.", "label": True}
    p = D.encode_prompts(shipped_tokenizer, [row["prompt"]])[0]
    c = D.encode_completions(shipped_tokenizer, [row["completion"]])[0]
    (e,) = D.unpaired_examples(shipped_tokenizer, [row], max_length=len(c) + 10)
    assert e["completion_ids"] == c and e["prompt_ids"] == p[-10:] and len(p) > 10 and e["label"] is True


def test_normalized_reward_reads_an_artifacts_offset_and_scale_keys():
    """(raw − offset) / scale from a model config's keys, or from an artifact's reward_offset / reward_scale."""
    from align.reward_model import OFFSET_KEY, SCALE_KEY, normalized_reward

    x = torch.tensor([3.0, 5.0])
    assert normalized_reward(x, {OFFSET_KEY: 1.0, SCALE_KEY: 2.0}).tolist() == [1.0, 2.0]
    assert normalized_reward(x, {"reward_offset": 1.0, "reward_scale": 4.0}).tolist() == [0.5, 1.0]
    assert normalized_reward(x, {}).tolist() == [3.0, 5.0]
