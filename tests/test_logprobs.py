"""Logprobs in OpenAI's chat and legacy completions formats, streamed and not."""

from __future__ import annotations

import json
import math

QUESTION = [{"role": "user", "content": "Name the largest planet in the solar system."}]


def test_chat_logprobs_shape_and_values(client, model):
    response = client.chat.completions.create(
        model=model, messages=QUESTION, max_tokens=12, temperature=0, logprobs=True, top_logprobs=5
    )
    choice = response.choices[0]
    items = choice.logprobs.content
    assert len(items) == response.usage.completion_tokens - (choice.finish_reason == "stop")
    assert "".join(bytes(item.bytes).decode() for item in items) == choice.message.content
    for item in items:
        assert item.logprob <= 0
        assert len(item.top_logprobs) == 5
        values = [top.logprob for top in item.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert all(v <= 0 for v in values)
        # Greedy: the sampled token is the most likely one.
        assert item.top_logprobs[0].token == item.token
        assert math.isclose(item.top_logprobs[0].logprob, item.logprob, abs_tol=1e-5)
        assert bytes(item.bytes).decode("utf-8", "replace") == item.token
        assert sum(math.exp(v) for v in values) <= 1.0001


def test_chat_logprobs_without_top(client, model):
    response = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=4, logprobs=True)
    assert all(item.top_logprobs == [] for item in response.choices[0].logprobs.content)
    plain = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=4)
    assert plain.choices[0].logprobs is None


def test_sampled_token_logprob_is_reported_outside_the_top(client, model):
    # At temperature 2 many sampled tokens fall outside the single most likely one.
    response = client.chat.completions.create(
        model=model, messages=QUESTION, max_tokens=24, temperature=2, seed=5, logprobs=True, top_logprobs=1
    )
    outside = [item for item in response.choices[0].logprobs.content if item.top_logprobs[0].token != item.token]
    assert outside
    for item in outside:
        assert item.logprob < item.top_logprobs[0].logprob


def test_top_logprobs_requires_logprobs(http, model):
    response = http.post("/chat/completions", json={"model": model, "messages": QUESTION, "top_logprobs": 3})
    assert response.status_code == 400
    assert "top_logprobs" in response.json()["error"]["message"]


def test_streamed_chat_logprobs_equal_non_streamed(client, model):
    kwargs = dict(model=model, messages=QUESTION, max_tokens=16, temperature=0, logprobs=True, top_logprobs=3)
    full = client.chat.completions.create(**kwargs).choices[0].logprobs.content
    streamed = []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        if chunk.choices and chunk.choices[0].logprobs:
            streamed.extend(chunk.choices[0].logprobs.content)
    assert [(i.token, i.logprob) for i in streamed] == [(i.token, i.logprob) for i in full]


def test_completion_legacy_logprobs(client, model):
    response = client.completions.create(model=model, prompt="The sky is", max_tokens=10, temperature=0, logprobs=3)
    choice = response.choices[0]
    lp = choice.logprobs
    n = len(lp.tokens)
    assert n == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) >= 1
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset[0] == 0
    assert all(b >= a for a, b in zip(lp.text_offset, lp.text_offset[1:]))
    for token, value, top, offset in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset):
        assert value <= 0
        assert token in top and 3 <= len(top) <= 4
        assert max(top.values()) == top[token]  # greedy
        assert choice.text[offset:].startswith(token)


def test_completion_logprobs_zero_lists_only_the_sampled_token(http, model):
    body = http.post("/completions", json={"model": model, "prompt": "Hi", "max_tokens": 3, "logprobs": 0}).json()
    lp = body["choices"][0]["logprobs"]
    assert [list(top) for top in lp["top_logprobs"]] == [[token] for token in lp["tokens"]]


def test_streamed_completion_logprobs_and_offsets(http, client, model):
    full = client.completions.create(model=model, prompt="One, two,", max_tokens=8, temperature=0, logprobs=2)
    body = {"model": model, "prompt": "One, two,", "max_tokens": 8, "temperature": 0, "logprobs": 2, "stream": True}
    tokens, offsets = [], []
    with http.stream("POST", "/completions", json=body) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                if choice["logprobs"]:
                    tokens += choice["logprobs"]["tokens"]
                    offsets += choice["logprobs"]["text_offset"]
    assert tokens == full.choices[0].logprobs.tokens
    assert offsets == full.choices[0].logprobs.text_offset


def test_no_logprobs_when_not_asked(http, model):
    body = http.post("/completions", json={"model": model, "prompt": "Hi", "max_tokens": 3}).json()
    assert body["choices"][0]["logprobs"] is None
