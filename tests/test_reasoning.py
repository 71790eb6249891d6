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


# ---------------------------------------------------------------- reasoning budget

def _spelled(choice: dict) -> str:
    """The answer's text as its tokens spell it (logprobs' bytes), markers included."""
    return b"".join(bytes(token["bytes"]) for token in choice["logprobs"]["content"]).decode()


def _token_text(choice: dict, count: int) -> str:
    return b"".join(bytes(token["bytes"]) for token in choice["logprobs"]["content"][:count]).decode()


@pytest.mark.parametrize("share", [0.0, 0.5, 1.0])
def test_a_budget_closes_the_reasoning_after_exactly_its_tokens(thinking_client, share):
    """The tiny model never writes </think> itself: with a budget, the server writes the closing
    after exactly `budget` tokens of reasoning, and the model answers after it. Budgets from 1
    to one short of what the model reasons unbounded (it may end with its end-of-turn token)."""
    _, server = thinking_client
    body = {"model": DEFAULT_MODEL, "messages": QUESTION, "max_tokens": 40, "temperature": 0,
            "reasoning_effort": "high", "logprobs": True}
    unbounded = httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=120).json()
    reasoned = len(unbounded["choices"][0]["logprobs"]["content"])
    assert reasoned >= 3, unbounded
    budget = 1 + round(share * (reasoned - 3))
    body["thinking_budget_tokens"] = budget
    response = httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=120).json()
    choice = response["choices"][0]
    spelled = _spelled(choice)
    assert spelled.index("\n</think>\n\n") == len(_token_text(choice, budget)), spelled
    assert "</think>" not in _token_text(choice, budget)
    assert response["usage"]["completion_tokens_details"] == {"reasoning_tokens": budget}
    assert choice["message"]["reasoning"] == _token_text(choice, budget) + "\n"
    # The answer follows the closing; streamed, the same split and the same count.
    assert spelled.endswith(choice["message"]["content"] or "")
    reasoning, content, usage = "", "", None
    with httpx.stream("POST", f"{server.base_url}/chat/completions", timeout=120,
                      json={**body, "stream": True, "stream_options": {"include_usage": True}}) as streamed:
        for line in streamed.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
                for part in chunk["choices"]:
                    reasoning += part["delta"].get("reasoning") or ""
                    content += part["delta"].get("content") or ""
    assert (reasoning, content) == (choice["message"]["reasoning"], choice["message"]["content"] or "")
    assert usage["completion_tokens_details"] == {"reasoning_tokens": budget}


def test_a_budget_of_0_turns_thinking_off_and_unlimited_leaves_it_on(thinking_client):
    _, server = thinking_client
    base = {"model": DEFAULT_MODEL, "messages": QUESTION, "max_tokens": 12, "temperature": 0}
    off = httpx.post(f"{server.base_url}/chat/completions", timeout=120,
                     json={**base, "reasoning_effort": "high", "reasoning_budget_tokens": 0}).json()
    assert off["choices"][0]["message"]["reasoning"] is None and off["choices"][0]["message"]["content"]
    unlimited = httpx.post(f"{server.base_url}/chat/completions", timeout=120,
                           json={**base, "thinking_budget_tokens": -1}).json()
    assert unlimited["choices"][0]["message"]["reasoning"]  # a budget other than 0 turns thinking on
    # Unlimited, the engine still counts the reasoning's tokens (Responses reads them from here).
    reasoning_tokens = unlimited["usage"]["completion_tokens_details"]["reasoning_tokens"]
    assert 0 < reasoning_tokens <= unlimited["usage"]["completion_tokens"]


def test_anthropic_budget_tokens_is_the_same_hard_cap(thinking_client):
    _, server = thinking_client
    chat = httpx.post(f"{server.base_url}/chat/completions", timeout=120, json={
        "model": DEFAULT_MODEL, "messages": QUESTION, "max_tokens": 30, "temperature": 0,
        "reasoning_effort": "low", "thinking_budget_tokens": 6}).json()["choices"][0]["message"]
    message = httpx.post(f"{server.base_url}/messages", timeout=120, json={
        "model": DEFAULT_MODEL, "messages": QUESTION, "max_tokens": 30, "temperature": 0,
        "thinking": {"type": "enabled", "budget_tokens": 6}}).json()
    blocks = {block["type"]: block for block in message["content"]}
    assert blocks["thinking"]["thinking"] == chat["reasoning"]
    assert blocks.get("text", {}).get("text", "") == (chat["content"] or "")


@pytest.mark.parametrize("field, value", [("thinking_budget_tokens", -2), ("thinking_budget_tokens", 1 << 40),
                                          ("reasoning_budget_tokens", "many"), ("thinking_budget_tokens", 1e30)])
def test_budgets_out_of_range_are_400s(thinking_client, field, value):
    _, server = thinking_client
    response = httpx.post(f"{server.base_url}/chat/completions", timeout=60, json={
        "model": DEFAULT_MODEL, "messages": QUESTION, "max_tokens": 5, field: value})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert field in response.json()["error"]["message"]
    huge = httpx.post(f"{server.base_url}/messages", timeout=60, json={
        "model": DEFAULT_MODEL, "messages": QUESTION, "max_tokens": 5,
        "thinking": {"type": "enabled", "budget_tokens": 1 << 40}})
    assert huge.status_code == 400 and huge.json()["type"] == "error", huge.text


# Harmony (gpt-oss) with the analysis channel opened by the prompt; the tiny model spells the
# channel markers as plain text, which is what the budget's closing must produce too.
HARMONY_TEMPLATE = (
    "{% for message in messages %}<|start|>{{ message['role'] }}<|message|>{{ message['content'] }}<|end|>"
    "{% endfor %}{% if add_generation_prompt %}<|start|>assistant<|channel|>analysis<|message|>{% endif %}"
)


def test_the_server_budget_and_message_apply_to_each_reasoning_format(tmp_path):
    """--reasoning-budget and --reasoning-budget-message, for `<think>` and for harmony: the
    reasoning ends after exactly the budget, then the message, then the format's own closing."""
    message = "Time is up."
    for parser, template, closing, end in (("think", THINKING_TEMPLATE, f"{message}\n</think>\n\n", "</think>"),
                                           ("harmony", HARMONY_TEMPLATE,
                                            f"{message}<|end|><|start|>assistant<|channel|>final<|message|>",
                                            "<|end|>")):
        (tmp_path / f"{parser}.jinja").write_text(template)
        (tmp_path / parser).mkdir()
        with run_server("--chat-template-file", str(tmp_path / f"{parser}.jinja"), "--reasoning-parser", parser,
                        "--reasoning-budget", "3", "--reasoning-budget-message", message,
                        "--slots", "1", "--ctx-size", "1024", log_dir=tmp_path / parser) as server:
            body = {"model": DEFAULT_MODEL, "messages": QUESTION, "max_tokens": 40, "temperature": 0,
                    "reasoning_effort": "medium", "logprobs": True}
            response = httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=120).json()
            choice = response["choices"][0]
            spelled = _spelled(choice)
            assert closing in spelled, (parser, spelled)
            assert spelled.index(closing) == len(_token_text(choice, 3)), (parser, spelled)
            assert response["usage"]["completion_tokens_details"] == {"reasoning_tokens": 3}
            assert choice["message"]["reasoning"] == _token_text(choice, 3) + closing[:closing.index(end)]
            # A request's own budget wins over the server's.
            wider = httpx.post(f"{server.base_url}/chat/completions", timeout=120,
                               json={**body, "thinking_budget_tokens": 5}).json()
            assert wider["usage"]["completion_tokens_details"] == {"reasoning_tokens": 5}


def test_every_api_counts_the_reasoning_tokens_the_engine_wrote(thinking_client):
    """The reasoning's tokens are counted by the engine as it writes them, and chat, Responses
    (streamed and whole) report that one count. (Chat reported none without a budget, and
    Responses tokenized the reasoning's text again.) The tiny model never writes </think>: every
    token it writes is reasoning, but the end of the answer."""
    client, _ = thinking_client
    chat = client.chat.completions.create(model=DEFAULT_MODEL, messages=QUESTION, max_tokens=40, temperature=0,
                                          reasoning_effort="high")
    counted = chat.usage.completion_tokens_details.reasoning_tokens
    assert counted == chat.usage.completion_tokens - (chat.choices[0].finish_reason == "stop")  # all but its end
    request = dict(model=DEFAULT_MODEL, input=QUESTION[0]["content"], max_output_tokens=40, temperature=0,
                   reasoning={"effort": "high"})
    whole = client.responses.create(**request)
    streamed = [event for event in client.responses.create(**request, stream=True)][-1].response
    for response in (whole, streamed):
        assert response.output[0].type == "reasoning"
        assert response.usage.output_tokens == chat.usage.completion_tokens
        assert response.usage.output_tokens_details.reasoning_tokens == counted
