"""POST /v1/chat/completions end to end, through the OpenAI SDK and raw HTTP."""

from __future__ import annotations

import asyncio
import json


QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


def test_non_streamed_answer_has_the_spec_shape(client, model):
    response = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=24, temperature=0)
    assert response.object == "chat.completion"
    assert response.id.startswith("chatcmpl-")
    assert response.model == model
    assert response.created > 1_700_000_000
    choice = response.choices[0]
    assert choice.index == 0
    assert choice.message.role == "assistant"
    assert choice.message.content.strip()
    assert choice.finish_reason in ("stop", "length")
    usage = response.usage
    assert usage.prompt_tokens > 5
    assert 1 <= usage.completion_tokens <= 24
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens <= usage.prompt_tokens


def test_greedy_answers_are_reproducible(client, model):
    answers = {
        client.chat.completions.create(model=model, messages=QUESTION, max_tokens=24, temperature=0)
        .choices[0].message.content
        for _ in range(3)
    }
    assert len(answers) == 1


def test_max_tokens_cuts_with_finish_reason_length(client, model):
    messages = [{"role": "user", "content": "Write a long story about a dragon and a knight."}]
    response = client.chat.completions.create(model=model, messages=messages, max_tokens=5, temperature=0)
    assert response.choices[0].finish_reason == "length"
    assert response.usage.completion_tokens == 5


def test_max_completion_tokens_is_accepted_as_max_tokens(client, model):
    messages = [{"role": "user", "content": "Write a long story about a dragon and a knight."}]
    response = client.chat.completions.create(
        model=model, messages=messages, max_completion_tokens=4, temperature=0
    )
    assert response.usage.completion_tokens == 4


def test_natural_end_reports_stop(client, model):
    response = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say just the word: yes"}], max_tokens=200, temperature=0
    )
    assert response.choices[0].finish_reason == "stop"
    assert response.usage.completion_tokens < 200


def test_stream_chunks_follow_openai_order(http, model):
    body = {
        "model": model, "messages": QUESTION, "max_tokens": 16, "temperature": 0,
        "stream": True, "stream_options": {"include_usage": True},
    }
    with http.stream("POST", "/chat/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    finish = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finish) == 1 and finish[0]["choices"][0]["finish_reason"] in ("stop", "length")
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["total_tokens"] == (
        usage_chunk["usage"]["prompt_tokens"] + usage_chunk["usage"]["completion_tokens"]
    )
    assert "cached_tokens" in usage_chunk["usage"]["prompt_tokens_details"]
    assert all("usage" not in c for c in chunks[:-1])


def test_stream_text_equals_non_streamed_text(client, model):
    full = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=30, temperature=0)
    stream = client.chat.completions.create(
        model=model, messages=QUESTION, max_tokens=30, temperature=0, stream=True
    )
    chunks = list(stream)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason


def test_stream_without_include_usage_has_no_usage_chunk(client, model):
    chunks = list(client.chat.completions.create(model=model, messages=QUESTION, max_tokens=4, stream=True))
    assert all(c.usage is None for c in chunks)
    assert all(c.choices for c in chunks)


async def test_async_client(async_client, model):
    response = await async_client.chat.completions.create(
        model=model, messages=QUESTION, max_tokens=8, temperature=0
    )
    assert response.choices[0].message.content
    stream = await async_client.chat.completions.create(
        model=model, messages=QUESTION, max_tokens=8, temperature=0, stream=True
    )
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert text == response.choices[0].message.content


def test_content_as_text_parts_equals_string_content(client, model):
    as_string = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Name a color.\nJust one."}], max_tokens=10, temperature=0
    )
    as_parts = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": [{"type": "text", "text": "Name a color."},
                                                {"type": "text", "text": "Just one."}]}],
        max_tokens=10, temperature=0,
    )
    assert as_parts.choices[0].message.content == as_string.choices[0].message.content
    assert as_parts.usage.prompt_tokens == as_string.usage.prompt_tokens


def test_system_and_assistant_history_with_null_content(client, model):
    response = client.chat.completions.create(
        model=model,
        messages=[
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": None},
            {"role": "user", "content": "Say hello."},
        ],
        max_tokens=8,
    )
    assert response.choices[0].message.content is not None


def test_system_prompt_changes_the_prompt(client, model):
    plain = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=1)
    with_system = client.chat.completions.create(
        model=model, messages=[{"role": "system", "content": "You are a pirate. Talk like one."}, *QUESTION],
        max_tokens=1,
    )
    assert with_system.usage.prompt_tokens != plain.usage.prompt_tokens


def test_temperature_and_seed(client, model):
    def sample(seed):
        return client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Invent a name for a fantasy city."}],
            max_tokens=16, temperature=1.2, seed=seed,
        ).choices[0].message.content

    assert sample(1234) == sample(1234)
    assert len({sample(seed) for seed in (1, 2, 3, 4)}) > 1


def test_top_k_one_is_greedy(client, model):
    greedy = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=16, temperature=0)
    top_k_1 = client.chat.completions.create(
        model=model, messages=QUESTION, max_tokens=16, temperature=1.5, seed=7, extra_body={"top_k": 1}
    )
    assert top_k_1.choices[0].message.content == greedy.choices[0].message.content


def test_tiny_top_p_and_full_min_p_are_greedy(client, model):
    greedy = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=16, temperature=0)
    expected = greedy.choices[0].message.content
    top_p = client.chat.completions.create(
        model=model, messages=QUESTION, max_tokens=16, temperature=1.5, seed=3, top_p=0.0001
    )
    assert top_p.choices[0].message.content == expected
    min_p = client.chat.completions.create(
        model=model, messages=QUESTION, max_tokens=16, temperature=1.5, seed=3, extra_body={"min_p": 1.0}
    )
    assert min_p.choices[0].message.content == expected


def test_stop_string_is_not_in_the_output(client, model):
    full = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=30, temperature=0)
    text = full.choices[0].message.content
    stop = text[8:12]
    assert stop.strip(), text
    stopped = client.chat.completions.create(
        model=model, messages=QUESTION, max_tokens=30, temperature=0, stop=[stop, "ZZZZ"]
    )
    assert stopped.choices[0].message.content == text[: text.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"


def test_stop_string_split_across_tokens_in_a_stream(client, model):
    messages = [{"role": "user", "content": "Describe the ocean in three sentences."}]
    pieces = [
        c.choices[0].delta.content
        for c in client.chat.completions.create(
            model=model, messages=messages, max_tokens=40, temperature=0, stream=True
        )
        if c.choices and c.choices[0].delta.content
    ]
    full = "".join(pieces)
    # A stop string made of the end of one streamed piece and the start of the next.
    boundary = next(
        i for i in range(3, len(pieces) - 1)
        if len(pieces[i].strip()) >= 2 and len(pieces[i + 1].strip()) >= 2
    )
    stop = pieces[boundary][-2:] + pieces[boundary + 1][:2]
    expected = full[: full.index(stop)]
    streamed = list(
        client.chat.completions.create(
            model=model, messages=messages, max_tokens=40, temperature=0, stream=True, stop=stop
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == expected  # nothing of the stop string leaked, not even its first half
    assert streamed[-1].choices[0].finish_reason == "stop"


async def test_eight_concurrent_streams_each_match_their_solo_answer(async_client, model):
    prompts = [
        "Write a haiku about autumn.", "What is 2 plus 2?", "Name three animals.", "Explain rain briefly.",
        "Give me a short motto.", "What is a computer?", "Describe a cat.", "Suggest a book title.",
    ]

    async def solo(prompt):
        response = await async_client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=48, temperature=0
        )
        return response.choices[0].message.content

    async def streamed(prompt):
        stream = await async_client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=48, temperature=0, stream=True
        )
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    expected = [await solo(p) for p in prompts]
    results = await asyncio.gather(*(streamed(p) for p in prompts))
    assert results == expected
    assert len(set(results)) == len(prompts)


def test_raw_httpx_json_request(http, model):
    response = http.post("/chat/completions", json={"model": model, "messages": QUESTION, "max_tokens": 3})
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("application/json")
    assert response.json()["usage"]["completion_tokens"] <= 3
