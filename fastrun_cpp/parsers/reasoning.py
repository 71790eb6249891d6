"""Reasoning parsers: split a thinking model's output into reasoning and answer.

Each parser is a pure function of the text generated so far, so streaming is a matter of
sending what grew since the last call; text that may still turn into a marker is held back.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Literal

from fastrun_cpp.parsers.text import partial_suffix


@dataclass
class ReasoningSplit:
    reasoning: str
    content: str


class ReasoningParser(ABC):
    name: ClassVar[str]
    needs_special_tokens: ClassVar[bool] = False
    # Text after which the answer starts (a grammar for the answer takes over there), and the
    # text that opens the reasoning when the model writes it itself.
    answer_marker: ClassVar[str]
    opening: ClassVar[str | None] = None
    # For a reasoning budget: where the model's reasoning starts and ends, and what the server
    # writes to end it at the budget (as the model would).
    budget_start: ClassVar[str]
    budget_end: ClassVar[str]
    budget_closing: ClassVar[str]

    @abstractmethod
    def split(self, text: str, *, starts_in_reasoning: bool, final: bool) -> ReasoningSplit:
        """Reasoning and content of `text`; before `final`, only what can no longer change."""

    def starts_in_reasoning(self, prompt: str) -> bool:
        """Whether the rendered prompt already opened the reasoning (the template prefilled it)."""
        return False


class ThinkTagParser(ReasoningParser):
    """`<think>…</think>` (DeepSeek-R1, Qwen3, QwQ…), including templates that put `<think>`
    at the end of the prompt so that the output starts inside the reasoning."""

    name = "think"
    start, end = "<think>", "</think>"
    answer_marker = end
    opening = start
    budget_start, budget_end, budget_closing = start, end, "\n</think>\n\n"

    def starts_in_reasoning(self, prompt: str) -> bool:
        tail = prompt.rstrip()
        return tail.endswith(self.start)

    def split(self, text: str, *, starts_in_reasoning: bool, final: bool) -> ReasoningSplit:
        body = text
        if not starts_in_reasoning:
            stripped = body.lstrip()
            if stripped.startswith(self.start):
                body = stripped[len(self.start):]
            elif not final and self.start.startswith(stripped):
                return ReasoningSplit("", "")  # may still become "<think>"
            else:
                return ReasoningSplit("", text)
        close = body.find(self.end)
        if close < 0:
            held = 0 if final else partial_suffix(body, [self.end])
            return ReasoningSplit(body[: len(body) - held], "")
        reasoning = body[:close]
        content = body[close + len(self.end):]
        return ReasoningSplit(reasoning, content.lstrip("\n") if final or content.strip() else "")


class HarmonyParser(ReasoningParser):
    """gpt-oss's harmony channels: `<|channel|>analysis<|message|>…<|end|>` is reasoning,
    `<|channel|>final<|message|>…` the answer (the markers are special tokens)."""

    name = "harmony"
    needs_special_tokens = True
    answer_marker = "<|channel|>final<|message|>"
    budget_start, budget_end = "<|channel|>analysis<|message|>", "<|end|>"
    budget_closing = "<|end|><|start|>assistant<|channel|>final<|message|>"
    _MARKERS = ("<|channel|>", "<|message|>", "<|end|>", "<|start|>", "<|return|>", "<|call|>")
    _SEGMENT = re.compile(r"<\|channel\|>(\w+)(?:[^<]*)<\|message\|>(.*?)(?=<\|end\|>|<\|return\|>|<\|call\|>|<\|start\|>|$)",
                          re.S)

    def starts_in_reasoning(self, prompt: str) -> bool:
        return prompt.endswith(self.budget_start)  # the prompt opened the analysis channel

    def split(self, text: str, *, starts_in_reasoning: bool, final: bool) -> ReasoningSplit:
        if starts_in_reasoning:
            text = self.budget_start + text
        usable = text if final else text[: len(text) - partial_suffix(text, self._MARKERS)]
        reasoning, content = [], []
        for channel, body in self._SEGMENT.findall(usable):
            (reasoning if channel == "analysis" else content).append(body)
        if "<|channel|>" not in usable and final:
            return ReasoningSplit("", text)  # no channels at all: plain text
        return ReasoningSplit("".join(reasoning), "".join(content))


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    parser.name: parser for parser in (ThinkTagParser, HarmonyParser)
}
ReasoningParserName = Literal[tuple(REASONING_PARSERS)]  # what settings accept: the registry's names


def select_reasoning_parser(template: str | None, override: str | None = None) -> ReasoningParser | None:
    """The parser named by `override`, else the one the chat template's markers point to;
    None for a model that cannot think."""
    if override:
        return REASONING_PARSERS[override]()
    source = template or ""
    if "<|channel|>" in source:
        return HarmonyParser()
    if "<think>" in source:
        return ThinkTagParser()
    return None
