"""TRL's dataset formats read as they are (align.data, align.chat): conversational and standard, explicit and
implicit prompts, unpaired preference, prompt-completion with a conversational completion, language modelling;
--assistant-only-loss's mask; empty SFT completions refused; DIR:SPLIT / Hub NAME:SPLIT; --eval-split; the
held-out defaults that follow --data; `align data show`. Unit tests on the shipped tiny tokenizer (its chat template
has {% generation %} markers); the end-to-end runs are in tests/test_trl_formats_train.py."""

import json

import pytest

from align import data as D
from align.chat import GENERATION, conversation_tokens, prefix_tokens
from align.errors import UserError
from align.paths import DATA_DIR
from tests.conftest import assert_user_error, run_align

SKY = [{"role": "user", "content": "What color is the sky?"}]
BLUE, GREEN = [{"role": "assistant", "content": "It is blue."}], [{"role": "assistant", "content": "It is green."}]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3 + 3?"},
        {"role": "assistant", "content": "6"}]


@pytest.fixture(scope="module")
def tok(shipped_tokenizer):
    return shipped_tokenizer


@pytest.fixture
def tok_markerless():
    """The shipped tokenizer with its template's {% generation %} markers taken out (the prefix-rendering path)."""
    from align.models import load_tokenizer, resolve

    t = load_tokenizer(resolve("tiny"))
    t.chat_template = GENERATION.sub("", t.chat_template).replace("{% endgeneration %}", "")
    return t


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def decode_labelled(tok, labels) -> list[str]:
    """The runs of labelled tokens, decoded."""
    runs, cur = [], []
    for t in labels + [D.IGNORE]:
        if t != D.IGNORE:
            cur.append(t)
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    return runs


# ------------------------------------------------------------------------------------ conversational completions


def test_a_conversational_completion_is_the_templates_assistant_turn(tmp_path, tok):
    """prompt-completion with a conversational completion: the prompt is the template up to the generation prompt,
    the completion exactly the rest of the whole conversation's rendering (its EOS the template's, once)."""
    rows = D.load_rows(write_jsonl(tmp_path / "pc.jsonl", [{"prompt": SKY, "completion": BLUE}]), "sft")
    (ex,) = D.sft_examples(tok, rows, 128)
    assert tok.decode(ex["input_ids"]) == tok.apply_chat_template(SKY + BLUE, tokenize=False)
    assert decode_labelled(tok, ex["labels"]) == ["It is blue.<|eos|>"]
    assert ex["input_ids"].count(tok.eos_token_id) == 1 and ex["n_labels"] == len(tok("It is blue.")["input_ids"]) + 1
    # the string completion of the same row: the same tokens (the template renders content + EOS)
    (same,) = D.sft_examples(tok, [{"prompt": SKY, "completion": "It is blue."}], 128)
    assert same == ex


def test_a_template_without_eos_in_the_assistant_turn_gets_one_appended(tok_markerless):
    t = tok_markerless
    t.chat_template = t.chat_template.replace("{{ eos_token }}", "<|user|>")  # a turn that ends otherwise
    (ids,) = D.encode_completions(t, [BLUE], [SKY])
    assert t.decode(ids) == "It is blue.<|user|><|eos|>"


def test_conversational_preference_explicit_and_implicit_prompt(tmp_path, tok):
    """{prompt, chosen, rejected} with message lists, and {chosen, rejected} as whole conversations sharing their
    prompt turns: the same pair."""
    explicit = D.load_rows(write_jsonl(tmp_path / "e.jsonl", [{"prompt": SKY, "chosen": BLUE, "rejected": GREEN}]),
                           "preference")
    implicit = D.load_rows(write_jsonl(tmp_path / "i.jsonl", [{"chosen": SKY + BLUE, "rejected": SKY + GREEN,
                                                               "margin": 1.5}]), "preference")
    assert implicit == [{"prompt": SKY, "chosen": BLUE, "rejected": GREEN, "margin": 1.5}]
    (a,), _ = D.preference_examples(tok, explicit, 128)
    (b,), _ = D.preference_examples(tok, implicit, 128)
    assert a == {**b, "margin": 0.0} and b["margin"] == 1.5
    assert tok.decode(a["prompt_ids"]) == "<|bos|><|user|>What color is the sky?<|assistant|>"
    assert (tok.decode(a["chosen_ids"]), tok.decode(a["rejected_ids"])) == ("It is blue.<|eos|>", "It is green.<|eos|>")


def test_standard_implicit_prompt_is_the_common_start_up_to_its_last_whitespace(tmp_path):
    assert D.implicit_prompt("The sky is blue.", "The sky is green.") == ("The sky is", " blue.", " green.")
    assert D.implicit_prompt("The answer is 42", "The answer is 43") == ("The answer is", " 42", " 43")
    assert D.implicit_prompt("x=42", "x=43") == ("x=4", "2", "3")  # no whitespace: the common start
    assert D.implicit_prompt("same", "same") == ("same", "", "")  # dropped later as empty
    rows = D.load_rows(write_jsonl(tmp_path / "s.jsonl", [{"chosen": "The sky is blue.", "rejected": "The sky is "
                                                           "green."}]), "preference")
    assert rows == [{"prompt": "The sky is", "chosen": " blue.", "rejected": " green."}]


def test_unpaired_conversational_rows(tmp_path, tok):
    rows = D.load_rows(write_jsonl(tmp_path / "u.jsonl", [{"prompt": SKY, "completion": BLUE, "label": True},
                                                          {"prompt": SKY, "completion": GREEN, "label": False}]),
                       ("unpaired", "preference"))
    good, bad = D.unpaired_examples(tok, rows, 128)
    assert (good["label"], bad["label"]) == (True, False)
    assert tok.decode(good["completion_ids"]) == "It is blue.<|eos|>" and good["prompt_ids"] == bad["prompt_ids"]


def test_language_modelling_text_has_loss_on_every_token_and_is_cut_on_the_right(tmp_path, tok):
    rows = D.load_rows(write_jsonl(tmp_path / "t.jsonl", [{"text": "The sky is blue."}]), "sft")
    (ex,) = D.sft_examples(tok, rows, 128)
    body = tok("The sky is blue.", add_special_tokens=False)["input_ids"]
    assert ex["input_ids"] == [tok.bos_token_id, *body, tok.eos_token_id]
    assert ex["labels"] == [D.IGNORE, *body, tok.eos_token_id] and ex["n_labels"] == len(body) + 1
    (cut,) = D.sft_examples(tok, rows, 4)
    assert cut["input_ids"] == [tok.bos_token_id, *body[:3]] and cut["n_labels"] == 3


def test_mixed_string_and_conversational_completions_keep_the_rows_order(tok):
    rows = [{"prompt": "a", "completion": "b"}, {"prompt": SKY, "completion": BLUE}, {"prompt": "c", "completion": "d"}]
    exs = D.sft_examples(tok, rows, 128)
    assert [decode_labelled(tok, e["labels"]) for e in exs] == [["b<|eos|>"], ["It is blue.<|eos|>"], ["d<|eos|>"]]


# ------------------------------------------------------------------------------------------- assistant-only loss


def test_assistant_only_loss_trains_every_assistant_turn_and_nothing_else(tok, tok_markerless):
    """A multi-turn conversation: exactly each assistant turn's content and its end-of-turn token carry loss,
    nothing of the system and user turns, nor padding; the template's {% generation %} markers and the prefix
    rendering find the same tokens. Without the flag only the last turn carries loss."""
    (ex,) = D.sft_examples(tok, [{"messages": CHAT}], 128, assistant_only=True)
    assert tok.decode(ex["input_ids"]) == tok.apply_chat_template(CHAT, tokenize=False)
    assert decode_labelled(tok, ex["labels"]) == ["4<|eos|>", "6<|eos|>"]
    lab = [i for i, t in enumerate(ex["labels"]) if t != D.IGNORE]
    four = len(tok.apply_chat_template(CHAT[:3], tokenize=True, add_generation_prompt=False)["input_ids"])
    assert lab == [four - 2, four - 1, len(ex["input_ids"]) - 2, len(ex["input_ids"]) - 1]
    assert ex["n_labels"] == 4
    assert conversation_tokens(tok_markerless, CHAT) == prefix_tokens(tok, CHAT) == (ex["input_ids"], ex["labels"])
    batch = D.collate_sft([ex, D.sft_examples(tok, [{"messages": CHAT[:3]}], 128, assistant_only=True)[0]],
                          tok.pad_token_id)
    assert decode_labelled(tok, batch["labels"][1].tolist()) == ["4<|eos|>"]  # its padding carries no loss
    (last,) = D.sft_examples(tok, [{"messages": CHAT}], 128)
    assert decode_labelled(tok, last["labels"]) == ["6<|eos|>"] and last["input_ids"] == ex["input_ids"]


def test_assistant_only_loss_cuts_from_the_left_and_drops_a_last_turn_that_does_not_fit(tok):
    (full,) = D.sft_examples(tok, [{"messages": CHAT}], 128, assistant_only=True)
    (cut,) = D.sft_examples(tok, [{"messages": CHAT}], 12, assistant_only=True)
    assert cut["input_ids"] == full["input_ids"][-12:] and cut["labels"][0] == D.IGNORE
    assert decode_labelled(tok, cut["labels"]) == ["6<|eos|>"]
    assert D.sft_examples(tok, [{"messages": CHAT}], 2, assistant_only=True) == []


def test_assistant_only_loss_needs_a_chat_template(tok_markerless):
    tok_markerless.chat_template = None
    with pytest.raises(UserError, match="--assistant-only-loss .* chat template"):
        D.sft_examples(tok_markerless, [{"messages": CHAT}], 64, assistant_only=True)


def test_the_sft_stage_trains_every_assistant_turn_and_holds_out_its_split(tmp_path, tiny_model_dir, single_process):
    """`align sft --assistant-only-loss --eval-split 0.25` on 8 conversations, the stage built in this process:
    auto's held-out set is the split (2 rows, none of them trained on), and every training and held-out example
    carries loss on both of its assistant turns."""
    from stages.sft import SFT, SFTConfig
    from tests.conftest import stage_in_process

    convs = [[*CHAT[:2], {"role": "assistant", "content": f"{i}"}, CHAT[3], {"role": "assistant", "content": f"{i}!"}]
             for i in range(8)]
    data = write_jsonl(tmp_path / "chats.jsonl", [{"messages": c} for c in convs])
    cfg = SFTConfig(model=str(tiny_model_dir), out=str(tmp_path / "o"), data=str(data), assistant_only_loss=True,
                    eval_split=0.25, batch_size=2, zero_stage=0, max_steps=1, eval_samples=0)
    with stage_in_process(cfg, "sft", SFT) as algo:
        assert (algo.cfg.eval_data, len(algo.examples), len(algo.eval_examples)) == ("", 6, 2)
        answers = [decode_labelled(algo.tok, e["labels"]) for e in algo.examples + algo.eval_examples]
    assert sorted(answers) == sorted([[f"{i}<|eos|>", f"{i}!<|eos|>"] for i in range(8)])  # each row once, split apart
    _, held = D.split_off([{"messages": c} for c in convs], 0.25)
    assert answers[6:] == [[f"{m['messages'][2]['content']}<|eos|>", f"{m['messages'][4]['content']}<|eos|>"]
                           for m in held]


# ------------------------------------------------------------------------------------------- refused rows


@pytest.mark.parametrize("good, row, what", [
    ({"prompt": "q", "completion": "ok"}, {"prompt": "q", "completion": "  "}, "empty completion"),
    ({"prompt": SKY, "completion": BLUE}, {"prompt": SKY, "completion": [{"role": "assistant", "content": ""}]},
     "empty completion"),
    ({"messages": SKY + BLUE}, {"messages": SKY + [{"role": "assistant", "content": " \n"}]},
     "empty last assistant message"),
    ({"text": "ok"}, {"text": ""}, "empty text"),
], ids=["string", "conversational", "messages", "text"])
def test_an_empty_sft_completion_is_refused_naming_the_row(tmp_path, good, row, what):
    p = write_jsonl(tmp_path / "d.jsonl", [good, row])
    with pytest.raises(UserError, match=f"^{p}: row 2: {what}; training on it teaches the model to answer "
                                        "nothing: fill it in or remove the row.$"):
        D.load_rows(p, "sft")


def test_a_wrong_column_type_names_the_row_and_the_fix_in_full(tmp_path):
    p = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "q", "chosen": [1, 2, 3] * 20, "rejected": "b"}])
    with pytest.raises(UserError) as e:
        D.load_rows(p, "preference")
    msg = str(e.value)
    assert msg.startswith(f"{p}: row 1: column 'chosen' must be a string or a list of {{role, content}} messages")
    assert "...; fix the row, or map another column with --columns old=chosen." in msg


@pytest.mark.parametrize("row, needle", [
    ({"prompt": SKY, "chosen": SKY + BLUE, "rejected": GREEN}, "must start and end with an assistant message"),
    ({"prompt": "q", "chosen": BLUE, "rejected": "b"}, "both be strings or both message lists"),
    ({"chosen": SKY + BLUE, "rejected": [{"role": "user", "content": "Other?"}] + GREEN},
     "share 0 leading message(s)"),
])
def test_conversational_preference_rows_that_do_not_fit_are_refused(tmp_path, row, needle):
    with pytest.raises(UserError, match="row 1: .*" + needle.replace("(", r"\(").replace(")", r"\)")):
        D.load_rows(write_jsonl(tmp_path / "d.jsonl", [row]), "preference")


def test_a_missing_column_lists_every_layout_of_the_format(tmp_path):
    with pytest.raises(UserError, match=r"no 'prompt', 'completion' column for sft data \(columns: question\); it "
                                        r"reads \{prompt, completion\} or \{messages\} or \{text\}"):
        D.load_rows(write_jsonl(tmp_path / "d.jsonl", [{"question": "q"}]), "sft")


# ------------------------------------------------------------------------------------------- splits, Hub, --eval-split


def test_split_spec_takes_a_trailing_split_name_only():
    from align.paths import split_spec

    assert split_spec("dd:test") == ("dd", "test") and split_spec("org/name:train[:10%]") == ("org/name", "train[:10%]")
    assert split_spec("train.jsonl") == ("train.jsonl", "") and split_spec("dir:") == ("dir:", "")
    assert split_spec("C:\\data\\train.jsonl") == ("C:\\data\\train.jsonl", "")  # a Windows drive is no split
    assert split_spec("C:\\data\\dd:test") == ("C:\\data\\dd", "test") and split_spec("a:b:c") == ("a:b", "c")


def test_a_dataset_dict_split_is_named_after_a_colon(tmp_path):
    import datasets

    dd = tmp_path / "dd"
    datasets.DatasetDict({"train": datasets.Dataset.from_list([{"text": "a"}]),
                          "test": datasets.Dataset.from_list([{"text": "b"}, {"text": "c"}])}).save_to_disk(str(dd))
    assert D.read_rows(dd) == [{"text": "a"}] and D.read_rows(f"{dd}:train") == [{"text": "a"}]
    assert D.read_rows(f"{dd}:test") == [{"text": "b"}, {"text": "c"}]
    with pytest.raises(UserError, match=rf"^{dd}: DatasetDict without a 'valid' split \(splits: train, test\)"):
        D.read_rows(f"{dd}:valid")
    with pytest.raises(UserError, match="is a file, which has no splits; drop ':test'"):
        D.read_rows(f"{write_jsonl(tmp_path / 'f.jsonl', [{'text': 'x'}])}:test")
    odd = tmp_path / "dd:test"  # a folder whose name holds a ':' wins over the split it seems to name
    datasets.DatasetDict({"train": datasets.Dataset.from_list([{"text": "colon"}])}).save_to_disk(str(odd))
    assert D.read_rows(odd) == [{"text": "colon"}]


def test_a_folder_of_data_files_loads_its_splits(tmp_path, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    folder = tmp_path / "folder"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", [{"text": "a"}])
    write_jsonl(folder / "test.jsonl", [{"text": "b"}])
    assert D.read_rows(folder) == [{"text": "a"}] and D.read_rows(f"{folder}:test") == [{"text": "b"}]
    with pytest.raises(UserError, match=rf"^{folder}: no split 'valid' \(.*\); name one as {folder}:SPLIT"):
        D.read_rows(f"{folder}:valid")


def test_an_unreachable_hub_dataset_is_one_line_exit_2():
    """Offline: `align data show NAME` fails at once with one line naming the dataset."""
    proc = run_align("data", "show", "nobody/no-such-dataset:test", env={"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
    assert_user_error(proc, "nobody/no-such-dataset: no such file or folder, and not a Hugging Face Hub dataset")


def test_a_hub_dataset_in_the_local_datasets_cache_loads_offline(tmp_path, monkeypatch):
    """Offline, a Hub dataset NAME:SPLIT that the local datasets cache holds loads from it (here a cache entry
    made from a local folder and filed under the Hub name someone/tiny_chats)."""
    import shutil

    import datasets

    cache = tmp_path / "cache"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    folder = tmp_path / "tiny_chats"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", [{"text": "train row"}])
    write_jsonl(folder / "test.jsonl", [{"text": "test row"}])
    datasets.load_dataset(str(folder), split="train")
    (built,) = [p for p in (cache / "tiny_chats").glob("default/*/*") if p.is_dir()]
    entry = cache / "someone___tiny_chats" / "default" / built.parent.name / built.name
    shutil.copytree(built, entry)
    proc = run_align("data", "show", "someone/tiny_chats:test", "--plain",
                     env={"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_DATASETS_CACHE": str(cache)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert '  loss        7  "test row<|eos|>"' in proc.stdout.splitlines(), proc.stdout


def test_split_off_is_deterministic_disjoint_and_keeps_the_order():
    rows = [{"i": i} for i in range(40)]
    train, held = D.split_off(rows, 0.1, "d")
    assert len(held) == 4 and len(train) == 36 and sorted(train + held, key=lambda r: r["i"]) == rows
    assert train == sorted(train, key=lambda r: r["i"]) and held == sorted(held, key=lambda r: r["i"])
    assert D.split_off(list(rows), 0.1, "d") == (train, held)  # the same rows every time (no global RNG)
    assert D.split_off(rows, 0.0) == (rows, []) and len(D.split_off(rows[:3], 0.01)[1]) == 1
    with pytest.raises(UserError, match="needs at least 2 rows"):
        D.split_off(rows[:1], 0.5, "d")


# ------------------------------------------------------------------------------------------- held-out defaults


def test_held_out_defaults_follow_the_data(tmp_path):
    """auto: the shipped test file beside the shipped training data (the default run unchanged); with the user's
    --data none, or --eval-split's part of it; an explicit file is kept; the artifact's config is concrete."""
    from align.config import build
    from stages.dpo import DPOConfig
    from stages.grpo import GRPOConfig
    from stages.ppo import PPOConfig
    from stages.rm import RMConfig
    from stages.sft import SFTConfig

    arith_test, prefs_test = str(DATA_DIR / "arithmetic/test.jsonl"), str(DATA_DIR / "prefs/test.jsonl")
    built = lambda cls, toml, explicit: build(cls, toml, explicit).resolved()  # noqa: E731 (as the run resolves it)
    mine = str(write_jsonl(tmp_path / "mine.jsonl", [{"prompt": "p", "completion": "c"}]))
    assert built(SFTConfig, None, {}).eval_data == arith_test
    assert built(SFTConfig, None, {"data": str(DATA_DIR / "arithmetic/train.jsonl")}).eval_data == arith_test
    assert built(SFTConfig, None, {"data": mine}).eval_data == ""
    assert built(SFTConfig, None, {"data": mine, "eval_data": mine}).eval_data == mine
    split = built(SFTConfig, None, {"data": mine, "eval_split": 0.05})
    assert (split.eval_data, split.eval_split) == ("", 0.05)
    assert built(SFTConfig, None, {"eval_split": 0.05}).eval_data == ""  # the shipped data's split instead
    for cls in (GRPOConfig, PPOConfig):
        assert built(cls, None, {}).eval_data == arith_test and built(cls, None, {"data": mine}).eval_data == ""
    assert built(RMConfig, None, {}).eval_data == prefs_test and built(RMConfig, None, {"data": mine}).eval_data == ""
    dpo = built(DPOConfig, None, {})
    assert (dpo.eval_data, dpo.pass_data) == (prefs_test, arith_test)
    dpo = built(DPOConfig, None, {"data": mine, "eval_split": 0.1})
    assert (dpo.eval_data, dpo.pass_data) == ("", "")
    assert dpo.held_out_note() == ("held-out: 10% of --data (--eval-split 0.1), removed from training; pass@1: none "
                                   "(--data is yours: --pass-data FILE to measure it)")
    assert built(SFTConfig, None, {"data": mine}).held_out_note() == \
        "held-out: none (--data is yours: --eval-split 0.05 holds out 5% of it)"
    assert built(SFTConfig, None, {}).held_out_note() == \
        f"held-out: {arith_test} (the shipped task's: --data is its training data)"
    with pytest.raises(UserError, match=f"--eval-split holds out part of --data .* --eval-data {mine}: give one"):
        build(SFTConfig, None, {"data": mine, "eval_data": mine, "eval_split": 0.1})
    with pytest.raises(UserError, match="--online reads prompts"):
        build(DPOConfig, None, {"online": True, "eval_split": 0.1})
    assert SFTConfig().eval_data == "auto" and SFTConfig(data=mine).resolved().eval_data == ""


def test_a_pipeline_leaves_auto_and_data_splits_as_written(tmp_path):
    """In a pipeline, a held-out option left at auto stays auto until its stage resolves it (never a path under
    the pipeline's folder), a DIR:SPLIT is read relative to the pipeline's folder, and a Hub dataset NAME is no
    path."""
    import datasets

    from align import pipeline as P

    datasets.DatasetDict({"train": datasets.Dataset.from_list([{"prompt": "p", "completion": "c"}])}).save_to_disk(
        str(tmp_path / "dd"))
    (tmp_path / "p.toml").write_text('[pipeline]\nout = "runs"\n[stages.sft]\nmodel = "tiny"\ndata = "dd:train"\n'
                                     '[stages.sft2]\nstage = "sft"\nmodel = "tiny"\ndata = "someone/chats:test"\n'
                                     'eval_data = "auto"\n')
    p = P.load(tmp_path / "p.toml")
    sft, sft2 = (P.resolve(p, s) for s in p.stages)
    assert sft["data"] == f"{tmp_path}/dd:train" and sft["eval_data"] == "auto"
    assert sft2["data"] == "someone/chats:test" and sft2["eval_data"] == "auto"
    assert P.fingerprint(p, p.stages[0]) != P.fingerprint(p, p.stages[1])


# ------------------------------------------------------------------------------------------- align data show


def test_data_show_marks_the_loss_spans(tmp_path):
    chats = write_jsonl(tmp_path / "chats.jsonl", [{"messages": CHAT}])
    proc = run_align("data", "show", chats, "--assistant-only-loss", "--plain")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.splitlines()[1:] == [
        "row 1: 36 tokens, 4 with loss",
        '  no loss    22  "<|bos|><|system|>Be brief.<|user|>What is 2 + 2?<|assistant|>"',
        '  loss        2  "4<|eos|>"',
        '  no loss    10  "<|user|>And 3 + 3?<|assistant|>"',
        '  loss        2  "6<|eos|>"']
    pairs = write_jsonl(tmp_path / "pairs.jsonl", [{"chosen": SKY + BLUE, "rejected": SKY + GREEN},
                                                   {"chosen": SKY + BLUE, "rejected": SKY + BLUE}])
    proc = run_align("data", "show", pairs)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout.splitlines()
    assert out[0] == f"{pairs}: preference data, tokenised for tiny" and out[1].startswith("row 1 chosen: ")
    assert out[1:4] == ["row 1 chosen: 24 tokens, 9 with loss",
                        '  no loss    15  "<|bos|><|user|>What color is the sky?<|assistant|>"',
                        '  loss        9  "It is blue.<|eos|>"']
    assert out[4] == "row 1 rejected: 23 tokens, 8 with loss" and out[6] == '  loss        8  "It is green.<|eos|>"'
    assert out[-1].startswith("row 2: the stage drops it: no usable preference pair (every pair has an empty prompt")
