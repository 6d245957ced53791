"""Datasets: JSONL / JSON / Parquet files or `save_to_disk` directories (the last two through `datasets`).

Formats (column names after `--columns old=new` mapping):
  sft          {prompt, completion} or {messages: [{role, content}, ...]} (last assistant turn is the completion)
  preference   {prompt, chosen, rejected}
  prompts      {prompt}
  verifiable   {prompt, answer}
  text         {text}
  responses    {prompt, response}            (rm score)
"""

from __future__ import annotations

import json
from pathlib import Path

from align.console import info
from align.errors import UserError

FORMATS = {
    "sft": ("prompt", "completion"),
    "preference": ("prompt", "chosen", "rejected"),
    "prompts": ("prompt",),
    "verifiable": ("prompt", "answer"),
    "text": ("text",),
    "responses": ("prompt", "response"),
    "unpaired": ("prompt", "completion", "label"),
}


def parse_columns(spec: str | dict | None) -> dict[str, str]:
    """'old=new,old2=new2' -> {'old': 'new', ...}"""
    if not spec:
        return {}
    if isinstance(spec, dict):
        return dict(spec)
    out = {}
    for part in spec.split(","):
        old, eq, new = (s.strip() for s in part.partition("="))
        if not (old and eq and new):
            raise UserError(f"--columns: {part!r} is not of the form old=new (e.g. --columns question=prompt).")
        out[old] = new
    return out


TEXT_COLUMNS = ("completion", "chosen", "rejected", "response", "text")  # a string in every row


def _not_utf8(path: Path, data: bytes, e: UnicodeDecodeError, lineno: int = 0) -> UserError:
    """The error for a file that is not UTF-8 text, naming the line and the first bad byte."""
    lineno = lineno or data[: e.start].count(b"\n") + 1
    return UserError(f"{path}:{lineno}: not UTF-8 text (byte {e.object[e.start]:#04x}); save the file as UTF-8.")


def _read_jsonl(path: Path) -> list[dict]:
    rows = []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise _not_utf8(path, raw, e, lineno) from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(f"{path}:{lineno}: not valid JSON ({e.msg}); fix or remove that line.") from None
            if not isinstance(row, dict):
                raise UserError(f"{path}:{lineno}: expected a JSON object per line, got {type(row).__name__}.")
            rows.append(row)
    return rows


def read_rows(path: str | Path) -> list[dict]:
    """The rows of a data file as dicts. JSONL and JSON are read directly (errors name the line; no `datasets`
    import, ~2 s of every start); Parquet and `save_to_disk` directories through `datasets`."""
    path = Path(path)
    if not path.exists():
        hub = len(path.parts) == 2 and not path.suffix and not str(path).startswith((".", "/"))
        raise UserError(f"{path}: data file not found." + (
            " It looks like a Hugging Face Hub dataset id: align reads local files (JSONL, JSON, Parquet, a "
            "save_to_disk directory); save it first, e.g. datasets.load_dataset(ID, split='train')"
            ".to_json('train.jsonl')." if hub else ""))
    suffix = path.suffix.lower()
    if path.is_dir() and (path / "artifact.json").is_file():  # an `align data make` artifact: its data.jsonl
        from align.artifacts import verify_artifact

        art = verify_artifact(path)
        if art.get("stage") != "data":
            raise UserError(f"{path}: a {art.get('stage')} artifact holds no data; give a data file or the --out of "
                            "`align data make`.")
        return _read_jsonl(path / "data.jsonl")
    if path.is_dir() or suffix == ".parquet":
        return _load_with_datasets(path).to_list()
    if suffix in (".jsonl", ".ndjson"):
        return _read_jsonl(path)
    if suffix == ".json":
        data = path.read_bytes()
        try:
            obj = json.loads(data.decode("utf-8-sig"))
        except UnicodeDecodeError as e:
            raise _not_utf8(path, data, e) from None
        except json.JSONDecodeError as e:
            raise UserError(f"{path}:{e.lineno}: not valid JSON ({e.msg}).") from None
        if isinstance(obj, dict) and "data" in obj:
            obj = obj["data"]
        if not isinstance(obj, list) or not all(isinstance(r, dict) for r in obj):
            raise UserError(f"{path}: expected a JSON list of objects (or JSONL, one object per line).")
        return obj
    raise UserError(f"{path}: unsupported data format {suffix!r}; use .jsonl, .json, .parquet or a save_to_disk dir.")


def _load_with_datasets(path: Path):
    import datasets

    if not path.is_dir():
        return datasets.Dataset.from_parquet(str(path))
    try:
        ds = datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError) as e:
        raise UserError(f"{path}: not a datasets save_to_disk directory ({str(e).splitlines()[0]}).") from None
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise UserError(f"{path}: DatasetDict without a 'train' split (splits: {', '.join(ds)}).")
        ds = ds["train"]
    return ds


def columns_of(rows: list[dict]) -> list[str]:
    """A dataset's columns: the keys of its first row (as `datasets` reads a list of rows)."""
    return list(rows[0]) if rows else []


def load_rows(path: str | Path, fmt: str | tuple[str, ...], columns: str | dict | None = None,
              limit: int = 0, held_out: bool = False) -> list[dict]:
    """Load, rename columns (a renamed column replaces one of the new name), check the required columns of `fmt`
    (a tuple: the first of those formats whose columns the data has); returns dict rows. Every old name of
    `columns` must be a column of the data, except in `held_out` data that already has the new name."""
    rows = read_rows(path)
    names = columns_of(rows)
    mapping = parse_columns(columns)
    for old, new in mapping.items():
        if old not in names and not (held_out and new in names):
            raise UserError(f"{path}: --columns maps {old!r}, but the data has no such column ({_cols(names)}).")
    # held-out data that already has the new name (the shipped held-out data beside your renamed training data)
    # is kept
    mapping = {old: new for old, new in mapping.items() if old in names}
    if mapping:
        replaced = set(mapping.values()) - set(mapping)
        rows = [{mapping.get(k, k): v for k, v in r.items() if k not in replaced} for r in rows]
        names = columns_of(rows)
    if not rows:
        raise UserError(f"{path}: the dataset is empty.")
    fmts = (fmt,) if isinstance(fmt, str) else fmt
    fmt = next((f for f in fmts if all(c in names for c in FORMATS[f])), fmts[0])
    required = FORMATS[fmt]
    if fmt == "sft" and "messages" in names and "prompt" not in names:
        required = ("messages",)
    missing = [c for c in required if c not in names]
    if missing:
        raise UserError(
            f"{path}: no {', '.join(repr(m) for m in missing)} column for {fmt} data (columns: {_cols(names)}). "
            f"Rename with --columns old=new."
        )
    if limit:
        rows = rows[:limit]
    for i, row in enumerate(rows, 1):
        for c in required:
            if row.get(c) is None:
                raise UserError(f"{path}: row {i} has no value in column {c!r}.")
        _check_types(path, i, row, required)
    return rows


def _check_types(path, i: int, row: dict, columns) -> None:
    """Text columns hold strings, a prompt a string or a list of chat messages: a wrong type is refused when
    the data is read (before --out is touched), naming the row, not when it is tokenised."""
    chat = "a list of {role, content} messages"
    for c in columns:
        value = row[c]
        if c in TEXT_COLUMNS:
            ok, want = isinstance(value, str), "a string"
        elif c == "prompt":
            ok, want = isinstance(value, str) or _is_chat(value), f"a string or {chat}"
        elif c == "messages":
            ok, want = _is_chat(value), chat
        else:
            continue
        if not ok:
            raise UserError(f"{path}: row {i}: column {c!r} must be {want}, not {type(value).__name__} "
                            f"{value!r:.40}.")


def _is_chat(value) -> bool:
    return isinstance(value, list) and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                           and isinstance(m.get("content"), str) for m in value)


def _cols(names: list[str]) -> str:
    return ", ".join(names) or "none"


# ---- chat formatting and tokenisation (one place for every stage) ----


def split_messages(row: dict) -> tuple[list[dict], str]:
    """A {messages} row -> (prompt messages, final assistant completion)."""
    msgs = row["messages"]
    if not msgs or msgs[-1].get("role") != "assistant":
        raise UserError("a messages row must end with an assistant message (the completion to learn).")
    return msgs[:-1], msgs[-1]["content"]


def prompt_text(tokenizer, prompt: str | list[dict]) -> str:
    """The text a policy sees before its response: the chat template with a generation prompt, if any."""
    messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    if tokenizer.chat_template:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    text = "\n".join(m["content"] for m in messages)
    return (tokenizer.bos_token or "") + text if isinstance(prompt, list) else (tokenizer.bos_token or "") + prompt


def prompt_texts(tokenizer, prompts: list) -> list[str]:
    """`prompt_text` for many prompts. Plain-string prompts are rendered once through the chat template around a
    sentinel and spliced (jinja per row costs ~0.2 ms: seconds per epoch of a large dataset). Templates that
    transform the content (trim, escape, ...) are detected by a second, padded probe and rendered per row."""
    sentinel = "\x00ALIGN\x00"
    probe = prompt_text(tokenizer, sentinel)
    if probe.count(sentinel) != 1:
        return [prompt_text(tokenizer, p) for p in prompts]
    head, tail = probe.split(sentinel)
    padded = " " + sentinel + " \n"
    if prompt_text(tokenizer, padded) != head + padded + tail:
        return [prompt_text(tokenizer, p) for p in prompts]
    return [head + p + tail if isinstance(p, str) else prompt_text(tokenizer, p) for p in prompts]


def encode_prompts(tokenizer, prompts: list) -> list[list[int]]:
    if not prompts:
        return []
    # verbose=False: no "sequence length is longer than the specified maximum" warning; align cuts or drops
    # what does not fit (the callers' --max-length / context checks)
    return tokenizer(prompt_texts(tokenizer, prompts), add_special_tokens=False, verbose=False)["input_ids"]


def encode_completions(tokenizer, completions: list[str]) -> list[list[int]]:
    """Response tokens followed by EOS: the model must learn to stop."""
    if not completions:
        return []
    ids = tokenizer(list(completions), add_special_tokens=False, verbose=False)["input_ids"]
    return [c + [tokenizer.eos_token_id] for c in ids]


def sft_examples(tokenizer, rows: list[dict], max_length: int) -> list[dict]:
    """input_ids and labels (-100 on prompt tokens) per row. Truncation: the prompt loses tokens from the left,
    the completion is never cut; a row whose completion alone does not fit is dropped."""
    prompts, completions = [], []
    for row in rows:
        if "messages" in row and "prompt" not in row:
            p, c = split_messages(row)
        else:
            p, c = row["prompt"], row["completion"]
        prompts.append(p)
        completions.append(c)
    out = []
    for p, c in zip(encode_prompts(tokenizer, prompts), encode_completions(tokenizer, completions)):
        if len(c) >= max_length:
            continue
        p = p[max(0, len(p) + len(c) - max_length):]
        out.append({"input_ids": p + c, "labels": [-100] * len(p) + c, "n_labels": len(c)})
    return out


def longest_row(examples: list[dict]) -> int | None:
    """Tokens of the longest row the tokenised examples make: an SFT row, a pair's prompt + its longer response,
    a KTO row's prompt + completion (None: no examples)."""
    def tokens(e: dict) -> int:
        if "input_ids" in e:
            return len(e["input_ids"])
        return len(e["prompt_ids"]) + max(len(e.get(k, ())) for k in ("chosen_ids", "rejected_ids", "completion_ids"))

    return max(map(tokens, examples), default=None)


def pad(seqs: list[list[int]], value: int, side: str = "right") -> list[list[int]]:
    width = max(len(s) for s in seqs)
    return [s + [value] * (width - len(s)) if side == "right" else [value] * (width - len(s)) + s for s in seqs]


def pack_examples(examples: list[dict], max_length: int) -> list[dict]:
    """Concatenate examples into rows of at most `max_length` tokens (first-fit by decreasing length).

    Each row carries `position_ids` that restart at 0 for every example; with no attention mask,
    transformers turns restarting positions into a block-diagonal causal mask, so packed examples never
    attend to each other and the loss equals that of the examples run separately (tested).
    """
    rows: list[dict] = []
    for e in sorted(examples, key=lambda e: -len(e["input_ids"])):
        n = len(e["input_ids"])
        row = next((r for r in rows if len(r["input_ids"]) + n <= max_length), None)
        if row is None:
            row = {"input_ids": [], "labels": [], "position_ids": [], "n_labels": 0}
            rows.append(row)
        row["input_ids"] += e["input_ids"]
        row["labels"] += e["labels"]
        row["position_ids"] += list(range(n))
        row["n_labels"] += e["n_labels"]
    return rows


def collate_sft(examples: list[dict], pad_id: int):
    """Right-padded batch. Packed rows get position_ids (padding is its own segment) and no attention mask."""
    import torch

    ids = pad([e["input_ids"] for e in examples], pad_id)
    labels = pad([e["labels"] for e in examples], -100)
    if "position_ids" in examples[0]:
        width = len(ids[0])
        pos = [e["position_ids"] + list(range(width - len(e["position_ids"]))) for e in examples]
        return {"input_ids": torch.tensor(ids), "position_ids": torch.tensor(pos), "labels": torch.tensor(labels)}
    mask = pad([[1] * len(e["input_ids"]) for e in examples], 0)
    return {"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(mask), "labels": torch.tensor(labels)}


def to_device(batch: dict, device) -> dict:
    return {k: v.to(device) for k, v in batch.items()}


def model_inputs(batch: dict) -> dict:
    """Forward kwargs for a collated training batch. No KV cache: it costs memory, and with a cache
    transformers ignores restarting position_ids (packing) and lets packed examples see each other."""
    keep = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask", "position_ids")}
    return {**keep, "use_cache": False}


# ---- preference pairs (rm, dpo)

PAIR_DROP_REASONS = ("empty", "identical", "too_long")


def preference_examples(tokenizer, rows: list[dict], max_length: int, source: str = "data") -> tuple[list[dict], dict]:
    """Tokenise {prompt, chosen, rejected[, margin]} rows once, for the reward model and DPO.

    The prompt is rendered with the chat template (`encode_prompts`); chosen and rejected each end with EOS
    (`encode_completions`). Truncation policy: the prompt loses tokens from the LEFT so that prompt + the longer
    response fits `max_length`; a response is never cut, and a pair whose longer response alone does not fit
    (with at least one prompt token left) is dropped. Pairs with chosen == rejected, or an empty prompt, chosen or
    rejected, are dropped too. Returns (examples, report); the report counts every drop reason and the prompts
    that were cut. A UserError naming `source` when no pair is left.
    """
    report = {"pairs": len(rows), "kept": 0, "prompt_truncated": 0, **{f"dropped_{r}": 0 for r in PAIR_DROP_REASONS}}
    valid = []
    for row in rows:
        texts = (row["prompt"], row["chosen"], row["rejected"])
        if any((t.strip() if isinstance(t, str) else t) in ("", [], None) for t in texts):
            report["dropped_empty"] += 1
        elif row["chosen"] == row["rejected"]:
            report["dropped_identical"] += 1
        else:
            valid.append(row)
    prompts = encode_prompts(tokenizer, [r["prompt"] for r in valid])
    chosen = encode_completions(tokenizer, [r["chosen"] for r in valid])
    rejected = encode_completions(tokenizer, [r["rejected"] for r in valid])
    out = []
    for row, p, c, r in zip(valid, prompts, chosen, rejected):
        longer = max(len(c), len(r))
        if longer >= max_length:
            report["dropped_too_long"] += 1
            continue
        cut = max(0, len(p) + longer - max_length)
        report["prompt_truncated"] += cut > 0
        out.append({"prompt_ids": p[cut:], "chosen_ids": c, "rejected_ids": r,
                    "margin": float(row["margin"]) if row.get("margin") is not None else 0.0})
    report["kept"] = len(out)
    if not out:
        reasons = {"empty": "every pair has an empty prompt, chosen or rejected",
                   "identical": "every pair has chosen == rejected",
                   "too_long": f"all pairs too long: no response fits --max-length {max_length}"}
        worst = max(PAIR_DROP_REASONS, key=lambda k: report[f"dropped_{k}"])
        raise UserError(f"{source}: no usable preference pair ({reasons[worst]}; dropped: "
                        + ", ".join(f"{report[f'dropped_{k}']} {k}" for k in PAIR_DROP_REASONS) + ").")
    return out, report


def pair_report_text(report: dict) -> str:
    """One line for the console: kept pairs and every drop reason."""
    drops = ", ".join(f"{report[f'dropped_{k}']} {k.replace('_', ' ')}" for k in PAIR_DROP_REASONS)
    return f"{report['kept']}/{report['pairs']} pairs kept (dropped: {drops}; prompts cut: {report['prompt_truncated']})"


def load_pairs(path: str, columns: str, tok, max_length: int, held_out: bool = False) -> list[dict]:
    """Preference pairs (the reward model's and DPO's data) tokenised once (preference_examples), with a line
    saying what was dropped."""
    rows = load_rows(path, "preference", columns, held_out=held_out)
    examples, report = preference_examples(tok, rows, max_length, source=str(path))
    info(f"{path}: {pair_report_text(report)}")
    return examples


def unpaired_examples(tokenizer, rows: list[dict], max_length: int, source: str = "data") -> list[dict]:
    """KTO's rows: {prompt, completion, label} (label true: desirable) tokenised as the pairs are (chat-templated
    prompt cut from the left to fit, completion + EOS never cut); empty or too-long completions are dropped.
    Preference pairs ({prompt, chosen, rejected}) are unpaired: chosen desirable, rejected undesirable."""
    if rows and "label" not in rows[0]:  # preference pairs (load_rows(path, ("unpaired", "preference")))
        pairs, _ = preference_examples(tokenizer, rows, max_length, source)
        return [{"prompt_ids": e["prompt_ids"], "completion_ids": e[k], "label": k == "chosen_ids"}
                for e in pairs for k in ("chosen_ids", "rejected_ids")]
    out = []
    for row, p, c in zip(rows, encode_prompts(tokenizer, [r["prompt"] for r in rows]),
                         encode_completions(tokenizer, [r["completion"] for r in rows])):
        label = row["label"]
        if isinstance(label, str):
            label = {"true": True, "1": True, "false": False, "0": False}.get(label.strip().lower(), label)
        if not isinstance(label, (bool, int)) or label not in (0, 1):
            raise UserError(f"{source}: label {row['label']!r} is not true/false (desirable or not).")
        if str(row["completion"]).strip() and len(c) < max_length:
            out.append({"prompt_ids": p[max(0, len(p) + len(c) - max_length):], "completion_ids": c, "label": bool(label)})
    if not out:
        raise UserError(f"{source}: no usable row (empty completions, or none fits --max-length {max_length}).")
    return out


def collate_kto(examples: list[dict], pad_id: int, mismatched_prompts: list[list[int]] | None = None):
    """One right-padded batch of 2B rows for KTO: the B (prompt_i, completion_i) rows, then B MISMATCHED rows
    (mismatched_prompts_i, completion_i) for the KL reference point — by default prompt_{i+1 mod B}; labels -100
    on prompt and padding; `desirable` [B] bool."""
    import torch

    prompts = [e["prompt_ids"] for e in examples]
    prompts = prompts + (prompts[1:] + prompts[:1] if mismatched_prompts is None else list(mismatched_prompts))
    comps = [e["completion_ids"] for e in examples] * 2
    seqs = [p + c for p, c in zip(prompts, comps)]
    labels = [[-100] * len(p) + c for p, c in zip(prompts, comps)]
    return {"input_ids": torch.tensor(pad(seqs, pad_id)), "labels": torch.tensor(pad(labels, -100)),
            "desirable": torch.tensor([e["label"] for e in examples])}


def collate_pairs(examples: list[dict], pad_id: int):
    """One right-padded batch of 2B rows: the B chosen sequences, then the B rejected ones (one forward for both).
    labels are -100 on prompt and padding; `margin` is the per-pair margin (0 when the data has none)."""
    import torch

    seqs = [e["prompt_ids"] + e["chosen_ids"] for e in examples] + [e["prompt_ids"] + e["rejected_ids"] for e in examples]
    labels = ([[-100] * len(e["prompt_ids"]) + e["chosen_ids"] for e in examples]
              + [[-100] * len(e["prompt_ids"]) + e["rejected_ids"] for e in examples])
    return {"input_ids": torch.tensor(pad(seqs, pad_id)), "attention_mask": torch.tensor(pad([[1] * len(s) for s in seqs], 0)),
            "labels": torch.tensor(pad(labels, -100)), "margin": torch.tensor([e["margin"] for e in examples])}
