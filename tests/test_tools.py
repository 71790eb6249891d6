"""Tool calling end to end on the default model (whose template knows no tools: the fallback
format is described in the system prompt)."""

from __future__ import annotations

import json

import jsonschema
import pytest

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 40},
                           "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Get the local time in a timezone",
        "parameters": {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 30}},
                       "required": ["tz"], "additionalProperties": False},
    },
}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What's the weather in Paris?"}]

# A conversation in which the model has called tools before: it then starts calls by itself.
FEW_SHOT = [
    {"role": "user", "content": "What's the weather in Rome?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Rome", "unit": "celsius"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21, "sky": "sunny"}'},
    {"role": "assistant", "content": "It is 21°C and sunny in Rome."},
    {"role": "user", "content": "What's the weather in Berlin?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_2", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Berlin", "unit": "celsius"}'}}]},
    {"role": "tool", "tool_call_id": "call_2", "content": '{"temp_c": 12, "sky": "rain"}'},
    {"role": "assistant", "content": "It is 12°C and raining in Berlin."},
    {"role": "user", "content": "What's the weather in Paris?"},
]


def assert_valid_calls(message, allowed=("get_weather", "get_time")):
    assert message.tool_calls
    ids = [call.id for call in message.tool_calls]
    assert len(set(ids)) == len(ids) and all(i.startswith("call_") for i in ids)
    for call in message.tool_calls:
        assert call.type == "function" and call.function.name in allowed
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1, "seed": 1}, {"temperature": 1, "seed": 2}])
def test_required_forces_valid_calls(client, model, sampling):
    response = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                              max_tokens=200, **sampling)
    choice = response.choices[0]
    # Sampled at temperature 1, a model may go on making parallel calls until max_tokens: the
    # calls it finished are still returned, each valid.
    assert choice.finish_reason == "tool_calls" or (
        choice.finish_reason == "length" and response.usage.completion_tokens == 200 and choice.message.tool_calls)
    assert_valid_calls(choice.message)


@pytest.mark.parametrize("name", ["get_weather", "get_time"])
def test_named_function_is_called(client, model, name):
    response = client.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, max_tokens=200, temperature=0,
        tool_choice={"type": "function", "function": {"name": name}},
    )
    message = response.choices[0].message
    assert_valid_calls(message, allowed=(name,))
    assert len(message.tool_calls) == 1


def test_none_offers_no_tools(client, model):
    without = client.chat.completions.create(model=model, messages=ASK, max_tokens=20, temperature=0)
    none = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="none",
                                          max_tokens=20, temperature=0)
    assert none.usage.prompt_tokens == without.usage.prompt_tokens
    assert none.choices[0].message.content == without.choices[0].message.content
    assert none.choices[0].message.tool_calls is None


def test_auto_lets_the_model_call(client, model):
    response = client.chat.completions.create(model=model, messages=FEW_SHOT, tools=TOOLS, max_tokens=120,
                                              temperature=0)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert_valid_calls(choice.message)
    assert json.loads(choice.message.tool_calls[0].function.arguments)["city"] == "Paris"


def test_auto_lets_the_model_answer(client, model):
    response = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, max_tokens=40, temperature=0)
    message = response.choices[0].message
    # Either way the answer is well formed: text, or calls that validate.
    if message.tool_calls:
        assert_valid_calls(message)
    else:
        assert message.content


@pytest.mark.parametrize("tool_choice", ["required", "auto"])
def test_streamed_calls_assemble_to_the_non_streamed_ones(client, model, tool_choice):
    messages = FEW_SHOT if tool_choice == "auto" else ASK
    full = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, tool_choice=tool_choice,
                                          max_tokens=200, temperature=0).choices[0]
    calls: dict[int, dict] = {}
    finish = None
    content = ""
    for chunk in client.chat.completions.create(model=model, messages=messages, tools=TOOLS, tool_choice=tool_choice,
                                                max_tokens=200, temperature=0, stream=True):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or []:
            entry = calls.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
            if delta.id:
                assert entry["id"] is None and delta.function.name and delta.type == "function"
                entry.update(id=delta.id, name=delta.function.name)
            entry["arguments"] += delta.function.arguments or ""
    assert finish == full.finish_reason == "tool_calls"
    assert content == (full.message.content or "")
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == \
        [(c.function.name, c.function.arguments) for c in full.message.tool_calls]


def test_agent_loop_through_the_sdk(client, model):
    messages = list(ASK)
    first = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER], tool_choice="required",
                                           max_tokens=120, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    arguments = json.loads(call.function.arguments)
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id,
                     "content": json.dumps({"city": arguments["city"], "temp_c": 18, "sky": "cloudy"})})
    final = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER], tool_choice="none",
                                           max_tokens=60, temperature=0)
    answer = final.choices[0]
    assert answer.message.tool_calls is None
    assert answer.message.content
    assert answer.finish_reason in ("stop", "length")
    baseline = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER], tool_choice="none",
                                              max_tokens=1)
    assert final.usage.prompt_tokens > baseline.usage.prompt_tokens + 20  # the call and its result were rendered


def test_tool_history_with_null_content_is_accepted(http, model):
    response = http.post("/chat/completions", json={"model": model, "messages": FEW_SHOT, "max_tokens": 5})
    assert response.status_code == 200


@pytest.mark.parametrize("body, mentions", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "nope"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": True,
                                                  "parameters": {"type": "object", "not": {}}}}],
      "tool_choice": "required"}, "'not'"),
    ({"tools": [{"type": "retrieval"}]}, "tools"),
])
def test_bad_tool_requests_are_400(http, model, body, mentions):
    response = http.post("/chat/completions", json={"model": model, "messages": ASK, **body})
    assert response.status_code == 400, response.text
    assert mentions in response.json()["error"]["message"]
