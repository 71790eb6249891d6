"""What a model writes is untrusted too. Adversarial outputs - trigger text merged with its
neighbours, unclosed and nested tags, tags split across tokens - go through the tool-call and
reasoning parsers and through the lazy-grammar path without a crash, and every answer stays
well formed: its deltas add up to the whole answer, whatever the split."""

from __future__ import annotations

import ctypes
import random

import httpx
import numpy as np
import pytest

from fastrun_cpp.default_model import embedded_model_path
from fastrun_cpp.engine.grammar import GrammarCompiler, LazyGrammar
from fastrun_cpp.engine.model import LlamaModel
from fastrun_cpp.engine.sampling import Candidates
from fastrun_cpp.parsers.chat_output import ChatOutputParser
from fastrun_cpp.parsers.reasoning import HarmonyParser, ThinkTagParser
from fastrun_cpp.parsers.tool_calls import (
    FallbackToolParser,
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    PythonicToolParser,
)
from fastrun_cpp.structured.json_schema import tool_calls_gbnf
from fastrun_cpp.structured.spec import CallableFunction, GrammarSpec
from tests.server import DEFAULT_MODEL

FRAGMENTS = [
    "<tool_call>", "</tool_call>", "<tool_", "call>", "</tool", "_call>", "<think>", "</think>", "<thi", "nk>",
    '{"name": "f", "arguments": {', '"city": "Paris"', "}", "}}", "{", '"', "\\", "\n", " ", "[TOOL_CALLS]",
    "[ARGS]", "<|python_tag|>", "<|channel|>", "analysis", "final", "<|message|>", "<|end|>", "```tool_code",
    "f(a=1)", "[", "]", ";", "é", "🙂", "\ufffd", "null", "true", "1e400", "-", '{"name": ', '"arguments"', ":",
]
TOOL_PARSERS = [HermesToolParser(), FallbackToolParser(), Llama3JsonToolParser(), MistralToolParser(),
                PythonicToolParser(), None]
REASONING = [(None, False), (ThinkTagParser(), False), (ThinkTagParser(), True), (HarmonyParser(), False)]


def random_output(rng: random.Random) -> str:
    return "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(1, 30)))


def stream(text: str, rng: random.Random, tools, reasoning, opened, max_calls) -> None:
    parser = ChatOutputParser(reasoning=reasoning, starts_in_reasoning=opened, tools=tools, max_calls=max_calls)
    cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 8))))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    content, reasoning_text, calls = "", "", {}
    for index, piece in enumerate(pieces):
        delta = parser.feed(piece, final=index == len(pieces) - 1)
        content += delta.content
        reasoning_text += delta.reasoning
        for call in delta.tool_calls:
            if call.id is not None:
                assert call.index not in calls, "a call was started twice"
                assert call.name, "a call without a name"
                calls[call.index] = [call.id, call.name, ""]
            calls[call.index][2] += call.arguments
    result = parser.result()
    assert result.content == content
    assert (result.reasoning or "") == reasoning_text
    assert [(i, c.name, c.arguments) for i, c in result.tool_calls] == [tuple(v) for _, v in sorted(calls.items())]
    assert len({i for i, _ in result.tool_calls}) == len(result.tool_calls)
    if max_calls is not None:
        assert len(result.tool_calls) <= max_calls


@pytest.mark.parametrize("seed", range(40))
def test_parsers_take_any_output_and_stay_consistent(seed):
    rng = random.Random(seed)
    for _ in range(25):
        text = random_output(rng)
        tools = rng.choice(TOOL_PARSERS)
        reasoning, opened = rng.choice(REASONING)
        stream(text, rng, tools, reasoning, opened, rng.choice([None, 1, 2]))


@pytest.fixture(scope="module")
def vocab():
    model = LlamaModel(embedded_model_path(), vocab_only=True)
    yield model
    model.close()


@pytest.fixture(scope="module")
def call_grammar(vocab):
    parser = HermesToolParser()
    gbnf = tool_calls_gbnf([CallableFunction("f", {"type": "object", "properties": {
                               "city": {"type": "string", "maxLength": 20}}, "required": ["city"]}, True)],
                           parser.call_grammar, lambda call: parser.calls_grammar(call, at_least=1, at_most=2))
    return GrammarCompiler(vocab).compile_now(GrammarSpec(gbnf, parser.lazy_triggers()))


ADVERSARIAL = [
    "<tool_call></tool_call>", "<tool_call>x", "text<tool_call>\n{\"name\": \"f\"", "<tool_<tool_call>",
    "<tool_call><tool_call>", "<tool_call>\n{\"name\": \"g\", ", "}<tool_call>}\n", "<tool_call>" * 5,
    "before <tool_call>\n{\"name\": \"f\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call> after",
    "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"city\": \"" + "x" * 50,
]


@pytest.mark.parametrize("text", ADVERSARIAL)
def test_lazy_grammar_arms_only_on_what_it_accepts(vocab, call_grammar, text):
    """Whatever surrounds the trigger, token by token: arming never throws inside llama.cpp, and
    once armed, every token picked is one the grammar allowed."""
    armed = _arm(vocab, call_grammar, text)
    if armed is None:
        return
    _sample_on(vocab, armed, np.random.default_rng(len(text)))


def test_a_valid_call_after_text_arms_the_grammar(vocab, call_grammar):
    text = 'before <tool_call>\n{"name": "f", "arguments": {"city": "Os'
    armed = _arm(vocab, call_grammar, text)
    assert armed is not None
    _sample_on(vocab, armed, np.random.default_rng(0))


def _arm(vocab, grammar, text):
    lazy = LazyGrammar(grammar, vocab)
    armed = None
    seen = ""
    for token in vocab.tokenize(text, add_special=False, parse_special=True):
        seen += vocab.token_bytes[token].decode("utf-8", "replace")
        armed = lazy.observe(seen) or armed
        if lazy.done:
            break
    return armed


def _sample_on(vocab, armed, rng):
    """Sample on with random logits: only allowed tokens, and accepting them never throws."""
    candidates = Candidates(vocab.n_vocab)
    logits = (ctypes.c_float * vocab.n_vocab)()
    for _ in range(30):
        np.ctypeslib.as_array(logits, shape=(vocab.n_vocab,))[:] = rng.normal(size=vocab.n_vocab)
        candidates.fill(logits)
        armed.mask(candidates)
        values = candidates.logits
        if not np.isfinite(values).any():
            break  # the grammar is complete: nothing but the end may come
        best = int(np.argmax(values))
        if best in vocab.eog_token_ids:
            break
        assert armed.allows(best)
        armed.accept(best)
    armed.free()


def test_a_model_writing_empty_tool_call_tags_is_served(server, model):
    """The conversation shows `<tool_call></tool_call>`, so the model writes it too: the lazy
    grammar's trigger comes with text the grammar refuses. The request is answered and the
    server lives on."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    messages = [
        {"role": "user", "content": "Say the tags."},
        {"role": "assistant", "content": "<tool_call></tool_call>"},
        {"role": "user", "content": "Again, exactly the same."},
        {"role": "assistant", "content": "<tool_call></tool_call>"},
        {"role": "user", "content": "Again, exactly the same."},
    ]
    for speculative in (True, False):
        response = httpx.post(f"{server.base_url}/chat/completions", json={
            "model": model, "messages": messages, "tools": tools, "max_tokens": 30, "temperature": 0,
            "speculative": speculative}, timeout=120)
        assert response.status_code == 200, response.text
    assert server.process.poll() is None
    assert httpx.post(f"{server.base_url}/completions", json={"model": DEFAULT_MODEL, "prompt": "Hi", "max_tokens": 2},
                      timeout=60).status_code == 200
