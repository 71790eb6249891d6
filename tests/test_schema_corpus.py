"""Every schema of a 57-schema real-world corpus is either answered validly or refused up front
naming what cannot be enforced; nothing in between. Run while two CPU-bound processes share the
machine: the grammar guards count work, so a busy machine refuses nothing an idle one accepts
(and the engine runs one thread beside them, engine/threads.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import jsonschema
import pytest

from tests.data.schema_corpus import CORPUS
from tests.json_prefix import close_json

# What a grammar cannot enforce, refused under `strict: true` with the keyword named.
REFUSED = {"string_map": "maxProperties", "unique_tags": "uniqueItems", "multiple_of": "multipleOf",
           "http_request": "maxProperties"}


@pytest.fixture(scope="module", autouse=True)
def busy_machine():
    """Two processes burning a core each, for as long as the corpus runs."""
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    yield
    for burner in burners:
        burner.kill()
        burner.wait()


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_corpus_schema_is_answered_validly_or_refused(http, model, name):
    schema, prompt = CORPUS[name]
    response = http.post("/chat/completions", timeout=600, json={  # a hang guard: the burners slow every token
        "model": model, "temperature": 0, "max_tokens": 200,
        "messages": [{"role": "user", "content": prompt + " Answer in JSON."}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}})
    if name in REFUSED:
        assert response.status_code == 400, response.text[:300]
        assert REFUSED[name] in response.json()["error"]["message"]
        return
    assert response.status_code == 200, response.text[:300]
    choice = response.json()["choices"][0]
    if choice["finish_reason"] == "stop":
        jsonschema.validate(json.loads(choice["message"]["content"]), schema)
    else:  # a small model may ramble inside a free string: what it wrote so far is valid JSON
        assert choice["finish_reason"] == "length"
        json.loads(close_json(choice["message"]["content"]))
