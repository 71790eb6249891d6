"""POST /v1/chat/completions: prompt rendering (tools, reasoning switches, control tokens in
user text kept plain), grammars (response formats, tool calls, after the reasoning when the
model thinks), n choices, and splitting each answer into reasoning, content and tool calls."""

from __future__ import annotations

import codecs
import dataclasses
import json
import logging
from dataclasses import dataclass
from typing import Any, AsyncIterator

from fastrun_cpp.chat import ChatTemplateError
from fastrun_cpp.chat.escape import ControlTextEscaper
from fastrun_cpp.engine import FinishReason, GenerationOutput, GenerationRequest
from fastrun_cpp.engine.reasoning_budget import ReasoningBudget
from fastrun_cpp.entrypoints.answer import (
    Answer,
    AnswerDelta,
    AnswerEvent,
    AnswerEvents,
    AnswerStarted,
    AnswerUsage,
    ChoiceFinished,
    ToolCallPart,
    collect,
)
from fastrun_cpp.entrypoints.openai.errors import APIError, bad_request
from fastrun_cpp.entrypoints.openai.logprobs import chat_logprobs
from fastrun_cpp.entrypoints.openai.protocol import (
    ChatChoiceLogprobs,
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
    ImagePrompt,
    OpenAIServing,
    PromptImages,
    current_share,
    openai_finish_reason,
    stop_sequences,
    stream_error_event,
    usage_of,
)
from fastrun_cpp.entrypoints.openai.models.serving import ServedModel
from fastrun_cpp.entrypoints.openai.utils import JSONPieces, TextChunks, answer_pieces
from fastrun_cpp.parsers import ReasoningParser, ToolFunction, ToolParser
from fastrun_cpp.parsers.chat_output import ChatOutputParser
from fastrun_cpp.parsers.tool_calls import FallbackToolParser
from fastrun_cpp.runtime import EngineStream, ModelRuntime
from fastrun_cpp.structured.grammars import base_grammar
from fastrun_cpp.structured.json_schema import closed_object_keys
from fastrun_cpp.structured.builder import BuildError
from fastrun_cpp.structured.reasoning import with_optional_reasoning
from fastrun_cpp.structured.spec import CallableFunction, GrammarSpec, Trigger
from fastrun_cpp.structured.validation import check_instance

logger = logging.getLogger(__name__)

MAX_PARALLEL_CALLS = 8  # tool calls one answer may hold


def _arguments_object(arguments: str) -> Any:
    """Templates expect arguments as a mapping; OpenAI sends a JSON string."""
    try:
        value = json.loads(arguments)
    except (ValueError, RecursionError):
        return arguments
    return value if isinstance(value, dict) else arguments


def template_messages(messages: list[ChatMessage], *, tools_as_text: bool,
                      images: PromptImages | None = None) -> list[dict[str, Any]]:
    """Messages as chat templates expect them: plain dicts with string content, each image
    part written as `images` writes it (a marker where the image goes; without `images`,
    image parts are left out).

    With `tools_as_text` (templates that know nothing of tools) past calls are written into
    the assistant's text in the fallback format, and tool results become user turns.
    """
    rendered = []
    for message in messages:
        role = "system" if message.role == "developer" else message.role  # same meaning
        image = None if images is None else images.from_tool if role == "tool" else images
        text = message.text(image)  # once: each image it meets is collected where its marker stands
        item: dict[str, Any] = {"role": role, "content": text}
        if message.reasoning_content and role == "assistant":
            item["reasoning_content"] = message.reasoning_content
        if tools_as_text:
            if message.tool_calls:
                calls = "\n".join(
                    "<tool_call>\n" + json.dumps({"name": c.function.name, "arguments": _arguments_object(
                        c.function.arguments)}) + "\n</tool_call>"
                    for c in message.tool_calls
                )
                item["content"] = (item["content"] + "\n" if item["content"] else "") + calls
            if role == "tool":
                item = {"role": "user", "content": f"Result of the tool call: {text}"}
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


def fold_late_system_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation with each system message after the first turn joined to the user
    message it precedes (or follows, at the end): for chat templates that allow a system
    message only first (Claude Code sends its environment notes between turns)."""
    folded: list[dict[str, Any]] = []
    pending: list[str] = []
    for index, message in enumerate(messages):
        if message["role"] == "system" and any(m["role"] != "system" for m in messages[:index]):
            pending.append(message["content"] or "")
            continue
        if pending and message["role"] == "user":
            message = {**message, "content": "\n\n".join([*pending, message["content"] or ""])}
            pending = []
        folded.append(message)
    if pending:
        last_user = next((i for i in range(len(folded) - 1, -1, -1) if folded[i]["role"] == "user"), None)
        if last_user is None:
            folded.append({"role": "user", "content": "\n\n".join(pending)})
        else:
            folded[last_user] = {**folded[last_user], "content": "\n\n".join([folded[last_user]["content"] or "",
                                                                                *pending])}
    return folded


def _image_urls(request: ChatCompletionRequest) -> list[str]:
    return [url for message in request.messages for url in message.images()]


def _with_system_text(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


@dataclass
class _Plan:
    """How one request is answered: parsers, grammar, and what to check afterwards."""

    tool_parser: ToolParser | None
    reasoning_parser: ReasoningParser | None
    starts_in_reasoning: bool
    max_calls: int | None
    grammar: GrammarSpec | None = None
    lenient_schemas: dict[str, Any] | None = None  # function name -> parameters, validated after
    lenient_response_schema: dict[str, Any] | None = None
    closed_keys: dict[str, frozenset[str]] | None = None  # function -> the only argument keys its grammar allows

    def parser(self) -> ChatOutputParser:
        return ChatOutputParser(reasoning=self.reasoning_parser, starts_in_reasoning=self.starts_in_reasoning,
                                tools=self.tool_parser, max_calls=self.max_calls, closed_keys=self.closed_keys)


# --reasoning-format: the names chat answers give the reasoning text.
REASONING_NAMES = {"reasoning": ("reasoning",), "reasoning_content": ("reasoning_content",),
                   "both": ("reasoning", "reasoning_content")}


# reasoning_effort's reasoning budgets (tokens; -1 unlimited), where no budget is named.
EFFORT_BUDGETS = {"none": 0, "low": 1024, "medium": 8192, "high": -1}
UNLIMITED_REASONING = 2**62  # a budget never reached: the engine counts the reasoning and forces nothing


def chat_completion(answer: Answer, model: str, *, logprobs: bool) -> ChatCompletion:
    """A chat answer whole, as chat's non-streamed object: its choices as their deltas added up."""
    choices = []
    for choice in answer.choices:
        tool_calls = [ToolCall(id=call.call_id, type="function", function=FunctionCall(name=call.name,
                                                                                         arguments=call.arguments))
                      for call in choice.tool_calls]
        choices.append(ChatCompletionChoice(
            index=choice.index,
            message=ChatResponseMessage(content=choice.text if choice.text or not tool_calls else None,
                                        reasoning=choice.reasoning or None, tool_calls=tool_calls or None),
            finish_reason=choice.finish_reason,
            logprobs=ChatChoiceLogprobs(content=choice.logprobs or []) if logprobs else None,
            stop_sequence=choice.stop_sequence,
        ))
    return ChatCompletion(id=answer.answer_id, created=answer.created, model=model, choices=choices,
                          usage=answer.usage)


class OpenAIServingChat(OpenAIServing):
    def __init__(self, *args, reasoning_format: str = "reasoning", reasoning_budget: int = -1,
                 reasoning_budget_message: str = "", **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.dump_context = {"reasoning_names": REASONING_NAMES[reasoning_format]}
        self.reasoning_budget = reasoning_budget  # --reasoning-budget: where a request names none
        self.reasoning_budget_message = reasoning_budget_message

    async def create_chat_completion(self, request: ChatCompletionRequest) -> JSONPieces | AsyncIterator[str]:
        events = await self.answer(request)
        if not request.stream:
            completion = chat_completion(await collect(events), request.model, logprobs=bool(request.logprobs))
            return answer_pieces(completion, "choices", self.dump_context)
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        return self._server_sent_events(self._chunks(events, request.model, include_usage))

    async def _server_sent_events(self, chunks: AsyncIterator[str]) -> AsyncIterator[str]:
        """Chat chunks as `data:` payloads, an error as one event in the spec's shape, then [DONE]."""
        try:
            async for chunk in chunks:
                yield chunk
        except APIError as exc:
            yield stream_error_event(exc)
            return
        yield "[DONE]"

    async def answer(self, request: ChatCompletionRequest) -> AnswerEvents:
        """The answer to a chat request as neutral events (raising APIError if the engine fails
        mid-way), streamed or `collect`ed whole (entrypoints/answer.py). The other generating
        endpoints (Responses, Messages) are translations onto this."""
        served = await self.served_model(request.model, request.keep_alive)
        runtime = served.runtime
        tool_parser = self._tool_parser(runtime, request)
        forced_calls = tool_parser is not None and request.tool_choice not in (None, "auto")
        constrained = forced_calls or (request.response_format is not None and request.response_format.type != "text")
        thinking = runtime.reasoning_parser is not None and self._thinking_on(request)
        # A grammar from the first token leaves no room for reasoning; with thinking on, the
        # grammar waits for the reasoning to end.
        reasoning_parser = runtime.reasoning_parser if thinking or not constrained else None
        fetched = await self.fetch_images(served, _image_urls(request))
        prompt, prepared = await self.in_prompt_pool(self._prompt, served, request, tool_parser, fetched)
        prompt_tokens, media = await self.with_images(served, prepared)
        plan = _Plan(
            tool_parser=tool_parser,
            reasoning_parser=reasoning_parser,
            starts_in_reasoning=reasoning_parser is not None and reasoning_parser.starts_in_reasoning(prompt),
            max_calls=1 if request.parallel_tool_calls is False or hasattr(request.tool_choice, "function") else None,
        )
        await self._plan_grammar(served, request, plan, thinking)
        needs_special = any(p is not None and p.needs_special_tokens for p in (tool_parser, reasoning_parser))
        generation = GenerationRequest(
            request_id=random_id("chatcmpl"),
            prompt_tokens=prompt_tokens,
            sampling=self.sampling_params(request, served),
            max_tokens=request.max_tokens or request.max_completion_tokens or served.sampling_defaults.max_tokens,
            stop=stop_sequences(request.stop, served),
            logprobs=(request.top_logprobs or 0) if request.logprobs else None,
            grammar=plan.grammar,
            render_special_tokens=needs_special,
            n=request.n or 1,
            speculative=request.speculative is not False,
            priority=request.priority or 0,
            session=request.prompt_cache_key or "",
            stepwise_outputs=tool_parser is not None,  # its calls may end a choice at any step
            reasoning_budget=self._reasoning_budget(served, request, plan),
            adapters=self.adapters_for(served, request.model, request.lora),
            media=media,
        )
        stream = await self.submit(served, generation, streaming=request.stream)
        return self._events(served, generation, stream, plan)

    async def count_prompt_tokens(self, request: ChatCompletionRequest) -> int:
        """The length of the prompt `request` renders to, tools and reasoning switches included."""
        served = await self.served_model(request.model, request.keep_alive)
        tool_parser = self._tool_parser(served.runtime, request)
        fetched = await self.fetch_images(served, _image_urls(request))
        _, prepared = await self.in_prompt_pool(self._prompt, served, request, tool_parser, fetched)
        tokens, _ = await self.with_images(served, prepared)
        return len(tokens)

    # ------------------------------------------------------------------ prompt

    @staticmethod
    def _tool_parser(runtime: ModelRuntime, request: ChatCompletionRequest) -> ToolParser | None:
        """The model's tool-call parser when this request offers tools."""
        if not request.tools or request.tool_choice == "none":
            return None
        if hasattr(request.tool_choice, "function"):
            names = {tool.function.name for tool in request.tools}
            if request.tool_choice.function.name not in names:
                raise bad_request(f"tool_choice names {request.tool_choice.function.name!r}, which is not in tools")
        return runtime.tool_parser

    @staticmethod
    def _named_budget(request: ChatCompletionRequest) -> int | None:
        """The reasoning budget the request names itself (llama-server's field or its alias)."""
        if request.thinking_budget_tokens is not None:
            return request.thinking_budget_tokens
        return request.reasoning_budget_tokens

    def _thinking_kwargs(self, request: ChatCompletionRequest) -> dict[str, Any]:
        """Template switches for reasoning: off unless reasoning_effort, or a budget other than
        0, asks for it; a budget of 0 turns it off. The request's own chat_template_kwargs win."""
        effort = request.reasoning_effort
        budget = self._named_budget(request)
        on = budget != 0 if budget is not None and effort is None else effort not in (None, "none") and budget != 0
        kwargs: dict[str, Any] = {"enable_thinking": on}
        if on and effort is not None:
            kwargs["reasoning_effort"] = effort
        return {**kwargs, **(request.chat_template_kwargs or {})}

    def _reasoning_budget(self, served: ServedModel, request: ChatCompletionRequest,
                          plan: _Plan) -> ReasoningBudget | None:
        """The engine's hard cap on this answer's reasoning: the request's budget, else the
        server's (--reasoning-budget), lowered to its effort's (EFFORT_BUDGETS). Unlimited, the
        engine only counts the reasoning's tokens (usage's reasoning_tokens); None when the model
        does not reason here."""
        parser = plan.reasoning_parser
        if parser is None:
            return None
        budget = self._named_budget(request)
        if budget is None:
            budgets = [self.reasoning_budget, EFFORT_BUDGETS[request.reasoning_effort or "high"]]
            budget = min((b for b in budgets if b >= 0), default=-1)
        closing: list[int] = []  # none: never forced
        if budget >= 0:
            tokenizer = served.runtime.tokenizer
            message = self.reasoning_budget_message
            closing = (tokenizer.tokenize_plain(message) if message else []) + tokenizer.tokenize(
                parser.budget_closing, add_special=False, parse_special=True)
        return ReasoningBudget(
            tokens=budget if budget >= 0 else UNLIMITED_REASONING, closing=tuple(closing),
            end=parser.budget_end.encode(), start=None if plan.starts_in_reasoning else parser.budget_start.encode())

    def _thinking_on(self, request: ChatCompletionRequest) -> bool:
        return bool(self._thinking_kwargs(request).get("enable_thinking"))

    def _prompt(self, served: ServedModel, request: ChatCompletionRequest, tool_parser: ToolParser | None,
                fetched: dict[str, tuple[bytes, str | None]] | None = None) -> tuple[str, list[int] | ImagePrompt]:
        """The rendered prompt and its tokens, or with images its text's tokens and the images
        read (in the prompt pool; `with_images` encodes them; `fetched`: the image URLs'
        bytes). Control-token text in the messages and tools stays plain text; the template's
        own markup is parsed."""
        runtime = served.runtime
        tokenizer = runtime.tokenizer
        escaper = ControlTextEscaper(tokenizer.control_texts)
        tools_as_text = isinstance(runtime.tool_parser, FallbackToolParser)
        images = self.prompt_images(served, fetched)
        messages = template_messages(request.messages, tools_as_text=tools_as_text, images=images)
        self.check_prompt_length(served, sum(len(message["content"] or "") for message in messages))
        template_tools = None
        if tool_parser is not None:
            instructions = tool_parser.system_prompt(self._functions(request))
            if instructions:
                messages = _with_system_text(messages, instructions)
            else:
                template_tools = [tool.model_dump(exclude_none=True) for tool in request.tools]
        def render(conversation: list[dict[str, Any]]) -> str:
            return runtime.chat_template.render(
                escaper.escape_all(conversation),
                tools=escaper.escape_all(template_tools),
                template_kwargs=escaper.escape_all(self._thinking_kwargs(request)),
            )

        try:
            try:
                prompt = render(messages)
            except ChatTemplateError:
                folded = fold_late_system_messages(messages)
                if folded == messages:
                    raise
                prompt = render(folded)  # the template takes a system message only first
        except ChatTemplateError as exc:
            raise bad_request(str(exc)) from exc
        self.check_prompt_text(served, prompt)

        def tokenize_text(text: str, first: bool) -> list[int]:
            return escaper.tokenize(text, lambda markup, opens: tokenizer.tokenize_prompt(markup, first=opens and first),
                                    tokenizer.tokenize_plain)

        if images.urls:
            return escaper.unescape(prompt), self.image_prompt(served, prompt, images, tokenize_text)
        tokens = tokenize_text(prompt, True)
        self.check_prompt_tokens(served, tokens)
        return escaper.unescape(prompt), tokens

    @staticmethod
    def _functions(request: ChatCompletionRequest) -> list[ToolFunction]:
        return [
            ToolFunction(tool.function.name, tool.function.description,
                         tool.function.parameters or {"type": "object", "properties": {}})
            for tool in request.tools or []
        ]

    # ------------------------------------------------------------------ grammar

    async def _plan_grammar(self, served: ServedModel, request: ChatCompletionRequest, plan: _Plan,
                            thinking: bool) -> None:
        """The grammar that enforces tool calls or the response format, if any.

        `required` and a named function force calls; `auto` arms a lazy grammar at a call's
        opening text, so that every call, once started, is well formed. A forced call's schema
        keyword a grammar cannot enforce is a 400 when `strict`, and otherwise left out of the
        grammar and checked after generation; with `auto`, no schema refuses the request (the
        grammar enforces what it can: GrammarBuilder.tool_grammar's `relaxed`). With thinking on,
        the grammar applies after the reasoning.
        """
        tool_parser = plan.tool_parser
        response_format = request.response_format
        choice = request.tool_choice or "auto"
        lazy_tools = choice == "auto"
        if tool_parser is not None and not (lazy_tools and response_format is not None
                                            and response_format.type != "text"):
            functions = [tool.function for tool in request.tools]
            if hasattr(choice, "function"):
                functions = [f for f in functions if f.name == choice.function.name]
            if not tool_parser.can_force:
                if not lazy_tools:
                    raise bad_request(f"tool_choice: forcing tool calls is not supported for the "
                                      f"{tool_parser.name} format")
                return  # calls are still parsed, just not enforced
            try:
                gbnf = await self.grammar_builder.tool_grammar(
                    [CallableFunction(f.name, f.parameters or {"type": "object", "properties": {}}, bool(f.strict),
                                      f._text_grammar) for f in functions],
                    tool_parser.call_format(plan.max_calls or MAX_PARALLEL_CALLS), relaxed=lazy_tools,
                    share=current_share(),
                )
            except BuildError as exc:
                raise bad_request(f"tools: {exc}") from exc
            plan.lenient_schemas = {f.name: f.parameters for f in functions
                                    if (lazy_tools or not f.strict) and f.parameters}
            plan.closed_keys = {f.name: keys for f in functions
                                if (keys := closed_object_keys(f.parameters or {"type": "object", "properties": {}}))
                                is not None}
            triggers = tool_parser.lazy_triggers() if lazy_tools else ()
            spec = GrammarSpec(gbnf, triggers)
            field = "tools"
        elif response_format is not None and response_format.type != "text":
            if response_format.type == "json_object" and response_format.schema_ is not None:
                gbnf = await self.schema_grammar(response_format.schema_, strict=False, field="response_format.schema")
                plan.lenient_response_schema = response_format.schema_
            elif response_format.type == "json_object":
                gbnf = base_grammar("json_object")
            else:
                json_schema = response_format.json_schema
                gbnf = await self.schema_grammar(json_schema.schema_, strict=bool(json_schema.strict),
                                                 field="response_format.json_schema.schema")
                if not json_schema.strict:
                    plan.lenient_response_schema = json_schema.schema_
            spec = GrammarSpec(gbnf)
            field = "response_format"
        else:
            return
        if thinking and not spec.lazy and plan.reasoning_parser is not None:
            spec = self._after_reasoning(spec, plan)
        plan.grammar = await self.checked_grammar(served, spec, field)

    @staticmethod
    def _after_reasoning(spec: GrammarSpec, plan: _Plan) -> GrammarSpec:
        """Think, then constrain: the grammar takes over where the answer starts. When the
        prompt opened the reasoning (or the model marks its answer), that is a trigger; when
        the model opens its reasoning itself, the grammar lets a reasoning block come first."""
        parser = plan.reasoning_parser
        if plan.starts_in_reasoning or parser.opening is None:
            return GrammarSpec(spec.gbnf, (Trigger(parser.answer_marker, after=True),))
        return GrammarSpec(with_optional_reasoning(spec.gbnf, parser.opening, parser.answer_marker))

    # ------------------------------------------------------------------ answer

    def _check_after(self, plan: _Plan, content: str, calls: list) -> None:
        """Lenient schemas: what the grammar left out is checked now; a failure is logged and
        the answer returned all the same."""
        for _, call in calls:
            schema = (plan.lenient_schemas or {}).get(call.name)
            if schema is not None and call.complete:
                problem = check_instance(call.arguments, schema)
                if problem:
                    logger.warning("tool call %s: arguments do not follow its full schema: %s", call.name, problem)
        if plan.lenient_response_schema is not None:
            problem = check_instance(content, plan.lenient_response_schema)
            if problem:
                logger.warning("response_format: the answer does not follow the full schema: %s", problem)

    @staticmethod
    def _finish_reason(reason: FinishReason | None, has_calls: bool, ended_with_calls: bool) -> str | None:
        if ended_with_calls or (has_calls and reason is FinishReason.STOP):
            return "tool_calls"
        return openai_finish_reason(reason)

    @staticmethod
    def _answer_token_bytes(served: ServedModel, generation: GenerationRequest) -> list[bytes]:
        """Each token's bytes as the engine writes them into this request's text."""
        tokenizer = served.runtime.tokenizer
        return tokenizer.token_bytes_special if generation.render_special_tokens else tokenizer.token_bytes

    @staticmethod
    def _completion_at_stop(plan: _Plan, before: str, output: GenerationOutput, token_bytes: list[bytes]) -> int:
        """The choice's completion tokens when its calls end it at `output`, whose text came
        after `before`. A step may bring several tokens (accepted drafts, as many as
        speculation chose to verify, which depends on timing): the answer, and what it counts,
        ends at the first token whose text makes the stop certain, wherever and however fast
        it ran."""
        tokens = output.token_ids
        earlier = output.completion_tokens - len(tokens)
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        text = before
        for taken, token in enumerate(tokens[:-1], start=1):
            text += decoder.decode(token_bytes[token])
            parser = plan.parser()
            parser.feed(text)
            if parser.stop_requested:
                return earlier + taken
        return output.completion_tokens

    async def _events(self, served: ServedModel, generation: GenerationRequest, stream: EngineStream,
                      plan: _Plan) -> AnswerEvents:
        """The answer as neutral events (entrypoints/answer.py), each choice parsed as it comes;
        a choice whose tool calls end it (a repeated call, or the last allowed) stops there."""
        token_bytes = served.runtime.tokenizer.token_bytes
        parsers = [plan.parser() for _ in range(generation.n)]
        stopped: set[int] = set()
        finals: dict[int, GenerationOutput] = {}
        texts: dict[int, list[str]] = {}  # by choice: the text so far (to place a stop, see below)
        answer_bytes = self._answer_token_bytes(served, generation)

        def delta_of(index: int, text: str, *, final: bool = False) -> AnswerDelta | None:
            parsed = parsers[index].feed(text, final=final)
            if not parsed:
                return None
            calls = tuple(ToolCallPart(call_index=c.index, call_id=c.id, name=c.name, arguments=c.arguments)
                          for c in parsed.tool_calls)
            return AnswerDelta(index=index, reasoning=parsed.reasoning, text=parsed.content, tool_calls=calls)

        async def finish(index: int, output: GenerationOutput) -> list[AnswerEvent]:
            parser = parsers[index]
            events: list[AnswerEvent] = []
            if index not in stopped and (tail := delta_of(index, "", final=True)) is not None:
                events.append(tail)
            answer = parser.result()
            if plan.lenient_schemas or plan.lenient_response_schema is not None:  # a schema check: off the loop
                await self.in_prompt_pool(self._check_after, plan, answer.content, answer.tool_calls)
            reason = self._finish_reason(output.finish_reason, bool(answer.tool_calls), parser.ended_with_calls)
            events.append(ChoiceFinished(index=index, finish_reason=reason, stop_sequence=output.stop_sequence))
            return events

        yield AnswerStarted(answer_id=generation.request_id, created=unix_time(), choices=generation.n)
        async for output in self.outputs(served, stream):
            index = output.index
            if index in stopped:  # decoded before the stop reached the engine: not part of the answer
                continue
            if output.finished:
                finals[index] = output
            texts.setdefault(index, []).append(output.text)
            delta = delta_of(index, output.text)
            stopping = parsers[index].stop_requested and not output.finished
            kept = len(output.token_ids)  # of this output's tokens, those in the answer
            if stopping:
                # Its usage and logprobs: the tokens up to the one that ended it.
                completion = self._completion_at_stop(plan, "".join(texts[index][:-1]), output, answer_bytes)
                kept -= output.completion_tokens - completion
                finals[index] = dataclasses.replace(output, completion_tokens=completion)
            if output.logprobs:
                logprobs = chat_logprobs(token_bytes, output.logprobs[:kept])
                delta = dataclasses.replace(delta, logprobs=logprobs) if delta is not None else \
                    AnswerDelta(index=index, logprobs=logprobs)
            if delta is not None:
                yield delta
            if stopping:
                stopped.add(index)
                stream.stop_choice(index)
                logger.info("%s: choice %d ends with its tool calls (a repeated call, or the last one allowed)",
                            generation.request_id, index)
            if stopping or output.finished:
                for event in await finish(index, output):
                    yield event
        yield AnswerUsage(usage=usage_of([finals[i] for i in sorted(finals)],
                                         reasoning_counted=generation.reasoning_budget is not None))

    async def _chunks(self, events: AnswerEvents, model: str, include_usage: bool) -> AsyncIterator[str]:
        """The answer's events as chat chunks' JSON: each choice opens with its role."""
        context = self.dump_context
        answer_id, created = "", 0

        def chunk(index: int, delta: ChatDelta, finish_reason: str | None = None, logprobs=None) -> str:
            choice = ChatCompletionChunkChoice(index=index, delta=delta, finish_reason=finish_reason, logprobs=logprobs)
            return ChatCompletionChunk(id=answer_id, created=created, model=model,
                                       choices=[choice]).model_dump_json(context=context)

        # Its templates are made at the first text, once the answer's id and time are known.
        text_chunks = TextChunks(lambda index, field, text: chunk(index, ChatDelta(**{field: text})))
        async for event in events:
            if isinstance(event, AnswerStarted):
                answer_id, created = event.answer_id, event.created
                for index in range(event.choices):
                    yield chunk(index, ChatDelta(role="assistant", content=""))
            elif isinstance(event, AnswerDelta):
                # Most of a stream: one piece of text or of reasoning, nothing else.
                if not event.tool_calls and event.logprobs is None and bool(event.text) != bool(event.reasoning):
                    yield text_chunks.render(event.index, "content" if event.text else "reasoning",
                                             event.text or event.reasoning)
                    continue
                calls = [ToolCallDelta(index=c.call_index, id=c.call_id, type="function" if c.call_id else None,
                                       function=FunctionCallDelta(name=c.name, arguments=c.arguments))
                         for c in event.tool_calls]
                delta = ChatDelta(content=event.text or None, reasoning=event.reasoning or None,
                                  tool_calls=calls or None)
                if event.logprobs is not None and delta.content is None and not calls and delta.reasoning is None:
                    delta = ChatDelta(content="")
                yield chunk(event.index, delta, logprobs=event.logprobs)
            elif isinstance(event, ChoiceFinished):
                yield chunk(event.index, ChatDelta(), event.finish_reason)
            elif include_usage:
                yield ChatCompletionChunk(id=answer_id, created=created, model=model, choices=[],
                                          usage=event.usage).model_dump_json(context=context)
