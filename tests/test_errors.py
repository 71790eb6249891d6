"""Every bad request gets a 4xx in the spec's error shape, and the engine keeps serving."""

from __future__ import annotations

import pytest

USER = [{"role": "user", "content": "hi"}]


def assert_error(response, status: int, *, mentions: str = "") -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "code"}
    assert error["code"] == status
    assert error["type"] == "invalid_request_error"
    assert error["message"]
    assert mentions in error["message"], error["message"]
    return error


def test_malformed_json(http):
    response = http.post("/chat/completions", content=b'{"model": "x", messages: }',
                         headers={"content-type": "application/json"})
    assert_error(response, 400, mentions="JSON")


@pytest.mark.parametrize("body", [b"[]", b'"text"', b"42", b"null"])
def test_body_that_is_not_an_object(http, body):
    response = http.post("/chat/completions", content=body, headers={"content-type": "application/json"})
    assert_error(response, 400, mentions="JSON object")


def test_empty_body(http):
    assert_error(http.post("/completions", content=b"", headers={"content-type": "application/json"}), 400)


def test_missing_model_says_model_is_required(http):
    error = assert_error(http.post("/chat/completions", json={"messages": USER}), 400)
    assert error["message"] == "model is required"


def test_missing_messages_and_prompt(http, model):
    assert_error(http.post("/chat/completions", json={"model": model}), 400, mentions="messages")
    assert_error(http.post("/completions", json={"model": model}), 400, mentions="prompt")


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", 2.5), ("temperature", -0.1), ("top_p", 1.5), ("top_k", -1), ("top_k", 1001),
        ("min_p", 2), ("max_tokens", 0), ("max_tokens", 16385), ("seed", -1), ("frequency_penalty", 3),
        ("presence_penalty", -2.5), ("repetition_penalty", 2.5), ("top_logprobs", 21),
        ("stop", ["a", "b", "c", "d", "e"]), ("stream", {"x": 1}), ("n", 129), ("n", 0),
        ("stream", "yes"), ("max_tokens", "16"), ("temperature", "0.5"), ("logprobs", 1),
    ],
)
def test_chat_out_of_range_values_name_the_field(http, model, field, value):
    response = http.post("/chat/completions", json={"model": model, "messages": USER, field: value})
    assert_error(response, 400, mentions=field)


@pytest.mark.parametrize(
    "field, value", [("max_tokens", 0), ("temperature", 9), ("top_p", -1), ("logprobs", 21), ("prompt", [1, 2])]
)
def test_completion_out_of_range_values_name_the_field(http, model, field, value):
    response = http.post("/completions", json={"model": model, "prompt": "hi", field: value})
    assert_error(response, 400, mentions=field)


def test_unknown_model_is_404_naming_it(http):
    response = http.post("/chat/completions", json={"model": "no-such-model", "messages": USER})
    assert_error(response, 404, mentions="no-such-model")
    response = http.post("/completions", json={"model": "no-such-model", "prompt": "x"})
    assert_error(response, 404, mentions="no-such-model")


@pytest.mark.parametrize(
    "content, mentions",
    [
        # A model served without a vision projector says how to serve one (tests/test_vision.py).
        ([{"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}], "--mmproj"),
        ([{"type": "text", "text": "look"}, {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}],
         "text"),
        ([{"type": "file", "file": {}}], "text"),
    ],
)
def test_content_parts_the_model_cannot_read_are_rejected(http, model, content, mentions):
    response = http.post("/chat/completions", json={"model": model, "messages": [{"role": "user", "content": content}]})
    assert_error(response, 400, mentions=mentions)


def test_bad_messages(http, model):
    for messages in ([], "hello", [{"role": "wizard", "content": "x"}], [{"role": "user"}], [{"content": "x"}]):
        response = http.post("/chat/completions", json={"model": model, "messages": messages})
        assert_error(response, 400, mentions="messages")


def test_prompt_longer_than_the_context(http, model):
    long_text = "word " * 3000  # the test server's context is 2048 tokens
    response = http.post("/chat/completions", json={"model": model, "messages": [{"role": "user", "content": long_text}]})
    assert_error(response, 400, mentions="context")
    response = http.post("/completions", json={"model": model, "prompt": ["short", long_text]})
    assert_error(response, 400, mentions="context")


def test_empty_completion_prompt(http, model):
    assert_error(http.post("/completions", json={"model": model, "prompt": ""}), 400, mentions="empty")
    assert_error(http.post("/completions", json={"model": model, "prompt": []}), 400, mentions="prompt")


def test_unknown_route_and_wrong_method(http):
    assert_error(http.get("/images/generations"), 404)
    assert_error(http.post("/models"), 405)


def test_server_still_answers_after_bad_requests(client, model):
    response = client.chat.completions.create(model=model, messages=USER, max_tokens=3)
    assert response.usage.completion_tokens >= 1


def test_sdk_raises_typed_errors(client, model):
    import openai

    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=model, messages=USER, temperature=5)
    assert bad.value.status_code == 400
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="missing", messages=USER)
