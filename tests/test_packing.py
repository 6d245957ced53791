"""Packing: examples concatenated in one row must not see each other (block-diagonal causal attention)."""

import torch

from align import data as D
from align.objectives.tokens import completion_nll, token_logprobs
from align.models import load_causal_lm, load_tokenizer, resolve


def test_pack_examples_fills_rows_and_restarts_positions():
    ex = [{"input_ids": [1] * n, "labels": [-100] * (n - 2) + [5, 6], "n_labels": 2} for n in (5, 3, 4, 2, 6)]
    rows = D.pack_examples(ex, max_length=10)
    assert sorted(len(r["input_ids"]) for r in rows) == [10, 10]  # 6+4 and 5+3+2, first-fit decreasing
    for r in rows:
        assert len(r["position_ids"]) == len(r["input_ids"]) == len(r["labels"])
        assert r["position_ids"][0] == 0
    assert sum(r["n_labels"] for r in rows) == 10
    batch = D.collate_sft(rows, pad_id=0)
    assert "attention_mask" not in batch and batch["position_ids"].shape == batch["input_ids"].shape


def test_packed_row_gives_the_same_logprobs_and_loss_as_separate_examples():
    tok = load_tokenizer(resolve("tiny"))
    torch.manual_seed(0)
    model = load_causal_lm(resolve("tiny"), tok, torch.float32).eval()
    rows = [{"prompt": "Tom has 3 apples. He buys 4 more. How many?", "completion": "3 + 4 = 7. #### 7"},
            {"prompt": "Sort in ascending order: 5 2 9", "completion": "2 5 9"},
            {"prompt": "Ann has 12 pens.", "completion": "12 - 2 = 10. #### 10"}]
    ex = D.sft_examples(tok, rows, max_length=256)
    (packed,) = D.pack_examples(ex, max_length=256)
    with torch.no_grad():
        b = D.collate_sft([packed], tok.pad_token_id)
        logits = model(**D.model_inputs(b)).logits
        lp_packed = token_logprobs(logits[:, :-1], b["input_ids"][:, 1:])[0]
        nll_packed, n_packed = completion_nll(logits, b["labels"])
        nll_sep, n_sep, offset = 0.0, 0, 0
        for e in sorted(ex, key=lambda e: -len(e["input_ids"])):  # packing order
            s = D.collate_sft([e], tok.pad_token_id)
            lg = model(**D.model_inputs(s)).logits
            lp = token_logprobs(lg[:, :-1], s["input_ids"][:, 1:])[0]
            n = len(e["input_ids"])
            # within each example, every prediction must match the packed row's
            torch.testing.assert_close(lp_packed[offset : offset + n - 1], lp, atol=1e-5, rtol=1e-5)
            nll, cnt = completion_nll(lg, s["labels"])
            nll_sep, n_sep, offset = nll_sep + nll, n_sep + cnt, offset + n
    assert int(n_packed) == int(n_sep)
    torch.testing.assert_close(nll_packed, nll_sep, atol=1e-4, rtol=1e-5)
