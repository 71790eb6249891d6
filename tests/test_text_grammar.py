"""A custom tool's grammar as GBNF for the text of a JSON string: what the grammar accepts is
what the string decodes to, every character JSON escapes spelled as its escape; what cannot be
enforced, or is over a bound, is a TextGrammarError."""

from __future__ import annotations

import json

import pytest

from fastrun_cpp.default_model import embedded_model_path
from fastrun_cpp.engine.grammar import GrammarCompiler
from fastrun_cpp.engine.model import LlamaModel
from fastrun_cpp.structured.spec import GrammarSpec
from fastrun_cpp.structured.text_grammar import MAX_DEFINITION_BYTES, TextGrammarError, text_grammar_rules
from tests.test_responses import APPLY_PATCH, APPLY_PATCH_TEXT


@pytest.fixture(scope="module")
def model():
    model = LlamaModel(embedded_model_path())
    yield model
    model.close()


@pytest.fixture(scope="module")
def compiler(model):
    compiler = GrammarCompiler(model)
    yield compiler
    compiler.close()


def string_grammar(syntax: str, definition: str, max_repetition: int = 1000) -> str:
    rules = text_grammar_rules(syntax, definition, prefix="text", max_repetition=max_repetition)
    return 'root ::= "\\"" text "\\""\n' + "\n".join(f"{name} ::= {body}" for name, body in rules.items())


def accepts(model, compiler, gbnf: str, text: str) -> bool:
    """Whether llguidance takes `text`, written as a JSON string, as a whole answer."""
    compiled = compiler.compile_now(GrammarSpec(gbnf))
    assert compiled.engine == "llguidance"
    tokens = model.tokenize(json.dumps(text, ensure_ascii=False), add_special=False, parse_special=False)
    constraint = compiled.instantiate()
    try:
        if constraint.valid_prefix(tokens) != len(tokens):
            return False
        for token in tokens:
            constraint.accept(token)
        return any(constraint.allows(end) for end in model.eog_token_ids)
    finally:
        constraint.free()


PATCHES = [
    "*** Begin Patch\n*** Add File: hello.txt\n+hi\n*** End Patch\n",
    "*** Begin Patch\n*** Delete File: old.txt\n*** End Patch",
    '*** Begin Patch\n*** Update File: src/a.py\n*** Move to: src/b.py\n@@ def f():\n-    return "one"\n'
    '+    return "two\\\\ \t three ∑ 😀"\n context\n*** End of File\n*** End Patch\n',
    "*** Begin Patch\n*** Update File: a\n@@\n+x\n*** Add File: b\n+\n*** End Patch\n",
]
NOT_PATCHES = [
    "*** Begin Patch\n*** Add File: hello.txt\n+hi\n",  # no end
    "*** Begin Patch\n*** Add File: hello.txt\n*** End Patch\n",  # an added file needs a line
    "*** Begin Patch\n*** Update File: a\nno marker\n*** End Patch\n",
    "*** Begin Patch\n*** Delete File: a\nb\n*** End Patch\n",  # the file name stops at the line's end
    "hello",
]


@pytest.mark.parametrize("text", PATCHES + NOT_PATCHES)
def test_codexs_apply_patch_grammar_accepts_its_language(model, compiler, text):
    assert accepts(model, compiler, string_grammar("lark", APPLY_PATCH), text) == bool(APPLY_PATCH_TEXT.fullmatch(text))


@pytest.mark.parametrize("text, expected", [("ab12", True), ("AB12", False), ('a"b\\c\n', True), ("a b", False)])
def test_a_regex_grammar_and_escaped_characters(model, compiler, text, expected):
    gbnf = string_grammar("regex", r'[a-z"\\\n]+\d*')
    assert accepts(model, compiler, gbnf, text) == expected


def test_lark_constructs_tool_grammars_use(model, compiler):
    grammar = '''
start: greeting ("," _name)~1..2 [END] NUMBER?
greeting: "hello"i | "hi"
_name: CNAME | "(" start ")"   // recursion is fine
END: "!"
%import common.(CNAME, INT)
NUMBER: INT
'''
    gbnf = string_grammar("lark", grammar)
    for text, expected in [("HeLLo,bob", True), ("hi,a_1,b!7", True), ("hi,(hello,x)", True), ("hi", False),
                           ("hi,a,b,c", False), ("hey,bob", False)]:
        assert accepts(model, compiler, gbnf, text) == expected, text


@pytest.mark.parametrize("syntax, definition, problem", [
    ("lark", 'start: WORD\n%ignore " "\n%import common.WORD', "%ignore"),
    ("lark", "start: /(?=a)a/", "not supported"),
    ("lark", "start: /a/i", "flags"),
    ("lark", "start: other", "not defined"),
    ("lark", 'rule: "a"', "no start rule"),
    ("lark", 'start: "a"~5000', "limit"),
    ("lark", "start: /a{5000}/", "limit"),
    ("lark", "start: " + "(" * 100 + '"a"' + ")" * 100, "nests"),
    ("lark", "start: " + '"a" ' * MAX_DEFINITION_BYTES, "bytes"),
    ("regex", r"(a)\1", "not supported"),
    ("ebnf", "start: a", "syntax"),
])
def test_what_cannot_be_enforced_is_refused(syntax, definition, problem):
    with pytest.raises(TextGrammarError, match=problem):
        text_grammar_rules(syntax, definition, prefix="text", max_repetition=1000)


def test_common_terminals(model, compiler):
    gbnf = string_grammar("lark", 'start: ESCAPED_STRING " " SIGNED_NUMBER\n'
                                  "%import common.(ESCAPED_STRING, SIGNED_NUMBER)")
    for text, expected in [('"a\\"b" -1.5e3', True), ('"ab" 12', True), ('"a"b" 1', False), ('"ab" x', False)]:
        assert accepts(model, compiler, gbnf, text) == expected, text
