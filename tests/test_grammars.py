"""The hand-written base grammars in grammars/: each compiles in llama.cpp and constrains a
real model to what it promises."""

from __future__ import annotations

from pathlib import Path

import pytest

import numpy as np

from fastrun_cpp.default_model import embedded_model_path
from fastrun_cpp.engine.constraint import MasksAhead
from fastrun_cpp.engine.errors import GrammarError
from fastrun_cpp.engine.grammar import GrammarCompiler
from fastrun_cpp.engine.model import LlamaModel
from fastrun_cpp.structured.grammars import base_grammar
from fastrun_cpp.parsers import TOOL_PARSERS
from fastrun_cpp.parsers.reasoning import ThinkTagParser
from fastrun_cpp.structured.json_schema import schema_to_gbnf, tool_calls_gbnf
from fastrun_cpp.structured.reasoning import with_optional_reasoning
from fastrun_cpp.structured.spec import CallableFunction, GrammarSpec
from tests.json_prefix import assert_json_answer

GRAMMARS = sorted(p.stem for p in (Path(__file__).parents[1] / "grammars").glob("*.gbnf"))


@pytest.fixture(scope="module")
def smollm():
    model = LlamaModel(embedded_model_path())
    yield model
    model.close()


def test_the_base_grammars_exist():
    assert {"json", "json_object"} <= set(GRAMMARS)


@pytest.fixture(scope="module")
def compiler(smollm):
    compiler = GrammarCompiler(smollm)
    yield compiler
    compiler.close()


@pytest.mark.parametrize("name", GRAMMARS)
def test_grammar_compiles_for_llguidance(compiler, name):
    assert compiler.compile_now(GrammarSpec(base_grammar(name))).engine == "llguidance"


def test_a_broken_grammar_is_reported(compiler):
    with pytest.raises(GrammarError):
        compiler.compile_now(GrammarSpec('root ::= "unterminated'))


def test_masks_computed_ahead_are_the_masks_of_the_step(compiler, smollm):
    # The engine computes a slot's next mask on a worker thread while the batch decodes; the
    # step then reads it. Along a JSON answer, and for two slots at once, it must be the mask
    # the step would compute itself, and never outlive the token it was computed before.
    compiled = compiler.compile_now(GrammarSpec(base_grammar("json_object")))
    answer = smollm.tokenize('{"name": "Bob", "tags": ["a", "b"], "age": 30}', add_special=False)
    ahead, inline, other = compiled.instantiate(), compiled.instantiate(), compiled.instantiate()
    masks = MasksAhead(workers=2)
    try:
        for token in answer:
            masks.start({0: ahead, 1: other})
            seconds = masks.finish()
            assert set(seconds) == {0, 1} and all(s >= 0 for s in seconds.values())
            expected = inline.allowed()
            assert np.array_equal(ahead.allowed(), expected) and np.array_equal(other.allowed(), expected)
            refused = int(np.flatnonzero(~expected)[0])
            assert ahead.allows(token) and not ahead.allows(refused)
            for constraint in (ahead, inline, other):
                constraint.accept(token)
    finally:
        masks.close()
        for constraint in (ahead, inline, other):
            constraint.free()


# Prompts the tiny model answers briefly (a rambling answer would hit max_tokens mid-value).
SHORT_JSON_PROMPTS = [
    "Give a JSON object with keys name and age for a person named Bob who is 30.",
    "Reply with a JSON object that has a single key 'answer' with the value 'yes'.",
]


@pytest.mark.parametrize("prompt", SHORT_JSON_PROMPTS + ["What is 2+2? Reply with a JSON number."])
def test_json_grammar_yields_any_json_value(client, model, prompt):
    # An empty schema means "any JSON value": the server constrains with grammars/json.gbnf.
    response = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=300,
        temperature=0, response_format={"type": "json_schema", "json_schema": {"name": "any", "schema": {}}},
    )
    assert_json_answer(response.choices[0], object)


@pytest.mark.parametrize("prompt", SHORT_JSON_PROMPTS + ["What is 2+2? Reply with a JSON number."])
def test_json_object_grammar_yields_an_object(client, model, prompt):
    response = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=300,
        temperature=0, response_format={"type": "json_object"},
    )
    assert_json_answer(response.choices[0], dict)


TREE = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                        "children": {"type": "array", "items": {"$ref": "#"}, "maxItems": 2}},
        "required": ["name", "children"]}
FORCEABLE_PARSERS = sorted(name for name, parser in TOOL_PARSERS.items() if parser().can_force)


@pytest.mark.parametrize("parser_name", FORCEABLE_PARSERS)
def test_tool_call_grammars_run_on_llguidance(compiler, parser_name):
    """Every grammar the server generates runs on llguidance, not on llama.cpp's fallback."""
    parser = TOOL_PARSERS[parser_name]()
    gbnf = tool_calls_gbnf([CallableFunction("save_tree", TREE, True), CallableFunction("f", {"type": "object"})],
                           parser.call_grammar,
                           lambda call: parser.calls_grammar(call, at_least=1, at_most=None))
    assert compiler.compile_now(GrammarSpec(gbnf)).engine == "llguidance"


@pytest.mark.parametrize("schema", [TREE, {"type": "string", "format": "email"}, {"type": "number", "minimum": -5},
                                    {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 40}],
                         ids=["recursive", "email", "bounded-number", "bounded-array"])
def test_schema_and_think_then_constrain_grammars_run_on_llguidance(compiler, schema):
    gbnf = schema_to_gbnf(schema)
    assert compiler.compile_now(GrammarSpec(gbnf)).engine == "llguidance"
    thinking = with_optional_reasoning(gbnf, ThinkTagParser.opening, ThinkTagParser.answer_marker)
    assert compiler.compile_now(GrammarSpec(thinking)).engine == "llguidance"
