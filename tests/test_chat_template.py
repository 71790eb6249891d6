"""Chat templates: the GGUF's own by default, an override file, and chat_template_kwargs."""

from __future__ import annotations

import pytest

from tests.server import DEFAULT_MODEL, run_server

# ChatML plus an optional system line that only `chat_template_kwargs` can switch on.
TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if house_style is defined %}<|im_start|>system\n{{ house_style }}<|im_end|>\n{% endif %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
HI = [{"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
def templated_server(tmp_path_factory):
    directory = tmp_path_factory.mktemp("template")
    path = directory / "chat.jinja"
    path.write_text(TEMPLATE)
    with run_server("--chat-template-file", str(path), "--slots", "2", "--ctx-size", "1024", log_dir=directory) as s:
        yield s


@pytest.fixture(scope="module")
def templated_client(templated_server):
    import openai

    return openai.OpenAI(base_url=templated_server.base_url, api_key="unused", max_retries=0)


def prompt_tokens(client, **kwargs) -> int:
    return client.chat.completions.create(model=DEFAULT_MODEL, messages=HI, max_tokens=1, **kwargs).usage.prompt_tokens


def test_chat_template_kwargs_reach_the_template(templated_client):
    plain = prompt_tokens(templated_client)
    styled = prompt_tokens(templated_client, extra_body={"chat_template_kwargs": {"house_style": "Answer in French."}})
    assert styled > plain + 5


def test_unused_and_reserved_kwargs_are_harmless(templated_client):
    plain = prompt_tokens(templated_client)
    assert prompt_tokens(templated_client, extra_body={"chat_template_kwargs": {"no_such_variable": 1}}) == plain
    # The server's own variables cannot be replaced through chat_template_kwargs.
    hijack = {"messages": [], "add_generation_prompt": False}
    assert prompt_tokens(templated_client, extra_body={"chat_template_kwargs": hijack}) == plain


def test_default_template_ignores_kwargs(client, model):
    plain = client.chat.completions.create(model=model, messages=HI, max_tokens=1).usage.prompt_tokens
    with_kwargs = client.chat.completions.create(
        model=model, messages=HI, max_tokens=1, extra_body={"chat_template_kwargs": {"enable_thinking": True}}
    ).usage.prompt_tokens
    assert with_kwargs == plain


def test_template_errors_are_400(tmp_path):
    path = tmp_path / "strict.jinja"
    path.write_text("{% if messages[0]['role'] != 'system' %}{{ raise_exception('system message first') }}{% endif %}"
                    "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    with run_server("--chat-template-file", str(path), "--slots", "1", "--ctx-size", "512", log_dir=tmp_path) as s:
        import httpx

        response = httpx.post(f"{s.base_url}/chat/completions", json={"model": DEFAULT_MODEL, "messages": HI})
    assert response.status_code == 400
    assert "system message first" in response.json()["error"]["message"]


def test_missing_template_file_is_a_clear_startup_error():
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "fastrun_cpp", "serve", "--chat-template-file", "/no/such/template.jinja"],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 2
    assert "chat_template_file" in result.stderr
