"""Chat formatting: rendering conversations with a model's own chat template."""

from fastrun_cpp.chat.template import ChatTemplate, ChatTemplateError

__all__ = ["ChatTemplate", "ChatTemplateError"]
