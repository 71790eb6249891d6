"""POST /v1/completions end to end."""

from __future__ import annotations

import json

PROMPT = "The three primary colors are"


def test_single_prompt(client, model):
    response = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0)
    assert response.object == "text_completion"
    assert response.id.startswith("cmpl-")
    assert response.model == model
    assert len(response.choices) == 1
    choice = response.choices[0]
    assert choice.index == 0 and choice.text
    assert choice.finish_reason in ("stop", "length")
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens
    assert response.usage.prompt_tokens_details.cached_tokens <= response.usage.prompt_tokens


def test_max_tokens_defaults_to_16(http, model):
    body = http.post("/completions", json={"model": model, "prompt": "Once upon a time", "temperature": 0}).json()
    usage = body["usage"]
    assert usage["completion_tokens"] <= 16
    if body["choices"][0]["finish_reason"] == "length":
        assert usage["completion_tokens"] == 16


def test_prompt_array_gives_one_choice_per_prompt(client, model):
    prompts = ["The capital of Italy is", "One, two, three,", "def hello():"]
    batch = client.completions.create(model=model, prompt=prompts, max_tokens=8, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1, 2]
    singles = [
        client.completions.create(model=model, prompt=p, max_tokens=8, temperature=0) for p in prompts
    ]
    assert [c.text for c in batch.choices] == [s.choices[0].text for s in singles]
    assert batch.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert batch.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)


def test_streamed_prompt_array_reassembles_per_index(http, client, model):
    prompts = ["Red, green,", "Monday, Tuesday,"]
    expected = client.completions.create(model=model, prompt=prompts, max_tokens=10, temperature=0)
    body = {"model": model, "prompt": prompts, "max_tokens": 10, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    texts = {0: "", 1: ""}
    finish = {}
    with http.stream("POST", "/completions", json=body) as response:
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    for chunk in chunks[:-1]:
        assert chunk["object"] == "text_completion"
        for choice in chunk["choices"]:
            texts[choice["index"]] += choice["text"]
            if choice["finish_reason"]:
                finish[choice["index"]] = choice["finish_reason"]
    assert [texts[0], texts[1]] == [c.text for c in expected.choices]
    assert finish == {0: expected.choices[0].finish_reason, 1: expected.choices[1].finish_reason}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == expected.usage.completion_tokens


def test_stream_via_sdk_equals_non_streamed(client, model):
    full = client.completions.create(model=model, prompt=PROMPT, max_tokens=20, temperature=0)
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(model=model, prompt=PROMPT, max_tokens=20, temperature=0, stream=True)
    )
    assert streamed == full.choices[0].text


def test_stop_sequences(client, model):
    full = client.completions.create(model=model, prompt="1, 2, 3, 4, 5,", max_tokens=20, temperature=0).choices[0].text
    assert " 7" in full, full
    stopped = client.completions.create(
        model=model, prompt="1, 2, 3, 4, 5,", max_tokens=20, temperature=0, stop=[" 7", "never"]
    )
    assert stopped.choices[0].text == full[: full.index(" 7")]
    assert stopped.choices[0].finish_reason == "stop"


def test_special_tokens_in_raw_prompt_are_parsed(client, model):
    # A hand-built ChatML prompt behaves like the chat endpoint's rendered one.
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say hello."}], max_tokens=10, temperature=0
    )
    raw = client.completions.create(
        model=model,
        prompt="<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nSay hello.<|im_end|>\n<|im_start|>assistant\n",
        max_tokens=10, temperature=0,
    )
    assert raw.usage.prompt_tokens == chat.usage.prompt_tokens
    assert raw.choices[0].text == chat.choices[0].message.content
