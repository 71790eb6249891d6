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
    # message_start already says how long the prompt is (agents size their context from it).
    prompt = claude.messages.count_tokens(model=DEFAULT_MODEL, messages=HELLO).input_tokens
    assert events[0].message.usage.input_tokens == prompt > 0


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
                                        "tools": [{"type": "web_search_20250305", "name": "web_search"}],
                                        "tool_choice": {"type": "tool", "name": "web_search"}})
    assert server_tool.status_code == 400 and "web_search" in server_tool.json()["error"]["message"]
    no_such_tool = httpx.post(url, json={"model": DEFAULT_MODEL, "max_tokens": 5, "messages": HELLO,
                                         "tool_choice": {"type": "tool", "name": "nope"}})
    assert no_such_tool.status_code == 400 and no_such_tool.json()["error"]["type"] == "invalid_request_error"
    assert "nope" in no_such_tool.json()["error"]["message"]
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


# ---------------------------------------------------------------- what Claude Code sends

BILLING = {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.332.1c9; cc_entrypoint=sdk-cli;"}
SYSTEM = [{"type": "text", "cache_control": {"type": "ephemeral"}, "text": "You are a helpful assistant. " + " ".join(
    f"Rule {i}: answer in plain words, without lists." for i in range(20))}]
CLAUDE_CODE_FIELDS = {
    "thinking": {"type": "adaptive", "display": "omitted"}, "output_config": {"effort": "high"},
    "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
    "metadata": {"user_id": '{"device_id":"d1","account_uuid":"","session_id":"s-1"}'},
}


def post_message(server, **body) -> httpx.Response:
    return httpx.post(f"{server.base_url}/messages?beta=true", timeout=120,
                      headers={"anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14"},
                      json={"model": DEFAULT_MODEL, "temperature": 0, **body})


def test_claude_codes_request_shape_is_served(server):
    """max_tokens 32000 (capped by the context), a system message between turns, thinking
    adaptive, output_config, context_management, a JSON user_id, a deferred tool and a server
    tool: served, the deferred and server tools left out of the prompt."""
    messages = [{"role": "user", "content": [{"type": "text", "text": "Say hello."}]},
                {"role": "system", "content": [{"type": "text", "text": "The user is in /tmp."}]}]
    tools = [{**WEATHER_TOOL, "cache_control": {"type": "ephemeral"}},
             {"name": "Later", "description": "deferred", "input_schema": {"type": "object"}, "defer_loading": True},
             {"type": "web_search_20250305", "name": "web_search", "max_uses": 5}]
    answer = post_message(server, max_tokens=32000, system=[BILLING, *SYSTEM], messages=messages, tools=tools,
                          **CLAUDE_CODE_FIELDS)
    assert answer.status_code == 200, answer.text
    assert answer.json()["stop_reason"] in ("end_turn", "max_tokens", "tool_use")
    count = httpx.post(f"{server.base_url}/messages/count_tokens", json={
        "model": DEFAULT_MODEL, "system": SYSTEM, "messages": messages, "tools": tools}).json()["input_tokens"]
    alone = httpx.post(f"{server.base_url}/messages/count_tokens", json={
        "model": DEFAULT_MODEL, "system": SYSTEM, "messages": messages, "tools": [WEATHER_TOOL]}).json()["input_tokens"]
    assert count == alone  # the deferred and server tools are not in the prompt
    usage = answer.json()["usage"]
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == count


def test_max_tokens_beyond_the_context_ends_with_max_tokens(server):
    """Anthropic's bound, not chat's 16384: the answer is cut where the 2048-token context ends."""
    long_prompt = [{"role": "user", "content": "Continue this list: " + " ".join(["one two three"] * 600)}]
    answer = post_message(server, max_tokens=100000, messages=long_prompt, extra={"ignored": True})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    usage = body["usage"]
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] + usage["output_tokens"] <= 2048
    assert body["stop_reason"] in ("end_turn", "max_tokens")
    too_many = post_message(server, max_tokens=128001, messages=HELLO)
    assert too_many.status_code == 400 and "max_tokens" in too_many.json()["error"]["message"]


def test_the_billing_header_changes_nothing(server):
    """Claude Code's billing block is left out of the prompt: the same answer at temperature 0,
    the same prompt, and a request whose block differs reuses the cached prefix whole."""
    question = [{"role": "user", "content": "Name three colours."}]
    plain = post_message(server, max_tokens=20, system=SYSTEM, messages=question).json()
    billed = post_message(server, max_tokens=20, system=[BILLING, *SYSTEM], messages=question).json()
    other = {"type": "text", "text": "x-anthropic-billing-header: cc_version=9.9.9.fff; cc_entrypoint=cli;"}
    rebilled = post_message(server, max_tokens=20, system=[other, *SYSTEM], messages=question).json()
    assert billed["content"] == plain["content"] == rebilled["content"]
    total = plain["usage"]["input_tokens"] + plain["usage"]["cache_read_input_tokens"]
    assert billed["usage"]["input_tokens"] + billed["usage"]["cache_read_input_tokens"] == total
    assert rebilled["usage"]["cache_read_input_tokens"] >= total - 1


# A template that takes a system message only first, as Qwen's raise for Claude Code's requests.
SYSTEM_FIRST_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'system' and not loop.first %}"
    "{{ raise_exception('System message must be at the beginning.') }}{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_system_message_between_turns_fits_a_template_that_refuses_it(tmp_path):
    """Claude Code's system messages between turns: a template that takes a system message
    only first still renders the request, the notes joined to the user turn they precede."""
    template = tmp_path / "system-first.jinja"
    template.write_text(SYSTEM_FIRST_TEMPLATE)
    with run_server("--chat-template-file", str(template), "--slots", "1", "--ctx-size", "1024",
                    log_dir=tmp_path) as server:
        messages = [{"role": "user", "content": "Hello."},
                    {"role": "system", "content": "The user is in /tmp."},
                    {"role": "user", "content": "Where am I?"}]
        answer = post_message(server, max_tokens=8, system="You are brief.", messages=messages)
        assert answer.status_code == 200, answer.text
        plain = post_message(server, max_tokens=8, system="You are brief.", messages=[
            {"role": "user", "content": "Hello."}, {"role": "user", "content": "The user is in /tmp.\n\nWhere am I?"}])
        assert answer.json()["content"] == plain.json()["content"]
