"""Reasoning: `reasoning_effort` switches thinking through the chat template, and thinking
text is split into `message.reasoning` / `delta.reasoning`."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.server import DEFAULT_MODEL, run_server

# ChatML that opens a <think> block when thinking is on (as Qwen3-style templates do).
THINKING_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking %}<think>\n{% endif %}{% endif %}"
)
QUESTION = [{"role": "user", "content": "What is 12 times 3?"}]


@pytest.fixture(scope="module")
def thinking_client(tmp_path_factory):
    directory = tmp_path_factory.mktemp("thinking")
    template = directory / "think.jinja"
    template.write_text(THINKING_TEMPLATE)
    with run_server("--chat-template-file", str(template), "--slots", "2", "--ctx-size", "1024",
                    log_dir=directory) as server:
        yield openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0), server


def test_thinking_on_puts_the_text_in_reasoning(thinking_client):
    client, _ = thinking_client
    response = client.chat.completions.create(model=DEFAULT_MODEL, messages=QUESTION, max_tokens=30,
                                              temperature=0, reasoning_effort="high", logprobs=True)
    choice = response.choices[0]
    message = choice.message
    # The tiny model never writes </think>: every generated token is reasoning, and counts.
    assert message.reasoning and message.reasoning.strip()
    assert not message.content
    tokens = choice.logprobs.content
    assert message.reasoning == b"".join(bytes(t.bytes) for t in tokens).decode()
    assert response.usage.completion_tokens == len(tokens) + (choice.finish_reason == "stop")


def test_thinking_off_by_default_and_with_none(thinking_client):
    client, _ = thinking_client
    for extra in ({}, {"reasoning_effort": "none"}):
        response = client.chat.completions.create(model=DEFAULT_MODEL, messages=QUESTION, max_tokens=20,
                                                  temperature=0, **extra)
        message = response.choices[0].message
        assert message.reasoning is None
        assert message.content


def test_chat_template_kwargs_can_switch_thinking_too(thinking_client):
    client, _ = thinking_client
    response = client.chat.completions.create(model=DEFAULT_MODEL, messages=QUESTION, max_tokens=10,
                                              temperature=0, extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    assert response.choices[0].message.reasoning


def test_streamed_reasoning_equals_non_streamed(thinking_client):
    client, _ = thinking_client
    kwargs = dict(model=DEFAULT_MODEL, messages=QUESTION, max_tokens=25, temperature=0, reasoning_effort="low")
    full = client.chat.completions.create(**kwargs).choices[0].message
    reasoning, content = "", ""
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        if chunk.choices:
            delta = chunk.choices[0].delta
            reasoning += getattr(delta, "reasoning", None) or (delta.model_extra or {}).get("reasoning") or ""
            content += delta.content or ""
    assert reasoning == full.reasoning
    assert content == (full.content or "")


def test_a_model_that_cannot_think_returns_null_reasoning(server, model):
    body = {"model": model, "messages": QUESTION, "max_tokens": 10, "reasoning_effort": "high"}
    response = httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=60).json()
    message = response["choices"][0]["message"]
    assert "reasoning" in message and message["reasoning"] is None
    assert message["content"]


@pytest.mark.parametrize("reasoning_format, names", [("reasoning_content", ("reasoning_content",)),
                                                      ("both", ("reasoning", "reasoning_content"))])
def test_reasoning_format_names_the_field(tmp_path, reasoning_format, names):
    """--reasoning-format: DeepSeek's `reasoning_content` (llama-server's default, what many chat
    front-ends read), or both names; the text is the same, streamed or not."""
    template = tmp_path / "think.jinja"
    template.write_text(THINKING_TEMPLATE)
    with run_server("--chat-template-file", str(template), "--reasoning-format", reasoning_format,
                    "--slots", "1", "--ctx-size", "1024", log_dir=tmp_path) as server:
        body = {"model": DEFAULT_MODEL, "messages": QUESTION, "max_tokens": 20, "temperature": 0,
                "reasoning_effort": "high"}
        message = httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=120).json()["choices"][0]["message"]
        assert {name for name in ("reasoning", "reasoning_content") if name in message} == set(names)
        text = message[names[0]]
        assert text and all(message[name] == text for name in names)
        streamed = {name: "" for name in names}
        with httpx.stream("POST", f"{server.base_url}/chat/completions", json={**body, "stream": True},
                          timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    for choice in json.loads(line[6:])["choices"]:
                        assert not set(choice["delta"]) & ({"reasoning", "reasoning_content"} - set(names))
                        for name in names:
                            streamed[name] += choice["delta"].get(name) or ""
        assert all(value == text for value in streamed.values()), streamed
        # Either name is taken back in an assistant turn, as clients of either kind send it.
        for name in ("reasoning", "reasoning_content"):
            turn = {"role": "assistant", "content": "36.", name: text}
            again = httpx.post(f"{server.base_url}/chat/completions", timeout=120,
                               json={**body, "messages": [*QUESTION, turn, {"role": "user", "content": "And 4?"}]})
            assert again.status_code == 200, again.text
