"""Structured outputs: response_format json_object / json_schema, enforced by grammars."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, Field

from tests.data.schemas import SCHEMAS
from tests.json_prefix import assert_json_answer

MAX_TOKENS = 400


def ask(client, model, schema, prompt, **kwargs):
    return client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt + " Answer in JSON."}],
        max_tokens=MAX_TOKENS,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}},
        **kwargs,
    )


@pytest.mark.parametrize("name", sorted(SCHEMAS))
@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1, "seed": 1}, {"temperature": 1, "seed": 2}],
                         ids=["greedy", "t1-seed1", "t1-seed2"])
def test_answers_always_validate_and_end(client, model, name, sampling):
    schema, prompt = SCHEMAS[name]
    response = ask(client, model, schema, prompt, **sampling)
    choice = response.choices[0]
    answer = json.loads(choice.message.content)
    jsonschema.validate(answer, schema)
    assert choice.finish_reason == "stop", choice.message.content


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1, "seed": 3}])
@pytest.mark.parametrize("prompt", [
    "Give a JSON object with keys name and age for a person named Bob who is 30.",
    "Return a JSON object describing the weather today.",
])
def test_json_object_mode(client, model, prompt, sampling):
    response = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=MAX_TOKENS,
        response_format={"type": "json_object"}, **sampling,
    )
    assert_json_answer(response.choices[0], dict)


@pytest.mark.parametrize("name", ["person", "order_nested"])
def test_json_object_with_a_schema_enforces_it(client, model, name):
    """llama-server's `{"type": "json_object", "schema": ...}` is enforced as a json_schema."""
    schema, prompt = SCHEMAS[name]
    for seed in (1, 2):
        response = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt + " Answer in JSON."}], max_tokens=MAX_TOKENS,
            temperature=1, seed=seed, extra_body={"response_format": {"type": "json_object", "schema": schema}})
        jsonschema.validate(json.loads(response.choices[0].message.content), schema)



def test_text_mode_is_unconstrained(client, model):
    plain = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hi."}],
                                           max_tokens=10, temperature=0)
    text = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hi."}],
                                          max_tokens=10, temperature=0, response_format={"type": "text"})
    assert text.choices[0].message.content == plain.choices[0].message.content


def test_streamed_json_equals_the_non_streamed_answer(client, model):
    schema, prompt = SCHEMAS["order_nested"]
    full = ask(client, model, schema, prompt, temperature=0).choices[0].message.content
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt + " Answer in JSON."}], max_tokens=MAX_TOKENS,
        temperature=0, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == full
    jsonschema.validate(json.loads(streamed), schema)


def test_seed_reproduces_constrained_answers(client, model):
    schema, prompt = SCHEMAS["person"]
    first = ask(client, model, schema, prompt, temperature=1.2, seed=77).choices[0].message.content
    second = ask(client, model, schema, prompt, temperature=1.2, seed=77).choices[0].message.content
    assert first == second


def test_stop_still_applies(client, model):
    schema, prompt = SCHEMAS["person"]
    full = ask(client, model, schema, prompt, temperature=0).choices[0].message.content
    cut = ask(client, model, schema, prompt, temperature=0, stop=['"age"']).choices[0]
    assert cut.message.content == full[: full.index('"age"')]
    assert cut.finish_reason == "stop"


def test_max_tokens_cuts_with_length(client, model):
    schema, prompt = SCHEMAS["person"]
    response = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=5, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema}},
    )
    assert response.choices[0].finish_reason == "length"


class Ingredient(BaseModel):
    name: str = Field(max_length=30)
    grams: int = Field(ge=1, le=5000)


class Recipe(BaseModel):
    dish: str = Field(max_length=40)
    ingredients: list[Ingredient] = Field(min_length=1, max_length=4)


def test_openai_sdk_parse_helper(client, model):
    completion = client.chat.completions.parse(
        model=model, messages=[{"role": "user", "content": "Give me a simple pancake recipe."}],
        response_format=Recipe, max_tokens=MAX_TOKENS, temperature=0,
    )
    recipe = completion.choices[0].message.parsed
    assert isinstance(recipe, Recipe) and recipe.ingredients


@pytest.mark.parametrize(
    "schema, mentions",
    [
        ({"type": "nonsense"}, "invalid JSON schema"),
        ({"type": "object", "properties": {"a": {"$ref": "https://example.com/a.json"}}}, "$ref"),
        ({"type": "integer", "multipleOf": 5}, "multipleOf"),
        ({"type": "string", "format": "phone-number"}, "phone-number"),
        ({"not": {"type": "string"}}, "'not'"),
        ({"type": "integer", "minimum": 10, "maximum": 5}, "bounds"),
        ({"type": "number", "maximum": 2.5}, "whole numbers"),
    ],
)
def test_unenforceable_or_invalid_schemas_are_400_when_strict(http, model, schema, mentions):
    response = http.post("/chat/completions", json={
        "model": model, "messages": [{"role": "user", "content": "hi"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}},
    })
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert mentions in error["message"]


SHIRT = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                                                  "uniqueItems": True, "maxItems": 3},
                                         "size": {"type": "integer", "format": "int32", "minimum": 0, "maximum": 9}},
         "required": ["tags", "size"], "additionalProperties": False}


@pytest.mark.parametrize("schema, unenforced", [
    ({"type": "integer", "multipleOf": 5}, ["multipleOf"]),
    (SHIRT, ["uniqueItems", "format"]),
])
def test_without_strict_what_cannot_be_enforced_is_left_to_a_check_after(http, model, schema, unenforced):
    """The enforceable part still binds the answer; the rest (multipleOf, uniqueItems, int32)
    is checked after generation, and only logged when the answer misses it."""
    response = http.post("/chat/completions", json={
        "model": model, "messages": [{"role": "user", "content": "Describe a shirt in JSON."}], "temperature": 0,
        "max_tokens": 100, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    })
    assert response.status_code == 200, response.text
    answer = json.loads(response.json()["choices"][0]["message"]["content"])
    jsonschema.validate(answer, without(schema, unenforced))


def without(schema, keywords):
    """The schema minus some keywords, at any depth."""
    if isinstance(schema, dict):
        return {k: without(v, keywords) for k, v in schema.items() if k not in keywords}
    if isinstance(schema, list):
        return [without(v, keywords) for v in schema]
    return schema


def test_missing_json_schema_is_400(http, model):
    response = http.post("/chat/completions", json={
        "model": model, "messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_schema"}})
    assert response.status_code == 400
    assert "json_schema" in response.json()["error"]["message"]


TREE = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "children": {"type": "array", "items": {"$ref": "#"}, "maxItems": 2}},
    "required": ["name", "children"], "additionalProperties": False}
LINKED_LIST = {"$defs": {"node": {"type": "object", "properties": {
    "value": {"type": "integer", "minimum": 0, "maximum": 99},
    "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}},
    "required": ["value", "next"], "additionalProperties": False}}, "$ref": "#/$defs/node"}


@pytest.mark.parametrize("schema, prompt", [
    (TREE, "A family tree: a grandmother with two children, each with one child."),
    (LINKED_LIST, "A linked list of the numbers 1, 2 and 3."),
], ids=["tree", "linked-list"])
def test_recursive_schemas_are_answered_and_valid(client, model, schema, prompt):
    """Schemas that refer to themselves (OpenAI's structured outputs take them): the answer
    follows the schema at every depth it reaches."""
    choice = ask(client, model, schema, prompt, temperature=0).choices[0]
    if choice.finish_reason == "stop":
        jsonschema.validate(json.loads(choice.message.content), schema)
    else:  # cut at max_tokens inside a deep tree: valid as far as it went
        assert choice.finish_reason == "length"
        assert_json_answer(choice, dict)


def test_recursive_tool_parameters_are_enforced(client, model):
    tool = {"type": "function", "function": {"name": "save_tree", "strict": True, "parameters": TREE}}
    response = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Save a tree with a root named a and one child b."}],
        tools=[tool], tool_choice="required", max_tokens=MAX_TOKENS, temperature=0)
    choice = response.choices[0]
    if choice.finish_reason == "tool_calls":
        for call in choice.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), TREE)
    else:
        assert choice.finish_reason == "length"


def test_grammar_time_per_token_is_a_metric(server, client, model):
    def histogram_count() -> float:
        text = httpx.get(f"{server.root_url}/metrics").text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("fastrun_grammar_step_seconds_count"))

    before = histogram_count()
    response = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Give a JSON object."}], max_tokens=16,
        temperature=0, response_format={"type": "json_object"})
    assert histogram_count() >= before + response.usage.completion_tokens - 1  # the end token is not masked
