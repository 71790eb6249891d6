"""POST /v1/chat/completions: prompt rendering (tools, reasoning switches), constrained tool
calls, and splitting the answer into reasoning, content and tool calls."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, AsyncIterator

from fastrun_cpp.chat import ChatTemplateError
from fastrun_cpp.engine import FinishReason, GenerationRequest
from fastrun_cpp.structured.spec import GrammarSpec
from fastrun_cpp.entrypoints.openai.errors import APIError, bad_request
from fastrun_cpp.entrypoints.openai.logprobs import chat_logprobs
from fastrun_cpp.entrypoints.openai.protocol import (
    ChatCompletion,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionChunkChoice,
    ChatCompletionRequest,
    ChatDelta,
    ChatMessage,
    ChatResponseMessage,
    FunctionCall,
    FunctionCallDelta,
    ToolCall,
    ToolCallDelta,
    random_id,
    unix_time,
)
from fastrun_cpp.entrypoints.openai.serving_engine import (
    OpenAIServing,
    collect,
    openai_finish_reason,
    sampling_params,
    stop_sequences,
    stream_error_event,
    usage_of,
)
from fastrun_cpp.entrypoints.openai.serving_models import ServedModel
from fastrun_cpp.parsers import ToolFunction, ToolParser
from fastrun_cpp.parsers.chat_output import ChatOutputParser
from fastrun_cpp.parsers.tool_calls import FallbackToolParser, UnsupportedToolChoice
from fastrun_cpp.structured import SchemaError, tool_calls_gbnf

logger = logging.getLogger(__name__)

MAX_FORCED_CALLS = 8  # `tool_choice: required` allows this many calls in one answer


def _arguments_object(arguments: str) -> Any:
    """Templates expect arguments as a mapping; OpenAI sends a JSON string."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    return value if isinstance(value, dict) else arguments


def template_messages(messages: list[ChatMessage], *, tools_as_text: bool) -> list[dict[str, Any]]:
    """Messages as chat templates expect them: plain dicts with string content.

    With `tools_as_text` (templates that know nothing of tools) past calls are written into
    the assistant's text in the fallback format, and tool results become user turns.
    """
    rendered = []
    for message in messages:
        role = "system" if message.role == "developer" else message.role  # same meaning
        item: dict[str, Any] = {"role": role, "content": message.text()}
        if tools_as_text:
            if message.tool_calls:
                calls = "\n".join(
                    "<tool_call>\n" + json.dumps({"name": c.function.name,
                                                  "arguments": _arguments_object(c.function.arguments)})
                    + "\n</tool_call>"
                    for c in message.tool_calls
                )
                item["content"] = (item["content"] + "\n" if item["content"] else "") + calls
            if role == "tool":
                item = {"role": "user", "content": f"Result of the tool call: {message.text()}"}
        else:
            if message.tool_calls:
                item["tool_calls"] = [
                    {"id": c.id, "type": "function",
                     "function": {"name": c.function.name, "arguments": _arguments_object(c.function.arguments)}}
                    for c in message.tool_calls
                ]
            if message.tool_call_id is not None:
                item["tool_call_id"] = message.tool_call_id
        rendered.append(item)
    return rendered


def _with_system_text(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


class OpenAIServingChat(OpenAIServing):
    async def create_chat_completion(
        self, request: ChatCompletionRequest
    ) -> ChatCompletion | AsyncIterator[str]:
        served = self.served_model(request.model)
        runtime = served.runtime
        tool_parser = self._tool_parser(runtime, request)
        forced_calls = tool_parser is not None and request.tool_choice not in (None, "auto")
        # Forced calls are constrained from the first token: no room for thinking.
        reasoning_parser = None if forced_calls else runtime.reasoning_parser
        prompt = await self.in_prompt_pool(self._render, served, request, tool_parser)
        grammar = await self._tool_grammar(served, request, tool_parser)
        if grammar is None:
            grammar = await self.response_grammar(served, request.response_format)
        needs_special = any(p is not None and p.needs_special_tokens for p in (tool_parser, reasoning_parser))
        generation = GenerationRequest(
            request_id=random_id("chatcmpl"),
            prompt_tokens=await self.tokenize(served, prompt),
            sampling=sampling_params(request, served),
            max_tokens=request.max_tokens or request.max_completion_tokens,
            stop=stop_sequences(request.stop),
            logprobs=(request.top_logprobs or 0) if request.logprobs else None,
            grammar=grammar,
            render_special_tokens=needs_special,
        )
        parser = ChatOutputParser(
            reasoning=reasoning_parser,
            starts_in_reasoning=reasoning_parser is not None and reasoning_parser.starts_in_reasoning(prompt),
            tools=tool_parser,
        )
        stream = await self.submit(served, generation, streaming=request.stream)
        if request.stream:
            include_usage = bool(request.stream_options and request.stream_options.include_usage)
            return self._stream(served, request, generation, stream, parser, include_usage)
        return await self._complete(served, request, generation, stream, parser)

    # ------------------------------------------------------------------ prompt

    @staticmethod
    def _tool_parser(runtime, request: ChatCompletionRequest) -> ToolParser | None:
        """The model's tool-call parser when this request offers tools."""
        if not request.tools or request.tool_choice == "none":
            return None
        if hasattr(request.tool_choice, "function"):
            names = {tool.function.name for tool in request.tools}
            if request.tool_choice.function.name not in names:
                raise bad_request(f"tool_choice names {request.tool_choice.function.name!r}, which is not in tools")
        return runtime.tool_parser

    @staticmethod
    def _thinking_kwargs(request: ChatCompletionRequest) -> dict[str, Any]:
        """Template switches for reasoning: off unless reasoning_effort asks for it; the
        request's own chat_template_kwargs win."""
        effort = request.reasoning_effort
        kwargs: dict[str, Any] = {"enable_thinking": effort not in (None, "none")}
        if effort not in (None, "none"):
            kwargs["reasoning_effort"] = effort
        return {**kwargs, **(request.chat_template_kwargs or {})}

    def _render(self, served: ServedModel, request: ChatCompletionRequest, tool_parser: ToolParser | None) -> str:
        tools_as_text = isinstance(served.runtime.tool_parser, FallbackToolParser)
        messages = template_messages(request.messages, tools_as_text=tools_as_text)
        template_tools = None
        if tool_parser is not None:
            functions = self._functions(request)
            instructions = tool_parser.system_prompt(functions)
            if instructions:
                messages = _with_system_text(messages, instructions)
            else:
                template_tools = [tool.model_dump(exclude_none=True) for tool in request.tools]
        try:
            return served.runtime.chat_template.render(messages, tools=template_tools, template_kwargs=self._thinking_kwargs(request))
        except ChatTemplateError as exc:
            raise bad_request(str(exc)) from exc

    @staticmethod
    def _functions(request: ChatCompletionRequest) -> list[ToolFunction]:
        return [
            ToolFunction(tool.function.name, tool.function.description,
                         tool.function.parameters or {"type": "object", "properties": {}})
            for tool in request.tools or []
        ]

    async def _tool_grammar(
        self, served: ServedModel, request: ChatCompletionRequest, tool_parser: ToolParser | None
    ) -> GrammarSpec | None:
        """`required` and a named function force calls from the first token; `auto` arms a lazy
        grammar that takes over once the model starts a call, so every call is well formed."""
        if tool_parser is None:
            return None
        choice = request.tool_choice or "auto"
        functions = self._functions(request)
        if hasattr(choice, "function"):
            functions = [f for f in functions if f.name == choice.function.name]
            at_most: int | None = 1
        else:
            at_most = MAX_FORCED_CALLS
        lazy = choice == "auto"
        if lazy and request.response_format is not None and request.response_format.type != "text":
            return None  # the answer's own format constrains it instead
        try:
            gbnf = await asyncio.to_thread(
                tool_calls_gbnf,
                [(f.name, f.parameters) for f in functions],
                tool_parser.call_grammar,
                lambda call: tool_parser.calls_grammar(call, at_least=1, at_most=at_most),
            )
        except UnsupportedToolChoice as exc:
            if lazy:
                return None  # calls are still parsed, just not enforced
            raise bad_request(f"tool_choice: {exc}") from exc
        except SchemaError as exc:
            raise bad_request(f"tools: {exc}") from exc
        triggers = tool_parser.lazy_triggers() if lazy else ()
        return await self.checked_grammar(served, GrammarSpec(gbnf, triggers), "tools")

    # ------------------------------------------------------------------ answer

    @staticmethod
    def _finish_reason(reason: FinishReason | None, has_calls: bool) -> str | None:
        if has_calls and reason is FinishReason.STOP:
            return "tool_calls"
        return openai_finish_reason(reason)

    async def _complete(
        self, served: ServedModel, request: ChatCompletionRequest, generation: GenerationRequest,
        stream: EngineStream, parser: ChatOutputParser,
    ) -> ChatCompletion:
        result = await collect(self.outputs(served, stream))
        parser.feed(result.text, final=True)
        answer = parser.result()
        tool_calls = [
            ToolCall(id=call_id, type="function", function=FunctionCall(name=call.name, arguments=call.arguments))
            for call_id, call in answer.tool_calls
        ]
        logprobs = None
        if generation.logprobs is not None:
            logprobs = chat_logprobs(served.runtime.tokenizer.token_bytes, result.logprobs or [])
        content = answer.content if answer.content or not tool_calls else None
        return ChatCompletion(
            id=generation.request_id,
            created=unix_time(),
            model=request.model,
            choices=[
                ChatCompletionChoice(
                    index=0,
                    message=ChatResponseMessage(content=content, reasoning=answer.reasoning,
                                                tool_calls=tool_calls or None),
                    finish_reason=self._finish_reason(result.finish_reason, bool(tool_calls)),
                    logprobs=logprobs,
                )
            ],
            usage=usage_of([result]),
        )

    async def _stream(
        self,
        served: ServedModel,
        request: ChatCompletionRequest,
        generation: GenerationRequest,
        stream: EngineStream,
        parser: ChatOutputParser,
        include_usage: bool,
    ) -> AsyncIterator[str]:
        created = unix_time()
        token_bytes = served.runtime.tokenizer.token_bytes

        def chunk(delta: ChatDelta, finish_reason: str | None = None, logprobs=None) -> str:
            choice = ChatCompletionChunkChoice(index=0, delta=delta, finish_reason=finish_reason, logprobs=logprobs)
            return ChatCompletionChunk(
                id=generation.request_id, created=created, model=request.model, choices=[choice]
            ).model_dump_json()

        def delta_of(text: str, *, final: bool = False) -> ChatDelta | None:
            parsed = parser.feed(text, final=final)
            if not parsed:
                return None
            calls = [
                ToolCallDelta(index=c.index, id=c.id, type="function" if c.id else None,
                              function=FunctionCallDelta(name=c.name, arguments=c.arguments))
                for c in parsed.tool_calls
            ]
            return ChatDelta(content=parsed.content or None, reasoning=parsed.reasoning or None,
                             tool_calls=calls or None)

        yield chunk(ChatDelta(role="assistant", content=""))
        last = None
        try:
            async for output in self.outputs(served, stream):
                last = output
                delta = delta_of(output.text)
                if output.logprobs:
                    yield chunk(delta or ChatDelta(content=""), logprobs=chat_logprobs(token_bytes, output.logprobs))
                elif delta is not None:
                    yield chunk(delta)
        except APIError as exc:
            yield stream_error_event(exc)
            return
        assert last is not None
        tail = delta_of("", final=True)
        if tail is not None:
            yield chunk(tail)
        has_calls = bool(parser.result().tool_calls)
        yield chunk(ChatDelta(), self._finish_reason(last.finish_reason, has_calls))
        if include_usage:
            yield ChatCompletionChunk(
                id=generation.request_id,
                created=created,
                model=request.model,
                choices=[],
                usage=usage_of([last]),
            ).model_dump_json()
        yield "[DONE]"
