"""A stream's tokens made faster than the stream interval (--stream-interval-ms) are handed
over together: one wake-up of the event loop and one write for several tokens, instead of one
per token taking the CPU that llama.cpp's threads run on. None is lost or reordered; a choice's
first and last tokens are never held; a step that prefills a prompt hands the held ones over
before it runs; at 0 every step's tokens go out at once.

The engine tests use an interval no step comes near (an hour), so what is held does not depend
on how fast the machine is."""

from __future__ import annotations

import json
import math
import threading

import httpx
import pytest

from fastrun_cpp.engine.engine import Engine, EngineConfig
from fastrun_cpp.engine.model import LlamaModel
from fastrun_cpp.engine.request import GenerationOutput, GenerationRequest, SamplingParams
from fastrun_cpp.engine.speculative import SpeculationConfig
from tests.server import DEFAULT_MODEL

AN_HOUR = 3600.0


class Deliveries:
    """What the engine hands over, one list per hand-over, in order."""

    def __init__(self) -> None:
        self.handed: list[list[GenerationOutput]] = []
        self._finished: dict[str, threading.Event] = {}
        self._lock = threading.Lock()

    def expect(self, request_id: str) -> threading.Event:
        return self._finished.setdefault(request_id, threading.Event())

    def __call__(self, outputs: list[GenerationOutput]) -> None:  # on the scheduler thread
        with self._lock:
            self.handed.append(list(outputs))
        for output in outputs:
            if output.finished:
                self.expect(output.request_id).set()

    def of(self, request_id: str) -> list[tuple[int, GenerationOutput]]:
        """(hand-over number, output) of one request."""
        with self._lock:
            return [(number, output) for number, outputs in enumerate(self.handed)
                    for output in outputs if output.request_id == request_id]


@pytest.fixture(scope="module")
def tiny_model(tiny_model_path) -> LlamaModel:
    return LlamaModel(str(tiny_model_path))


def run_engine(model: LlamaModel, interval_s: float) -> tuple[Engine, Deliveries]:
    deliveries = Deliveries()
    config = EngineConfig(slots=2, ctx_size=2048, batch_size=512, threads=2, prompt_cache_mib=0, max_queue=8,
                          swa_full=False, flash_attn="auto", cache_type_k="f16", cache_type_v="f16",
                          adapt_threads=False, speculation=SpeculationConfig(kind="none"),
                          stream_interval_s=interval_s)
    engine = Engine(model, config, deliveries)
    engine.start()
    return engine, deliveries


def request(model: LlamaModel, request_id: str, text: str, max_tokens: int) -> GenerationRequest:
    """A greedy answer of exactly `max_tokens` tokens (the end-of-generation tokens banned)."""
    return GenerationRequest(
        request_id=request_id, prompt_tokens=model.tokenize(text, add_special=True, parse_special=False),
        sampling=SamplingParams(temperature=0, logit_bias=tuple((token, -math.inf) for token in model.eog_token_ids)),
        max_tokens=max_tokens)


def tokens_per_hand_over(deliveries: Deliveries, request_id: str) -> list[int]:
    counts: dict[int, int] = {}
    for number, output in deliveries.of(request_id):
        counts[number] = counts.get(number, 0) + len(output.token_ids)
    return list(counts.values())


def answer(deliveries: Deliveries, request_id: str) -> tuple[str, list[int]]:
    outputs = [output for _, output in deliveries.of(request_id)]
    return "".join(o.text for o in outputs), [t for o in outputs for t in o.token_ids]


def test_held_tokens_go_out_with_the_last_and_nothing_is_lost(tiny_model):
    held, held_deliveries = run_engine(tiny_model, AN_HOUR)
    each, each_deliveries = run_engine(tiny_model, 0.0)
    try:
        for engine, deliveries in ((held, held_deliveries), (each, each_deliveries)):
            done = deliveries.expect("a")
            engine.add_request(request(tiny_model, "a", "Count the ships in the harbour:", 60))
            assert done.wait(300)
    finally:
        held.shutdown()
        each.shutdown()
    # At 0, one hand-over per step, a token each.
    assert tokens_per_hand_over(each_deliveries, "a") == [1] * 60
    # Held: the first token at once (the time to the first token is never held), then the
    # other 59 in one hand-over with the end of the answer.
    assert tokens_per_hand_over(held_deliveries, "a") == [1, 59]
    assert held_deliveries.of("a")[-1][1].finished
    assert answer(held_deliveries, "a") == answer(each_deliveries, "a")


def test_a_prompt_to_prefill_hands_the_held_tokens_over_first(tiny_model):
    """A prompt chunk may take long: the tokens held for a running stream go out before it."""
    engine, deliveries = run_engine(tiny_model, AN_HOUR)
    try:
        first_done, second_done = deliveries.expect("long"), deliveries.expect("second")
        engine.add_request(request(tiny_model, "long", "Write out the numbers from one on:", 1800))
        while not deliveries.of("long"):  # its first token
            assert not first_done.wait(0.01)
        engine.add_request(request(tiny_model, "second", "The harbour master counted the crates. " * 20, 4))
        assert first_done.wait(600) and second_done.wait(600)
    finally:
        engine.shutdown()
    second_first_token = deliveries.of("second")[0][0]
    first_hand_over = deliveries.of("long")[0][0]
    handed_before = [output for number, output in deliveries.of("long") if first_hand_over < number < second_first_token]
    assert handed_before and not any(output.finished for output in handed_before)
    assert sum(len(output.token_ids) for _, output in deliveries.of("long")) == 1800


def test_a_stream_sends_each_token_once_and_its_first_alone(http):
    """Through the API, on the shared server (default interval): the first content chunk holds
    one token, the chunks' tokens (counted by their logprobs) are the answer's, in order."""
    body = {"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": "Name three rivers."}],
            "max_tokens": 40, "temperature": 0, "logprobs": True}
    whole = http.post("/chat/completions", json=body).json()
    counts, text = [], []
    with http.stream("POST", "/chat/completions", json={**body, "stream": True}) as response:
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            choices = json.loads(line[6:])["choices"]
            if choices and choices[0]["logprobs"]:
                counts.append(len(choices[0]["logprobs"]["content"]))
                text.append(choices[0]["delta"].get("content") or "")
    assert counts[0] == 1
    assert sum(counts) == whole["usage"]["completion_tokens"]
    assert "".join(text) == whole["choices"][0]["message"]["content"]
