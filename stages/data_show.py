"""`align data show DATA --model M`: the first rows of a dataset as a stage's trainer sees them — the tokens the
model's tokenizer and chat template make of each row, every span marked as carrying loss or not, with its token
counts. Nothing is trained or written; only the tokenizer is loaded.

    align data show chats.jsonl --model runs/sft --assistant-only-loss
    align data show pairs.jsonl --n 1 --plain | less
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from rich.markup import escape

from align import data as D
from align.chat import read_template
from align.config import Options, chat_template_opt, opt
from align.console import console
from align.errors import UserError
from align.models import load_tokenizer, resolve

FORMATS = ("auto", "sft", "preference", "unpaired", "prompts")
AUTO_ORDER = ("unpaired", "preference", "sft", "prompts")  # by the columns: label, chosen/rejected, completion, prompt


@dataclass(frozen=True)
class DataShowConfig(Options):
    data: str = opt("", "The data: a file (JSONL, JSON, Parquet), DIR[:SPLIT] (save_to_disk) or a Hub dataset "
                        "NAME[:SPLIT].", path=True)
    model: str = opt("tiny", "Whose tokenizer and chat template: a preset, a stage's --out artifact or a "
                             "save_pretrained dir.", path=True)
    n: int = opt(3, "Rows to show (the first N).", ge=1)
    format: str = opt("auto", "Read the rows as a stage does: sft (sft, ppo's ptx), preference (rm, dpo), unpaired "
                              "(dpo --loss kto), prompts (grpo, ppo, dpo --online); auto: by the columns.",
                      choices=FORMATS)
    assistant_only_loss: bool = opt(False, "sft {messages}: loss on every assistant turn, as `align sft "
                                           "--assistant-only-loss`.")
    max_length: int = opt(256, "--max-length of the stage (a prompt is cut from the left to fit).", ge=1)
    columns: str = opt("", "Rename columns: old=new,old2=new2, as the stage's --columns.")
    plain: bool = opt(False, "Plain text: each span on a line of its own, marked loss / no loss (the default when "
                             "the output is not a terminal: a pipe, a file).")
    trust_remote_code: bool = opt(False, "Allow tokenizer code from the model directory.")
    chat_template: str = chat_template_opt()

    def validate(self):
        super().validate()
        if not self.data:
            raise UserError("give the data to show: align data show FILE (or DIR[:SPLIT], or a Hub dataset NAME).")
        if self.columns:
            D.parse_columns(self.columns)
        if self.chat_template:
            read_template(self.chat_template)


def row_sequences(fmt: str, tok, row: dict, cfg: DataShowConfig) -> list[tuple[str, list[int], list[int]]]:
    """[(title, input_ids, labels)] of one row as the trainer of `fmt` tokenises it (labels -100: no loss): one
    sequence for sft and a prompt, one per response for a pair, the row's completion for unpaired data; [] (sft)
    or a UserError (a pair, an unpaired row) saying why when the stage drops the row."""
    def seq(title: str, prompt: list[int], response: list[int]):
        return title, prompt + response, [D.IGNORE] * len(prompt) + response

    if fmt == "sft":
        return [("", e["input_ids"], e["labels"])
                for e in D.sft_examples(tok, [row], cfg.max_length, cfg.assistant_only_loss)]
    if fmt == "preference":  # (a UserError when the stage drops the pair)
        (e,), _ = D.preference_examples(tok, [row], cfg.max_length, source="the stage drops it")
        return [seq("chosen", e["prompt_ids"], e["chosen_ids"]), seq("rejected", e["prompt_ids"], e["rejected_ids"])]
    if fmt == "unpaired":
        (e,) = D.unpaired_examples(tok, [row], cfg.max_length, source="the stage drops it")
        return [seq("desirable" if e["label"] else "undesirable", e["prompt_ids"], e["completion_ids"])]
    (p,) = D.encode_prompts(tok, [row["prompt"]])
    return [seq("prompt (the completions are sampled)", p, [])]


def spans(ids: list[int], labels: list[int]) -> list[tuple[bool, list[int]]]:
    """The runs of consecutive tokens that carry loss (True) or not (False), in order."""
    out: list[tuple[bool, list[int]]] = []
    for t, lab in zip(ids, labels):
        loss = lab != D.IGNORE
        if out and out[-1][0] == loss:
            out[-1][1].append(t)
        else:
            out.append((loss, [t]))
    return out


def show_sequence(tok, head: str, ids: list[int], labels: list[int], plain: bool) -> None:
    """A head line with the token counts, then the sequence: plain, one span a line (`loss` / `no loss`, its
    tokens, its text as a JSON string); on a terminal, the text with the loss spans in green, the rest dimmed."""
    from rich.text import Text

    n_loss = sum(lab != D.IGNORE for lab in labels[1:])  # the first token is never predicted
    title = f"{head}: {len(ids)} tokens, {n_loss} with loss"
    if plain:
        print(title)
        for loss, part in spans(ids, labels):
            text = json.dumps(tok.decode(part), ensure_ascii=False)
            print(f"  {'loss' if loss else 'no loss':<8}{len(part):>5}  {text}")
        return
    text = Text()
    text.append(f"{title}\n", style="bold")
    for loss, part in spans(ids, labels):
        text.append(tok.decode(part), style="bold green" if loss else "dim")
    console.print(text)


def run(cfg: DataShowConfig) -> dict:
    tok = load_tokenizer(resolve(cfg.model, expect=None), cfg.trust_remote_code, cfg.chat_template)
    fmts = AUTO_ORDER if cfg.format == "auto" else (cfg.format,)
    rows = D.load_rows(cfg.data, fmts, cfg.columns, limit=cfg.n)
    fmt = D.layout(fmts, D.columns_of(rows))[0]
    plain = cfg.plain or not console.is_terminal
    kind = f"{fmt} ({D.data_kind(rows)})" if fmt == "sft" else fmt
    if not plain:
        console.print(f"[bold]{escape(cfg.data)}[/]: {kind} data, tokenised for {escape(cfg.model)}: "
                      "[bold green]loss[/], [dim]no loss[/]")
    else:
        print(f"{cfg.data}: {kind} data, tokenised for {cfg.model}")
    shown = 0
    for i, row in enumerate(rows, 1):
        try:
            seqs = row_sequences(fmt, tok, row, cfg)
        except UserError as e:
            seqs = []
            print(f"row {i}: {e}")
        else:
            if not seqs:
                print(f"row {i}: the stage drops it (its completion does not fit --max-length {cfg.max_length})")
        for title, ids, labels in seqs:
            show_sequence(tok, f"row {i}{' ' + title if title else ''}", ids, labels, plain)
        shown += bool(seqs)
    return {"rows": len(rows), "shown": shown, "format": fmt}
