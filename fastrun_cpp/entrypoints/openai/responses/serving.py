"""POST /v1/responses and GET/DELETE /v1/responses/{id}: OpenAI's Responses API, translated
onto chat completions (translation.py: the same prompt rendering, grammars, tool and reasoning
parsers, prefix cache and limits), with stored responses for `previous_response_id` and
background ones (background.py). An answer is rendered from chat's answer events: streamed as
typed events (events.py), or collected whole into the Response such a stream ends with."""

from __future__ import annotations

import base64
import json
import logging
from typing import Any, AsyncIterator, Callable

from sse_starlette import ServerSentEvent

from fastrun_cpp.auth import ActiveKey
from fastrun_cpp.entrypoints.answer import (
    Answer,
    AnswerDelta,
    AnswerEvents,
    AnswerUsage,
    ChoiceFinished,
    collect,
)
from fastrun_cpp.entrypoints.jobs import JobRunner
from fastrun_cpp.entrypoints.openai.chat_completion.serving import OpenAIServingChat
from fastrun_cpp.entrypoints.openai.errors import APIError, bad_request, model_not_found
from fastrun_cpp.entrypoints.openai.files.serving import OpenAIServingFiles
from fastrun_cpp.entrypoints.openai.protocol import ChatCompletionRequest, unix_time
from fastrun_cpp.entrypoints.openai.serving_engine import too_many_images
from fastrun_cpp.entrypoints.openai.protocol import Usage as ChatUsage
from fastrun_cpp.entrypoints.openai.responses.background import (
    BackgroundResponses,
    request_for_background,
)
from fastrun_cpp.entrypoints.openai.responses.protocol import (
    FunctionToolChoice,
    IncompleteDetails,
    InputImagePart,
    InputTokensDetails,
    MessageItem,
    OutputItem,
    OutputMessage,
    OutputReasoning,
    OutputText,
    OutputTokensDetails,
    ReasoningText,
    Response,
    ResponsesRequest,
    ResponseUsage,
    ToolOutputItem,
)
from fastrun_cpp.entrypoints.openai.responses.sealed import ReasoningSeal
from fastrun_cpp.entrypoints.openai.responses.store import (
    BackgroundJob,
    ResponseStore,
    StoredTooLarge,
)
from fastrun_cpp.entrypoints.openai.utils import StoreThread
from fastrun_cpp.entrypoints.request_context import current_record
from fastrun_cpp.entrypoints.tenancy import AccountAtCap, AccountGate, UsageRecorder

logger = logging.getLogger(__name__)

from fastrun_cpp.entrypoints.openai.responses.events import ResponseEvents
from fastrun_cpp.entrypoints.openai.responses.translation import (
    ToolSet,
    as_input_items,
    chat_messages,
    chat_request,
    conversation_items,
    item_id,
)


def _account() -> str | None:
    record = current_record()
    return record.account if record is not None else None


class OpenAIServingResponses:
    def __init__(self, chat: OpenAIServingChat, store: ResponseStore, seal: ReasoningSeal, runner: JobRunner,
                 files: OpenAIServingFiles, *, key_for: Callable[[int | None], ActiveKey | None], gate: AccountGate,
                 usage: UsageRecorder | None, background_per_account: int) -> None:
        self.chat = chat
        self.store = store
        self.files = files
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
        answer = await self.chat.answer(chat)
        response_id = item_id("resp")
        if not request.stream:
            response = self._response(request, response_id, await collect(answer), tools)
            await self._store(request, response, conversation)
            return response
        return self._stream(request, response_id, answer, conversation, tools)

    async def _chat_of(self, request: ResponsesRequest,
                       history: list[dict[str, Any]] | None = None) -> tuple[list[dict[str, Any]], ToolSet,
                                                                               ChatCompletionRequest]:
        """The whole conversation, the tools and the chat request that answers it."""
        if history is None:
            history = await self._history(request)
        await self._read_image_files(request)
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

    async def _read_image_files(self, request: ResponsesRequest) -> None:
        """Each input_image that names an uploaded file (`file_id`, the account's own) gets the
        file's bytes as its image, before the input is translated and stored: a conversation
        continued later, or a background response run later, reads the image it was sent, even
        if the file is deleted since."""
        if isinstance(request.input, str):
            return
        contents = [item.content if isinstance(item, MessageItem) else item.output
                    for item in request.input if isinstance(item, (MessageItem, ToolOutputItem))]
        parts = [part for content in contents if isinstance(content, list) for part in content
                 if isinstance(part, InputImagePart) and part.image_url is None and part.file_id is not None]
        if len(parts) > self.chat.limits.images:
            raise too_many_images(self.chat.limits)
        for part in parts:
            content = await self.files.image_file(part.file_id)
            part.image_url = base64.b64encode(content).decode("ascii")  # media.py reads bare base64

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

    @staticmethod
    def _usage(usage: ChatUsage) -> ResponseUsage:
        details = usage.completion_tokens_details  # the reasoning's tokens, as the engine counted them
        return ResponseUsage(
            input_tokens=usage.prompt_tokens,
            input_tokens_details=InputTokensDetails(cached_tokens=usage.prompt_tokens_details.cached_tokens),
            output_tokens=usage.completion_tokens,
            output_tokens_details=OutputTokensDetails(reasoning_tokens=details.reasoning_tokens if details else 0),
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

    def _response(self, request: ResponsesRequest, response_id: str, answer: Answer, tools: ToolSet) -> Response:
        """The answer whole, as the Response a stream of it ends with."""
        choice = answer.choices[0]
        output: list[OutputItem] = []
        if choice.reasoning:
            output.append(OutputReasoning(id=item_id("rs"), status="completed",
                                          content=[ReasoningText(text=choice.reasoning)],
                                          encrypted_content=self._sealed(request, choice.reasoning)))
        if choice.text or not choice.tool_calls:
            output.append(OutputMessage(id=item_id("msg"), status="completed", content=[OutputText(text=choice.text)]))
        for call in choice.tool_calls:
            output.append(tools.output_call(item_id("fc"), "completed", call.call_id, call.name, call.arguments))
        response = self._skeleton(request, response_id, answer.created)
        response.output = output
        usage = self._usage(answer.usage) if answer.usage is not None else None
        return self._finish(response, self._incomplete(request, choice.finish_reason, answer.usage), usage)

    async def _stream(self, request: ResponsesRequest, response_id: str, answer: AnswerEvents,
                      conversation: list[dict[str, Any]], tools: ToolSet, *,
                      background: bool = False) -> AsyncIterator[ServerSentEvent]:
        skeleton = self._skeleton(request, response_id, unix_time())
        skeleton.background = background
        events = ResponseEvents(skeleton, tools, lambda text: self._sealed(request, text))
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
        self._finish(response, incomplete, self._usage(usage) if usage is not None else None)
        await self._store(request, response, conversation)
        yield events.lifecycle("response.incomplete" if response.status == "incomplete" else "response.completed")
