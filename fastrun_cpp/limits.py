"""Bounds on the work a request can ask for, checked where the work is decided, before it is
done. Each is a setting (`--limit-<name>`, FASTRUN_LIMITS__<NAME>); breaking one is a 400 that
names it."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class Limits(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    # Request shapes (the body itself is capped at 64 MiB by the spec).
    messages: int = Field(2048, ge=1, description="Messages in a chat request.")
    content_parts: int = Field(256, ge=1, description="Content parts in one message.")
    tools: int = Field(128, ge=1, description="Tools in a chat request.")
    prompts: int = Field(64, ge=1, description="Prompts in one completions request.")
    choices: int = Field(
        128, ge=1, description="Choices in one request (n, and best_of in completions); those beyond the model's "
        "slots run as slots free up."
    )
    logit_bias: int = Field(1024, ge=1, description="Entries of logit_bias.")
    stop_length: int = Field(512, ge=1, description="Characters of one stop string.")
    stop_sequences: int = Field(16, ge=1, description="Stop strings in one request (Messages' stop_sequences).")
    json_containers: int = Field(
        32768, ge=64, description="Objects and arrays in one request body: what decoding and validating it may cost "
        "(each a few microseconds, holding the interpreter)."
    )
    json_depth: int = Field(
        256, ge=16, le=512, description="Nesting depth of one request body: what is built from it walks it by "
        "recursion (templates, escaping, validation)."
    )
    embedding_inputs: int = Field(2048, ge=1, description="Inputs in one embeddings request.")
    rerank_documents: int = Field(1000, ge=1, description="Documents in one rerank request (Cohere's bound).")
    # Images (vision models): checked from the bytes and the header, before any pixel is decoded.
    images: int = Field(100, ge=1, description="Images in one request (the context bounds them too).")
    image_bytes: int = Field(20 * 2**20, ge=1024, description="Bytes of one image as sent, decoded from base64 "
                             "(OpenAI's bound).")
    image_pixels: int = Field(64 * 2**20, ge=4096, le=89_478_485, description="Pixels of one image (width x "
                              "height, from its header): what decoding it may cost in memory, 3 bytes a pixel (at "
                              "most Pillow's own decompression-bomb bound).")
    # Image URLs, fetched only from the hosts --allowed-media-domains names.
    image_url_timeout_s: float = Field(10, gt=0, le=600, description="Time to fetch all of one request's image URLs "
                                       "together (s; llama-server's bound for one).")
    image_url_bytes: int = Field(64 * 2**20, ge=1024, description="Bytes fetched for one request's image URLs "
                                 "together (a request body's own bound).")
    image_url_redirects: int = Field(3, ge=0, le=20, description="Redirects one image URL may take, each to a host "
                                     "that is allowed too.")
    # JSON schemas (response_format, tool parameters) and their patterns.
    schema_depth: int = Field(32, ge=1, description="Nesting depth of a JSON schema.")
    schema_nodes: int = Field(4096, ge=1, description="Subschemas, properties and enum values in a JSON schema.")
    repetition: int = Field(
        1000, ge=1, description="Largest maxLength, minLength, maxItems, minItems or {m,n} a grammar may expand."
    )
    pattern_length: int = Field(1000, ge=1, description="Characters of one schema pattern.")
    pattern_cost: int = Field(20000, ge=1, description="Grammar elements one pattern may expand to.")
    number_bound: float = Field(
        2**53 - 1, gt=0, description="Largest magnitude of a numeric bound (minimum, maximum...) a grammar enforces: "
        "JavaScript's Number.MAX_SAFE_INTEGER, which zod writes into tool schemas. Beyond it, a forced call or a "
        "response format is refused; the tools of a tool_choice auto request are treated as unbounded."
    )
    # Grammars, and the time their building may take.
    grammar_bytes: int = Field(1 << 20, ge=1024, description="Bytes of a generated grammar.")
    grammar_nesting: int = Field(128, ge=8, description="Nested groups in a generated grammar.")
    grammar_first_step_ms: float = Field(
        100, gt=0, description="CPU time a grammar llguidance cannot run (llama.cpp's engine runs it) may take to "
        "mask a 128k-token vocabulary in its first step (ms; scaled for larger vocabularies)."
    )
    grammar_step_ms: float = Field(
        10, gt=0, description="CPU time a grammar may take for one token with a 128k-token vocabulary (ms; scaled "
        "for larger vocabularies): what one constrained request may cost every request decoding beside it. "
        "llguidance's per-step fuel is set from it, a count of work that holds on a busy machine as on an idle "
        "one (past it, the request ends); a grammar's CPU time ends a request only past ten times this, as a "
        "watchdog."
    )
    schema_timeout_s: float = Field(5, gt=0, description="CPU time to turn a schema into a grammar (s).")
    grammar_timeout_s: float = Field(10, gt=0, description="CPU time to compile a grammar (s).")
    # Connections.
    header_timeout_s: float = Field(10, gt=0, description="Time a client may take to send its request headers (s).")
    body_timeout_s: float = Field(60, gt=0, description="Time a client may take to send its request body (s).")


class LimitExceeded(ValueError):
    """A request breaks one of the limits; the message names it."""

    def __init__(self, name: str, detail: str) -> None:
        flag = "--limit-" + name.replace("_", "-")
        super().__init__(f"{detail} (limit {flag})")
        self.name = name
