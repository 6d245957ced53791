"""Regenerate the shipped data and tokenizer.

    python scripts/make_data.py            # writes data/{arithmetic,sort,prefs,text}/{train,test}.jsonl,
                                           # data/digit_sort/ and data/tokenizer/, then checks them

Data (fixed seeds, train and test prompts disjoint; arithmetic test prompts never appear in any
train file and prefs test prompts never appear in arithmetic train):
    arithmetic 20000 / 500 (levels 1-4 in equal shares), sort 5000 / 200,
    prefs 50000 / 300 (arithmetic pairs), text 3000 / 200;
    digit_sort (the default pipeline's task): train 20000 / test 500 demonstrations, prefs 5000 / prefs_test 300
    pairs, no test prompt in any training file. The tokenizer never sees digit_sort (it predates the task).

Tokenizer: byte-level BPE with 512 tokens (6 specials + 256 bytes + merges), digits always split
into single tokens, trained on all train text (of prefs, the first 4,000 pairs). Specials, ids 0..5:
    <|pad|> <|bos|> <|eos|> <|system|> <|user|> <|assistant|>
Chat template: bos, then <|system|>text / <|user|>text / <|assistant|>text<|eos|> per message,
and a trailing <|assistant|> when add_generation_prompt=True.
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402
from transformers import AutoTokenizer, PreTrainedTokenizerFast  # noqa: E402

from align.tasks import make_dataset, row_key, write_jsonl  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
DATA = os.path.join(ROOT, "data")
SPECIALS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>"]
VOCAB_SIZE = 512
TOKENIZER_PREF_ROWS = 4000
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}<|system|>{{ message['content'] }}"
    "{% elif message['role'] == 'user' %}<|user|>{{ message['content'] }}"
    "{% elif message['role'] == 'assistant' %}<|assistant|>{% generation %}{{ message['content'] }}{{ eos_token }}{% endgeneration %}"
    "{% else %}{{ raise_exception('unknown role ' + message['role'] + '; use system, user or assistant') }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_data():
    """All splits as {task: (train, test)}, with test prompts kept out of every train file."""
    arith_test = make_dataset("arithmetic", 500, seed=1001)
    prefs_test = make_dataset("prefs", 300, seed=3001, exclude={row_key(r) for r in arith_test})
    held_out = {row_key(r) for r in arith_test + prefs_test}
    arith_train = make_dataset("arithmetic", 20000, seed=1000, exclude=held_out)
    prefs_train = make_dataset("prefs", 50000, seed=3000, exclude=held_out)
    sort_test = make_dataset("sort", 200, seed=2001)
    sort_train = make_dataset("sort", 5000, seed=2000, exclude={row_key(r) for r in sort_test})
    text_test = make_dataset("text", 200, seed=4001)
    text_train = make_dataset("text", 3000, seed=4000, exclude={row_key(r) for r in text_test})
    return {"arithmetic": (arith_train, arith_test), "sort": (sort_train, sort_test),
            "prefs": (prefs_train, prefs_test), "text": (text_train, text_test)}


def build_digit_sort():
    """The default pipeline's files: {name: rows} for data/digit_sort/NAME.jsonl."""
    test = make_dataset("digit_sort", 500, seed=5001)
    prefs_test = make_dataset("digit_sort_prefs", 300, seed=6001, exclude={row_key(r) for r in test})
    held_out = {row_key(r) for r in test + prefs_test}
    return {"train": make_dataset("digit_sort", 20000, seed=5000, exclude=held_out), "test": test,
            "prefs": make_dataset("digit_sort_prefs", 5000, seed=6000, exclude=held_out), "prefs_test": prefs_test}


def row_texts(row):
    """Every string field of a row that the tokenizer should see."""
    return [row[k] for k in ("prompt", "completion", "chosen", "rejected", "text") if k in row]


def train_tokenizer(texts):
    """Byte-level BPE with single-digit tokens, wrapped as a transformers fast tokenizer."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>",
        model_max_length=512, chat_template=CHAT_TEMPLATE,
    )


def check_tokenizer(path, samples):
    """Reload offline and check ids, digit splitting, round trips and the chat template."""
    tok = AutoTokenizer.from_pretrained(path)
    assert len(tok) == VOCAB_SIZE, len(tok)
    assert [tok.convert_tokens_to_ids(s) for s in SPECIALS] == list(range(6))
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    for d in "0123456789":
        assert len(tok.encode(d, add_special_tokens=False)) == 1, d
    for text in ["12345", "Tom has 23 apples.", "23 + 45 - 12 = 56. #### 56", "x=1,234.5"]:
        pieces = [tok.decode([i]) for i in tok.encode(text, add_special_tokens=False)]
        digits = [p for p in pieces if any(c.isdigit() for c in p)]
        assert all(len(p) == 1 for p in digits), (text, pieces)
    for text in samples:
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text, text
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "1 2"}]
    rendered = tok.apply_chat_template(chat, tokenize=False)
    assert rendered == "<|bos|><|user|>Hi<|assistant|>1 2<|eos|>", rendered
    prompt = tok.apply_chat_template(chat[:1], tokenize=False, add_generation_prompt=True)
    assert prompt == "<|bos|><|user|>Hi<|assistant|>", prompt
    return tok


def main():
    splits = build_data()
    for task, (train, test) in splits.items():
        write_jsonl(train, os.path.join(DATA, task, "train.jsonl"))
        write_jsonl(test, os.path.join(DATA, task, "test.jsonl"))
        print(f"{task}: {len(train)} train, {len(test)} test")
    for name, rows in build_digit_sort().items():
        write_jsonl(rows, os.path.join(DATA, "digit_sort", f"{name}.jsonl"))
        print(f"digit_sort {name}: {len(rows)} rows")
    # The tokenizer sees the first 4,000 preference pairs only: it was trained when prefs had 4,000 rows, and
    # growing the pair set must not change token ids (trained models would no longer match).
    texts = [t for task, (train, _) in splits.items() for row in (train[:TOKENIZER_PREF_ROWS] if task == "prefs" else train)
             for t in row_texts(row)]
    path = os.path.join(DATA, "tokenizer")
    train_tokenizer(texts).save_pretrained(path)
    samples = [t for _, test in splits.values() for row in test[:20] for t in row_texts(row)]
    tok = check_tokenizer(path, samples)
    arith = splits["arithmetic"][1]
    for field in ("prompt", "completion"):
        mean = sum(len(tok.encode(r[field], add_special_tokens=False)) for r in arith) / len(arith)
        print(f"arithmetic test {field}: {mean:.1f} tokens on average")
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(DATA) for f in fs)
    print(f"tokenizer: {len(tok)} tokens; data/ total {size / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
