"""POST /v1/chat/completions: render the conversation, generate, parse reasoning and tool calls, respond or stream.

A `tool_choice` of "required" or a named function, and `response_format`, become a grammar the sampler enforces
(`ChatFormat.tool_call_grammar` / `ChatFormat.constrain`), so even a weak model returns a well-formed answer.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from deltaserve.chat.media import ImageSlot
from deltaserve.chat.messages import ChatMessage, ToolSpec
from deltaserve.chat.xtml import THINKING_EFFORTS
from deltaserve.engine.output_processor import SequenceUpdate
from deltaserve.entrypoints.openai.logprobs import chat_logprobs, vllm_prompt_logprobs
from deltaserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatMessageParam,
    NamedToolChoice,
    ResponseFormat,
)
from deltaserve.entrypoints.server.accumulate import ChoiceAccumulator
from deltaserve.entrypoints.server.errors import bad_request
from deltaserve.entrypoints.server.frontend import Frontend, chat_processors
from deltaserve.entrypoints.server.images import RequestImages
from deltaserve.entrypoints.server.prompt import RenderedPrompt
from deltaserve.parsers.types import ToolCall
from deltaserve.sampling_params import SamplingParams, StructuredOutput
from deltaserve.text.tokenizer import TokenLimitExceeded


def to_chat_messages(messages: list[ChatMessageParam], images: RequestImages | None = None) -> list[ChatMessage]:
    """OpenAI messages -> the renderers' neutral messages; 400 for content this server cannot render. `image_url`
    parts of user messages are decoded into `images` (a 400 naming the part when there is none or it is bad)."""
    out = []
    for i, m in enumerate(messages):
        if m.content is None and m.role != "assistant":  # the spec makes content required (and not null) but there
            raise bad_request(f"a {m.role} message needs content (a string or a list of content parts)",
                              param=f"messages.{i}.content")
        content, slots = _content(m.content, param=f"messages.{i}.content",
                                  images=images if m.role == "user" else None)
        if slots:
            out.append(ChatMessage(role="user", content=content, name=m.name, images=slots))
        elif m.role == "tool":
            if not m.tool_call_id:
                raise bad_request("a tool message needs tool_call_id", param=f"messages.{i}.tool_call_id")
            out.append(ChatMessage(role="tool", content=content, tool_call_id=m.tool_call_id, name=m.name))
        elif m.role == "assistant":
            calls = tuple(ToolCall(id=c.id, name=c.function.name, arguments=c.function.arguments)
                          for c in m.tool_calls or ())
            out.append(ChatMessage(role="assistant", content=content, name=m.name, tool_calls=calls,
                                   reasoning=m.reasoning_content or m.reasoning))
        else:
            out.append(ChatMessage(role="system" if m.role == "developer" else m.role, content=content, name=m.name))
    return out


def _content(content: Any, *, param: str, images: RequestImages | None) -> tuple[str, tuple[ImageSlot, ...]]:
    """The text of a message's content and, with `images` (user messages), its image parts placed in it."""
    if content is None or isinstance(content, str):
        return content or "", ()
    parts: list[str] = []
    slots: list[ImageSlot] = []
    for j, part in enumerate(content):
        if part.type == "image_url" and images is not None:
            if part.image_url is None or not part.image_url.url:
                raise bad_request("an image_url part needs image_url.url", param=f"{param}.{j}.image_url")
            slot = images.add_url(part.image_url.url, param=f"{param}.{j}.image_url")
            slots.append(ImageSlot(position=sum(map(len, parts)), num_tokens=slot.num_tokens))
            continue
        if part.type != "text" or part.text is None:
            supported = "'text' and 'image_url'" if images is not None else "'text'"
            raise bad_request(f"content part type {part.type!r} is not supported here (only {supported})",
                              param=f"{param}.{j}.type")
        parts.append(part.text)
    return "".join(parts), tuple(slots)


def prompt_chars(messages: list[ChatMessageParam]) -> int:
    """Characters of the messages' content: text the prompt holds verbatim (for `Frontend.check_text_length`)."""
    total = 0
    for m in messages:
        if isinstance(m.content, str):
            total += len(m.content)
        elif m.content is not None:
            total += sum(len(part.text or "") for part in m.content)
    return total


def check_prompt_length(frontend: Frontend, body: ChatCompletionRequest) -> None:
    """The cheap length check before rendering (not with truncate_prompt_tokens, which makes a long prompt fit)."""
    if body.truncate_prompt_tokens is None:
        frontend.check_text_length(prompt_chars(body.messages), param="messages")


def render_chat_prompt(frontend: Frontend, body: ChatCompletionRequest, max_tokens: int | None = None
                       ) -> RenderedPrompt:
    """Validate a chat request's messages, tools, tool_choice and formats and render its prompt (shared by
    /v1/chat/completions and /tokenize); a prompt of more than `max_tokens` is `Frontend.prompt_too_long`."""
    fmt = frontend.chat_format
    frontend.check_model(body.model)
    tools = [ToolSpec(name=t.function.name, description=t.function.description or "",
                      parameters=t.function.parameters or {"type": "object", "properties": {}})
             for t in body.tools or ()]
    requested = body.tool_choice or ("auto" if tools else "none")
    forced = None
    if isinstance(requested, NamedToolChoice):
        forced = requested.function.name
        if forced not in {t.name for t in tools}:
            raise bad_request(f"tool_choice names the function {forced!r}, which is not in tools",
                              param="tool_choice")
    elif requested == "required" and not tools:
        raise bad_request("tool_choice 'required' needs at least one tool", param="tool_choice")
    choice: str = forced if forced is not None else str(requested)
    kwargs = body.chat_template_kwargs or {}
    # A prefill continues the answer: thinking is off unless asked for (which the formats then refuse).
    thinking = kwargs.get("thinking", kwargs.get("enable_thinking",
                                                 fmt.default_thinking and not body.continue_final_message))
    if not isinstance(thinking, bool):
        raise bad_request("chat_template_kwargs.thinking must be a boolean", param="chat_template_kwargs")
    effort, source = body.reasoning_effort, "reasoning_effort"
    if effort is None:
        effort, source = kwargs.get("thinking_effort"), "chat_template_kwargs"
    if effort is not None and effort not in THINKING_EFFORTS:
        raise bad_request(f"{source} thinking effort must be one of {', '.join(THINKING_EFFORTS)}, got "
                          f"{effort!r:.40}", param=source)
    forcing = choice == "required" or forced is not None
    declared, extra = _response_format(body.response_format), body.structured_extra()
    if declared is not None and extra is not None:
        raise bad_request("give either response_format or structured_outputs, not both", param="structured_outputs")
    answer = extra or declared
    if forcing and answer is not None:
        # vLLM's rule too: the forced call's grammar and an answer format cannot both constrain one output.
        raise bad_request("response_format / structured_outputs cannot be combined with a tool_choice that "
                          "forces a tool call", param="structured_outputs" if extra else "response_format")
    if body.continue_final_message and (forcing or answer is not None):
        raise bad_request("a continued assistant message cannot also be constrained by a forced tool call or a "
                          "response format (the grammar would start mid-answer)", param="continue_final_message")
    try:
        # The format declares what the request set in the prompt as its template does (K3: internal messages;
        # "none" only when the client sent it); vLLM's structured_outputs only constrain the sampler.
        images = RequestImages(frontend.images)
        prompt_ids = fmt.render(to_chat_messages(body.messages, images), tools=tools, thinking=thinking,
                                add_generation_prompt=body.add_generation_prompt,
                                tool_choice=choice if body.tool_choice is not None else None,
                                response_format=declared, thinking_effort=effort,
                                continue_final_message=body.continue_final_message, max_tokens=max_tokens)
    except TokenLimitExceeded:
        raise frontend.prompt_too_long(param="messages") from None
    except ValueError as exc:
        param = "continue_final_message" if body.continue_final_message else "messages"
        raise bad_request(str(exc), param=param) from exc
    return RenderedPrompt(prompt_ids=prompt_ids, tools=tools, forced=forced, forcing=forcing, thinking=thinking,
                          answer=answer, tools_active=bool(tools) and choice != "none",
                          images=images.place(prompt_ids))


class ChatPlan:
    """Everything decided before generation: prompt ids, sampling params, parser settings."""

    def __init__(self, frontend: Frontend, body: ChatCompletionRequest) -> None:
        fmt = frontend.chat_format
        prompt = render_chat_prompt(frontend, body, frontend.render_limit(body.truncate_prompt_tokens))
        self.prompt_ids, self.thinking, self.tools_active = prompt.prompt_ids, prompt.thinking, prompt.tools_active
        self.images = prompt.images
        if body.truncate_prompt_tokens is not None and self.images:
            raise bad_request("truncate_prompt_tokens cannot be used with images (the cut could fall inside one)",
                              param="truncate_prompt_tokens")
        if body.truncate_prompt_tokens is not None:
            self.prompt_ids = self.prompt_ids[-frontend.truncation(body.truncate_prompt_tokens):]
        self.show_reasoning = prompt.thinking and body.include_reasoning
        self.tokens_as_ids = body.return_tokens_as_token_ids
        self.priority = frontend.check_priority(body.priority)
        requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        max_tokens = frontend.resolve_max_tokens(
            len(self.prompt_ids), requested,
            param="max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens")
        structured = None
        if prompt.forcing:
            structured = fmt.tool_call_grammar(prompt.tools, name=prompt.forced, parallel=body.parallel_tool_calls,
                                               thinking=prompt.thinking)
            frontend.validate_tool_grammar(prompt.tools, structured, param="tools", name=prompt.forced)
        elif prompt.answer is not None:
            frontend.validate_structured(prompt.answer, param="response_format")
            structured = fmt.constrain(prompt.answer, thinking=prompt.thinking)
        if body.top_logprobs is not None and not body.logprobs:
            raise bad_request("top_logprobs needs logprobs set to true", param="top_logprobs")
        if body.top_logprobs is not None and not 0 <= body.top_logprobs <= 20:
            raise bad_request(f"top_logprobs must be between 0 and 20, got {body.top_logprobs}", param="top_logprobs")
        self.params: SamplingParams = body.sampling_params(
            max_tokens=max_tokens, logprobs=(body.top_logprobs or 0) if body.logprobs else None,
            max_n=frontend.config.max_n, vocab_size=frontend.client.info.vocab_size, structured=structured,
            bad_words_token_ids=frontend.bad_words_token_ids(body.bad_words),
            max_stop=frontend.config.max_stop_sequences)

    def processors(self, frontend: Frontend):  # noqa: ANN201 - a SequenceProcessor factory
        return chat_processors(frontend, thinking=self.thinking, tools=self.tools_active)

    @classmethod
    async def make(cls, frontend: Frontend, body: ChatCompletionRequest) -> ChatPlan:
        """The plan, rendered and validated off the event loop after the cheap length check."""
        check_prompt_length(frontend, body)
        return await frontend.offload(cls, frontend, body)


def _response_format(rf: ResponseFormat | None) -> StructuredOutput | None:
    """The OpenAI `response_format` as a constraint; None for absent or "text"."""
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return StructuredOutput("json_object")
    if rf.json_schema is None or rf.json_schema.schema_ is None:
        raise bad_request("response_format json_schema needs json_schema.schema", param="response_format")
    return StructuredOutput("json_schema", json.dumps(rf.json_schema.schema_))


async def chat_completion(frontend: Frontend, body: ChatCompletionRequest) -> dict[str, Any]:
    """The non-streaming response body."""
    plan = await ChatPlan.make(frontend, body)
    frontend.check_capacity(plan.params.n)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    acc = ChoiceAccumulator(plan.params.n, hide_reasoning=plan.thinking and not plan.show_reasoning)
    stream = frontend.generate(request_id, plan.prompt_ids, plan.params, plan.processors(frontend),
                               priority=plan.priority, session_id=body.user,
                               kv_transfer_params=body.kv_transfer_params, images=plan.images)
    async for update in stream:
        acc.add(update)
    choices = []
    for i in range(plan.params.n):
        c = acc.choices[i]
        message: dict[str, Any] = {"role": "assistant", "content": c.content if c.content or not c.tool_calls
                                   else None, "refusal": None}
        if plan.show_reasoning:
            message["reasoning_content"] = c.reasoning
        if c.tool_calls:
            message["tool_calls"] = [{"id": t.id, "type": "function",
                                      "function": {"name": t.name, "arguments": t.arguments}}
                                     for t in c.tool_calls]
        choices.append({
            "index": i, "message": message,
            "logprobs": {"content": chat_logprobs(frontend.tokenizer, c.logprobs, plan.tokens_as_ids), "refusal": None}
            if plan.params.logprobs is not None else None,
            "finish_reason": _finish(c.finish_reason, bool(c.tool_calls)),
        })
    response = {"id": request_id, "object": "chat.completion", "created": int(time.time()),
                "model": frontend.model_name, "choices": choices, "usage": acc.usage(len(plan.prompt_ids))}
    if body.prompt_logprobs is not None:  # vLLM puts the prompt's logprobs beside the choices (one prompt)
        response["prompt_logprobs"] = vllm_prompt_logprobs(frontend.tokenizer, acc.choices[0].prompt_logprobs or [])
    if acc.kv_transfer_params is not None:
        response["kv_transfer_params"] = acc.kv_transfer_params
    return response


async def chat_completion_stream(frontend: Frontend, body: ChatCompletionRequest) -> AsyncIterator[str]:
    """Validate now (errors become HTTP errors), then return the SSE event stream."""
    if body.prompt_logprobs is not None:
        raise bad_request("prompt_logprobs is not supported when streaming (as in vLLM)", param="prompt_logprobs")
    plan = await ChatPlan.make(frontend, body)
    frontend.check_capacity(plan.params.n)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    stream = frontend.stream(request_id, frontend.generate(request_id, plan.prompt_ids, plan.params,
                                                           plan.processors(frontend), priority=plan.priority,
                                                           session_id=body.user,
                                                           kv_transfer_params=body.kv_transfer_params,
                                                           images=plan.images))
    usage_mode = body.stream_options.usage_mode() if body.stream_options else None
    return _events(frontend, plan, request_id, stream, usage_mode)


async def _events(frontend: Frontend, plan: ChatPlan, request_id: str, stream: AsyncGenerator[SequenceUpdate, None],
                  usage_mode: str | None) -> AsyncIterator[str]:
    created = int(time.time())
    hidden = plan.thinking and not plan.show_reasoning
    acc = ChoiceAccumulator(plan.params.n, hide_reasoning=hidden)
    started = [False] * plan.params.n

    def chunk(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> str:
        body: dict[str, Any] = {"id": request_id, "object": "chat.completion.chunk", "created": created,
                                "model": frontend.model_name, "choices": choices}
        if usage_mode is not None:  # continuous: this choice's own count so far, as vLLM reports it
            body["usage"] = usage if usage or usage_mode == "final" else acc.usage(len(plan.prompt_ids),
                                                                                   choices[0]["index"])
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    try:
        async for update in stream:
            acc.add(update)
            delta: dict[str, Any] = {}
            if update.delta.reasoning and plan.show_reasoning:
                delta["reasoning_content"] = update.delta.reasoning
            if update.delta.content:
                delta["content"] = update.delta.content
            if update.delta.tool_calls:
                delta["tool_calls"] = _tool_call_deltas(update)
            send_logprobs = (plan.params.logprobs is not None and any(lp is not None for lp in update.logprobs)
                             and not (hidden and update.delta.reasoning))
            if not delta and update.finish_reason is None and not send_logprobs:
                continue  # no empty chunks, except to carry the logprobs of tokens without text
            if not started[update.index]:
                started[update.index] = True
                delta = {"role": "assistant", **delta}
            choice: dict[str, Any] = {"index": update.index, "delta": delta, "logprobs": None, "finish_reason": None}
            if send_logprobs:
                choice["logprobs"] = {"content": chat_logprobs(frontend.tokenizer, update.logprobs,
                                                               plan.tokens_as_ids), "refusal": None}
            if update.finish_reason is not None:
                c = acc.choices[update.index]
                choice["finish_reason"] = _finish(update.finish_reason, bool(c.tool_calls))
            yield chunk([choice])
        if usage_mode is not None:
            yield chunk([], acc.usage(len(plan.prompt_ids)))
    except Exception as exc:  # noqa: BLE001 - after the headers went out, an error can only be an event
        err = frontend.stream_error(exc)
        yield err.openai_event()
    finally:
        await stream.aclose()  # aborts sequences still running when the client went away mid-stream
    yield "data: [DONE]\n\n"


def _tool_call_deltas(update: SequenceUpdate) -> list[dict[str, Any]]:
    merged: dict[int, dict[str, Any]] = {}
    for d in update.delta.tool_calls:
        entry = merged.setdefault(d.index, {"index": d.index, "function": {"arguments": ""}})
        if d.id is not None:
            entry["id"], entry["type"] = d.id, "function"
        if d.name is not None:
            entry["function"]["name"] = d.name
        entry["function"]["arguments"] += d.arguments
    return list(merged.values())


def _finish(reason: str | None, has_tool_calls: bool) -> str | None:
    if reason == "stop" and has_tool_calls:
        return "tool_calls"
    return reason
