"""Speculative decoding is lossless: with drafts verified inside the batch, answers are token
for token the answers without speculation - at temperature 0, and with a seed at any
temperature - on both default models, with grammars, logprobs, stop strings, penalties and
logit_bias; and drafts are really used where the answer copies from its context."""

from __future__ import annotations

import httpx
import pytest

from tests.server import DEFAULT_MODEL, run_server, wait_until

PASSAGE = " ".join(f"The keeper of lighthouse {i} logs the weather at {i % 12 + 1} o'clock and trims wick {i * 7 % 19}."
                   for i in range(25))
COPY = [{"role": "user", "content": f"Here is a passage:\n\n{PASSAGE}\n\nCopy the passage exactly, word for word."}]
CHAT = [{"role": "user", "content": "Tell me a short story about a fox and a crow."}]
CODE = [{"role": "user", "content": "def area(width, height):\n    return width * height\n\n"
                                    "def perimeter(width, height):\n    return 2 * (width + height)\n\n"
                                    "Rewrite both functions with `height` renamed to `h`. Output the code."}]


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def model_flags(request, gemma_path):
    if request.param == "smollm2":
        return DEFAULT_MODEL, []
    return gemma_path.stem, ["--model", str(gemma_path)]


@pytest.fixture(scope="module")
def servers(model_flags, tmp_path_factory):
    """The same model with n-gram speculation (the default) and without."""
    model, flags = model_flags
    directory = tmp_path_factory.mktemp("spec")
    with run_server(*flags, "--slots", "2", "--ctx-size", "2048", log_dir=directory) as on, \
            run_server(*flags, "--slots", "2", "--ctx-size", "2048", "--spec-type", "none", log_dir=directory) as off:
        yield model, on, off


def ask(server, model: str, **body) -> dict:
    response = httpx.post(f"{server.base_url}/chat/completions", json={"model": model, **body}, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


def spec_counts(server, model: str) -> tuple[int, int]:
    stats = server.health()["models"][model]["stats"]
    return stats["drafted_tokens"], stats["accepted_tokens"]


DRAFT_ATTEMPTS = 4


def asked_with_drafts(servers, body: dict) -> tuple[list[tuple[dict, dict]], bool]:
    """The same request to the server with drafts and to the one without, until drafts were
    verified for it (at most DRAFT_ATTEMPTS times): every pair of answers, and whether drafts
    were verified. Whether a draft is verified is the cost gate's call, from step times measured
    on this machine, so on a busy one a whole answer may draft nothing: the request is asked
    again (a state waited for, in attempts, not in time). Every pair must agree."""
    model, on, off = servers
    pairs = []
    for _ in range(DRAFT_ATTEMPTS):
        before = spec_counts(on, model)
        pairs.append((ask(on, model, **body), ask(off, model, **body)))
        if spec_counts(on, model)[0] > before[0]:
            return pairs, True
    return pairs, False


@pytest.mark.parametrize("messages", [COPY, CODE, CHAT], ids=["copy", "code-edit", "chat"])
def test_greedy_answers_are_the_same_with_and_without_drafts(servers, messages):
    model, on, off = servers
    body = dict(messages=messages, max_tokens=160, temperature=0, logprobs=True, top_logprobs=2)
    with_drafts, without = ask(on, model, **body), ask(off, model, **body)
    assert with_drafts["choices"][0]["message"] == without["choices"][0]["message"]
    assert with_drafts["choices"][0]["finish_reason"] == without["choices"][0]["finish_reason"]
    assert with_drafts["usage"]["completion_tokens"] == without["usage"]["completion_tokens"]
    assert [t["token"] for t in with_drafts["choices"][0]["logprobs"]["content"]] == \
           [t["token"] for t in without["choices"][0]["logprobs"]["content"]]


def test_drafts_are_used_when_the_answer_copies(servers):
    model, on, _ = servers
    for _ in range(DRAFT_ATTEMPTS):  # the cost gate's call, from step times: see asked_with_drafts
        before = spec_counts(on, model)
        ask(on, model, messages=COPY, max_tokens=160, temperature=0)
        drafted, accepted = (a - b for a, b in zip(spec_counts(on, model), before))
        if drafted > 0 and accepted > 0:
            break
    assert drafted > 0 and accepted > 0
    assert on.health()["models"][model]["speculation"]["acceptance_rate"] is not None
    assert '"spec_accepted"' in on.log()


@pytest.mark.parametrize("seed", range(6))
def test_seeded_sampling_is_the_same_with_and_without_drafts(servers, seed):
    """Each drafted position is sampled by the request's own sampler, exactly as without
    drafts: same seed, same tokens (so the distribution is the same too)."""
    model = servers[0]
    body = dict(messages=COPY, max_tokens=80, temperature=0.8, top_p=0.95, seed=seed)
    pairs, drafted = asked_with_drafts(servers, body)
    if model == DEFAULT_MODEL:  # drafts were verified, so the comparison means something (Gemma 3
        # strays from the passage at this temperature: its answers draft nothing to verify)
        assert drafted
    for with_drafts, without in pairs:
        assert with_drafts["choices"][0]["message"] == without["choices"][0]["message"]


@pytest.mark.parametrize("extra", [
    {"response_format": {"type": "json_object"}},
    {"stop": ["lighthouse 7"]},
    {"frequency_penalty": 0.8, "presence_penalty": 0.5, "repetition_penalty": 1.2},
    {"logit_bias": {"11": -100, "28": 5}},
], ids=["grammar", "stop", "penalties", "logit_bias"])
def test_everything_else_still_applies(servers, extra):
    body = dict(messages=COPY, max_tokens=120, temperature=0, **extra)
    copies = not {"response_format", "frequency_penalty"} & set(extra)
    pairs, drafted = asked_with_drafts(servers, body) if copies else ([(ask(servers[1], servers[0], **body),
                                                                         ask(servers[2], servers[0], **body))], False)
    # Drafts were verified, so the comparison means something: not for a JSON answer (it copies no
    # prose; its grammar refuses those drafts), nor with penalties (they keep the answer from copying).
    assert drafted or not copies
    for with_drafts, without in pairs:
        assert with_drafts["choices"][0]["message"]["content"] == without["choices"][0]["message"]["content"]
        assert with_drafts["usage"]["completion_tokens"] == without["usage"]["completion_tokens"]


def test_a_request_can_opt_out(servers):
    model, on, _ = servers
    before = spec_counts(on, model)
    ask(on, model, messages=COPY, max_tokens=60, temperature=0, speculative=False)
    assert spec_counts(on, model) == before


def test_a_draft_model_is_lossless(tmp_path):
    """The default model drafting for itself (every draft the target would pick) and the tiny
    random model (few accepted): both answer exactly as without speculation."""
    from fastrun_cpp.default_model import embedded_model_path
    from fastrun_cpp.tiny_model import write_tiny_model

    tiny = write_tiny_model(tmp_path / "tiny.gguf", embedded_model_path())
    body = dict(messages=COPY, max_tokens=80, temperature=0)
    with run_server("--slots", "2", "--spec-type", "none", log_dir=tmp_path) as off:
        expected = ask(off, DEFAULT_MODEL, **body)["choices"][0]["message"]["content"]
    for draft in (str(embedded_model_path()), str(tiny)):
        with run_server("--slots", "2", "--spec-type", "draft", "--draft-model", draft, log_dir=tmp_path) as on:
            assert ask(on, DEFAULT_MODEL, **body)["choices"][0]["message"]["content"] == expected
            drafted, accepted = spec_counts(on, DEFAULT_MODEL)
            assert drafted > 0
            if draft == str(embedded_model_path()):
                assert accepted > drafted // 2


def test_a_draft_model_with_another_vocabulary_is_refused(tmp_path, gemma_path):
    with run_server("--spec-type", "draft", "--draft-model", str(gemma_path), log_dir=tmp_path,
                    wait_until="/health") as server:
        assert wait_until(lambda: server.health()["models"][DEFAULT_MODEL]["state"] != "loading", timeout=300)
        state = server.health()["models"][DEFAULT_MODEL]
    assert state["state"] == "failed"
    assert "vocabular" in state["error"]


def test_a_copying_stream_drafts_beside_busy_chat_streams(tmp_path):
    """Draft rows go to the slots that have drafts: three chat streams without matches in their
    context must not hold the rows a copying stream next to them can use."""
    import json
    from concurrent.futures import ThreadPoolExecutor

    with run_server("--slots", "4", "--ctx-size", "2048", log_dir=tmp_path) as server:
        def post(messages: list[dict], request_id: str) -> None:
            response = httpx.post(f"{server.base_url}/chat/completions", headers={"X-Request-ID": request_id},
                                  json={"model": DEFAULT_MODEL, "messages": messages, "max_tokens": 200,
                                        "temperature": 0}, timeout=300)
            assert response.status_code == 200, response.text

        with ThreadPoolExecutor(4) as pool:
            chats = [pool.submit(post, [{"role": "user", "content": f"Write a long story about a {animal}."}],
                                 f"chat-{animal}") for animal in ("fox", "crow", "bear")]
            assert wait_until(lambda: server.busy_slots() >= 3, timeout=120)
            copy = pool.submit(post, COPY, "copy-request")
            for future in [*chats, copy]:
                future.result()
        lines = [json.loads(line[line.index("{"):]) for line in server.log().splitlines()
                 if '"request_id": "copy-request"' in line]
        assert lines and lines[0].get("spec_accepted", 0) > 0, lines
