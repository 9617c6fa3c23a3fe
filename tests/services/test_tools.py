"""Tool calling pieces without a stack: the request checks, the Hermes rendering, the parsers
(streamed delta by delta must equal parsed whole), the forced-choice constraints."""

from __future__ import annotations

import json

import pytest

from services.gateway.errors import APIError
from services.gateway.prompts import chat_prompt_ids, normalize_messages
from services.gateway.tools import ToolRequest, hermes_messages, parse_tools, split_message
from shared.model.chat_template import template_variables
from shared.model.grammar import GrammarCompiler
from shared.model.tokenizer import Tokenizer

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


@pytest.fixture(scope="module")
def tokenizer(default_gguf) -> Tokenizer:
    return Tokenizer.from_gguf(default_gguf)


@pytest.mark.parametrize("tools, choice, needle", [
    ([], None, "non-empty"),
    ([{"type": "function"}], None, "tools[0]"),
    ([{"type": "retrieval", "function": {"name": "x"}}], None, "tools[0]"),
    ([{"type": "function", "function": {"name": ""}}], None, "name"),
    ([WEATHER, WEATHER], None, "twice"),
    ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], None, "parameters"),
    ([WEATHER], "sometimes", "tool_choice"),
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "nope"),
    (None, "required", "needs 'tools'"),
])
def test_bad_tools_are_400s_naming_the_problem(tools, choice, needle):
    with pytest.raises(APIError) as err:
        parse_tools(tools, choice, None)
    assert err.value.status == 400 and needle in err.value.message


def test_choices_parse():
    assert parse_tools(None, None, None) is None
    assert parse_tools([WEATHER], None, None).choice == "auto"
    named = parse_tools([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}}, False)
    assert (named.choice, named.name, named.parallel) == ("named", "get_time", False)


HERMES_OUTPUT = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
                 '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


@pytest.mark.parametrize("piece", [1, 3, 7, 1000])
def test_hermes_parser_streamed_equals_whole(piece):
    request = ToolRequest([WEATHER, TIME], "auto")
    content, calls = split_message(request, HERMES_OUTPUT)
    assert content == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    parser = request.parser()
    text, deltas = "", []
    for i in range(0, len(HERMES_OUTPUT), piece):
        t, d = parser.push(HERMES_OUTPUT[i:i + piece])
        text, deltas = text + t, deltas + d
    t, d = parser.finish()
    text, deltas = text + t, deltas + d
    assert text.strip() == content
    assert [d["index"] for d in deltas] == [0, 1]
    assert [d["function"] for d in deltas] == [c["function"] for c in calls]


def test_hermes_parser_keeps_what_is_not_a_call():
    request = ToolRequest([WEATHER], "auto")
    assert split_message(request, "a <tool is not a tag") == ("a <tool is not a tag", [])
    assert split_message(request, "<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])
    content, calls = split_message(request, '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}')
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"city": "Rome"}  # never closed
    single = ToolRequest([WEATHER], "auto", parallel=False)
    content, calls = split_message(single, HERMES_OUTPUT)
    assert len(calls) == 1 and "get_time" in content  # parallel_tool_calls false: the first call only


def test_forced_choices_constrain_and_parse(tokenizer):
    compiler = GrammarCompiler(tokenizer)
    named = ToolRequest([WEATHER, TIME], "named", "get_weather")
    compiler.check(named.constraint())
    parser = named.parser()
    deltas = parser.push('{"city": ') [1] + parser.push('"Oslo"}')[1] + parser.finish()[1]
    assert deltas[0]["function"] == {"name": "get_weather", "arguments": ""} and deltas[0]["id"].startswith("call_")
    assert "".join(d["function"]["arguments"] for d in deltas) == '{"city": "Oslo"}'
    required = ToolRequest([WEATHER, TIME], "required")
    compiler.check(required.constraint())
    content, calls = split_message(required, '[{"name": "get_time", "arguments": {}}, '
                                             '{"name": "get_weather", "arguments": {"city": "Oslo"}}]')
    assert content is None and [c["function"]["name"] for c in calls] == ["get_time", "get_weather"]
    assert split_message(required, '[{"name": "get_ti') == ('[{"name": "get_ti', [])  # cut off: kept as text
    assert ToolRequest([WEATHER], "auto").constraint() is None


def test_hermes_rendering_of_tools_calls_and_results(tokenizer):
    assert "tools" not in template_variables(tokenizer.chat_template)  # SmolLM2's template has no tools
    assert "tools" in template_variables("{% for t in tools %}{{ t }}{% endfor %}")
    messages = normalize_messages([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    ])
    tools = ToolRequest([WEATHER], "auto")
    rendered = hermes_messages(messages, tools)
    assert rendered[0]["content"].startswith("Be brief.\n\nYou are a function calling AI model")
    assert '"name": "get_weather"' in rendered[0]["content"] and "<tools>" in rendered[0]["content"]
    assert rendered[2]["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert rendered[3] == {"role": "tool", "content": '<tool_response>\n{"temp": 21}\n</tool_response>'}
    text = tokenizer.decode(chat_prompt_ids(tokenizer, messages, tools))
    assert "<|im_start|>tool\n<tool_response>" in text and text.endswith("<|im_start|>assistant\n")
    none = tokenizer.decode(chat_prompt_ids(tokenizer, messages, ToolRequest([WEATHER], "none")))
    assert "<tools>" not in none and "<tool_call>" in none  # no tools offered; the history is still written
    with pytest.raises(APIError):
        normalize_messages([{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": 3}}]}])
