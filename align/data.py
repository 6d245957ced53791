"""Datasets: JSONL / JSON / Parquet files, `save_to_disk` folders (a DatasetDict's split: DIR:SPLIT), folders of
data files and Hugging Face Hub datasets (NAME[:SPLIT]), the last ones through `datasets`; TRL's dataset formats
read as they are (docs/data.md).

Formats (column names after `--columns old=new` mapping; each column a string, or - for a conversational dataset -
a list of {role, content} messages):
  sft          {prompt, completion} (a conversational completion: assistant messages), {messages} (the last
               assistant turn is the completion; --assistant-only-loss: every assistant turn) or {text} (language
               modelling: loss on every token)
  preference   {prompt, chosen, rejected}, or {chosen, rejected} with an implicit prompt (the common start of the
               two: leading messages of two conversations, the text up to the last whitespace of two strings)
  unpaired     {prompt, completion, label}
  prompts      {prompt}
  verifiable   {prompt, answer}
  text         {text}
  responses    {prompt, response}            (rm score)
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

from align import vision
from align.chat import (IGNORE, completion_ids, conversation_tokens, last_span, prompt_text,  # noqa: F401
                        prompt_texts)
from align.console import info
from align.errors import UserError
from align.paths import split_spec

# each format's column sets, in the order they are tried (the first the data has wins)
LAYOUTS = {
    "sft": (("prompt", "completion"), ("messages",), ("text",)),
    "preference": (("prompt", "chosen", "rejected"), ("chosen", "rejected")),
    "prompts": (("prompt",),),
    "verifiable": (("prompt", "answer"),),
    "text": (("text",),),
    "responses": (("prompt", "response"),),
    "unpaired": (("prompt", "completion", "label"),),
}
FORMATS = {name: layouts[0] for name, layouts in LAYOUTS.items()}  # each format's main columns


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


TEXT_COLUMNS = ("response", "text")  # a string in every row
RESPONSE_COLUMNS = ("completion", "chosen", "rejected")  # a string, or a conversation's assistant messages
DATA_SUFFIXES = (".jsonl", ".ndjson", ".json", ".parquet", ".csv", ".tsv", ".txt", ".arrow")
HUB_DATASET = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


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


def is_hub_name(name: str) -> bool:
    """Whether `name` (no such local path) can be a Hugging Face Hub dataset id: NAME or OWNER/NAME, without a data
    file's suffix (a missing data.jsonl is a missing file, not a dataset)."""
    return bool(HUB_DATASET.fullmatch(name)) and Path(name).suffix.lower() not in DATA_SUFFIXES


def read_rows(spec: str | Path) -> list[dict]:
    """The rows of a data option's value as dicts. JSONL and JSON are read directly (errors name the line; no
    `datasets` import, ~2 s of every start); Parquet, `save_to_disk` folders (DIR:SPLIT: a DatasetDict's split,
    `train` by default), folders of data files and Hub datasets (NAME[:SPLIT]) through `datasets`."""
    name, split = split_spec(str(spec))
    path = Path(name)
    if not path.exists():
        if is_hub_name(name):
            return _load_dataset(name, split, f"{name}: no such file or folder, and not a Hugging Face Hub dataset "
                                              "that could be loaded").to_list()
        raise UserError(f"{path}: data file not found.")
    if split and not path.is_dir():
        raise UserError(f"{spec}: {path} is a file, which has no splits; drop ':{split}' (a split names one of a "
                        "DatasetDict folder or of a Hub dataset).")
    suffix = path.suffix.lower()
    if path.is_dir() and (path / "artifact.json").is_file():  # an `align data make` artifact: its data.jsonl
        from align.artifacts import verify_artifact

        art = verify_artifact(path)
        if art.get("stage") != "data":
            raise UserError(f"{path}: a {art.get('stage')} artifact holds no data; give a data file or the --out of "
                            "`align data make`.")
        return _read_jsonl(path / "data.jsonl")
    if path.is_dir() or suffix == ".parquet":
        return _load_with_datasets(path, split).to_list()
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


def _load_with_datasets(path: Path, split: str = ""):
    """A Parquet file, a `save_to_disk` folder (a DatasetDict: its `split`, by default `train`) or a folder of data
    files (`datasets.load_dataset(folder)`)."""
    import datasets

    if not path.is_dir():
        return datasets.Dataset.from_parquet(str(path))
    try:
        ds = datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError) as e:
        if not any(p.is_file() and p.suffix.lower() in DATA_SUFFIXES for p in path.rglob("*")):
            raise UserError(f"{path}: not a datasets save_to_disk directory ({str(e).splitlines()[0]}), nor a "
                            "folder of data files.") from None
        return _load_dataset(str(path), split, f"{path}: a folder of data files that `datasets` could not load")
    if isinstance(ds, datasets.DatasetDict):
        name = split or "train"
        if name not in ds:
            raise UserError(f"{path}: DatasetDict without a {name!r} split (splits: {', '.join(ds)}); name one as "
                            f"{path}:SPLIT.")
        return ds[name]
    if split:
        raise UserError(f"{path}: a single Dataset (save_to_disk), which has no splits; drop ':{split}'.")
    return ds


def _load_dataset(name: str, split: str, failed: str):
    """`datasets.load_dataset(name, split=split or 'train')`: a Hub dataset (offline: from the local datasets
    cache) or a local folder of data files. A failure is one line: `failed`, and why."""
    import logging

    import datasets

    info(f"{name}: loading with datasets.load_dataset (split {split or 'train'})")
    hub_log = logging.getLogger("huggingface_hub")
    level = hub_log.level
    hub_log.setLevel(logging.ERROR)  # no line per retry of an unreachable Hub: the failure is said once, below
    try:
        return datasets.load_dataset(name, split=split or "train")
    except Exception as e:  # noqa: BLE001 - the library's many failures (network, names, splits) become one line
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        if "split" in reason.lower():
            raise UserError(f"{name}: no split {split or 'train'!r} ({reason}); name one as {name}:SPLIT.") from None
        raise UserError(f"{failed} ({reason}). Give a local file (JSONL, JSON, Parquet), a save_to_disk folder, or a "
                        "Hub dataset id that is reachable or in the local datasets cache.") from None
    finally:
        hub_log.setLevel(level)


def columns_of(rows: list[dict]) -> list[str]:
    """A dataset's columns: the keys of its first row (as `datasets` reads a list of rows)."""
    return list(rows[0]) if rows else []


def layout(fmts: tuple[str, ...], names: list[str]) -> tuple[str, tuple[str, ...]]:
    """(format, columns) of the first of `fmts`' column sets that the data has; (fmts[0], its main columns) when
    none fits."""
    for f in fmts:
        for cols in LAYOUTS[f]:
            if all(c in names for c in cols):
                return f, cols
    return fmts[0], FORMATS[fmts[0]]


def load_rows(path: str | Path, fmt: str | tuple[str, ...], columns: str | dict | None = None,
              limit: int = 0, held_out: bool = False) -> list[dict]:
    """Load, rename columns (a renamed column replaces one of the new name), check the columns of `fmt` (a tuple:
    the first of those formats whose columns the data has; each format's column sets: LAYOUTS) and their values;
    returns dict rows, preference rows with an implicit prompt made explicit. Every old name of `columns` must be
    a column of the data, except in `held_out` data that already has the new name."""
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
    fmt, required = layout(fmts, names)
    missing = [c for c in required if c not in names]
    if missing:
        kinds = " or ".join("{" + ", ".join(cols) + "}" for f in fmts for cols in LAYOUTS[f])
        raise UserError(
            f"{path}: no {', '.join(repr(m) for m in missing)} column for {fmt} data (columns: {_cols(names)}); it "
            f"reads {kinds}. Rename with --columns old=new."
        )
    if limit:
        rows = rows[:limit]
    for i, row in enumerate(rows, 1):
        for c in required:
            if row.get(c) is None:
                raise UserError(f"{path}: row {i} has no value in column {c!r}.")
        row = rows[i - 1] = vision.normalize_row(path, i, row)  # its images resolved, if it has any
        _check_types(path, i, row, required)
        if fmt == "sft":
            _check_completion(path, i, row)
    if fmt == "preference" and "prompt" not in required:
        rows = [_explicit_prompt(path, i, r) for i, r in enumerate(rows, 1)]
    return rows


def _check_types(path, i: int, row: dict, columns) -> None:
    """Text columns hold strings, a prompt a string or a list of chat messages, a completion (chosen, rejected) a
    string or a conversation's assistant messages: a wrong type is refused when the data is read (before --out
    is touched), naming the row, not when it is tokenised."""
    chat = "a list of {role, content} messages"
    for c in columns:
        value = row[c]
        if c in TEXT_COLUMNS:
            ok, want = isinstance(value, str), "a string"
        elif c in RESPONSE_COLUMNS:
            ok, want = isinstance(value, str) or _is_chat(value), f"a string or {chat} (the assistant's)"
        elif c == "prompt":
            ok, want = isinstance(value, str) or _is_chat(value), f"a string or {chat}"
        elif c == "messages":
            ok, want = _is_chat(value), chat
        else:
            continue
        if not ok:
            raise UserError(f"{path}: row {i}: column {c!r} must be {want}, not {type(value).__name__} "
                            f"{_short(value)}; fix the row, or map another column with --columns old={c}.")
        if c in RESPONSE_COLUMNS and "prompt" in columns and value and isinstance(value, list) and not (
                value[0]["role"] == value[-1]["role"] == "assistant"):
            raise UserError(f"{path}: row {i}: column {c!r} is a conversation that must start and end with an "
                            f"assistant message (roles: {', '.join(m['role'] for m in value)}); the turns before "
                            "the assistant's belong in 'prompt'.")
        if c == "messages" and not any(m["role"] == "assistant" for m in value[-1:]):
            raise UserError(f"{path}: row {i}: a messages row must end with an assistant message (the completion to "
                            "learn); remove the trailing turns or the row.")
    if {"chosen", "rejected"} <= set(columns) and isinstance(row["chosen"], str) != isinstance(row["rejected"], str):
        raise UserError(f"{path}: row {i}: 'chosen' and 'rejected' must both be strings or both message lists.")


def _short(value, n: int = 60) -> str:
    """repr(value), cut to about `n` characters with a visible '...'."""
    text = repr(value)
    return text if len(text) <= n else text[: n - 3] + "..."


def is_empty(value) -> bool:
    """An empty response: None, blank text, or messages whose contents are all blank."""
    if isinstance(value, list):
        return all(not m["content"].strip() for m in value)
    return value is None or not str(value).strip()


def _check_completion(path, i: int, row: dict) -> None:
    """SFT: an empty completion (string or conversational, a messages row's last assistant turn, a text) is
    refused, naming the row: training on it teaches the model to answer nothing."""
    if "prompt" in row and "completion" in row:
        what, value = "completion", row["completion"]
    elif "messages" in row:
        what, value = "last assistant message", row["messages"][-1:]
    else:
        what, value = "text", row["text"]
    if is_empty(value):
        raise UserError(f"{path}: row {i}: empty {what}; training on it teaches the model to answer nothing: fill "
                        "it in or remove the row.")


def implicit_prompt(chosen, rejected) -> tuple:
    """TRL's implicit prompt: (prompt, chosen, rejected) of two whole conversations (the common leading messages
    are the prompt, the rest of each its completion) or two strings (the common start, cut back to its last
    whitespace so that no word is split: 'The sky is' + ' blue.' / ' green.')."""
    n = 0
    while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
        n += 1
    if isinstance(chosen, str):
        space = max(chosen.rfind(ws, 0, n) for ws in " \t\n")
        n = space if space > 0 else n
    return chosen[:n], chosen[n:], rejected[n:]


def _explicit_prompt(path, i: int, row: dict) -> dict:
    """A preference row with an implicit prompt, as {prompt, chosen, rejected} (its other columns kept)."""
    prompt, chosen, rejected = implicit_prompt(row["chosen"], row["rejected"])
    if isinstance(prompt, list) and any(m["role"] != "assistant" for m in chosen + rejected):
        raise UserError(f"{path}: row {i}: 'chosen' and 'rejected' share {len(prompt)} leading message(s), and what "
                        "follows is not the assistant's alone; give the prompt as a 'prompt' column.")
    return {**row, "prompt": prompt, "chosen": chosen, "rejected": rejected}


def _is_chat(value) -> bool:
    """A list of {role, content} messages; a content is a string, or (a user's message with images: align.vision)
    a list of {type: text / image} parts."""
    return isinstance(value, list) and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                           and (isinstance(m.get("content"), str) or _is_parts(m.get("content")))
                                           for m in value)


def _is_parts(content) -> bool:
    """A message's content given as a list of {type: text / image} parts."""
    return isinstance(content, list) and all(isinstance(p, dict) and p.get("type") in ("text", "image")
                                             for p in content)


def _cols(names: list[str]) -> str:
    return ", ".join(names) or "none"


def split_off(rows: list[dict], fraction: float, source: str = "data") -> tuple[list[dict], list[dict]]:
    """(training rows, held-out rows): --eval-split's `fraction` of `rows` (at least one, leaving at least one)
    held out, drawn by a fixed seed of its own (the same rows for any --seed, so runs of several seeds are
    measured alike; the run's random draws untouched), both parts in their order in the data. `fraction` 0: (rows,
    [])."""
    if not fraction:
        return rows, []
    if len(rows) < 2:
        raise UserError(f"{source}: --eval-split needs at least 2 rows (one to train on, one held out); it has "
                        f"{len(rows)}.")
    k = min(len(rows) - 1, max(1, round(fraction * len(rows))))
    held = set(random.Random(0x5EED).sample(range(len(rows)), k))
    return ([r for i, r in enumerate(rows) if i not in held], [r for i, r in enumerate(rows) if i in held])


def verifiable_rows(rows: list[dict], source: str = "data") -> list[dict]:
    """--eval-split's held-out rows as an RL stage's verifiable data: pass@k checks their 'answer'."""
    if rows and "answer" not in rows[0]:
        raise UserError(f"{source}: --eval-split holds out rows to measure pass@k on, which needs an 'answer' column "
                        f"(columns: {_cols(columns_of(rows))}); map one with --columns old=answer, or drop "
                        "--eval-split.")
    return rows


# ---- chat formatting and tokenisation (one place for every stage; the chat template's part: align.chat) ----


def split_messages(row: dict) -> tuple[list[dict], str]:
    """A {messages} row -> (prompt messages, final assistant completion)."""
    msgs = row["messages"]
    if not msgs or msgs[-1].get("role") != "assistant":
        raise UserError("a messages row must end with an assistant message (the completion to learn).")
    return msgs[:-1], msgs[-1]["content"]


def encode_prompts(tokenizer, prompts: list, tools: list | None = None) -> list[list[int]]:
    """The prompts' tokens as the chat template renders them with a generation prompt; `tools`: the JSON schemas
    of the tools the policy may call, shown by the template (an Agent's `schemas`: align.tools.chat_format)."""
    if not prompts:
        return []
    texts = prompt_texts(tokenizer, prompts, tools)
    images = [vision.prompt_images(p) for p in prompts]
    if any(images):  # rows with images (align.vision): their image pads expanded, their tensors kept
        return [vision.encode_image_prompt(tokenizer, t, im) if im else
                tokenizer(t, add_special_tokens=False, verbose=False)["input_ids"] for t, im in zip(texts, images)]
    # verbose=False: no "sequence length is longer than the specified maximum" warning; align cuts or drops
    # what does not fit (the callers' --max-length / context checks)
    return tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]


def encode_completions(tokenizer, completions: list, prompts: list | None = None) -> list[list[int]]:
    """Response tokens followed by EOS: the model must learn to stop. A conversational completion (assistant
    messages) is what the chat template renders for it after its prompt (`prompts`, in the same order; EOS as
    the template gives it, else appended: align.chat.completion_ids)."""
    if not completions:
        return []
    if not all(isinstance(c, str) for c in completions):
        strings = [i for i, c in enumerate(completions) if isinstance(c, str)]
        out = dict(zip(strings, encode_completions(tokenizer, [completions[i] for i in strings])))
        return [out[i] if i in out else completion_ids(tokenizer, prompts[i], c) for i, c in enumerate(completions)]
    ids = tokenizer(list(completions), add_special_tokens=False, verbose=False)["input_ids"]
    return [c + [tokenizer.eos_token_id] for c in ids]


def sft_examples(tokenizer, rows: list[dict], max_length: int, assistant_only: bool = False,
                 tools: str = "") -> list[dict]:
    """input_ids and labels (-100 on tokens without loss) per row, in the rows' order. {prompt, completion} and
    {messages} (its last assistant turn the completion): loss on the completion; the prompt loses tokens from the
    left, the completion is never cut, and a row whose completion alone does not fit is dropped. {messages} with
    `assistant_only` (--assistant-only-loss): loss on every assistant turn (`conversation_example`). {text}:
    language modelling, loss on every token (`text_examples`). `tools` (--tools): {prompt, completion} text
    completions hold tool calls and the tools' answers (`tool_completion`): loss on the policy's parts only."""
    if (assistant_only or tools) and any(vision.row_has_images(r) for r in rows):
        raise UserError(f"rows with images train on their last assistant turn; drop "
                        f"{'--assistant-only-loss' if assistant_only else '--tools'}.")
    out: list[dict | None] = [None] * len(rows)
    pc, texts = [], []  # (place, prompt, completion); (place, text)
    for i, row in enumerate(rows):
        if "prompt" in row and "completion" in row:
            pc.append((i, row["prompt"], row["completion"]))
        elif "messages" in row and assistant_only:
            out[i] = conversation_example(tokenizer, row["messages"], max_length, row_tools(row))
        elif "messages" in row:
            pc.append((i, *split_messages(row)))
        else:
            texts.append((i, row["text"]))
    if pc:
        places, prompts, completions = (list(x) for x in zip(*pc))
        if tools:
            labelled = [tool_completion(tokenizer, tools, c) for c in completions]
        else:
            labelled = [(c, c) for c in encode_completions(tokenizer, completions, prompts)]
        for i, p, (c, lab) in zip(places, encode_prompts(tokenizer, prompts), labelled):
            if len(c) >= max_length:
                continue
            p = vision.cut_left(p, len(p) + len(c) - max_length, tokenizer)
            out[i] = {"input_ids": p + c, "labels": [-100] * len(p) + lab, "n_labels": sum(t != IGNORE for t in lab),
                      **vision.example_images(p)}
    if texts:
        for (i, _), e in zip(texts, text_examples(tokenizer, [t for _, t in texts], max_length)):
            out[i] = e
    return [e for e in out if e is not None]


def tool_completion(tokenizer, tools: str, completion) -> tuple[list[int], list[int]]:
    """(ids, labels) of a demonstration holding tool calls: its text cut into the policy's parts and the tools'
    answers (align.tools.segments), each part tokenised on its own — as an episode holds them: the policy's turns
    as sampled, each answer tokenised when it came — then EOS; labels IGNORE on the tools' tokens."""
    from align import tools as T

    if not isinstance(completion, str):
        raise UserError("--tools in SFT reads {prompt, completion} rows whose completion is text holding the tool "
                        "calls and answers (as `align data make mul_tool` writes them).")
    ids, labels = [], []
    for text, policy in T.segments(tools, completion):
        part = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
        ids += part
        labels += part if policy else [IGNORE] * len(part)
    return ids + [tokenizer.eos_token_id], labels + [tokenizer.eos_token_id]


def row_tools(row: dict) -> list | None:
    """A conversation row's `tools` (TRL's column: the JSON schemas of the functions it calls; a JSON string is
    read), None without one."""
    tools = row.get("tools")
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except ValueError:
            raise UserError(f"a row's tools must be a list of JSON schemas (or its JSON text), got {tools[:60]!r}") from None
    return tools or None


def conversation_example(tokenizer, messages: list[dict], max_length: int, tools: list | None = None) -> dict | None:
    """A whole conversation with loss on every assistant turn (align.chat.conversation_tokens; `tools`: the schemas
    its template shows). Too long: it loses tokens from the left; None when its last assistant turn alone does not
    fit."""
    ids, labels = conversation_tokens(tokenizer, messages, tools)
    if len(ids) - last_span(labels) >= max_length:
        return None
    cut = max(0, len(ids) - max_length)
    ids, labels = ids[cut:], [IGNORE] + labels[cut + 1:]  # the first token is never predicted
    return {"input_ids": ids, "labels": labels, "n_labels": sum(t != IGNORE for t in labels)}


def text_examples(tokenizer, texts: list[str], max_length: int) -> list[dict | None]:
    """Language modelling: BOS + text + EOS, cut on the right at `max_length`, loss on every token but the first
    (which nothing predicts); None for a text that leaves no token to learn."""
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    out = []
    for x in tokenizer(list(texts), add_special_tokens=False, verbose=False)["input_ids"]:
        ids = (bos + x + [tokenizer.eos_token_id])[:max_length]
        out.append({"input_ids": ids, "labels": [IGNORE] + ids[1:], "n_labels": len(ids) - 1} if len(ids) > 1 else None)
    return out


def data_kind(rows: list[dict]) -> str:
    """Which SFT data `rows` are, by their first row: prompt-completion, messages or text."""
    row = rows[0] if rows else {}
    return ("prompt-completion" if "prompt" in row and "completion" in row else "messages" if "messages" in row
            else "text")


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
    if any("image_prompt" in e for e in examples):
        raise UserError("--packing: rows with images cannot be packed (a vision-language model computes its M-RoPE "
                        "positions from each row's image tokens); drop --packing.")
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
    return {"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(mask), "labels": torch.tensor(labels),
            **vision.collate_images(examples)}


def to_device(batch: dict, device) -> dict:
    return {k: v.to(device) for k, v in batch.items()}


def model_inputs(batch: dict) -> dict:
    """Forward kwargs for a collated training batch. No KV cache: it costs memory, and with a cache
    transformers ignores restarting position_ids (packing) and lets packed examples see each other."""
    keep = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask", "position_ids")}
    return {**keep, **vision.forward_images(batch), "use_cache": False}


# ---- preference pairs (rm, dpo)

PAIR_DROP_REASONS = ("empty", "identical", "too_long")


def preference_examples(tokenizer, rows: list[dict], max_length: int, source: str = "data") -> tuple[list[dict], dict]:
    """Tokenise {prompt, chosen, rejected[, margin]} rows once, for the reward model and DPO.

    The prompt is rendered with the chat template (`encode_prompts`); chosen and rejected (strings, or the
    assistant's messages: the template's rendering after the prompt) each end with EOS (`encode_completions`).
    Truncation policy: the prompt loses tokens from the LEFT so that prompt + the longer
    response fits `max_length`; a response is never cut, and a pair whose longer response alone does not fit
    (with at least one prompt token left) is dropped. Pairs with chosen == rejected, or an empty prompt, chosen or
    rejected, are dropped too. Returns (examples, report); the report counts every drop reason and the prompts
    that were cut. A UserError naming `source` when no pair is left.
    """
    report = {"pairs": len(rows), "kept": 0, "prompt_truncated": 0, **{f"dropped_{r}": 0 for r in PAIR_DROP_REASONS}}
    valid = []
    for row in rows:
        prompt = row["prompt"]
        if (prompt.strip() if isinstance(prompt, str) else prompt) in ("", [], None) or is_empty(row["chosen"]) \
                or is_empty(row["rejected"]):
            report["dropped_empty"] += 1
        elif row["chosen"] == row["rejected"]:
            report["dropped_identical"] += 1
        else:
            valid.append(row)
    prompts = encode_prompts(tokenizer, [r["prompt"] for r in valid])
    chosen = encode_completions(tokenizer, [r["chosen"] for r in valid], [r["prompt"] for r in valid])
    rejected = encode_completions(tokenizer, [r["rejected"] for r in valid], [r["prompt"] for r in valid])
    out = []
    for row, p, c, r in zip(valid, prompts, chosen, rejected):
        longer = max(len(c), len(r))
        if longer >= max_length:
            report["dropped_too_long"] += 1
            continue
        cut = max(0, len(p) + longer - max_length)
        report["prompt_truncated"] += cut > 0
        out.append({"prompt_ids": vision.cut_left(p, cut, tokenizer), "chosen_ids": c, "rejected_ids": r,
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


def load_pairs(path: str, columns: str, tok, max_length: int, held_out: bool = False,
               rows: list[dict] | None = None) -> list[dict]:
    """Preference pairs (the reward model's and DPO's data) tokenised once (preference_examples), with a line
    saying what was dropped. `rows`: rows already read (--eval-split's parts of --data), else `path`'s."""
    rows = load_rows(path, "preference", columns, held_out=held_out) if rows is None else rows
    examples, report = preference_examples(tok, rows, max_length, source=str(path))
    info(f"{path}: {pair_report_text(report)}")
    return examples


def unpaired_examples(tokenizer, rows: list[dict], max_length: int, source: str = "data") -> list[dict]:
    """KTO's rows: {prompt, completion, label} (label true: desirable) tokenised as the pairs are (chat-templated
    prompt cut from the left to fit, completion + EOS never cut); empty or too-long completions are dropped.
    Preference pairs ({prompt, chosen, rejected}) are unpaired: chosen desirable, rejected undesirable."""
    if any(vision.row_has_images(r) for r in rows):  # its mismatched-prompt rows would pair text with other images
        raise UserError(f"{source}: --loss kto reads text rows; rows with images train with the pair losses (the "
                        "default sigmoid, ipo, ...).")
    if rows and "label" not in rows[0]:  # preference pairs (load_rows(path, ("unpaired", "preference")))
        pairs, _ = preference_examples(tokenizer, rows, max_length, source)
        return [{"prompt_ids": e["prompt_ids"], "completion_ids": e[k], "label": k == "chosen_ids"}
                for e in pairs for k in ("chosen_ids", "rejected_ids")]
    out = []
    prompts = [r["prompt"] for r in rows]
    for row, p, c in zip(rows, encode_prompts(tokenizer, prompts),
                         encode_completions(tokenizer, [r["completion"] for r in rows], prompts)):
        label = row["label"]
        if isinstance(label, str):
            label = {"true": True, "1": True, "false": False, "0": False}.get(label.strip().lower(), label)
        if not isinstance(label, (bool, int)) or label not in (0, 1):
            raise UserError(f"{source}: label {row['label']!r} is not true/false (desirable or not).")
        if not is_empty(row["completion"]) and len(c) < max_length:
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
            "labels": torch.tensor(pad(labels, -100)), "margin": torch.tensor([e["margin"] for e in examples]),
            **vision.collate_images([e["prompt_ids"] for e in examples] * 2)}
