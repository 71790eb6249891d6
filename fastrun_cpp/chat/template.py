"""Render a conversation into a prompt with the model's GGUF chat template (Jinja)."""

from __future__ import annotations

from typing import Any

import jinja2
from llama_cpp.llama_chat_format import Jinja2ChatFormatter

# Used when a GGUF carries no template: ChatML, the most common format.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Variables the server itself passes; chat_template_kwargs may not replace them.
_RESERVED = frozenset(
    {"messages", "tools", "tool_choice", "functions", "function_call", "add_generation_prompt",
     "bos_token", "eos_token", "raise_exception", "strftime_now"}
)


class ChatTemplateError(ValueError):
    """The template refused the conversation (e.g. roles out of order) or failed to render."""


class ChatTemplate:
    def __init__(self, template: str | None, *, bos_token: str, eos_token: str) -> None:
        self.source = template or CHATML_TEMPLATE
        self.bos_token = bos_token
        try:
            self._formatter = Jinja2ChatFormatter(
                template=self.source, eos_token=eos_token, bos_token=bos_token
            )
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the model's chat template does not compile: {exc}") from exc

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        extra = {k: v for k, v in (template_kwargs or {}).items() if k not in _RESERVED}
        try:
            return self._formatter(messages=messages, tools=tools, **extra).prompt
        except (jinja2.TemplateError, ValueError, TypeError, KeyError, IndexError) as exc:
            raise ChatTemplateError(f"the chat template could not render these messages: {exc}") from exc
