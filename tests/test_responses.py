"""OpenAI's Responses API with the official SDK: text, streaming events, function tools,
text.format, stored responses and previous_response_id (prefix cache hits across turns)."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from tests.server import DEFAULT_MODEL, run_server
from tests.test_keys import create_key

WEATHER_TOOL = {
    "type": "function", "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


def test_text_answer(client):
    response = client.responses.create(model=DEFAULT_MODEL, input="Say hello to the world.", max_output_tokens=24,
                                       temperature=0, instructions="You are brief.")
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.status in ("completed", "incomplete")
    messages = [item for item in response.output if item.type == "message"]
    assert len(messages) == 1 and messages[0].content[0].type == "output_text"
    assert response.output_text == messages[0].content[0].text and response.output_text.strip()
    usage = response.usage
    assert usage.input_tokens > 0 and 0 < usage.output_tokens <= 24
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert response.instructions == "You are brief."


def test_max_output_tokens_makes_it_incomplete(client):
    response = client.responses.create(model=DEFAULT_MODEL, input="Tell me a long story about a dragon.",
                                       max_output_tokens=3, temperature=0)
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 3


def test_stream_events_add_up_to_the_answer(client):
    stream = client.responses.create(model=DEFAULT_MODEL, input="Write one sentence about cats.",
                                     max_output_tokens=40, temperature=0, stream=True)
    events = list(stream)
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert kinds.index("response.output_item.added") < kinds.index("response.content_part.added") \
        < kinds.index("response.output_text.delta") < kinds.index("response.output_text.done") \
        < kinds.index("response.content_part.done") < kinds.index("response.output_item.done")
    numbers = [event.sequence_number for event in events]
    assert numbers == list(range(len(events)))
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    done = next(event for event in events if event.type == "response.output_text.done")
    final = events[-1].response
    assert deltas == done.text == final.output_text and deltas.strip()
    assert final.usage.output_tokens > 0
    # Non-streamed, the same request gives the same text.
    whole = client.responses.create(model=DEFAULT_MODEL, input="Write one sentence about cats.",
                                    max_output_tokens=40, temperature=0)
    assert whole.output_text == deltas


def test_required_function_tool(client):
    response = client.responses.create(model=DEFAULT_MODEL, input="What is the weather in Oslo?",
                                       tools=[WEATHER_TOOL], tool_choice="required", temperature=0,
                                       max_output_tokens=200)
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls, response.output
    assert all(call.name == "get_weather" and call.call_id for call in calls)
    assert isinstance(json.loads(calls[0].arguments).get("city"), str)


def test_streamed_function_call_with_sdk_helper(client):
    with client.responses.stream(model=DEFAULT_MODEL, input="What is the weather in Paris?", tools=[WEATHER_TOOL],
                                 tool_choice={"type": "function", "name": "get_weather"}, temperature=0,
                                 max_output_tokens=200) as stream:
        events = list(stream)
        final = stream.get_final_response()
    calls = [item for item in final.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert deltas == done[0].arguments == calls[0].arguments
    assert isinstance(json.loads(calls[0].arguments)["city"], str)


def test_text_format_json_schema(client):
    response = client.responses.create(
        model=DEFAULT_MODEL, input="Describe a person as JSON.", temperature=0, max_output_tokens=100,
        text={"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}})
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), PERSON)
    assert response.text.format.type == "json_schema"


def test_previous_response_id_continues_and_hits_the_cache(client):
    first = client.responses.create(model=DEFAULT_MODEL, input="My name is Ada. Please remember it.",
                                    max_output_tokens=30, temperature=0)
    second = client.responses.create(model=DEFAULT_MODEL, input="What is my name?", previous_response_id=first.id,
                                     max_output_tokens=30, temperature=0)
    third = client.responses.create(model=DEFAULT_MODEL, input="Say it once more.", previous_response_id=second.id,
                                    max_output_tokens=30, temperature=0)
    turns = [first, second, third]
    assert second.previous_response_id == first.id
    # Each turn's prompt holds the earlier ones whole: they come from the cache.
    for earlier, later in zip(turns, turns[1:]):
        assert later.usage.input_tokens > earlier.usage.input_tokens + earlier.usage.output_tokens - 2
        assert later.usage.input_tokens_details.cached_tokens >= earlier.usage.input_tokens - 1
    # The continued conversation is the same as sending the whole history by hand.
    by_hand = client.responses.create(model=DEFAULT_MODEL, max_output_tokens=30, temperature=0, store=False, input=[
        {"role": "user", "content": "My name is Ada. Please remember it."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"},
    ])
    assert by_hand.output_text == second.output_text


def test_function_call_output_continues_a_tool_turn(client):
    first = client.responses.create(model=DEFAULT_MODEL, input="What is the weather in Oslo?", tools=[WEATHER_TOOL],
                                    tool_choice={"type": "function", "name": "get_weather"}, temperature=0,
                                    max_output_tokens=200)
    call = next(item for item in first.output if item.type == "function_call")
    second = client.responses.create(model=DEFAULT_MODEL, previous_response_id=first.id, tools=[WEATHER_TOOL],
                                     temperature=0, max_output_tokens=30, input=[
                                         {"type": "function_call_output", "call_id": call.call_id,
                                          "output": "Sunny, 21 degrees"}])
    assert second.usage.input_tokens_details.cached_tokens > 0
    assert second.output


def test_retrieve_and_delete(client, http):
    response = client.responses.create(model=DEFAULT_MODEL, input="Hi", max_output_tokens=5)
    again = client.responses.retrieve(response.id)
    assert again.id == response.id and again.output_text == response.output_text
    client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    missing = http.get("/responses/resp_nope")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "invalid_request_error"
    not_stored = client.responses.create(model=DEFAULT_MODEL, input="Hi", max_output_tokens=5, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(not_stored.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=DEFAULT_MODEL, input="Hi", previous_response_id=not_stored.id)


@pytest.mark.parametrize("tool", [{"type": "web_search", "external_web_access": False},
                                  {"type": "file_search", "vector_store_ids": ["x"]},
                                  {"type": "computer_use_preview", "display_width": 1, "display_height": 1,
                                   "environment": "linux"}])
def test_built_in_tools_are_left_out_unless_required(http, tool):
    """A hosted tool runs nowhere here: with `auto` it is not offered (and kept in the
    response's tools); required, it is a 400 that names it."""
    offered = http.post("/responses", json={"model": DEFAULT_MODEL, "input": "hi", "tools": [tool, WEATHER_TOOL],
                                            "max_output_tokens": 4})
    assert offered.status_code == 200, offered.text
    assert offered.json()["tools"][0]["type"] == tool["type"]
    required = http.post("/responses", json={"model": DEFAULT_MODEL, "input": "hi", "tools": [tool],
                                             "tool_choice": "required"})
    assert required.status_code == 400
    assert tool["type"] in required.json()["error"]["message"]


@pytest.mark.parametrize("body", [
    {"input": []},
    {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
    {"input": "hi", "max_output_tokens": 0},
    {"input": "hi", "temperature": 3},
    {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}},
    {"input": [{"type": "bogus"}]},
    {"input": "hi", "tool_choice": {"type": "function", "name": "missing"}, "tools": [WEATHER_TOOL]},
])
def test_bad_requests_are_400(http, body):
    answer = http.post("/responses", json={"model": DEFAULT_MODEL, **body})
    assert answer.status_code == 400, answer.text
    assert set(answer.json()["error"]) == {"message", "type", "code"}


def test_stored_responses_belong_to_their_account(tmp_path):
    db = tmp_path / "keys.sqlite3"
    alice, bob = create_key(db, "alice"), create_key(db, "bob")
    with run_server("--slots", "1", "--ctx-size", "512", log_dir=tmp_path, env={"FASTRUN_KEYS_DB": str(db)}) as s:
        as_alice = openai.OpenAI(base_url=s.base_url, api_key=alice, max_retries=0)
        as_bob = openai.OpenAI(base_url=s.base_url, api_key=bob, max_retries=0)
        response = as_alice.responses.create(model=DEFAULT_MODEL, input="Hi", max_output_tokens=4)
        assert as_alice.responses.retrieve(response.id).id == response.id
        with pytest.raises(openai.NotFoundError):
            as_bob.responses.retrieve(response.id)
        with pytest.raises(openai.NotFoundError):
            as_bob.responses.create(model=DEFAULT_MODEL, input="Hi", previous_response_id=response.id)
        with pytest.raises(openai.NotFoundError):
            as_bob.responses.delete(response.id)
        assert httpx.get(f"{s.base_url}/responses/{response.id}").status_code == 401


def test_an_account_stores_within_its_own_budget(tmp_path):
    """Past an account's count, its own oldest responses go, never another account's; a
    conversation over the account's bytes is answered but not stored."""
    db = tmp_path / "keys.sqlite3"
    alice, bob = create_key(db, "alice"), create_key(db, "bob")
    with run_server("--slots", "1", "--ctx-size", "2048", "--responses-per-account", "2",
                    "--responses-per-account-mib", "0.005", log_dir=tmp_path, env={"FASTRUN_KEYS_DB": str(db)}) as s:
        as_alice = openai.OpenAI(base_url=s.base_url, api_key=alice, max_retries=0)
        as_bob = openai.OpenAI(base_url=s.base_url, api_key=bob, max_retries=0)
        bobs = as_bob.responses.create(model=DEFAULT_MODEL, input="Hi", max_output_tokens=2)
        alices = [as_alice.responses.create(model=DEFAULT_MODEL, input=f"Hi {i}", max_output_tokens=2)
                  for i in range(4)]
        with pytest.raises(openai.NotFoundError):
            as_alice.responses.retrieve(alices[0].id)
        with pytest.raises(openai.NotFoundError):
            as_alice.responses.retrieve(alices[1].id)
        assert [as_alice.responses.retrieve(r.id).id for r in alices[2:]] == [r.id for r in alices[2:]]
        assert as_bob.responses.retrieve(bobs.id).id == bobs.id  # untouched by alice's
        # Over the account's bytes: answered, not stored, and it evicts nothing.
        large = as_alice.responses.create(model=DEFAULT_MODEL, input="word " * 1500, max_output_tokens=2)
        with pytest.raises(openai.NotFoundError):
            as_alice.responses.retrieve(large.id)
        assert as_alice.responses.retrieve(alices[3].id).id == alices[3].id


# ---------------------------------------------------------------- what Codex CLI sends


def test_a_namespace_tools_call_comes_back_with_its_namespace(client):
    """Codex's MCP tools come in a namespace: the call names the function and its namespace
    apart, and the call and its output continue the conversation."""
    namespace = {"type": "namespace", "name": "weather_server", "description": "Weather tools.",
                 "tools": [{**WEATHER_TOOL, "strict": False}]}
    response = client.responses.create(model=DEFAULT_MODEL, input="What is the weather in Oslo?", tools=[namespace],
                                        tool_choice="required", temperature=0, max_output_tokens=60, store=False)
    raw = response.model_dump()
    calls = [item for item in raw["output"] if item["type"] == "function_call"]
    assert calls and calls[0]["name"] == "get_weather" and calls[0]["namespace"] == "weather_server"
    assert "city" in json.loads(calls[0]["arguments"])
    follow_up = client.responses.create(model=DEFAULT_MODEL, tools=[namespace], temperature=0, max_output_tokens=20,
                                        store=False, input=[
        {"role": "user", "content": "What is the weather in Oslo?"},
        {"type": "function_call", "call_id": calls[0]["call_id"], "name": "get_weather",
         "namespace": "weather_server", "arguments": calls[0]["arguments"]},
        {"type": "function_call_output", "call_id": calls[0]["call_id"], "output": "Sunny, 21 degrees"}])
    assert follow_up.status in ("completed", "incomplete") and follow_up.output_text is not None
    assert follow_up.usage.input_tokens_details.cached_tokens > 0


@pytest.mark.parametrize("streamed", [False, True])
def test_a_custom_tools_call_is_a_custom_tool_call(http, streamed):
    tool = {"type": "custom", "name": "shell", "description": "Run a shell command; the input is the command.",
            "format": {"type": "grammar", "syntax": "lark", "definition": "start: /[a-z ]+/"}}
    body = {"model": DEFAULT_MODEL, "input": "List the files here.", "tools": [tool], "tool_choice": "required",
            "temperature": 0, "max_output_tokens": 60, "store": False, "stream": streamed}
    if streamed:
        with http.stream("POST", "/responses", json=body) as answer:
            assert answer.status_code == 200
            events = [json.loads(line[5:]) for line in answer.iter_lines() if line.startswith("data:")]
        done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
        assert any(e["type"] == "response.custom_tool_call_input.done" for e in events)
    else:
        answer = http.post("/responses", json=body)
        assert answer.status_code == 200, answer.text
        done = answer.json()["output"]
    calls = [item for item in done if item["type"] == "custom_tool_call"]
    assert calls and calls[0]["name"] == "shell" and isinstance(calls[0]["input"], str) and calls[0]["call_id"]
    assert not [item for item in done if item["type"] == "function_call"]
    # Its grammar held, to its end or as far as max_output_tokens let it go.
    assert re.fullmatch("[a-z ]+" if calls[0]["status"] == "completed" else "[a-z ]*", calls[0]["input"]), calls[0]


# Codex CLI's apply_patch tool (codex-rs/core: tool_apply_patch.lark), and the same language as a
# Python regex to check its answers against.
APPLY_PATCH = r"""start: begin_patch hunk+ end_patch
begin_patch: "*** Begin Patch" LF
end_patch: "*** End Patch" LF?

hunk: add_hunk | delete_hunk | update_hunk
add_hunk: "*** Add File: " filename LF add_line+
delete_hunk: "*** Delete File: " filename LF
update_hunk: "*** Update File: " filename LF change_move? change?

filename: /(.+)/
add_line: "+" /(.*)/ LF -> line

change_move: "*** Move to: " filename LF
change: (change_context | change_line)+ eof_line?
change_context: ("@@" | "@@ " /(.+)/) LF
change_line: ("+" | "-" | " ") /(.*)/ LF
eof_line: "*** End of File" LF

%import common.LF
"""
APPLY_PATCH_TEXT = re.compile(
    r"\*\*\* Begin Patch\n("
    r"\*\*\* Add File: .+\n(\+.*\n)+"
    r"|\*\*\* Delete File: .+\n"
    r"|\*\*\* Update File: .+\n(\*\*\* Move to: .+\n)?(((@@|@@ .+)\n|[-+ ].*\n)+(\*\*\* End of File\n)?)?"
    r")+\*\*\* End Patch\n?")


PATCH_LINE = re.compile(r"\*\*\* (Add|Delete|Update) File: .+|\*\*\* Move to: .+|[-+ ].*|@@( .+)?|\*\*\* End of File"
                        r"|\*\*\* End Patch")


def test_a_custom_tools_lark_grammar_is_enforced(http):
    """Codex's apply_patch, forced: a finished call is a patch, and one cut by
    max_output_tokens is a patch so far (a tiny model seldom ends one)."""
    tool = {"type": "custom", "name": "apply_patch", "description": "Edit files with a patch.",
            "format": {"type": "grammar", "syntax": "lark", "definition": APPLY_PATCH}}
    for seed, prompt in enumerate(["Add a file hello.txt that says hi.", "Delete the file old.txt."]):
        answer = http.post("/responses", json={
            "model": DEFAULT_MODEL, "input": prompt, "tools": [tool], "tool_choice": {"type": "custom", "name": "apply_patch"},
            "temperature": 1, "seed": seed, "max_output_tokens": 100, "store": False})
        assert answer.status_code == 200, answer.text
        calls = [item for item in answer.json()["output"] if item["type"] == "custom_tool_call"]
        assert calls, answer.json()
        text = calls[0]["input"]
        if calls[0]["status"] == "completed":
            assert APPLY_PATCH_TEXT.fullmatch(text), text
        else:
            lines = text.split("\n")[:-1]  # the lines it finished
            assert "*** Begin Patch\n".startswith(text) or lines[0] == "*** Begin Patch", text
            assert all(PATCH_LINE.fullmatch(line) for line in lines[1:]), text


@pytest.mark.parametrize("arguments, text", [
    ('{"input": "a\\nb"}', "a\nb"), ('{"input": "a\\nb', "a\nb"), ('{"input": "ab\\u00', "ab"),
    ('{ "input" : "ab"', "ab"), ("not json", "not json")])
def test_a_custom_calls_text_even_when_cut(arguments, text):
    from fastrun_cpp.entrypoints.openai.responses.translation import custom_input

    assert custom_input(arguments) == text


def test_a_custom_tool_grammar_that_cannot_be_enforced(http):
    """Forced, it is a 400 naming the grammar; with auto, the input is free text."""
    tool = {"type": "custom", "name": "shell", "description": "Run a command.",
            "format": {"type": "grammar", "syntax": "lark", "definition": "start: WORD\n%ignore \" \""}}
    body = {"model": DEFAULT_MODEL, "input": "List the files.", "tools": [tool], "temperature": 0,
            "max_output_tokens": 30, "store": False}
    forced = http.post("/responses", json={**body, "tool_choice": "required"})
    assert forced.status_code == 400 and "%ignore" in forced.json()["error"]["message"], forced.text
    assert http.post("/responses", json={**body, "tool_choice": "auto"}).status_code == 200


def test_codexs_request_shape_is_served(http):
    """store false, include, reasoning summary, prompt_cache_key, client_metadata, developer
    messages with ids, a max_output_tokens beyond chat's 16384: served, twice with a cache hit."""
    body = {"model": DEFAULT_MODEL, "stream": False, "store": False, "include": ["reasoning.encrypted_content"],
            "reasoning": {"summary": "auto"}, "prompt_cache_key": "thread-1", "tool_choice": "auto",
            "parallel_tool_calls": True, "client_metadata": {"x-codex-turn-metadata": "{}"},
            "max_output_tokens": 20000, "temperature": 0,
            "tools": [{"type": "function", "name": "exec_command", "strict": False, "parameters": {
                "type": "object", "properties": {"cmd": {"type": "string"}, "yield_time_ms": {
                    "type": "number", "maximum": 9007199254740991}}, "required": ["cmd"]}},
                {"type": "web_search", "external_web_access": False}],
            "input": [{"type": "message", "id": "msg_1", "role": "developer",
                       "content": [{"type": "input_text", "text": "You are a coding agent."}]},
                      {"type": "message", "id": "msg_2", "role": "user",
                       "content": [{"type": "input_text", "text": "Say hi."}]}]}
    first = http.post("/responses", json=body)
    assert first.status_code == 200, first.text
    second = http.post("/responses", json={**body, "input": body["input"] + [
        {"type": "reasoning", "summary": [], "content": None, "encrypted_content": None},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hi."}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Again."}]}]})
    assert second.status_code == 200, second.text
    first_prompt = first.json()["usage"]["input_tokens"]
    assert second.json()["usage"]["input_tokens_details"]["cached_tokens"] >= first_prompt - 1


def test_reasoning_round_trips_sealed_for_its_account(tmp_path):
    """With store false and include reasoning.encrypted_content, the reasoning item carries a
    sealed copy of its text; sent back by the same account it goes into the prompt (the prompt
    grows by it), by another account it is left out, and a forged one is left out."""
    from tests.test_keys import create_key
    from tests.test_reasoning import THINKING_TEMPLATE

    template = tmp_path / "think.jinja"
    template.write_text(THINKING_TEMPLATE.replace(
        "{{ message['content'] }}", "{% if message.reasoning_content %}<think>{{ message.reasoning_content }}"
        "</think>{% endif %}{{ message['content'] }}"))
    db = tmp_path / "keys.sqlite3"
    alice, bob = create_key(db, "alice"), create_key(db, "bob")
    with run_server("--chat-template-file", str(template), "--slots", "1", "--ctx-size", "1024",
                    log_dir=tmp_path, env={"FASTRUN_KEYS_DB": str(db)}) as server:
        def respond(key, items):
            answer = httpx.post(f"{server.base_url}/responses", headers={"Authorization": f"Bearer {key}"}, json={
                "model": DEFAULT_MODEL, "input": items, "store": False, "include": ["reasoning.encrypted_content"],
                "reasoning": {"effort": "low"}, "max_output_tokens": 40, "temperature": 0}, timeout=120)
            assert answer.status_code == 200, answer.text
            return answer.json()

        question = [{"role": "user", "content": "What is 12 times 3?"}]
        first = respond(alice, question)
        reasoning = [item for item in first["output"] if item["type"] == "reasoning"]
        assert reasoning and reasoning[0]["encrypted_content"]
        sealed = reasoning[0]["encrypted_content"]
        assert reasoning[0]["content"][0]["text"] not in sealed  # not the text as is
        follow = [{"role": "assistant", "content": "36"}, {"role": "user", "content": "And 12 times 4?"}]
        without = respond(alice, question + follow)["usage"]["input_tokens"]
        item = {"type": "reasoning", "summary": [], "encrypted_content": sealed}
        with_it = respond(alice, question + [item] + follow)["usage"]["input_tokens"]
        assert with_it > without
        assert respond(bob, question + [item] + follow)["usage"]["input_tokens"] == without
        forged = {**item, "encrypted_content": sealed[:-4] + "AAAA"}
        assert respond(alice, question + [forged] + follow)["usage"]["input_tokens"] == without
