"""--chat-template FILE: a Jinja chat template in place of the tokenizer's own (for a model whose template has none
or renders no tools). The file becomes the tokenizer's template right after loading, so prompts and tool schemas
render in its family's format; a file that cannot serve is refused with exit 2 before anything runs; the stage's
saved model keeps it (the next stage and `align export` read it from there), its sha256 is among the artifact's
inputs, and a pipeline reads a relative path from its TOML's folder and reruns the stage when the file changes."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from align import pipeline as P
from align.artifacts import sha256_file
from align.errors import UserError
from align.models import load_tokenizer, resolve
from tests.conftest import assert_user_error, output, run_align, small_sft

TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"
HERMES = TEMPLATES / "hermes.jinja"
MUL = {"type": "function", "function": {"name": "mul", "description": "Multiply two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}


def test_the_file_becomes_the_template_and_tools_render_in_its_family_format(tiny_model_dir):
    from align.data import encode_prompts
    from align.tools.chat_format import family, render_answer

    source = resolve(str(tiny_model_dir))
    own, tok = load_tokenizer(source), load_tokenizer(source, chat_template=str(HERMES))
    assert tok.chat_template == HERMES.read_text() != own.chat_template
    assert (family(own), family(tok)) == (None, "hermes")  # the tiny tokenizer's own template renders no tools
    (ids,) = encode_prompts(tok, ["What is 2 * 3?"], [MUL])
    text = tok.decode(ids)
    assert text.startswith("<|im_start|>system\nYou may call functions.") and "<tools>" + json.dumps(MUL) in text
    assert text.endswith("<|im_start|>user\nWhat is 2 * 3?<|im_end|>\n<|im_start|>assistant\n")
    assert "<tools>" not in own.decode(encode_prompts(own, ["What is 2 * 3?"], [MUL])[0])
    answer = render_answer(tok, "hermes", [MUL], "mul", {"a": 2, "b": 3}, "6")
    assert answer == "<|im_end|>\n<|im_start|>user\n<tool_response>\n6\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


def test_every_command_that_loads_a_models_tokenizer_takes_the_option():
    from align import registry

    takes = {" ".join(c.words) for c in registry.COMMANDS
             if "chat_template" in {f.name for f in dataclasses.fields(c.config_class())}}
    assert takes == {"sft", "rm train", "rm eval", "rm score", "ppo", "dpo", "grpo", "eval", "data show", "data make"}


BAD = {  # file text (None: no such file) -> what the message says
    "missing": (None, "cannot read it (No such file or directory)"),
    "syntax": ("{% for m in messages %}{{ m.content }\n", "not a Jinja template (line 1: unexpected '}')"),
    "no messages": ("Hello {{ name }}", "never reads `messages`"),
    "not utf-8": (b"\xff\xfe{{ messages }}", "not UTF-8 text"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_file_that_cannot_serve_exits_2_naming_it_before_anything_runs(tmp_path, case):
    content, says = BAD[case]
    f = tmp_path / "t.jinja"
    if content is not None:
        f.write_bytes(content.encode() if isinstance(content, str) else content)
    proc = run_align("sft", "--chat-template", f, "--out", tmp_path / "out", "--max-steps", 1, timeout=120)
    out = assert_user_error(proc, f"--chat-template {f}: {says}", "chat_template.jinja")
    assert not (tmp_path / "out").exists(), out  # refused before --out is touched


def test_a_stage_uses_the_file_and_its_saved_model_keeps_it_with_its_sha256_in_the_inputs(tmp_path):
    template = tmp_path / "mine.jinja"
    template.write_text(HERMES.read_text())
    out = tmp_path / "sft"
    proc = run_align("sft", *small_sft(), "--out", out, "--max-steps", 1, "--batch-size", 2, "--eval-samples", 0,
                     "--chat-template", template, timeout=300)
    assert proc.returncode == 0, output(proc)
    assert (out / "model" / "chat_template.jinja").read_text() == template.read_text()
    assert load_tokenizer(resolve(str(out))).chat_template == template.read_text()  # the next stage's, and export's
    inputs = json.loads((out / "artifact.json").read_text())["inputs"]
    assert inputs["chat_template"] == {str(template): sha256_file(template)}
    shown = run_align("data", "show", small_sft()[1], "--format", "prompts", "--n", 1, "--plain",
                      "--chat-template", template, timeout=120)
    assert shown.returncode == 0 and '"<|im_start|>user\\n' in shown.stdout, output(shown)


def test_a_pipeline_reads_a_relative_file_from_its_folder_and_reruns_the_stage_when_it_changes(tmp_path):
    (tmp_path / "templates").mkdir()
    template = tmp_path / "templates" / "t.jinja"
    template.write_text(HERMES.read_text())
    (tmp_path / "t.jsonl").write_text('{"prompt": "1 + 1 =", "answer": "2"}\n')
    f = tmp_path / "p.toml"
    f.write_text('[stages.eval]\nmodel = "tiny"\ndata = "t.jsonl"\nchat-template = "templates/t.jinja"\n')
    p = P.load(f)
    assert P.resolve(p, p.stages[0])["chat_template"] == str(template)
    fp = P.fingerprint(p, p.stages[0])
    template.write_text(HERMES.read_text().replace("You may call functions.", "Call functions."))
    assert P.fingerprint(P.load(f), P.load(f).stages[0]) != fp
    template.write_text("{{ oops")
    with pytest.raises(UserError, match=r"stages\.eval\.chat-template: --chat-template .*t\.jinja: not a Jinja"):
        P.load(f)
