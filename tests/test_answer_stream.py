"""One answer stream feeds every API (entrypoints/answer.py): the same greedy answer streamed as
chat chunks, as Responses events and as Messages events carries the same text and end, and a
forced call arrives whole in each, in its client's own types (the SDKs from PyPI parse them)."""

from __future__ import annotations

import json

import anthropic
import pytest

from fastrun_cpp.entrypoints.openai.protocol import ChatCompletionChunk, ChatCompletionChunkChoice, ChatDelta
from fastrun_cpp.entrypoints.openai.utils import TextChunks
from tests.server import DEFAULT_MODEL

PROMPT = "Write two sentences about the sea."
CALL_TOKENS = 200  # room for a whole call, however long the small model makes the city
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


@pytest.fixture(scope="module")
def claude(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.root_url, api_key="unused", max_retries=0, timeout=120)


def chat_stream(client, max_tokens: int = 40, **extra) -> tuple[str, list[tuple[str, str]], str]:
    text, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(model=DEFAULT_MODEL, max_tokens=max_tokens, temperature=0, stream=True,
                                                messages=[{"role": "user", "content": PROMPT}], **extra):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                name, arguments = calls.get(call.index, ("", ""))
                calls[call.index] = (name + (call.function.name or ""), arguments + (call.function.arguments or ""))
            finish = choice.finish_reason or finish
    return text, [calls[i] for i in sorted(calls)], finish


def test_the_same_text_streams_through_chat_responses_and_messages(client, claude):
    text, _, finish = chat_stream(client)
    assert text and finish in ("stop", "length")

    deltas, done = "", None
    for event in client.responses.create(model=DEFAULT_MODEL, input=PROMPT, max_output_tokens=40, temperature=0,
                                         stream=True):
        if event.type == "response.output_text.delta":
            deltas += event.delta
        elif event.type in ("response.completed", "response.incomplete"):
            done = event.response
    assert deltas == text == done.output_text
    assert done.status == ("completed" if finish == "stop" else "incomplete")

    with claude.messages.stream(model=DEFAULT_MODEL, max_tokens=40, messages=[{"role": "user", "content": PROMPT}],
                                extra_body={"temperature": 0}) as stream:
        streamed = "".join(stream.text_stream)
        message = stream.get_final_message()
    assert streamed == text == message.content[0].text
    assert message.stop_reason == ("end_turn" if finish == "stop" else "max_tokens")
    assert message.usage.output_tokens > 0


def test_a_forced_tool_call_streams_the_same_call_through_each_api(client, claude):
    tool = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                             "parameters": WEATHER}}
    _, calls, finish = chat_stream(client, CALL_TOKENS, tools=[tool], tool_choice="required")
    assert finish == "tool_calls" and calls and calls[0][0] == "get_weather"
    assert isinstance(json.loads(calls[0][1])["city"], str)  # whole arguments, as the grammar made them

    items = []
    for event in client.responses.create(
            model=DEFAULT_MODEL, input=PROMPT, max_output_tokens=CALL_TOKENS, temperature=0, stream=True,
            tool_choice="required",
            tools=[{"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": WEATHER}]):
        if event.type == "response.output_item.done" and event.item.type == "function_call":
            items.append(event.item)
    assert items and items[0].name == "get_weather" and isinstance(json.loads(items[0].arguments)["city"], str)

    with claude.messages.stream(model=DEFAULT_MODEL, max_tokens=CALL_TOKENS,
                                messages=[{"role": "user", "content": PROMPT}], tools=[{"name": "get_weather", "description": "Weather in a city", "input_schema": WEATHER}],
                                tool_choice={"type": "any"}, extra_body={"temperature": 0}) as stream:
        message = stream.get_final_message()
    uses = [block for block in message.content if block.type == "tool_use"]
    assert message.stop_reason == "tool_use" and uses and uses[0].name == "get_weather"
    assert isinstance(uses[0].input["city"], str)


TRICKY_TEXTS = [" the", "", 'say "hi"', "back\\slash", "line\nbreak\ttab\r", "\x00\x01\x1f\x7f", "\u2028\u2029",
                "é 中文 😀", "</script><b>", "\ud7ff\ue000\uffff", TextChunks.MARK]


@pytest.mark.parametrize("names", [("reasoning",), ("reasoning_content",), ("reasoning", "reasoning_content")])
@pytest.mark.parametrize("model", ["smollm2", 'a "quoted" \\ model é', "mark" + TextChunks.MARK, TextChunks.MARK])
def test_a_text_chunk_from_its_template_is_the_chunk_its_models_write(names, model):
    """A streamed token's chunk is spliced into a template (entrypoints/openai/utils.py's
    TextChunks): byte for byte what building and dumping its models writes, for every text,
    both fields and every name reasoning is written under. A model named like the mark gets
    no template: its chunks are dumped whole, the same bytes."""
    context = {"reasoning_names": names}

    def dumped(index: int, field: str, text: str) -> str:
        choice = ChatCompletionChunkChoice(index=index, delta=ChatDelta(**{field: text}))
        return ChatCompletionChunk(id="chatcmpl-1", created=1, model=model, choices=[choice]).model_dump_json(context=context)

    chunks = TextChunks(dumped)
    for index in (0, 3):
        for field in ("content", "reasoning"):
            for text in TRICKY_TEXTS:
                rendered = chunks.render(index, field, text)
                assert rendered == dumped(index, field, text)
                delta = json.loads(rendered)["choices"][0]["delta"]
                assert delta == ({name: text for name in names} if field == "reasoning" else {"content": text})


def test_a_text_chunk_without_a_template_that_fits_is_dumped_whole():
    """A dump that holds the mark beside the text (here in a field of its own), or that holds no
    text at all, gets no template: each chunk is then its own dump, never the mark's place
    filled twice."""
    chunks = TextChunks(lambda index, field, text: json.dumps({"a": TextChunks.MARK, field: text}))
    assert json.loads(chunks.render(0, "content", "hi")) == {"a": TextChunks.MARK, "content": "hi"}
    assert json.loads(chunks.render(0, "content", "ho")) == {"a": TextChunks.MARK, "content": "ho"}
    fixed = TextChunks(lambda index, field, text: json.dumps({"fixed": "text"}))
    assert json.loads(fixed.render(0, "content", "hi")) == {"fixed": "text"}
