"""Tool-call and reasoning parsers on real outputs of each model family, whole and streamed
with split points anywhere."""

from __future__ import annotations

import json
import random

import pytest

from fastrun_cpp.parsers import select_reasoning_parser, select_tool_parser
from fastrun_cpp.parsers.chat_output import ChatOutputParser
from fastrun_cpp.parsers.reasoning import HarmonyParser, ThinkTagParser
from fastrun_cpp.parsers.tool_calls import (
    FallbackToolParser,
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    PythonicToolParser,
)

# (family, reasoning parser, prompt opened the reasoning, tool parser, output, expected)
# expected: (reasoning, content, [(name, arguments as JSON)])
CASES = [
    ("qwen2.5 two calls", None, False, HermesToolParser(),
     'Let me check both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
     '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n</tool_call>',
     (None, "Let me check both.\n", [("get_weather", {"city": "Paris", "unit": "celsius"}),
                                      ("get_time", {"tz": "Europe/Paris"})])),
    ("qwen2.5 plain answer", None, False, HermesToolParser(),
     "The weather in Paris is usually mild; a <tool> is something else.",
     (None, "The weather in Paris is usually mild; a <tool> is something else.", [])),
    ("qwen3 thinking then call", ThinkTagParser(), False, HermesToolParser(),
     '<think>\nThe user wants the weather in Paris, so I call get_weather.\n</think>\n\n<tool_call>\n'
     '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     ("\nThe user wants the weather in Paris, so I call get_weather.\n", "", [("get_weather", {"city": "Paris"})])),
    ("llama3.1 python_tag", None, False, Llama3JsonToolParser(),
     '<|python_tag|>{"name": "get_weather", "parameters": {"city": "San Francisco", "days": 2}}',
     (None, "", [("get_weather", {"city": "San Francisco", "days": 2})])),
    ("llama3.1 bare json, two calls", None, False, Llama3JsonToolParser(),
     '{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "get_time", "parameters": {}}',
     (None, "", [("get_weather", {"city": "Oslo"}), ("get_time", {})])),
    ("llama3.1 prose", None, False, Llama3JsonToolParser(),
     "It is sunny in Oslo today.", (None, "It is sunny in Oslo today.", [])),
    ("mistral v3 array", None, False, MistralToolParser(),
     '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome", "days": [1, 2]}}, '
     '{"name": "get_time", "arguments": {"tz": "CET"}}]',
     (None, "", [("get_weather", {"city": "Rome", "days": [1, 2]}), ("get_time", {"tz": "CET"})])),
    ("mistral v11 args", None, False, MistralToolParser(),
     '[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}',
     (None, "", [("get_weather", {"city": "Rome"})])),
    ("gemma tool_code", None, False, PythonicToolParser(),
     '```tool_code\nget_weather(city="Tokyo", days=3)\n```',
     (None, "", [("get_weather", {"city": "Tokyo", "days": 3})])),
    ("gemma pythonic list", None, False, PythonicToolParser(),
     "[get_weather(city='Tokyo'), get_time(tz='JST')]",
     (None, "", [("get_weather", {"city": "Tokyo"}), ("get_time", {"tz": "JST"})])),
    ("deepseek-r1 prompt-opened think", ThinkTagParser(), True, None,
     "Okay, the user asks for 2+2. That is 4.\n</think>\n\nThe answer is **4**.",
     ("Okay, the user asks for 2+2. That is 4.\n", "The answer is **4**.", [])),
    ("deepseek-r1 think tag in output", ThinkTagParser(), False, None,
     "<think>\nSimple.\n</think>\n\nFour.", ("\nSimple.\n", "Four.", [])),
    ("gpt-oss harmony", HarmonyParser(), False, None,
     "<|channel|>analysis<|message|>The user asks 2+2. Answer 4.<|end|><|start|>assistant"
     "<|channel|>final<|message|>2 + 2 = 4.<|return|>",
     ("The user asks 2+2. Answer 4.", "2 + 2 = 4.", [])),
    ("fallback format", None, False, FallbackToolParser(),
     'Sure.\n<tool_call>\n{"name": "lookup", "arguments": {"q": "ünïcode \\"quoted\\""}}\n</tool_call>',
     (None, "Sure.\n", [("lookup", {"q": 'ünïcode "quoted"'})])),
]


def run(pieces, reasoning, opened, tools):
    parser = ChatOutputParser(reasoning=reasoning, starts_in_reasoning=opened, tools=tools)
    reasoning_text, content, calls = "", "", {}
    for i, piece in enumerate(pieces):
        delta = parser.feed(piece, final=i == len(pieces) - 1)
        reasoning_text += delta.reasoning
        content += delta.content
        for call in delta.tool_calls:
            entry = calls.setdefault(call.index, {"id": None, "name": None, "arguments": ""})
            if call.id is not None:
                assert entry["id"] is None, "id sent twice"
                entry["id"], entry["name"] = call.id, call.name
            else:
                assert entry["id"] is not None, "arguments before the call's first delta"
            entry["arguments"] += call.arguments
    return parser.result(), reasoning_text, content, calls


def check(result, reasoning_text, content, calls, expected):
    want_reasoning, want_content, want_calls = expected
    assert result.reasoning == want_reasoning
    assert result.content == want_content
    assert [(c.name, json.loads(c.arguments)) for _, c in result.tool_calls] == want_calls
    # The deltas add up to exactly the whole answer.
    assert reasoning_text == (want_reasoning or "")
    assert content == want_content
    assert [(calls[i]["id"], calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)] == \
        [(call_id, c.name, c.arguments) for call_id, c in result.tool_calls]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_whole_output(case):
    _, reasoning, opened, tools, text, expected = case
    check(*run([text], reasoning, opened, tools), expected)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_every_single_split_point(case):
    _, reasoning, opened, tools, text, expected = case
    for cut in range(1, len(text)):
        check(*run([text[:cut], text[cut:]], reasoning, opened, tools), expected)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_character_by_character_and_random_splits(case):
    _, reasoning, opened, tools, text, expected = case
    check(*run(list(text), reasoning, opened, tools), expected)
    rng = random.Random(len(text))
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 12))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        check(*run(pieces, reasoning, opened, tools), expected)


def test_parsers_are_chosen_from_the_chat_template():
    assert isinstance(select_tool_parser("{% for tool in tools %}<tool_call>{% endfor %}"), HermesToolParser)
    assert isinstance(select_tool_parser("{{ tools }} [TOOL_CALLS]"), MistralToolParser)
    assert isinstance(select_tool_parser("{% if tools %}<|python_tag|>{% endif %}"), Llama3JsonToolParser)
    assert isinstance(select_tool_parser("{{ messages }}"), FallbackToolParser)  # no tools in the template
    assert isinstance(select_tool_parser(None), FallbackToolParser)
    assert isinstance(select_tool_parser("{{ tools }}", override="pythonic"), PythonicToolParser)
    assert isinstance(select_reasoning_parser("{{ '<think>' }}"), ThinkTagParser)
    assert isinstance(select_reasoning_parser("<|channel|>analysis"), HarmonyParser)
    assert select_reasoning_parser("{{ messages }}") is None


def test_think_parser_sees_a_prompt_that_opened_the_reasoning():
    assert ThinkTagParser().starts_in_reasoning("<|im_start|>assistant\n<think>\n")
    assert not ThinkTagParser().starts_in_reasoning("<|im_start|>assistant\n")


# ------------------------------------------------------------------ a call that repeats an earlier one

FIRST_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
SECOND_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


def _fed_until_stop(parser: ChatOutputParser, text: str) -> int | None:
    """Feeds `text` character by character; how much of it was fed when the parser asked to stop."""
    for position in range(1, len(text) + 1):
        parser.feed(text[position - 1])
        if parser.stop_requested:
            return position
    return None


def test_a_call_certain_to_repeat_stops_before_it_closes():
    # The grammar allows only "city": once its value is finished, only the closing can follow.
    parser = ChatOutputParser(tools=FallbackToolParser(), closed_keys={"get_weather": frozenset({"city"})})
    stopped_at = _fed_until_stop(parser, FIRST_CALL + SECOND_CALL)
    assert stopped_at == len(FIRST_CALL) + SECOND_CALL.index('"Oslo"') + len('"Oslo"')
    assert parser.ended_with_calls
    assert [call.arguments for _, call in parser.result().tool_calls] == ['{"city": "Oslo"}']


@pytest.mark.parametrize("second, closed_keys", [
    ('{"city": "Oslo City"}', {"get_weather": frozenset({"city"})}),  # a prefix of the value is not the value
    ('{"city": "Oslo", "unit": "c"}', None),  # other keys may come: only the whole call tells
    ('{"city": "Oslo", "unit": "c"}', {"get_weather": frozenset({"city", "unit"})}),
])
def test_a_call_that_may_still_differ_is_not_stopped_early(second, closed_keys):
    parser = ChatOutputParser(tools=FallbackToolParser(), closed_keys=closed_keys)
    text = FIRST_CALL + '<tool_call>\n{"name": "get_weather", "arguments": ' + second + '}\n</tool_call>'
    assert _fed_until_stop(parser, text) is None
    assert [call.arguments for _, call in parser.result().tool_calls] == ['{"city": "Oslo"}', second]


def test_a_number_is_not_finished_until_something_follows_it():
    parser = ChatOutputParser(tools=FallbackToolParser(), closed_keys={"f": frozenset({"n"})})
    call = '<tool_call>\n{"name": "f", "arguments": {"n": 12}}\n</tool_call>\n'
    text = call + call.replace("12", "123")
    assert _fed_until_stop(parser, text) is None
    assert len(parser.result().tool_calls) == 2


def test_an_answer_cut_inside_an_unsent_later_call_ended_with_its_calls():
    parser = ChatOutputParser(tools=FallbackToolParser())
    parser.feed(FIRST_CALL + '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Ber', final=True)
    assert parser.ended_with_calls  # what was sent is one complete call
    cut_first = ChatOutputParser(tools=FallbackToolParser())
    cut_first.feed('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Ber', final=True)
    assert not cut_first.ended_with_calls  # the call sent is cut: finish_reason stays "length"
