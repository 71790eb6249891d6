"""Anthropic's Messages API with the official SDK: text, streaming, tools, thinking, stop
sequences, count_tokens, x-api-key, and Anthropic's error shape."""

from __future__ import annotations

import anthropic
import httpx
import pytest

from tests.server import DEFAULT_MODEL, run_server
from tests.test_keys import create_key
from tests.test_reasoning import THINKING_TEMPLATE

GREEDY = {"temperature": 0}  # through extra_body: newer SDKs leave the argument out
WEATHER_TOOL = {"name": "get_weather", "description": "Get the current weather in a city",
                "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
HELLO = [{"role": "user", "content": "Say hello to the world."}]


@pytest.fixture(scope="module")
def claude(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.root_url, api_key="unused", max_retries=0, timeout=120)


def test_text_message(claude):
    message = claude.messages.create(model=DEFAULT_MODEL, max_tokens=24, messages=HELLO, system="You are brief.",
                                     extra_body=GREEDY)
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert [block.type for block in message.content] == ["text"] and message.content[0].text.strip()
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert 0 < message.usage.output_tokens <= 24
    prompt = claude.messages.count_tokens(model=DEFAULT_MODEL, messages=HELLO, system="You are brief.").input_tokens
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == prompt


def test_same_text_as_chat_completions(claude, client):
    message = claude.messages.create(model=DEFAULT_MODEL, max_tokens=30, messages=HELLO, extra_body=GREEDY)
    chat = client.chat.completions.create(model=DEFAULT_MODEL, max_tokens=30, messages=HELLO, temperature=0)
    assert message.content[0].text == chat.choices[0].message.content


def test_stream_adds_up_to_the_message(claude):
    with claude.messages.stream(model=DEFAULT_MODEL, max_tokens=30, messages=HELLO, extra_body=GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [event.type for event in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_start" in kinds and "content_block_stop" in kinds and "message_delta" in kinds
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta" and e.delta.type == "text_delta")
    assert text == final.content[0].text and text.strip()
    whole = claude.messages.create(model=DEFAULT_MODEL, max_tokens=30, messages=HELLO, extra_body=GREEDY)
    assert whole.content[0].text == text
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == \
        whole.usage.input_tokens + whole.usage.cache_read_input_tokens


def test_stop_sequence(claude):
    message = claude.messages.create(model=DEFAULT_MODEL, max_tokens=60, stop_sequences=[" ", "\n"],
                                     messages=[{"role": "user", "content": "Tell me about the sea."}],
                                     extra_body=GREEDY)
    assert message.stop_reason == "stop_sequence"
    assert message.stop_sequence in (" ", "\n")
    assert message.stop_sequence not in "".join(block.text for block in message.content)


@pytest.mark.parametrize("streamed", [False, True])
def test_tool_use(claude, streamed):
    request = dict(model=DEFAULT_MODEL, max_tokens=200, tools=[WEATHER_TOOL], tool_choice={"type": "any"},
                   messages=[{"role": "user", "content": "What is the weather in Oslo?"}], extra_body=GREEDY)
    if streamed:
        with claude.messages.stream(**request) as stream:
            message = stream.get_final_message()
    else:
        message = claude.messages.create(**request)
    uses = [block for block in message.content if block.type == "tool_use"]
    assert uses and all(use.name == "get_weather" and use.id for use in uses)
    assert isinstance(uses[0].input.get("city"), str)
    assert message.stop_reason in ("tool_use", "max_tokens")
    # The tool's result goes back as a tool_result block; the next answer reads it.
    follow_up = claude.messages.create(
        model=DEFAULT_MODEL, max_tokens=30, tools=[WEATHER_TOOL], extra_body=GREEDY, messages=[
            *request["messages"],
            {"role": "assistant", "content": [u.model_dump(include={"type", "id", "name", "input"}) for u in uses]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                          "content": "Sunny, 21 degrees"}]},
        ])
    assert follow_up.usage.cache_read_input_tokens > 0
    assert follow_up.content


@pytest.fixture(scope="module")
def thinking_claude(tmp_path_factory):
    directory = tmp_path_factory.mktemp("thinking-messages")
    template = directory / "think.jinja"
    template.write_text(THINKING_TEMPLATE)
    with run_server("--chat-template-file", str(template), "--slots", "1", "--ctx-size", "1024",
                    log_dir=directory) as server:
        yield anthropic.Anthropic(base_url=server.root_url, api_key="unused", max_retries=0)


@pytest.mark.parametrize("streamed", [False, True])
def test_thinking(thinking_claude, streamed):
    request = dict(model=DEFAULT_MODEL, max_tokens=30, thinking={"type": "enabled", "budget_tokens": 1024},
                   messages=[{"role": "user", "content": "What is 12 times 3?"}], extra_body=GREEDY)
    if streamed:
        with thinking_claude.messages.stream(**request) as stream:
            events = list(stream)
            message = stream.get_final_message()
        assert any(e.type == "content_block_delta" and e.delta.type == "thinking_delta" for e in events)
    else:
        message = thinking_claude.messages.create(**request)
    assert message.content[0].type == "thinking" and message.content[0].thinking.strip()
    plain = thinking_claude.messages.create(model=DEFAULT_MODEL, max_tokens=10, extra_body=GREEDY,
                                            messages=[{"role": "user", "content": "What is 12 times 3?"}])
    assert all(block.type != "thinking" for block in plain.content)


def test_errors_come_in_anthropics_shape(server):
    url = f"{server.base_url}/messages"
    missing_max_tokens = httpx.post(url, json={"model": DEFAULT_MODEL, "messages": HELLO})
    assert missing_max_tokens.status_code == 400
    body = missing_max_tokens.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in body["error"]["message"]
    unknown = httpx.post(url, json={"model": "nope", "max_tokens": 5, "messages": HELLO})
    assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "not_found_error"
    server_tool = httpx.post(url, json={"model": DEFAULT_MODEL, "max_tokens": 5, "messages": HELLO,
                                        "tools": [{"type": "web_search_20250305", "name": "web_search"}]})
    assert server_tool.status_code == 400 and "web_search_20250305" in server_tool.json()["error"]["message"]
    image = httpx.post(url, json={"model": DEFAULT_MODEL, "max_tokens": 5, "messages": [
        {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": "x"}}]}]})
    assert image.status_code == 400 and image.json()["type"] == "error"


def test_x_api_key_authenticates(tmp_path):
    db = tmp_path / "keys.sqlite3"
    key = create_key(db, "alice")
    with run_server("--slots", "1", "--ctx-size", "512", log_dir=tmp_path, env={"FASTRUN_KEYS_DB": str(db)}) as s:
        good = anthropic.Anthropic(base_url=s.root_url, api_key=key, max_retries=0)
        assert good.messages.create(model=DEFAULT_MODEL, max_tokens=3, messages=HELLO).content is not None
        bad = anthropic.Anthropic(base_url=s.root_url, api_key="fr_" + "x" * 43, max_retries=0)
        with pytest.raises(anthropic.AuthenticationError) as caught:
            bad.messages.create(model=DEFAULT_MODEL, max_tokens=3, messages=HELLO)
        assert caught.value.body["type"] == "error"
        assert caught.value.body["error"]["type"] == "authentication_error"
