"""Parsers of model output: tool calls and reasoning, one per model family, in registries
(as vLLM's tool and reasoning parsers). They work on text only: no engine, no HTTP."""

from fastrun_cpp.parsers.reasoning import (
    REASONING_PARSERS,
    ReasoningParser,
    ReasoningParserName,
    select_reasoning_parser,
)
from fastrun_cpp.parsers.tool_calls import (
    TOOL_PARSERS,
    ParsedToolCall,
    ToolCallStreamer,
    ToolFunction,
    ToolParser,
    ToolParserName,
    select_tool_parser,
)

__all__ = [
    "REASONING_PARSERS",
    "TOOL_PARSERS",
    "ParsedToolCall",
    "ReasoningParser",
    "ReasoningParserName",
    "ToolCallStreamer",
    "ToolFunction",
    "ToolParser",
    "ToolParserName",
    "select_reasoning_parser",
    "select_tool_parser",
]
