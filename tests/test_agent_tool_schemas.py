"""Tool schemas as real tools write them: the tools Claude Code and Codex CLI send
(tests/data/agent_tools.json, captured from the CLIs on loopback) and those 17 common MCP
servers list (tests/data/mcp_tool_schemas.json, from their `tools/list`), all accepted when the
model may choose (`tool_choice: auto`), on every endpoint. A forced call keeps its exact
grammar: it is served, or refused with a 400 naming what cannot be built."""

from __future__ import annotations

import json
from pathlib import Path

import anthropic
import httpx
import pytest

from tests.server import run_server

DATA = Path(__file__).parent / "data"
AGENT_TOOLS = json.loads((DATA / "agent_tools.json").read_text())
MCP_TOOLS = json.loads((DATA / "mcp_tool_schemas.json").read_text())
CLAUDE_CODE = next(tools for source, tools in AGENT_TOOLS.items() if "claude-code" in source)
CODEX = next(tools for source, tools in AGENT_TOOLS.items() if "codex" in source)
USER = [{"role": "user", "content": "Say hi."}]
MODEL = "tiny"


@pytest.fixture(scope="module")
def tiny_server(tiny_model_path, tmp_path_factory):
    """The random-weight model with SmolLM2's vocabulary and template (the same tool-call format
    and grammars): what is tested is that the tools are accepted, and reading a prompt of 26
    tools' descriptions costs it next to nothing."""
    with run_server("--model", str(tiny_model_path), "--served-model-name", MODEL, "--slots", "2",
                    "--ctx-size", "32768", log_dir=tmp_path_factory.mktemp("logs")) as server:
        yield server


@pytest.fixture(scope="module")
def http(tiny_server):
    with httpx.Client(base_url=tiny_server.base_url, timeout=120) as client:
        yield client


def chat_tools(tools: list[dict]) -> list[dict]:
    """Anthropic-shaped or MCP tools ({name, description, input_schema}) as chat function tools."""
    return [{"type": "function", "function": {"name": tool["name"], "description": tool.get("description") or "",
                                              "parameters": tool["input_schema"]}}
            for tool in tools if "input_schema" in tool]


def codex_functions(tools: list[dict]) -> list[dict]:
    """Codex's function tools, those inside its namespaces included, as chat function tools."""
    out = []
    for tool in tools:
        members = tool["tools"] if tool["type"] == "namespace" else [tool]
        out += [{"type": "function", "function": {"name": member["name"], "parameters": member.get("parameters") or {}}}
                for member in members if member["type"] == "function"]
    return out


def chat(http: httpx.Client, **fields) -> httpx.Response:
    return http.post("/chat/completions", json={"model": MODEL, "messages": USER, "max_tokens": 1,
                                                "temperature": 0, **fields})


@pytest.mark.parametrize("source", list(MCP_TOOLS))
def test_an_mcp_servers_tools_are_accepted(http, source):
    response = chat(http, tools=chat_tools(MCP_TOOLS[source]), tool_choice="auto")
    assert response.status_code == 200, response.text


def test_claude_codes_tools_are_accepted_on_messages(tiny_server):
    claude = anthropic.Anthropic(base_url=tiny_server.root_url, api_key="unused", max_retries=0, timeout=120)
    message = claude.messages.create(model=MODEL, max_tokens=1, messages=USER, tools=CLAUDE_CODE,
                                     extra_body={"temperature": 0})
    assert message.stop_reason in ("max_tokens", "end_turn", "tool_use")


def test_codexs_tools_are_accepted_on_responses(http):
    response = http.post("/responses", json={"model": MODEL, "input": "Say hi.", "max_output_tokens": 1,
                                             "tools": CODEX, "tool_choice": "auto", "store": False})
    assert response.status_code == 200, response.text
    assert response.json()["tools"] == CODEX  # as sent, hosted tool included


def every_function() -> list[tuple[str, dict]]:
    functions = [(source, tool) for source, tools in MCP_TOOLS.items() for tool in chat_tools(tools)]
    functions += [("claude-code", tool) for tool in chat_tools(CLAUDE_CODE)]
    functions += [("codex", tool) for tool in codex_functions(CODEX)]
    return functions


@pytest.mark.timeout(900)
def test_forced_calls_keep_their_exact_grammar(http):
    """Each function forced alone: served with its whole schema, or refused with a 400 that names
    the limit or keyword; at most a handful of the corpus are refused."""
    refused = []
    functions = every_function()
    for source, tool in functions:
        name = tool["function"]["name"]
        response = chat(http, tools=[tool], tool_choice={"type": "function", "function": {"name": name}})
        if response.status_code != 200:
            assert response.status_code == 400, (source, name, response.text)
            message = response.json()["error"]["message"]
            assert "--limit-" in message or "not supported" in message or "cannot" in message, message
            refused.append((source, name, message))
    assert len(functions) > 200
    assert len(refused) <= 2, refused


# A constraint the grammar cannot enforce exactly never fails a request that may not call at all.
RELAXED_CASES = {
    "MAX_SAFE_INTEGER bounds": {"type": "integer", "minimum": -9007199254740991, "maximum": 9007199254740991},
    "a bound beyond it": {"type": "number", "maximum": 1e300},
    "\\S in a class": {"type": "string", "pattern": "^[a\\S]+$"},
    "a word boundary": {"type": "string", "pattern": "\\bword\\b"},
    "a lookahead": {"type": "string", "pattern": "^(?=.*[A-Z]).{8,}$"},
    "a huge maxLength": {"type": "string", "maxLength": 524288},
    "allOf of patterns": {"type": "string", "allOf": [{"minLength": 1}, {"pattern": "^\\S+$"}]},
    "unknown keywords": {"type": "string", "x-order": 3, "contentMediaType": "text/plain", "dependentRequired": {}},
    "a format nobody knows": {"type": "string", "format": "int32"},
    "a schema 40 deep": {"type": "object", "properties": {"a": json.loads('{"type":"object","properties":{"a":' * 40
                                                                          + '{"type":"string"}' + "}}" * 40)}},
}


@pytest.mark.parametrize("name", list(RELAXED_CASES))
def test_auto_tools_with_unenforceable_schemas_are_served(http, name):
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": RELAXED_CASES[name]}, "required": ["x"]}}}
    response = chat(http, tools=[tool], tool_choice="auto")
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("name", ["\\S in a class", "a lookahead", "a huge maxLength", "a schema 40 deep"])
def test_forced_calls_with_unenforceable_schemas_are_refused_by_name(http, name):
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": RELAXED_CASES[name]}, "required": ["x"]}}}
    response = chat(http, tools=[tool], tool_choice="required")
    assert response.status_code == 400, response.text
    assert "tools: function 'f'" in response.json()["error"]["message"]


def test_patterns_in_the_javascript_dialect_are_enforced(http):
    """\\S, \\D, [\\s\\S] and (?:...) groups are part of the grammar's regex dialect: a forced
    call's argument follows the pattern."""
    pattern = "^(?:id)-\\D\\S[\\s\\S]{2}$"
    tool = {"type": "function", "function": {"name": "tag", "parameters": {
        "type": "object", "properties": {"tag": {"type": "string", "pattern": pattern}}, "required": ["tag"]}}}
    response = chat(http, tools=[tool], tool_choice="required", max_tokens=40)
    assert response.status_code == 200, response.text
    import re

    arguments = json.loads(response.json()["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"])
    assert re.fullmatch(pattern, arguments["tag"]), arguments
