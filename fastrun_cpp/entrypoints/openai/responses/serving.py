"""POST /v1/responses and GET/DELETE /v1/responses/{id}: OpenAI's Responses API, translated
onto chat completions (the same prompt rendering, grammars, tool and reasoning parsers,
prefix cache and limits), with stored responses for `previous_response_id`."""

from __future__ import annotations

import json
import logging
import re
import uuid
from typing import Any, AsyncIterator, Callable

from sse_starlette import ServerSentEvent

from fastrun_cpp.auth import ActiveKey
from fastrun_cpp.entrypoints.openai.errors import APIError, bad_request, model_not_found
from fastrun_cpp.entrypoints.answer import AnswerDelta, AnswerEvents, AnswerUsage, ChoiceFinished
from fastrun_cpp.entrypoints.openai.protocol import ChatCompletion, ChatCompletionRequest, unix_time
from fastrun_cpp.entrypoints.openai.protocol import Usage as ChatUsage
from fastrun_cpp.entrypoints.openai.responses.protocol import (
    CustomTool,
    CustomToolCallItem,
    FunctionCallItem,
    FunctionTool,
    FunctionToolChoice,
    HostedToolChoice,
    IncompleteDetails,
    InputTokensDetails,
    MessageItem,
    NamespaceTool,
    OutputCustomToolCall,
    OutputFunctionCall,
    OutputItem,
    OutputMessage,
    OutputReasoning,
    OutputText,
    OutputTokensDetails,
    ReasoningInputItem,
    ReasoningText,
    Response,
    ResponsesRequest,
    ResponseError,
    ResponseUsage,
    ToolOutputItem,
)
from fastrun_cpp.entrypoints.openai.responses.sealed import ReasoningSeal
from fastrun_cpp.entrypoints.jobs import JobRunner
from fastrun_cpp.entrypoints.openai.responses.background import BackgroundResponses, request_for_background
from fastrun_cpp.entrypoints.openai.responses.store import BackgroundJob, ResponseStore, StoredTooLarge
from fastrun_cpp.entrypoints.tenancy import AccountAtCap
from fastrun_cpp.entrypoints.openai.chat_completion.serving import OpenAIServingChat
from fastrun_cpp.entrypoints.openai.utils import StoreThread
from fastrun_cpp.entrypoints.request_context import current_record
from fastrun_cpp.entrypoints.tenancy import AccountGate, UsageRecorder
from fastrun_cpp.entrypoints.openai.serving_engine import record_stream_error

logger = logging.getLogger(__name__)

_EFFORTS = {"none": "none", "minimal": "low", "low": "low", "medium": "medium", "high": "high"}


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _account() -> str | None:
    record = current_record()
    return record.account if record is not None else None


class ToolSet:
    """The request's tools as the chat layer offers them, and the way back: a namespace's
    functions are offered as `namespace.name`, a custom tool as a function taking its text as
    `input`; hosted tools are not offered (none runs here)."""

    SEPARATOR = "."

    def __init__(self, request: ResponsesRequest) -> None:
        self.functions: list[dict[str, Any]] = []
        self.text_grammars: dict[str, tuple[str, str]] = {}  # chat name -> a custom tool's (syntax, definition)
        self._origin: dict[str, tuple[str, str | None, str]] = {}  # chat name -> (kind, namespace, name)
        hosted = []
        for tool in request.tools or []:
            if isinstance(tool, NamespaceTool):
                for member in tool.tools:
                    self._add(member, tool.name)
            elif isinstance(tool, (FunctionTool, CustomTool)):
                self._add(tool, None)
            else:
                hosted.append(tool.type)
        if hosted:
            logger.debug("hosted tools not offered to the model (none runs here): %s", ", ".join(hosted))
        choice = request.tool_choice
        if isinstance(choice, HostedToolChoice) and not isinstance(choice, FunctionToolChoice):
            raise bad_request(f"tool_choice: the hosted tool {choice.type!r} does not run on this server")
        if isinstance(choice, FunctionToolChoice) and choice.name not in self._origin:
            raise bad_request(f"tool_choice: no {choice.type} tool named {choice.name!r} in tools")
        if choice == "required" and not self.functions:
            raise bad_request("tool_choice: 'required' needs a function or custom tool; hosted tools "
                              f"({', '.join(hosted)}) do not run on this server")

    @classmethod
    def chat_name(cls, namespace: str | None, name: str) -> str:
        """The name the model sees (and calls) for a tool of `namespace`."""
        return f"{namespace}{cls.SEPARATOR}{name}" if namespace else name

    def _add(self, tool: FunctionTool | CustomTool, namespace: str | None) -> None:
        name = self.chat_name(namespace, tool.name)
        if isinstance(tool, FunctionTool):
            function = tool.model_dump(exclude={"type"}, exclude_none=True)
            function["name"] = name
            self._origin[name] = ("function", namespace, tool.name)
        else:
            description = tool.description or ""
            if tool.format is not None and tool.format.type == "grammar" and tool.format.definition:
                syntax = tool.format.syntax or "lark"
                description += f"\n\nIts input follows this {syntax} grammar:\n{tool.format.definition}"
                self.text_grammars[name] = (syntax, tool.format.definition)
            function = {"name": name, "description": description.strip(), "parameters": {
                "type": "object", "properties": {"input": {"type": "string", "description": "The tool's input, "
                                                           "as plain text."}},
                "required": ["input"], "additionalProperties": False}}
            self._origin[name] = ("custom", namespace, tool.name)
        self.functions.append({"type": "function", "function": function})

    def output_call(self, item_id: str, status: str, call_id: str, chat_name: str,
                    arguments: str) -> OutputFunctionCall | OutputCustomToolCall:
        kind, namespace, name = self._origin.get(chat_name, ("function", None, chat_name))
        if kind == "custom":
            return OutputCustomToolCall(id=item_id, status=status, call_id=call_id, name=name,
                                        input=custom_input(arguments), namespace=namespace)
        return OutputFunctionCall(id=item_id, status=status, call_id=call_id, name=name, arguments=arguments,
                                  namespace=namespace)


_INPUT_OPENING = re.compile(r'\s*\{\s*"input"\s*:\s*"')


def custom_input(arguments: str) -> str:
    """A custom tool's text from the arguments the model wrote for it ({"input": ...}); of a
    call cut short (max_output_tokens), the text as far as it got."""
    try:
        value = json.loads(arguments)
    except (ValueError, RecursionError):
        opening = _INPUT_OPENING.match(arguments)
        return _string_so_far(arguments[opening.end():]) if opening else arguments
    return value["input"] if isinstance(value, dict) and isinstance(value.get("input"), str) else arguments


def _string_so_far(body: str) -> str:
    """A JSON string's content, perhaps cut in an escape or followed by its closing quote."""
    for end in range(len(body), max(len(body) - 7, -1), -1):
        try:
            return json.loads(f'"{body[:end]}"')
        except ValueError:
            continue
    return body


def conversation_items(request: ResponsesRequest, seal: ReasoningSeal, account: str) -> list[dict[str, Any]]:
    """The request's input as plain items (a string is one user message). Reasoning comes
    back when this server sealed it for this account; hosted tools' items are left out."""
    if isinstance(request.input, str):
        return [{"type": "message", "role": "user", "content": request.input}]
    items = []
    for item in request.input:
        if isinstance(item, MessageItem):
            items.append({"type": "message", "role": item.role, "content": item.chat_content()})
        elif isinstance(item, FunctionCallItem):
            items.append({"type": "function_call", "call_id": item.call_id, "name": item.name,
                          "arguments": item.arguments, "namespace": item.namespace})
        elif isinstance(item, CustomToolCallItem):
            items.append({"type": "custom_tool_call", "call_id": item.call_id, "name": item.name,
                          "input": item.input, "namespace": item.namespace})
        elif isinstance(item, ToolOutputItem):
            items.append({"type": "function_call_output", "call_id": item.call_id, "output": item.chat_content()})
        elif isinstance(item, ReasoningInputItem) and item.encrypted_content:
            text = seal.open(account, item.encrypted_content)
            if text:
                items.append({"type": "reasoning", "text": text})
    return items


def chat_messages(instructions: str | None, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Conversation items as chat messages: consecutive tool calls join the assistant turn
    before them (custom tools' text as their `input` argument), their outputs become tool
    messages, and reasoning goes with the assistant turn that follows it."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    reasoning = None
    for item in items:
        kind = item["type"]
        if kind == "reasoning":
            reasoning = item["text"]
        elif kind == "message":
            message = {"role": item["role"], "content": item["content"]}
            if item["role"] == "assistant" and reasoning:
                message["reasoning_content"], reasoning = reasoning, None
            messages.append(message)
        elif kind in ("function_call", "custom_tool_call"):
            name = ToolSet.chat_name(item.get("namespace"), item["name"])
            arguments = item["arguments"] if kind == "function_call" else json.dumps({"input": item["input"]})
            call = {"id": item["call_id"], "type": "function", "function": {"name": name, "arguments": arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and reasoning is None:
                last.setdefault("tool_calls", []).append(call)
            else:
                message = {"role": "assistant", "content": None, "tool_calls": [call]}
                if reasoning:
                    message["reasoning_content"], reasoning = reasoning, None
                messages.append(message)
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
    return messages


def chat_request(request: ResponsesRequest, messages: list[dict[str, Any]], tools: ToolSet) -> ChatCompletionRequest:
    data: dict[str, Any] = {"model": request.model, "messages": messages, "stream": request.stream}
    if request.stream:
        data["stream_options"] = {"include_usage": True}
    data.update(request.sampling_values())
    if request.parallel_tool_calls is not None:
        data["parallel_tool_calls"] = request.parallel_tool_calls
    if tools.functions:
        data["tools"] = tools.functions
        if isinstance(request.tool_choice, FunctionToolChoice):
            data["tool_choice"] = {"type": "function", "function": {"name": request.tool_choice.name}}
        elif request.tool_choice is not None:
            data["tool_choice"] = request.tool_choice
    if request.prompt_cache_key:
        data["prompt_cache_key"] = request.prompt_cache_key
    text_format = request.text.format if request.text is not None else None
    if text_format is not None and text_format.type == "json_schema":
        data["response_format"] = {"type": "json_schema", "json_schema": {
            "name": text_format.name, "schema": text_format.schema_, "strict": text_format.strict,
            "description": text_format.description}}
    elif text_format is not None:
        data["response_format"] = {"type": text_format.type}
    if request.reasoning is not None and request.reasoning.effort is not None:
        data["reasoning_effort"] = _EFFORTS[request.reasoning.effort]
    try:
        chat = ChatCompletionRequest.model_validate(data)
    except ValueError as exc:
        raise bad_request(f"input: {exc}") from None
    for tool in chat.tools or []:
        tool.function._text_grammar = tools.text_grammars.get(tool.function.name)
    if request.max_output_tokens is not None:
        # The Responses API's bound on max_output_tokens, checked by ResponsesRequest, not chat's.
        chat = chat.model_copy(update={"max_tokens": request.max_output_tokens})
    return chat


def as_input_items(output: list[OutputItem]) -> list[dict[str, Any]]:
    """A response's output as the items of the next turn's conversation."""
    items = []
    for item in output:
        if isinstance(item, OutputReasoning) and item.content:
            items.append({"type": "reasoning", "text": "".join(part.text for part in item.content)})
        elif isinstance(item, OutputMessage):
            items.append({"type": "message", "role": "assistant", "content": "".join(p.text for p in item.content)})
        elif isinstance(item, OutputFunctionCall):
            items.append({"type": "function_call", "call_id": item.call_id, "name": item.name,
                          "arguments": item.arguments, "namespace": item.namespace})
        elif isinstance(item, OutputCustomToolCall):
            items.append({"type": "custom_tool_call", "call_id": item.call_id, "name": item.name,
                          "input": item.input, "namespace": item.namespace})
    return items


class OpenAIServingResponses:
    def __init__(self, chat: OpenAIServingChat, store: ResponseStore, seal: ReasoningSeal, runner: JobRunner, *,
                 key_for: Callable[[int | None], ActiveKey | None], gate: AccountGate,
                 usage: UsageRecorder | None, background_per_account: int) -> None:
        self.chat = chat
        self.store = store
        self.seal = seal
        self.background = BackgroundResponses(self, runner, key_for=key_for, gate=gate, usage=usage,
                                              per_account=background_per_account)
        self.in_store = StoreThread("fastrun-responses").run

    # ------------------------------------------------------------------ stored responses

    async def retrieve(self, response_id: str) -> dict[str, Any]:
        stored = await self.in_store(self.store.get, _account(), response_id)
        if stored is None:
            raise APIError(404, f"no stored response with id {response_id!r}")
        return stored.response

    async def delete(self, response_id: str) -> dict[str, Any]:
        account = _account()
        if await self.in_store(self.store.get, account, response_id) is None:
            raise APIError(404, f"no stored response with id {response_id!r}")
        # A background job still running would store its response again as it ends: it stops first.
        if self.background.cancel(response_id):
            await self.background.wait_cancelled(response_id)
        if not await self.in_store(self.store.delete, account, response_id):
            raise APIError(404, f"no stored response with id {response_id!r}")
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    # ------------------------------------------------------------------ create

    async def create(self, request: ResponsesRequest) -> Response | AsyncIterator[ServerSentEvent]:
        if request.background:
            return await self._queue_background(request)
        conversation, tools, chat = await self._chat_of(request)
        result = await self.chat.answer(chat)
        response_id = item_id("resp")
        if isinstance(result, ChatCompletion):
            response = await self._response(request, response_id, result, tools)
            await self._store(request, response, conversation)
            return response
        return self._stream(request, response_id, result, conversation, tools)

    async def _chat_of(self, request: ResponsesRequest,
                       history: list[dict[str, Any]] | None = None) -> tuple[list[dict[str, Any]], ToolSet,
                                                                               ChatCompletionRequest]:
        """The whole conversation, the tools and the chat request that answers it."""
        if history is None:
            history = await self._history(request)
        # Translating and validating a long conversation is work: off the event loop.
        conversation = history + await self.chat.in_prompt_pool(conversation_items, request, self.seal,
                                                                _account() or "")
        if len(conversation) > self.chat.limits.messages:
            raise bad_request(f"the conversation has {len(conversation)} items, over {self.chat.limits.messages} "
                              "(limit --limit-messages)")
        tools = ToolSet(request)
        if len(tools.functions) > self.chat.limits.tools:  # a namespace's functions count one by one
            raise bad_request(f"tools hold {len(tools.functions)} functions, namespaces included, over "
                              f"{self.chat.limits.tools} (limit --limit-tools)")
        chat = await self.chat.in_prompt_pool(self._translated, request, conversation, tools)
        return conversation, tools, chat

    @staticmethod
    def _translated(request: ResponsesRequest, conversation: list[dict[str, Any]], tools: ToolSet) -> ChatCompletionRequest:
        return chat_request(request, chat_messages(request.instructions, conversation), tools)

    async def _history(self, request: ResponsesRequest) -> list[dict[str, Any]]:
        history: list[dict[str, Any]] = []
        if request.previous_response_id is not None:
            stored = await self.in_store(self.store.get, _account(), request.previous_response_id)
            if stored is None:
                raise APIError(404, f"previous_response_id: no stored response with id {request.previous_response_id!r}")
            history = stored.conversation
        return history

    # ------------------------------------------------------------------ background

    async def _queue_background(self, request: ResponsesRequest) -> Response | AsyncIterator[ServerSentEvent]:
        """Store the queued response with its job and answer at once (or follow it as a stream)."""
        if not request.store:
            raise bad_request("background: a background response is stored (store must not be false)")
        if not self.chat.models.knows(request.model):
            raise model_not_found(request.model)
        history = await self._history(request)
        await self._chat_of(request, history)  # the request's own errors are its 400 now, not a failed job later
        account = _account()
        response = self._skeleton(request, item_id("resp"), unix_time())
        response.status, response.background = "queued", True
        record = current_record()
        job = BackgroundJob(response.id, account or "", record.key_id if record is not None else None,
                            request_for_background(request), history)
        try:
            await self.in_store(self.store.put_background, account, job.key_id, response.model_dump(mode="json"),
                                 job.request, history, per_account=self.background.per_account)
        except AccountAtCap as exc:  # checked and taken in one transaction: requests sent together count
            raise APIError(429, str(exc), "rate_limit_error", retry_after=30) from None
        self.background.run(job)
        if request.stream:
            return self.background.follow(account, response.id, -1)
        return response

    async def answer_background(self, job: BackgroundJob) -> AsyncIterator[ServerSentEvent]:
        """The job's answer as stream events (raises APIError while it cannot start, e.g. 429)."""
        request = ResponsesRequest.model_validate(job.request)
        conversation, tools, chat = await self._chat_of(request, job.conversation)
        return self._stream(request, job.response_id, await self.chat.answer(chat), conversation, tools,
                            background=True)

    async def mark_background(self, job: BackgroundJob, status: str) -> None:
        stored = await self.in_store(self.store.get, job.account, job.response_id)
        if stored is not None:
            stored.response["status"] = status
            await self.in_store(self.store.put, job.account, stored.response, stored.conversation)

    async def end_background(self, job: BackgroundJob, events: list[str], *, failed: APIError | None = None,
                             cancelled: bool = False) -> None:
        """The job's end: its response as it ended (a completed one the stream stored itself),
        and its events for replay."""
        stored = await self.in_store(self.store.get, job.account, job.response_id)
        if stored is None:  # deleted meanwhile, or gone past the retention or the budget
            await self.in_store(self.store.drop_background, job.response_id)
            return
        response, conversation = stored.response, stored.conversation
        last = json.loads(events[-1]) if events else {}
        if cancelled:
            response.update(status="cancelled", completed_at=None)
        elif failed is not None:
            response.update(status="failed", error={"code": failed.error_type, "message": failed.message})
        elif last.get("type") == "response.failed":
            response = last["response"]
        await self.in_store(self.store.finish_background, job.account, response, conversation, events)

    async def cancel(self, response_id: str) -> dict[str, Any]:
        account = _account()
        stored = await self.in_store(self.store.get, account, response_id)
        if stored is None:
            raise APIError(404, f"no stored response with id {response_id!r}")
        if not stored.response.get("background"):
            raise bad_request("only a background response can be cancelled")
        if self.background.cancel(response_id):
            await self.background.wait_cancelled(response_id)
            stored = await self.in_store(self.store.get, account, response_id) or stored
        elif await self.in_store(self.store.stop_elsewhere, response_id):
            # Another server runs it: it cancels the job when it next renews its lease.
            stored = await self.background.settled(account, response_id) or stored
        return stored.response

    async def follow(self, response_id: str, starting_after: int) -> AsyncIterator[ServerSentEvent]:
        stored = await self.in_store(self.store.get, _account(), response_id)
        if stored is None:
            raise APIError(404, f"no stored response with id {response_id!r}")
        if not stored.response.get("background"):
            raise bad_request("stream: only a background response can be streamed again")
        return self.background.follow(_account(), response_id, starting_after)

    def _sealed(self, request: ResponsesRequest, reasoning: str) -> str | None:
        """The reasoning as `encrypted_content`, when the client asked for it."""
        if "reasoning.encrypted_content" not in (request.include or ()):
            return None
        return self.seal.seal(_account() or "", reasoning)

    async def _store(self, request: ResponsesRequest, response: Response, conversation: list[dict[str, Any]]) -> None:
        if not request.store:
            return
        try:
            await self.in_store(self.store.put, _account(), response.model_dump(mode="json"),
                                 conversation + as_input_items(response.output))
        except StoredTooLarge as exc:
            logger.warning("response %s not stored: %s", response.id, exc)

    def _skeleton(self, request: ResponsesRequest, response_id: str, created: int) -> Response:
        text_format = request.text.format if request.text is not None and request.text.format is not None else None
        return Response(
            id=response_id, created_at=created, status="in_progress", model=request.model,
            instructions=request.instructions, output=[],
            parallel_tool_calls=request.parallel_tool_calls is not False,
            previous_response_id=request.previous_response_id, max_output_tokens=request.max_output_tokens,
            metadata=request.metadata or {},
            reasoning={"effort": request.reasoning.effort, "summary": None} if request.reasoning else None,
            store=request.store, temperature=request.temperature, top_p=request.top_p,
            text={"format": text_format.model_dump(by_alias=True, exclude_none=True) if text_format
                  else {"type": "text"}},
            tool_choice=(request.tool_choice.model_dump() if isinstance(request.tool_choice, FunctionToolChoice)
                         else request.tool_choice or "auto"),
            tools=[tool.model_dump(exclude_none=True) for tool in request.tools or []],
            user=request.user,
        )

    async def _usage(self, request: ResponsesRequest, usage, reasoning: str) -> ResponseUsage:
        reasoning_tokens = 0
        if reasoning:
            served = self.chat.models.held(request.model)
            reasoning_tokens = len(await self.chat.in_prompt_pool(served.runtime.tokenizer.tokenize_plain, reasoning))
        return ResponseUsage(
            input_tokens=usage.prompt_tokens,
            input_tokens_details=InputTokensDetails(cached_tokens=usage.prompt_tokens_details.cached_tokens),
            output_tokens=usage.completion_tokens,
            output_tokens_details=OutputTokensDetails(reasoning_tokens=min(reasoning_tokens, usage.completion_tokens)),
            total_tokens=usage.total_tokens,
        )

    def _incomplete(self, request: ResponsesRequest, finish_reason: str | None, usage: ChatUsage | None) -> bool:
        """Whether the request's max_output_tokens, or the context, ended the answer. One cut by
        the server's own cap on answers that name none (--default-max-tokens) is complete: the
        client asked for no bound (and Codex fails a turn on an incomplete response)."""
        if finish_reason != "length":
            return False
        context = self.chat.models.held(request.model).runtime.info.max_context
        return request.max_output_tokens is not None or (usage is not None and usage.total_tokens >= context - 1)

    @staticmethod
    def _finish(response: Response, incomplete: bool, usage: ResponseUsage | None) -> Response:
        response.completed_at = unix_time()
        response.usage = usage
        if incomplete:
            response.status = "incomplete"
            response.incomplete_details = IncompleteDetails(reason="max_output_tokens")
            if response.output:
                response.output[-1].status = "incomplete"
        else:
            response.status = "completed"
        return response

    async def _response(self, request: ResponsesRequest, response_id: str, result: ChatCompletion,
                        tools: ToolSet) -> Response:
        choice = result.choices[0]
        message = choice.message
        output: list[OutputItem] = []
        if message.reasoning:
            output.append(OutputReasoning(id=item_id("rs"), status="completed",
                                          content=[ReasoningText(text=message.reasoning)],
                                          encrypted_content=self._sealed(request, message.reasoning)))
        if message.content or not message.tool_calls:
            output.append(OutputMessage(id=item_id("msg"), status="completed",
                                        content=[OutputText(text=message.content or "")]))
        for call in message.tool_calls or []:
            output.append(tools.output_call(item_id("fc"), "completed", call.id, call.function.name,
                                            call.function.arguments))
        response = self._skeleton(request, response_id, result.created)
        response.output = output
        usage = await self._usage(request, result.usage, message.reasoning or "")
        return self._finish(response, self._incomplete(request, choice.finish_reason, result.usage), usage)

    async def _stream(self, request: ResponsesRequest, response_id: str, answer: AnswerEvents,
                      conversation: list[dict[str, Any]], tools: ToolSet, *,
                      background: bool = False) -> AsyncIterator[ServerSentEvent]:
        skeleton = self._skeleton(request, response_id, unix_time())
        skeleton.background = background
        events = _ResponseEvents(skeleton, tools, lambda text: self._sealed(request, text))
        yield events.lifecycle("response.created")
        yield events.lifecycle("response.in_progress")
        finish_reason = None
        usage = None
        try:
            async for answer_event in answer:
                if isinstance(answer_event, AnswerDelta):
                    if answer_event.reasoning:
                        for event in events.reasoning(answer_event.reasoning):
                            yield event
                    if answer_event.text:
                        for event in events.text(answer_event.text):
                            yield event
                    for call in answer_event.tool_calls:
                        for event in events.tool_call(call.call_index, call.call_id, call.name, call.arguments):
                            yield event
                elif isinstance(answer_event, ChoiceFinished):
                    finish_reason = answer_event.finish_reason
                elif isinstance(answer_event, AnswerUsage):
                    usage = answer_event.usage
        except APIError as exc:
            for event in events.failed(exc):
                yield event
            return
        incomplete = self._incomplete(request, finish_reason, usage)
        for event in events.close(at_end=True, incomplete=incomplete):
            yield event
        response = events.response
        response.output = events.output
        if usage is not None:
            usage = await self._usage(request, usage, events.reasoning_text)
        self._finish(response, incomplete, usage)
        await self._store(request, response, conversation)
        yield events.lifecycle("response.incomplete" if response.status == "incomplete" else "response.completed")


class _ResponseEvents:
    """The typed events of one streamed response, numbered in order; output items open as
    their first delta arrives and close when another kind of item starts or the answer ends."""

    def __init__(self, response: Response, tools: ToolSet, seal: Callable[[str], str | None]) -> None:
        self.response = response
        self.tools = tools
        self._seal = seal
        self.output: list[OutputItem] = []
        self.reasoning_text = ""
        self._sequence = 0
        self._open: OutputItem | None = None
        self._texts: list[str] = []

    def _event(self, kind: str, **fields: Any) -> ServerSentEvent:
        data = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return ServerSentEvent(data=json.dumps(data, separators=(",", ":")), event=kind)

    def lifecycle(self, kind: str) -> ServerSentEvent:
        return self._event(kind, response=self.response.model_dump(mode="json"))

    def failed(self, exc: APIError) -> list[ServerSentEvent]:
        """A failure mid-stream: OpenAI's `error` event, then `response.failed` (what Codex
        reads: it ignores `error`)."""
        record_stream_error(exc)
        self.response.status = "failed"
        self.response.error = ResponseError(code=exc.error_type, message=exc.message)
        self.response.output = self.output
        return [self._event("error", code=exc.error_type, message=exc.message, param=None),
                self.lifecycle("response.failed")]

    @property
    def _index(self) -> int:
        return len(self.output) - 1

    def _start(self, item: OutputItem) -> list[ServerSentEvent]:
        events = self.close()
        self.output.append(item)
        self._open = item
        self._texts = []
        events.append(self._event("response.output_item.added", output_index=self._index,
                                  item=item.model_dump(mode="json")))
        return events

    def reasoning(self, text: str) -> list[ServerSentEvent]:
        events = []
        if not isinstance(self._open, OutputReasoning):
            events += self._start(OutputReasoning(id=item_id("rs"), status="in_progress", content=[]))
            events.append(self._event("response.content_part.added", item_id=self._open.id, output_index=self._index,
                                      content_index=0, part={"type": "reasoning_text", "text": ""}))
        self._texts.append(text)
        self.reasoning_text += text
        events.append(self._event("response.reasoning_text.delta", item_id=self._open.id, output_index=self._index,
                                  content_index=0, delta=text))
        return events

    def text(self, text: str) -> list[ServerSentEvent]:
        events = []
        if not isinstance(self._open, OutputMessage):
            events += self._start(OutputMessage(id=item_id("msg"), status="in_progress", content=[]))
            events.append(self._event("response.content_part.added", item_id=self._open.id, output_index=self._index,
                                      content_index=0, part=OutputText(text="").model_dump(mode="json")))
        self._texts.append(text)
        events.append(self._event("response.output_text.delta", item_id=self._open.id, output_index=self._index,
                                  content_index=0, delta=text, logprobs=[]))
        return events

    def tool_call(self, index: int, call_id: str | None, name: str | None, arguments: str) -> list[ServerSentEvent]:
        events = []
        if call_id is not None:  # a new call: its id and name come first
            events += self._start(self.tools.output_call(item_id("fc"), "in_progress", call_id, name or "", ""))
        if arguments and isinstance(self._open, (OutputFunctionCall, OutputCustomToolCall)):
            self._texts.append(arguments)
            if isinstance(self._open, OutputFunctionCall):  # a custom tool's text comes whole, at its end
                events.append(self._event("response.function_call_arguments.delta", item_id=self._open.id,
                                          output_index=self._index, delta=arguments))
        return events

    def close(self, *, at_end: bool = False, incomplete: bool = False) -> list[ServerSentEvent]:
        """Finish the open item; `at_end` of the answer (`incomplete`: cut short), an answer
        with no output at all still gets its empty message."""
        item = self._open
        if item is None:
            if not (at_end and not self.output):
                return []
            return self.text("") + self.close(at_end=True, incomplete=incomplete)
        self._open = None
        text = "".join(self._texts)
        status = "incomplete" if incomplete else "completed"
        index = self._index
        events = []
        if isinstance(item, OutputMessage):
            part = OutputText(text=text)
            item.content = [part]
            events.append(self._event("response.output_text.done", item_id=item.id, output_index=index,
                                      content_index=0, text=text, logprobs=[]))
            events.append(self._event("response.content_part.done", item_id=item.id, output_index=index,
                                      content_index=0, part=part.model_dump(mode="json")))
        elif isinstance(item, OutputReasoning):
            part = ReasoningText(text=text)
            item.content = [part]
            item.encrypted_content = self._seal(text)
            events.append(self._event("response.reasoning_text.done", item_id=item.id, output_index=index,
                                      content_index=0, text=text))
            events.append(self._event("response.content_part.done", item_id=item.id, output_index=index,
                                      content_index=0, part=part.model_dump(mode="json")))
        elif isinstance(item, OutputCustomToolCall):
            item.input = custom_input(text)
            events.append(self._event("response.custom_tool_call_input.done", item_id=item.id, output_index=index,
                                      input=item.input))
        else:
            item.arguments = text
            events.append(self._event("response.function_call_arguments.done", item_id=item.id, output_index=index,
                                      name=item.name, arguments=text))
        item.status = status
        events.append(self._event("response.output_item.done", output_index=index, item=item.model_dump(mode="json")))
        return events
