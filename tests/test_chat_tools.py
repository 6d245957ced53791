"""Users' tools in the model's own chat-template tool format (align.tools.chat_format): the family read from the
template (Hermes / Qwen, Llama 3.1, Mistral: tests/fixtures/chat_templates, written in each family's structure),
the tools shown in the prompt, a call parsed in the family's format, and the answer as the template renders a
tool message, appended as the environment's tokens after the policy's call."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from align.rollout.episode import Limits, run_episode
from align.tools.chat_format import family, parse_call, render_answer
from align.tools.sandbox import isolation

FIXTURES = Path(__file__).parent / "fixtures"
TEMPLATES = FIXTURES / "chat_templates"
MUL = {"type": "function", "function": {"name": "mul", "description": "Multiply two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
CALLS = {  # each family's call of mul(2, 3), as a model of that family writes it
    "hermes": '<tool_call>\n{"name": "mul", "arguments": {"a": 2, "b": 3}}\n</tool_call>',
    "llama3": '{"name": "mul", "parameters": {"a": 2, "b": 3}}',
    "mistral": '[TOOL_CALLS][{"name": "mul", "arguments": {"a": 2, "b": 3}, "id": "call0tool"}]',
}
ANSWERS = {  # the text after the call up to the next assistant turn, written out by hand from each template
    "hermes": "<|im_end|>\n<|im_start|>user\n<tool_response>\n6\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
    "llama3": "<|start_header_id|>ipython<|end_header_id|>\n\n6<|eos|><|start_header_id|>assistant<|end_header_id|>\n\n",
    "mistral": '[TOOL_RESULTS]{"content": "6", "call_id": "call0tool"}[/TOOL_RESULTS]',
}


def tokenizer(fam: str | None):
    from transformers import AutoTokenizer

    from align.paths import TOKENIZER_DIR

    tok = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    if fam:
        tok.chat_template = (TEMPLATES / f"{fam}.jinja").read_text()
    return tok


def test_the_family_is_read_from_the_template_and_a_template_without_tools_keeps_the_builtin_format():
    assert {f: family(tokenizer(f)) for f in CALLS} == {f: f for f in CALLS}
    assert family(tokenizer(None)) is None  # the shipped tokenizer's template renders no tools
    chatml = tokenizer(None)
    chatml.chat_template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    assert family(chatml) is None  # SmolLM2's kind: ChatML, no tools


@pytest.mark.parametrize("fam", list(CALLS))
def test_a_call_is_parsed_in_its_familys_format(fam):
    assert parse_call(fam, CALLS[fam]) == ("mul", {"a": 2, "b": 3})
    assert parse_call(fam, "The answer is 6.") is None  # an answer, no call
    broken = {"hermes": "<tool_call>{name: mul}</tool_call>", "llama3": '{"name": "mul", "parameters": [2, 3]}',
              "mistral": '[TOOL_CALLS][{"arguments": {}}]'}[fam]
    assert parse_call(fam, broken).startswith("error: a call is")
    as_string = CALLS[fam].replace('{"a": 2, "b": 3}', json.dumps(json.dumps({"a": 2, "b": 3})))
    assert parse_call(fam, as_string) == ("mul", {"a": 2, "b": 3})  # arguments written as a JSON string


@pytest.mark.parametrize("fam", list(CALLS))
def test_the_answer_is_the_templates_tool_message_after_the_call(fam):
    tok = tokenizer(fam)
    assert render_answer(tok, fam, [MUL], "mul", {"a": 2, "b": 3}, "6") == ANSWERS[fam]
    # the prompt shows the tool (the schema as the template renders it)
    from align.data import encode_prompts

    (ids,) = encode_prompts(tok, ["What is 2 * 3?"], [MUL])
    assert '"name": "mul"' in tok.decode(ids) and "What is 2 * 3?" in tok.decode(ids)
    (plain,) = encode_prompts(tok, ["What is 2 * 3?"])
    assert len(plain) < len(ids)


@pytest.mark.skipif(isolation() is None, reason="this machine cannot isolate a process's network")
@pytest.mark.parametrize("fam", list(CALLS))
def test_an_episode_calls_a_users_function_in_its_familys_format(fam):
    """The policy writes the family's call (ended by its stop text, or by EOS), the sandboxed function answers, the
    template's tool message follows as the environment's tokens, the policy answers; the episode's tokens are the
    policy's as written and the answer tokenised once."""
    from align import tools

    tok = tokenizer(fam)
    encode = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    agent = tools.agent(f"{FIXTURES / 'user_tools.py'}:mul", 64, 3, 64, tokenizer=tok)
    try:
        assert agent.schemas[0]["function"]["name"] == "mul"
        env = agent.make_env({})
        eos = tok.eos_token_id
        call = encode(CALLS[fam]) + ([] if env.stops else [eos])
        turns = iter([(call, "stop" if env.stops else "eos"), (encode("It is 6.") + [eos], "eos")])

        def sample_turns(contexts, which, offsets, budgets, stops):
            assert stops == env.stops
            ids, why = next(turns)
            return [(ids, [0.0] * len(ids), why)]

        ep = run_episode(sample_turns, encode, decode, env, {}, encode("What is 2 * 3?"), Limits(3, 256, 512, 512))
    finally:
        agent.close()
    observation = encode(ANSWERS[fam])
    assert ep.ids == call + observation + encode("It is 6.") + [eos]
    assert ep.policy_mask == [1] * len(call) + [0] * len(observation) + [1] * (len(encode("It is 6.")) + 1)
    assert (ep.tool_calls, ep.tool_errors, ep.stop, len(ep.turns)) == (1, 0, "done", 2)


@pytest.mark.parametrize("tools_as", ["list", "json"])
def test_sft_on_a_tool_use_conversation_learns_the_assistants_calls_and_answer_not_the_tools(tools_as):
    """A {messages, tools} row (TRL's tool-calling format): the template shows the tools, and the loss covers the
    assistant's call and final answer (their end-of-turn tokens included), never the system prompt, the user's
    question or the tool's answer."""
    from align.chat import IGNORE
    from align.data import sft_examples

    tok = tokenizer("hermes")
    messages = [{"role": "user", "content": "What is 2 * 3?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": {"name": "mul", "arguments": {"a": 2, "b": 3}}}]},
                {"role": "tool", "name": "mul", "content": "6"},
                {"role": "assistant", "content": "It is 6."}]
    row = {"messages": messages, "tools": [MUL] if tools_as == "list" else json.dumps([MUL])}
    (ex,) = sft_examples(tok, [row], 2048, True)
    ids, labels = ex["input_ids"], ex["labels"]
    text = tok.decode(ids)
    assert '"name": "mul", "description"' in text  # the tools, shown by the template
    learned = tok.decode([t for t, lab in zip(ids, labels) if lab != IGNORE])
    call = '<tool_call>\n{"name": "mul", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>\n'
    # (+ EOS: this tokenizer's is not the template's <|im_end|>, and a final turn ends with the model's EOS)
    assert learned == call + "It is 6.<|im_end|>\n" + tok.eos_token
    assert "<tool_response>" not in learned and "What is" not in learned
