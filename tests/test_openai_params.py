"""The parameters real OpenAI clients send, through the OpenAI SDK: n, logit_bias, min_tokens and
ignore_eos, echo,
suffix, best_of, parallel_tool_calls, lenient and strict tools, think-then-constrain, and the
fields accepted and ignored."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest

from tests.json_prefix import close_json
from tests.server import DEFAULT_MODEL, run_server
from tests.test_reasoning import THINKING_TEMPLATE
from tests.test_tools import ASK, FEW_SHOT, SCHEMAS, TOOLS, WEATHER

STORY = [{"role": "user", "content": "Tell me a very short story about a fox."}]
# SmolLM2 tokens: "</", "think", ">" (they spell "</think>"), " banana".
CLOSE_THINK = ("9617", "17400", "46")
BANANA = 21285


def texts(response) -> list[str]:
    return [choice.message.content for choice in sorted(response.choices, key=lambda c: c.index)]


# ------------------------------------------------------------------ n


def test_n_choices_share_one_prompt_and_each_is_reproducible(client, model, server):
    before = server.health()["models"][model]["stats"]["prompt_tokens"]
    many = client.chat.completions.create(model=model, messages=STORY, n=3, seed=11, temperature=1, max_tokens=20)
    after = server.health()["models"][model]["stats"]["prompt_tokens"]
    assert sorted(c.index for c in many.choices) == [0, 1, 2]
    assert after - before == many.usage.prompt_tokens  # the prompt was evaluated once
    singles = [client.chat.completions.create(model=model, messages=STORY, seed=11 + i, temperature=1, max_tokens=20)
               for i in range(3)]
    assert texts(many) == [s.choices[0].message.content for s in singles]  # choice i: seed + i
    assert many.usage.prompt_tokens == singles[0].usage.prompt_tokens
    assert many.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    again = client.chat.completions.create(model=model, messages=STORY, n=3, seed=11, temperature=1, max_tokens=20)
    assert texts(again) == texts(many)


def test_n_beyond_the_slots_runs_in_waves_each_choice_as_if_alone(client, model, server):
    # The shared server has 4 slots: choices 4..9 run as slots free up, off the cached prompt.
    before = server.health()["models"][model]["stats"]["prompt_tokens"]
    many = client.chat.completions.create(model=model, messages=STORY, n=10, seed=11, temperature=1, max_tokens=12)
    after = server.health()["models"][model]["stats"]["prompt_tokens"]
    assert sorted(c.index for c in many.choices) == list(range(10))
    assert after - before == many.usage.prompt_tokens  # counted once, for the whole request
    for i in (0, 4, 9):  # choice i: seed + i, in whichever wave it ran
        single = client.chat.completions.create(model=model, messages=STORY, seed=11 + i, temperature=1, max_tokens=12)
        assert texts(many)[i] == single.choices[0].message.content
    best = client.completions.create(model=model, prompt="My favourite animal is", n=1, best_of=6, seed=3,
                                     temperature=1, max_tokens=3)
    assert len(best.choices) == 1 and best.usage.completion_tokens >= 6  # six answers of at most 3 tokens


def test_n_over_the_limit_names_the_limit(http, model):
    response = http.post("/chat/completions", json={"model": model, "messages": STORY, "n": 129})
    assert response.status_code == 400
    error = response.json()["error"]
    assert "--limit-choices" in error["message"] and "slot" not in error["message"]


def test_choices_beyond_the_slots_take_turns_with_other_requests(tmp_path):
    # One slot: a request's later choices queue behind a request that came in meanwhile.
    with run_server("--slots", "1", "--ctx-size", "1024", log_dir=tmp_path) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
        finished: dict[int, str] = {}
        seen_when_other_finished: list[int] = []
        other = threading.Thread(target=lambda: (
            client.chat.completions.create(model=DEFAULT_MODEL, messages=STORY, max_tokens=4),
            seen_when_other_finished.append(len(finished))))
        texts_by_choice = {i: "" for i in range(4)}
        for chunk in client.chat.completions.create(model=DEFAULT_MODEL, messages=STORY, n=4, temperature=0,
                                                    max_tokens=40, stream=True):
            if chunk.choices and other.ident is None:  # choice 0 is running
                other.start()
            for choice in chunk.choices:
                texts_by_choice[choice.index] += choice.delta.content or ""
                if choice.finish_reason:
                    finished[choice.index] = choice.finish_reason
        other.join()
    assert seen_when_other_finished and seen_when_other_finished[0] < 4
    assert sorted(finished) == [0, 1, 2, 3] and all(texts_by_choice.values())
    assert len(set(texts_by_choice.values())) == 1  # greedy: every wave gives the same answer


def test_n_streamed_adds_up_to_the_non_streamed_choices(client, model):
    whole = client.chat.completions.create(model=model, messages=STORY, n=2, seed=5, temperature=1, max_tokens=16)
    pieces = {0: "", 1: ""}
    finished = {}
    usage = None
    for chunk in client.chat.completions.create(model=model, messages=STORY, n=2, seed=5, temperature=1,
                                                max_tokens=16, stream=True, stream_options={"include_usage": True}):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            pieces[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished[choice.index] = choice.finish_reason
    assert [pieces[0], pieces[1]] == texts(whole)
    assert finished == {c.index: c.finish_reason for c in whole.choices}
    assert usage.completion_tokens == whole.usage.completion_tokens


def test_n_on_completions_with_several_prompts(client, model):
    answer = client.completions.create(model=model, prompt=["Once upon a time", "The capital of France"], n=2,
                                       seed=3, temperature=1, max_tokens=8)
    assert sorted(c.index for c in answer.choices) == [0, 1, 2, 3]
    single = client.completions.create(model=model, prompt="The capital of France", seed=4, temperature=1, max_tokens=8)
    assert next(c.text for c in answer.choices if c.index == 3) == single.choices[0].text
    streamed = {}
    for chunk in client.completions.create(model=model, prompt=["Once upon a time", "The capital of France"], n=2,
                                           seed=3, temperature=1, max_tokens=8, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert streamed == {c.index: c.text for c in answer.choices}


# ------------------------------------------------------------------ logit_bias


def first_token(client, model, **extra) -> tuple[int, list[str]]:
    response = client.chat.completions.create(model=model, messages=STORY, max_tokens=6, temperature=0,
                                              logprobs=True, top_logprobs=1, **extra)
    tokens = [entry.token for entry in response.choices[0].logprobs.content]
    return response, tokens


def test_logit_bias_bans_and_forces(client, model):
    from fastrun_cpp.default_model import embedded_model_path
    from fastrun_cpp.engine.model import LlamaModel

    vocab = LlamaModel(embedded_model_path(), vocab_only=True)
    try:
        _, tokens = first_token(client, model)
        greedy = vocab.tokenize(tokens[0], add_special=False, parse_special=False)
        assert len(greedy) == 1
        _, banned = first_token(client, model, logit_bias={str(greedy[0]): -100})
        assert tokens[0] not in banned
        _, forced = first_token(client, model, logit_bias={str(BANANA): 100})
        assert forced[0] == " banana"
        completion = client.completions.create(model=model, prompt="The fox", max_tokens=3, temperature=0,
                                               logit_bias={str(BANANA): 100})
        assert completion.choices[0].text.startswith(" banana")
    finally:
        vocab.close()


def test_logit_bias_works_with_a_grammar(client, model):
    """The grammar still decides what may come: a token forced by bias where JSON cannot have it
    is not taken, and a banned one never appears."""
    quote = 18  # the token '"'
    response = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "A JSON object about a fox."}], max_tokens=40,
        temperature=0, response_format={"type": "json_object"}, logit_bias={str(BANANA): 100, str(quote): -100},
        logprobs=True,
    )
    content = response.choices[0].message.content
    assert content.lstrip().startswith("{")  # " banana" cannot start a JSON object
    json.loads(close_json(content))
    assert '"' not in [entry.token for entry in response.choices[0].logprobs.content]


# ------------------------------------------------------------------ min_tokens, ignore_eos (vLLM's, llama-server's)

SHORT = [{"role": "user", "content": "Answer with one word: is the sky blue?"}]


def test_min_tokens_and_ignore_eos_hold_the_end_back(client, model, http):
    natural = client.chat.completions.create(model=model, messages=SHORT, max_tokens=100, temperature=0)
    ended = natural.usage.completion_tokens  # the end-of-generation token included
    assert natural.choices[0].finish_reason == "stop" and ended < 60, natural
    longer = client.chat.completions.create(model=model, messages=SHORT, max_tokens=100, temperature=0,
                                            extra_body={"min_tokens": ended + 10})
    assert longer.usage.completion_tokens >= ended + 10
    # Up to where the model ended, the logits were the same: the same text.
    assert longer.choices[0].message.content.startswith(natural.choices[0].message.content.rstrip())
    full = client.chat.completions.create(model=model, messages=SHORT, max_tokens=ended + 20, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert (full.usage.completion_tokens, full.choices[0].finish_reason) == (ended + 20, "length")
    # Raw completions, streamed, sampled: the same.
    with http.stream("POST", "/completions", json={
            "model": model, "prompt": "The end.", "max_tokens": 40, "ignore_eos": True, "temperature": 1, "seed": 5,
            "stream": True, "stream_options": {"include_usage": True}}) as stream:
        chunks = [json.loads(line[6:]) for line in stream.iter_lines() if line.startswith("data: {")]
    assert chunks[-1]["usage"]["completion_tokens"] == 40
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"


@pytest.mark.parametrize("fields", [{"min_tokens": 30, "max_tokens": 20}, {"min_tokens": -1},
                                    {"min_tokens": "5"}, {"ignore_eos": "yes"}, {"min_tokens": 10**9}])
def test_min_tokens_and_ignore_eos_out_of_range_are_400s(http, model, fields):
    response = http.post("/chat/completions", json={"model": model, "messages": SHORT, **fields})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["type"] == "invalid_request_error"


# ------------------------------------------------------------------ echo, suffix, best_of


def test_echo_puts_the_prompt_first_with_its_logprobs(client, model):
    prompt = "The quick brown fox"
    plain = client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0)
    echoed = client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0, echo=True, logprobs=1)
    choice = echoed.choices[0]
    assert choice.text == prompt + plain.choices[0].text
    logprobs = choice.logprobs
    prompt_tokens = echoed.usage.prompt_tokens
    assert len(logprobs.tokens) == prompt_tokens + echoed.usage.completion_tokens
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert all(isinstance(lp, float) and lp <= 0 for lp in logprobs.token_logprobs[1:])
    assert "".join(logprobs.tokens[:prompt_tokens]) == prompt
    streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(
        model=model, prompt=prompt, max_tokens=4, temperature=0, echo=True, stream=True) if chunk.choices)
    assert streamed == choice.text


def test_suffix_fills_in_the_middle(tmp_path, tiny_model_path):
    with run_server("--model", str(tiny_model_path), "--slots", "1", log_dir=tmp_path) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
        answer = client.completions.create(model=tiny_model_path.stem, prompt="def add(a, b):", suffix="    return c",
                                           max_tokens=5, temperature=0)
        plain = client.completions.create(model=tiny_model_path.stem, prompt="def add(a, b):", max_tokens=1)
        suffix_only = client.completions.create(model=tiny_model_path.stem, prompt="    return c", max_tokens=1)
    # prefix, suffix and middle markers around the two texts
    assert answer.usage.prompt_tokens == plain.usage.prompt_tokens + suffix_only.usage.prompt_tokens + 3


def test_suffix_needs_fim_tokens(http, model):
    response = http.post("/completions", json={"model": model, "prompt": "a", "suffix": "b"})
    assert response.status_code == 400
    assert model in response.json()["error"]["message"]


def test_best_of_returns_the_surest_answers(client, model):
    candidates = client.completions.create(model=model, prompt="My favourite animal is", n=3, seed=21,
                                           temperature=1.2, max_tokens=6, logprobs=0)

    def mean(choice):
        return sum(choice.logprobs.token_logprobs) / len(choice.logprobs.token_logprobs)

    best = max(candidates.choices, key=mean)
    chosen = client.completions.create(model=model, prompt="My favourite animal is", n=1, best_of=3, seed=21,
                                       temperature=1.2, max_tokens=6)
    assert [c.text for c in chosen.choices] == [best.text]
    assert chosen.choices[0].logprobs is None  # not asked for
    assert chosen.usage.completion_tokens == candidates.usage.completion_tokens  # all three were generated


# ------------------------------------------------------------------ tools


def test_parallel_tool_calls_false_means_one_call(client, model):
    two = [{"role": "user", "content": "What's the weather in Paris and the time in Tokyo?"}]
    for choice in ("required", "auto"):
        response = client.chat.completions.create(model=model, messages=FEW_SHOT[:-1] + two, tools=TOOLS,
                                                  tool_choice=choice, parallel_tool_calls=False, max_tokens=120,
                                                  temperature=0)
        calls = response.choices[0].message.tool_calls or []
        assert len(calls) <= 1
        if choice == "required":
            assert len(calls) == 1 and response.choices[0].finish_reason == "tool_calls"


def test_required_ends_when_the_model_ends_or_repeats_its_calls(client, model):
    """At temperature 0 the default model makes its calls, then either ends (one CPU) or starts
    over with an identical call (another): either way the answer ends there, long before
    max_tokens, with its distinct calls."""
    response = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                              max_tokens=300, temperature=0)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    assert len(calls) == len({json.dumps(c, sort_keys=True) for c in calls}), "an identical call twice"
    assert response.usage.completion_tokens < 160
    for name, arguments in calls:
        jsonschema.validate(arguments, SCHEMAS[name])


CITY_WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}}}


@pytest.mark.parametrize("seed", range(4))
def test_a_required_call_ends_with_tool_calls_though_tokens_remain_short(client, model, seed):
    """Once its call is complete, the model may write more calls in the tokens left; a call
    certain to repeat ends the answer, and one cut by max_tokens was never sent: either way
    the answer is its complete calls (the SDK raises LengthFinishReasonError on "length")."""
    with client.chat.completions.stream(model=model, messages=[{"role": "user", "content": "Weather in Oslo?"}],
                                        tools=[CITY_WEATHER], tool_choice="required", max_tokens=60,
                                        seed=seed) as stream:
        completion = stream.get_final_completion()
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = [json.loads(call.function.arguments) for call in choice.message.tool_calls]
    assert calls and len(calls) == len({json.dumps(c, sort_keys=True) for c in calls})
    for arguments in calls:
        jsonschema.validate(arguments, CITY_WEATHER["function"]["parameters"])


def stream_answer(client, model, **request):
    content, calls, finish = "", {}, None
    content_after_calls = False
    for chunk in client.chat.completions.create(model=model, stream=True, **request):
        for choice in chunk.choices:
            if choice.delta.content:
                content += choice.delta.content
                content_after_calls = content_after_calls or bool(calls)
            for call in choice.delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"name": None, "arguments": ""})
                if call.function.name:
                    entry["name"] = call.function.name
                entry["arguments"] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    assert not content_after_calls, "text sent as content after tool-call deltas"
    return content, [calls[i] for i in sorted(calls)], finish


@pytest.mark.timeout(1800)  # ~2 requests per token of the answer: long on a loaded machine, never stuck
def test_a_call_cut_by_max_tokens_is_never_taken_back(client, model):
    full = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER], tool_choice="required",
                                          max_tokens=120, temperature=0)
    used = full.usage.completion_tokens
    full_calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in full.choices[0].message.tool_calls or []]

    def cut_at(max_tokens: int) -> None:
        request = dict(messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=max_tokens, temperature=0)
        whole = client.chat.completions.create(model=model, **request).choices[0]
        content, calls, finish = stream_answer(client, model, **request)
        expected = [{"name": c.function.name, "arguments": c.function.arguments} for c in whole.message.tool_calls or []]
        assert calls == expected, max_tokens
        assert content == (whole.message.content or ""), max_tokens
        assert finish == whole.finish_reason, max_tokens
        if max_tokens < used and finish != "length":
            # Ended by the server, not cut: a repeated call was seen before max_tokens (a looping
            # model), and the answer holds the full answer's calls, whole.
            assert finish == "tool_calls" and expected == full_calls, max_tokens

    # Every cut point, two at a time: answers at temperature 0 do not depend on batching.
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(cut_at, range(1, used + 1)))


OPENAPI_STYLE = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {
        "city": {"type": "string", "maxLength": 40},
        "days": {"type": "integer", "format": "int32", "minimum": 1, "maximum": 7, "multipleOf": 1},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "uniqueItems": True, "maxItems": 3},
    }, "required": ["city", "days"]}}}


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_tools_with_unenforceable_keywords_are_served(client, model, choice):
    response = client.chat.completions.create(model=model, messages=ASK, tools=[OPENAPI_STYLE, TOOLS[1]],
                                              tool_choice=choice, max_tokens=120, temperature=0)
    calls = response.choices[0].message.tool_calls or []
    if choice == "required":
        assert calls and response.choices[0].finish_reason == "tool_calls"
    for call in calls:
        json.loads(call.function.arguments)


def test_strict_tools_keep_the_400(http, model):
    strict = json.loads(json.dumps(OPENAPI_STYLE))
    strict["function"]["strict"] = True
    response = http.post("/chat/completions", json={"model": model, "messages": ASK, "tools": [strict],
                                                    "tool_choice": "required"})
    assert response.status_code == 400
    assert "format" in response.json()["error"]["message"] or "multipleOf" in response.json()["error"]["message"]


# ------------------------------------------------------------------ think, then constrain


@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    directory = tmp_path_factory.mktemp("thinker")
    template = directory / "think.jinja"
    template.write_text(THINKING_TEMPLATE)
    with run_server("--chat-template-file", str(template), "--slots", "4", "--ctx-size", "1024",
                    log_dir=directory) as server:
        yield openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)


def close_think_bias() -> dict[str, int]:
    """Push the model to write "</think>" (it otherwise never does): it then thinks a little,
    closes, and answers."""
    return {token: 100 for token in CLOSE_THINK}


def test_the_grammar_applies_after_the_reasoning(thinker):
    response = thinker.chat.completions.create(
        model=DEFAULT_MODEL, messages=[{"role": "user", "content": "A JSON object about a fox."}], n=4, seed=1,
        temperature=1, max_tokens=40, reasoning_effort="high", response_format={"type": "json_object"},
        logit_bias=close_think_bias(),
    )
    answered = 0
    for choice in response.choices:
        message = choice.message
        if message.content:  # the reasoning ended: from there on, the grammar's
            answered += 1
            assert message.content.lstrip().startswith("{")
            json.loads(close_json(message.content))
        else:
            assert message.reasoning  # all of it was thinking
    assert answered >= 1
    # The thinking itself was free: a grammar from the first token would have made it "{...".
    assert any(c.message.reasoning and not c.message.reasoning.lstrip().startswith("{") for c in response.choices)


def test_forced_tools_apply_after_the_reasoning(thinker):
    response = thinker.chat.completions.create(
        model=DEFAULT_MODEL, messages=ASK, tools=TOOLS, tool_choice="required", n=4, seed=2, temperature=1,
        max_tokens=80, reasoning_effort="high", logit_bias=close_think_bias(),
    )
    for choice in response.choices:
        for call in choice.message.tool_calls or []:
            assert call.function.name in SCHEMAS
            json.loads(close_json(call.function.arguments))
    assert any(choice.message.tool_calls for choice in response.choices)


def test_a_model_that_opens_its_reasoning_itself_may_skip_it(tmp_path):
    """Template without a prefilled <think>: the grammar lets an optional reasoning block come
    first; the answer is still the schema's."""
    template = tmp_path / "plain.jinja"
    template.write_text(THINKING_TEMPLATE.replace("{% if enable_thinking %}<think>\n{% endif %}", ""))
    with run_server("--chat-template-file", str(template), "--reasoning-parser", "think", "--slots", "1",
                    log_dir=tmp_path) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
        response = client.chat.completions.create(
            model=DEFAULT_MODEL, messages=[{"role": "user", "content": "A JSON object with a name."}], max_tokens=60,
            temperature=0, reasoning_effort="low", response_format={"type": "json_object"})
    message = response.choices[0].message
    json.loads(close_json(message.content))


# ------------------------------------------------------------------ what clients send besides


def test_fields_accepted_and_ignored_and_unknown_ones_logged(tmp_path):
    with run_server("--slots", "1", "--log-level", "debug", log_dir=tmp_path) as server:
        response = httpx.post(f"{server.base_url}/chat/completions", json={
            "model": DEFAULT_MODEL, "messages": STORY, "max_tokens": 2, "user": "u-1", "metadata": {"k": "v"},
            "store": False, "service_tier": "auto", "prediction": {"type": "content", "content": "x"},
            "some_vendor_field": 1, "messages_extra": {"a": 1}}, timeout=60)
        assert response.status_code == 200, response.text
        assert "some_vendor_field" in server.log() and "messages_extra" in server.log()
