"""What a chat template makes of a conversation, for align.data: the text a policy sees before its response, a
conversational completion's tokens, and which tokens of a whole conversation are the assistant's.

A conversational completion is the template's own rendering of the assistant turn(s) after the prompt (its
end-of-turn tokens included), so a model trains on exactly the tokens it will be asked to produce; the prompt is
the template up to its generation prompt, as at inference.
"""

from __future__ import annotations

import re
from pathlib import Path

from align.errors import UserError

IGNORE = -100  # the label of a token without loss
GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")  # a template that marks the assistant's tokens itself


def read_template(path: str) -> str:
    """--chat-template FILE: its Jinja text, checked to parse as a chat template (one that reads `messages`, with
    transformers' `{% generation %}` and loop controls); a UserError naming the file otherwise."""
    import jinja2
    from jinja2 import meta
    from jinja2.ext import Extension, loopcontrols

    class Generation(Extension):  # transformers' {% generation %}...{% endgeneration %}, parsed as its body
        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    fix = "give a file holding a chat template's Jinja text (as a model's chat_template.jinja)"
    try:
        text = Path(path).read_text(encoding="utf-8")
        ast = jinja2.Environment(extensions=[loopcontrols, Generation]).parse(text)
    except OSError as e:
        raise UserError(f"--chat-template {path}: cannot read it ({e.strerror or type(e).__name__}); {fix}.",
                        option="chat_template") from None
    except UnicodeDecodeError:
        raise UserError(f"--chat-template {path}: not UTF-8 text; {fix}.", option="chat_template") from None
    except jinja2.TemplateSyntaxError as e:
        why = (e.message or "syntax error").rstrip(".")
        raise UserError(f"--chat-template {path}: not a Jinja template (line {e.lineno}: {why}); {fix}.",
                        option="chat_template") from None
    if "messages" not in meta.find_undeclared_variables(ast):
        raise UserError(f"--chat-template {path}: never reads `messages`, so it cannot render a conversation; "
                        f"{fix}.", option="chat_template")
    return text


def prompt_text(tokenizer, prompt: str | list[dict], tools: list | None = None) -> str:
    """The text a policy sees before its response: the chat template with a generation prompt, if any; `tools`:
    the JSON schemas of the tools it may call, rendered by the template (align.tools.chat_format)."""
    messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    if tokenizer.chat_template:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                             **({"tools": tools} if tools else {}))
    text = "\n".join(m["content"] for m in messages)
    return (tokenizer.bos_token or "") + text if isinstance(prompt, list) else (tokenizer.bos_token or "") + prompt


def prompt_texts(tokenizer, prompts: list, tools: list | None = None) -> list[str]:
    """`prompt_text` for many prompts. Plain-string prompts are rendered once through the chat template around a
    sentinel and spliced (jinja per row costs ~0.2 ms: seconds per epoch of a large dataset). Templates that
    transform the content (trim, escape, ...) are detected by a second, padded probe and rendered per row."""
    sentinel = "\x00ALIGN\x00"
    probe = prompt_text(tokenizer, sentinel, tools)
    if probe.count(sentinel) != 1:
        return [prompt_text(tokenizer, p, tools) for p in prompts]
    head, tail = probe.split(sentinel)
    padded = " " + sentinel + " \n"
    if prompt_text(tokenizer, padded, tools) != head + padded + tail:
        return [prompt_text(tokenizer, p, tools) for p in prompts]
    return [head + p + tail if isinstance(p, str) else prompt_text(tokenizer, p, tools) for p in prompts]


def _render(tokenizer, messages: list[dict], generation_prompt: bool = False, tools: list | None = None) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt,
                                             **({"tools": tools} if tools else {}))
    except Exception as e:  # noqa: BLE001 - a template's own raise_exception (an unknown role, ...) is jinja's
        raise UserError(f"the chat template cannot render this conversation ({e}).") from None


def completion_text(tokenizer, prompt: str | list[dict], completion: list[dict]) -> str:
    """The text of a conversational completion (assistant messages) after `prompt` (a string is one user
    message): the template's rendering of prompt + completion past its rendering of the prompt with the
    generation prompt. Without a chat template: the messages' contents, one a line."""
    if not tokenizer.chat_template:
        return "\n".join(m["content"] for m in completion)
    messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    head, full = prompt_text(tokenizer, messages), _render(tokenizer, messages + completion)
    if not full.startswith(head):
        raise UserError(f"the chat template renders the prompt {_short(head)} differently inside the whole "
                        f"conversation {_short(full)}, so the completion's tokens cannot be told apart; give the "
                        "completion as a string.")
    return full[len(head):]


def completion_ids(tokenizer, prompt: str | list[dict], completion: list[dict]) -> list[int]:
    """The tokens of a conversational completion (`completion_text`), ending with EOS as a string completion
    does: a template whose assistant turn holds no EOS gets one appended (one whose turn holds it, followed by a
    newline, is kept as rendered)."""
    ids = tokenizer(completion_text(tokenizer, prompt, completion), add_special_tokens=False,
                    verbose=False)["input_ids"]
    return ids if tokenizer.eos_token_id in ids else ids + [tokenizer.eos_token_id]


def conversation_tokens(tokenizer, messages: list[dict], tools: list | None = None) -> tuple[list[int], list[int]]:
    """(input_ids, labels) of a whole conversation as the chat template renders it, the labels IGNORE on every
    token but the assistant turns' (their content and end-of-turn tokens). A template with {% generation %}
    markers says which tokens are the assistant's itself (transformers' return_assistant_tokens_mask); otherwise
    each assistant turn is the rendering of the conversation up to and including it past the rendering before it
    with the generation prompt (`prefix_tokens`). A final assistant turn without EOS gets one, as a completion.
    `tools`: the JSON schemas of the tools the conversation calls (a row's `tools`, as TRL's datasets give them):
    the template shows them; its tool calls are the assistant's tokens, the tools' answers are not."""
    if not tokenizer.chat_template:
        raise UserError("--assistant-only-loss finds the assistant turns through the chat template, and this "
                        "tokenizer has none; use a model whose tokenizer has one.")
    ids, labels = [], []
    if GENERATION.search(tokenizer.chat_template):
        enc = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True, **({"tools": tools} if tools else {}))
        ids, mask = list(enc["input_ids"]), list(enc["assistant_masks"])
        labels = [t if m else IGNORE for t, m in zip(ids, mask)]
    if not any(t != IGNORE for t in labels):  # no markers, or markers around nothing
        ids, labels = prefix_tokens(tokenizer, messages, tools)
    tail = last_span(labels)
    if messages[-1]["role"] == "assistant" and tokenizer.eos_token_id not in ids[tail:]:
        ids, labels = ids + [tokenizer.eos_token_id], labels + [tokenizer.eos_token_id]
    return ids, labels


def prefix_tokens(tokenizer, messages: list[dict], tools: list | None = None) -> tuple[list[int], list[int]]:
    """`conversation_tokens` by rendering prefixes: the text between an assistant turn's generation prompt and
    the end of its turn is the assistant's; each piece of the whole rendering is tokenised on its own (as a
    prompt and its completion are), the assistant's pieces labelled."""
    full, at, pieces = _render(tokenizer, messages, tools=tools), 0, []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        head, turn = _render(tokenizer, messages[:i], True, tools), _render(tokenizer, messages[: i + 1], tools=tools)
        if not (turn.startswith(head) and full.startswith(turn) and len(head) >= at):
            raise UserError(f"the chat template does not render the conversation up to assistant turn {i + 1} as the "
                            f"start of the whole conversation, so its tokens cannot be told apart; use a template "
                            "with {% generation %} markers.")
        pieces += [(full[at:len(head)], False), (full[len(head):len(turn)], True)]
        at = len(turn)
    pieces.append((full[at:], False))
    ids, labels = [], []
    for text, trained in pieces:
        t = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"] if text else []
        ids += t
        labels += t if trained else [IGNORE] * len(t)
    return ids, labels


def last_span(labels: list[int]) -> int:
    """Where the last run of labelled tokens starts (len(labels) when none is labelled)."""
    end = len(labels)
    while end and labels[end - 1] == IGNORE:
        end -= 1
    start = end
    while start and labels[start - 1] != IGNORE:
        start -= 1
    return start if end else len(labels)


def _short(text: str, n: int = 60) -> str:
    return repr(text) if len(text) <= n else repr(text[: n - 3]) + "..."
