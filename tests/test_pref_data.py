"""Preference pairs: tokenisation, the truncation policy, drop reasons, batch collation."""

from __future__ import annotations

import pytest

from align import data as D
from align.errors import UserError


def test_pairs_tokenised_with_template_and_eos(shipped_tokenizer):
    tok = shipped_tokenizer
    rows = [{"prompt": "What is 2 + 3?", "chosen": "2 + 3 = 5. #### 5", "rejected": "2 + 3 = 6. #### 6", "margin": 1.5}]
    (ex,), rep = D.preference_examples(tok, rows, 256)
    assert ex["prompt_ids"] == D.encode_prompts(tok, [rows[0]["prompt"]])[0]
    assert ex["chosen_ids"][-1] == ex["rejected_ids"][-1] == tok.eos_token_id
    assert ex["margin"] == 1.5 and rep["kept"] == 1 and rep["prompt_truncated"] == 0


def test_truncation_cuts_prompt_from_left_never_response(shipped_tokenizer):
    tok = shipped_tokenizer
    row = {"prompt": "x " * 40 + "What is 2 + 3?", "chosen": "2 + 3 = 5. #### 5", "rejected": "2 + 3 = 15. #### 15"}
    (full,), _ = D.preference_examples(tok, [row], 1000)
    longer = max(len(full["chosen_ids"]), len(full["rejected_ids"]))
    limit = longer + 5
    (ex,), rep = D.preference_examples(tok, [row], limit)
    assert ex["chosen_ids"] == full["chosen_ids"] and ex["rejected_ids"] == full["rejected_ids"]  # never cut
    assert ex["prompt_ids"] == full["prompt_ids"][-5:]  # the prompt keeps its END
    assert len(ex["prompt_ids"]) + longer == limit and rep["prompt_truncated"] == 1
    with pytest.raises(UserError, match="all pairs too long"):
        D.preference_examples(tok, [row], longer, source="pairs.jsonl")  # no room for a prompt token


def test_drop_reasons_are_counted(shipped_tokenizer):
    ok = {"prompt": "p", "chosen": "a", "rejected": "b"}
    rows = [ok, {**ok, "rejected": "a"}, {**ok, "chosen": " "}, {**ok, "prompt": ""}, {**ok, "chosen": "1 " * 300}]
    ex, rep = D.preference_examples(shipped_tokenizer, rows, 64)
    assert len(ex) == 1
    assert rep == {"pairs": 5, "kept": 1, "prompt_truncated": 0, "dropped_empty": 2, "dropped_identical": 1,
                   "dropped_too_long": 1}
    assert "1/5 pairs kept" in D.pair_report_text(rep)


def test_identical_only_fails_naming_the_file(shipped_tokenizer):
    with pytest.raises(UserError, match=r"pairs\.jsonl: .*chosen == rejected"):
        D.preference_examples(shipped_tokenizer, [{"prompt": "p", "chosen": "a", "rejected": "a"}] * 3, 64,
                              source="pairs.jsonl")


def test_collate_pairs_puts_chosen_then_rejected(shipped_tokenizer):
    tok = shipped_tokenizer
    rows = [{"prompt": "p1", "chosen": "1", "rejected": "22"}, {"prompt": "p2 longer", "chosen": "333", "rejected": "4"}]
    ex, _ = D.preference_examples(tok, rows, 64)
    b = D.collate_pairs(ex, tok.pad_token_id)
    assert b["input_ids"].shape[0] == 4 and b["margin"].tolist() == [0.0, 0.0]
    for i, (e, key) in enumerate([(ex[0], "chosen_ids"), (ex[1], "chosen_ids"), (ex[0], "rejected_ids"), (ex[1], "rejected_ids")]):
        n = len(e["prompt_ids"]) + len(e[key])
        assert b["input_ids"][i, :n].tolist() == e["prompt_ids"] + e[key]
        assert b["attention_mask"][i].sum() == n
        assert [x for x in b["labels"][i].tolist() if x != -100] == e[key]
