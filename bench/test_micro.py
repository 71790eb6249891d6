"""Micro-benchmarks of hot Python paths (pytest-benchmark). Not part of `make test`:

    .venv/bin/python -m pytest bench/test_micro.py --benchmark-enable
"""

from __future__ import annotations

import json

from fastrun_cpp.structured import json_schema


def wide_schema(properties: int = 60) -> dict:
    kinds = [
        {"type": "string", "maxLength": 40},
        {"type": "integer", "minimum": 0, "maximum": 10000},
        {"type": "number", "minimum": -100, "maximum": 100},
        {"type": "boolean"},
        {"type": "string", "enum": ["red", "green", "blue"]},
        {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 5},
        {"type": "string", "format": "date"},
        {"anyOf": [{"type": "string", "maxLength": 20}, {"type": "null"}]},
    ]
    return {
        "type": "object",
        "properties": {f"field_{i}": kinds[i % len(kinds)] for i in range(properties)},
        "required": [f"field_{i}" for i in range(0, properties, 2)],
        "additionalProperties": False,
    }


def test_schema_to_grammar_conversion_of_60_properties(benchmark):
    schema_json = json.dumps(wide_schema())
    # Uncached: the cost a new schema pays once.
    grammar = benchmark(json_schema._convert.__wrapped__, schema_json)
    assert "field_59" in grammar


def test_schema_to_grammar_cached(benchmark):
    schema = wide_schema()
    json_schema.schema_to_gbnf(schema)
    benchmark(json_schema.schema_to_gbnf, schema)


# ------------------------------------------------------------------ text, templates, SSE

import pytest  # noqa: E402


@pytest.fixture(scope="module")
def smollm():
    from fastrun_cpp.default_model import embedded_model_path
    from fastrun_cpp.engine.model import LlamaModel

    model = LlamaModel(embedded_model_path())
    yield model
    model.close()


def conversation(turns: int = 60) -> list[dict]:
    """About 4k tokens of chat."""
    messages = [{"role": "system", "content": "You are a helpful assistant who answers with care."}]
    for i in range(turns):
        messages.append({"role": "user", "content": f"Question {i}: how do rivers, lakes and seas differ in {i}?"})
        messages.append({"role": "assistant", "content": f"Answer {i}: rivers flow, lakes rest, and seas are salty; "
                                                         f"in case {i} the difference is mostly in size and motion."})
    return messages


def test_chat_template_rendering_4k_tokens(benchmark, smollm):
    from fastrun_cpp.chat import ChatTemplate

    template = ChatTemplate(smollm.chat_template, bos_token=smollm.bos_text, eos_token=smollm.eos_text)
    messages = conversation()
    prompt = benchmark(template.render, messages)
    assert 3500 < len(smollm.tokenize_prompt(prompt)) < 5000


def test_tokenization_4k_tokens(benchmark, smollm):
    from fastrun_cpp.chat import ChatTemplate

    template = ChatTemplate(smollm.chat_template, bos_token=smollm.bos_text, eos_token=smollm.eos_text)
    prompt = template.render(conversation())
    tokens = benchmark(smollm.tokenize_prompt, prompt)
    assert len(tokens) > 3500


def test_sse_chunk_encoding(benchmark):
    from sse_starlette.sse import ensure_bytes

    from fastrun_cpp.entrypoints.openai.protocol import ChatCompletionChunk, ChatCompletionChunkChoice, ChatDelta

    def encode() -> bytes:
        chunk = ChatCompletionChunk(
            id="chatcmpl-0123456789abcdef0123456789abcdef", created=1_800_000_000,
            model="HuggingFaceTB/SmolLM2-135M-Instruct",
            choices=[ChatCompletionChunkChoice(index=0, delta=ChatDelta(content=" token"))],
        )
        return ensure_bytes(chunk.model_dump_json(), "\n")

    assert benchmark(encode).startswith(b"data: {")


# ------------------------------------------------------------------ scheduler

@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
def test_scheduler_overhead_with_16_active_slots(benchmark, smollm, temperature):
    """Share of each scheduler step spent outside llama_decode (Python, sampling, hand-off),
    with 16 slots generating at once. Target: under 5%. Greedy isolates the scheduler itself;
    sampled adds llama.cpp's sampler over the whole vocabulary (OpenAI's defaults: no top_k)."""
    import threading

    from fastrun_cpp.engine import Engine, EngineConfig, GenerationRequest, SamplingParams

    def run() -> float:
        done = threading.Event()
        finished = []

        def collect(outputs):
            finished.extend(o for o in outputs if o.finished)
            if len(finished) == 16:
                done.set()

        from fastrun_cpp.registry import ModelConfig
        from fastrun_cpp.runtime.model_runtime import engine_config

        config = engine_config(ModelConfig(id="bench", path=smollm.path, slots=16, ctx_size=512), threads=2)
        engine = Engine(smollm, config, collect)
        engine.start()
        prompt = smollm.tokenize_prompt("<|im_start|>user\nTell me a long story.<|im_end|>\n<|im_start|>assistant\n")
        for i in range(16):
            engine.add_request(GenerationRequest(f"r{i}", prompt + [i + 100], SamplingParams(temperature=temperature, seed=i),
                                                 max_tokens=64))
        done.wait(300)
        stats = engine.stats
        engine.shutdown()
        return 1 - stats.decode_seconds / stats.step_seconds

    overhead = benchmark.pedantic(run, rounds=1, iterations=1)
    benchmark.extra_info["overhead_share"] = overhead
    print(f"\nscheduler overhead with 16 active slots, temperature {temperature}: {overhead:.1%} of each step")
