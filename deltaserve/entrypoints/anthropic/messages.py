"""POST /v1/messages: the Anthropic Messages API over the same frontend as the OpenAI routes.

Streaming sends Anthropic's event sequence: message_start, then per content block (thinking, text, tool_use, in
the order the model produced them) content_block_start / content_block_delta (thinking_delta, text_delta,
input_json_delta) / content_block_stop, then message_delta (stop_reason, usage) and message_stop.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from deltaserve.chat.media import ImageSlot
from deltaserve.chat.messages import ChatMessage, ToolSpec
from deltaserve.engine.output_processor import SequenceUpdate
from deltaserve.entrypoints.anthropic.protocol import ContentBlock, CountTokensRequest, MessagesRequest
from deltaserve.entrypoints.server.accumulate import ChoiceAccumulator
from deltaserve.entrypoints.server.errors import bad_request
from deltaserve.entrypoints.server.frontend import Frontend, chat_processors
from deltaserve.entrypoints.server.images import RequestImages
from deltaserve.entrypoints.server.prompt import RenderedPrompt
from deltaserve.parsers.types import ToolCall
from deltaserve.sampling_params import SamplingParams, StructuredOutput
from deltaserve.text.tokenizer import TokenLimitExceeded

_STOP_REASONS = {"length": "max_tokens", "abort": "end_turn"}


def _block_text(blocks: str | list[ContentBlock] | None, param: str) -> str:
    if blocks is None or isinstance(blocks, str):
        return blocks or ""
    out = []
    for i, b in enumerate(blocks):
        if b.type != "text" or b.text is None:
            raise bad_request(f"{param}.{i}: only text blocks are supported here, got {b.type!r}")
        out.append(b.text)
    return "".join(out)


def to_chat_messages(body: CountTokensRequest, images: RequestImages | None = None) -> list[ChatMessage]:
    """Anthropic system + messages -> the renderers' neutral messages (tool_result blocks become tool messages);
    `image` blocks of user messages are decoded into `images` (a 400 naming the block when there is none or it is
    bad)."""
    out = []
    if body.system:
        out.append(ChatMessage(role="system", content=_block_text(body.system, "system")))
    for i, m in enumerate(body.messages):
        if isinstance(m.content, str):
            out.append(ChatMessage(role=m.role, content=m.content))
            continue
        texts, reasoning, calls = [], [], []
        slots: list[ImageSlot] = []
        for j, b in enumerate(m.content):
            where = f"messages.{i}.content.{j}"
            if b.type == "text" and b.text is not None:
                texts.append(b.text)
            elif b.type == "image" and m.role == "user" and images is not None:
                slot = _image(b, where, images)
                slots.append(ImageSlot(position=sum(map(len, texts)), num_tokens=slot.num_tokens))
            elif b.type == "tool_result" and m.role == "user":
                if not b.tool_use_id:
                    raise bad_request(f"{where}: tool_result needs tool_use_id")
                out.append(ChatMessage(role="tool", tool_call_id=b.tool_use_id,
                                       content=_block_text(b.content, f"{where}.content")))
            elif b.type == "tool_use" and m.role == "assistant":
                if not b.id or not b.name:
                    raise bad_request(f"{where}: tool_use needs id and name")
                calls.append(ToolCall(id=b.id, name=b.name, arguments=json.dumps(b.input or {}, ensure_ascii=False)))
            elif b.type == "thinking" and m.role == "assistant":
                reasoning.append(b.thinking or "")
            elif b.type == "redacted_thinking":
                continue
            else:
                raise bad_request(f"{where}: content block type {b.type!r} is not supported in a {m.role} message")
        if m.role == "assistant":
            out.append(ChatMessage(role="assistant", content="".join(texts), tool_calls=tuple(calls),
                                   reasoning="".join(reasoning) if reasoning else None))
        elif texts or slots:
            out.append(ChatMessage(role="user", content="".join(texts), images=tuple(slots)))
    return out


def _image(block: ContentBlock, where: str, images: RequestImages) -> ImageSlot:
    source = block.source
    if source is None:
        raise bad_request(f"{where}: an image block needs a source", param=f"{where}.source")
    if source.type == "base64" and source.data is not None:
        return images.add_base64(source.data, param=f"{where}.source")
    if source.type == "url" and source.url:
        return images.add_url(source.url, param=f"{where}.source")
    raise bad_request(f"{where}: an image source is {{type: base64, media_type, data}} or {{type: url, url}}",
                      param=f"{where}.source")


def render_messages_prompt(frontend: Frontend, body: CountTokensRequest, max_tokens: int | None = None
                           ) -> RenderedPrompt:
    """Validate a Messages request's tools, tool_choice, thinking and output format and render its prompt (shared
    by /v1/messages and /v1/messages/count_tokens); a prompt of more than `max_tokens` is
    `Frontend.prompt_too_long`."""
    fmt = frontend.chat_format
    frontend.check_model(body.model)
    for i, t in enumerate(body.tools or ()):
        if t.input_schema is None:
            raise bad_request(f"tools.{i}.input_schema: Field required")
    tools = [ToolSpec(name=t.name, description=t.description or "", parameters=t.input_schema or {})
             for t in body.tools or ()]
    tc = body.tool_choice
    choice, forced = ("auto" if tools else "none"), None
    if tc is not None:
        if tc.type == "tool":
            if not tc.name or tc.name not in {t.name for t in tools}:
                raise bad_request(f"tool_choice names the tool {tc.name!r}, which is not in tools")
            choice = forced = tc.name
        elif tc.type == "any":
            if not tools:
                raise bad_request("tool_choice 'any' needs at least one tool")
            choice = "required"
        else:
            choice = tc.type
    # A last assistant message is a prefill (the answer continues it): thinking off unless asked for.
    prefill = body.messages[-1].role == "assistant"
    thinking = fmt.default_thinking and not prefill if body.thinking is None else body.thinking.type != "disabled"
    forcing = choice == "required" or forced is not None
    answer = None
    if body.output_config is not None and body.output_config.format is not None:
        if forcing:
            raise bad_request("output_config.format cannot be combined with a tool_choice that forces a tool call")
        answer = StructuredOutput("json_schema", json.dumps(body.output_config.format.schema_))
    if prefill and (forcing or answer is not None):
        raise bad_request("a prefilled assistant message cannot also be constrained by a forced tool call or an "
                          "output format")
    try:
        images = RequestImages(frontend.images)
        prompt_ids = fmt.render(to_chat_messages(body, images), tools=tools, thinking=thinking,
                                tool_choice=choice if tc is not None else None, response_format=answer,
                                add_generation_prompt=not prefill, continue_final_message=prefill,
                                max_tokens=max_tokens)
    except TokenLimitExceeded:
        raise frontend.prompt_too_long(param="messages") from None
    except ValueError as exc:
        raise bad_request(str(exc)) from exc
    return RenderedPrompt(prompt_ids=prompt_ids, tools=tools, forced=forced, forcing=forcing, thinking=thinking,
                          answer=answer, tools_active=bool(tools) and choice != "none",
                          images=images.place(prompt_ids))


def _chars(blocks: str | list[ContentBlock] | None) -> int:
    if blocks is None or isinstance(blocks, str):
        return len(blocks or "")
    return sum(len(b.text or "") + _chars(b.content) for b in blocks)


def check_prompt_length(frontend: Frontend, body: CountTokensRequest) -> None:
    """The cheap length check before rendering: the system prompt's and messages' text (and tool results) is in
    the prompt verbatim (`Frontend.check_text_length`)."""
    frontend.check_text_length(_chars(body.system) + sum(_chars(m.content) for m in body.messages),
                               param="messages")


class MessagesPlan:
    """Prompt ids and sampling params of one /v1/messages request."""

    def __init__(self, frontend: Frontend, body: MessagesRequest) -> None:
        fmt = frontend.chat_format
        prompt = render_messages_prompt(frontend, body, frontend.render_limit(None))
        self.prompt_ids, self.thinking, self.tools_active = prompt.prompt_ids, prompt.thinking, prompt.tools_active
        self.images = prompt.images
        if body.max_tokens < 1:
            raise bad_request(f"max_tokens must be at least 1, got {body.max_tokens}")
        max_tokens = frontend.resolve_max_tokens(len(self.prompt_ids), body.max_tokens)
        structured = None
        if prompt.forcing:
            tc = body.tool_choice
            parallel = not (tc is not None and tc.disable_parallel_tool_use)
            structured = fmt.tool_call_grammar(prompt.tools, name=prompt.forced, parallel=parallel,
                                               thinking=prompt.thinking)
            frontend.validate_tool_grammar(prompt.tools, structured, param="tools", name=prompt.forced)
        elif prompt.answer is not None:
            frontend.validate_structured(prompt.answer, param="output_config.format")
            structured = fmt.constrain(prompt.answer, thinking=prompt.thinking)
        stop = tuple(body.stop_sequences or ())
        if len(stop) > frontend.config.max_stop_sequences:
            raise bad_request(f"stop_sequences has {len(stop)} strings; the server accepts at most "
                              f"{frontend.config.max_stop_sequences} (--max-stop-sequences)")
        values: dict[str, Any] = {"max_tokens": max_tokens, "stop": stop, "structured": structured}
        for name in ("temperature", "top_p", "top_k"):
            if getattr(body, name) is not None:
                values[name] = getattr(body, name)
        try:
            self.params = SamplingParams(**values)
        except ValueError as exc:
            raise bad_request(str(exc)) from exc

    def processors(self, frontend: Frontend):  # noqa: ANN201 - a SequenceProcessor factory
        return chat_processors(frontend, thinking=self.thinking, tools=self.tools_active)

    @classmethod
    async def make(cls, frontend: Frontend, body: MessagesRequest) -> MessagesPlan:
        """The plan, rendered and validated off the event loop after the cheap length check."""
        check_prompt_length(frontend, body)
        return await frontend.offload(cls, frontend, body)


def _stop_reason(reason: str | None, stop_string: str | None, has_tool_calls: bool) -> str:
    if stop_string is not None:
        return "stop_sequence"
    if reason == "stop":
        return "tool_use" if has_tool_calls else "end_turn"
    return _STOP_REASONS.get(reason or "", "end_turn")


def _tool_input(arguments: str) -> dict[str, Any] | None:
    try:
        value = json.loads(arguments or "{}")
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


async def create_message(frontend: Frontend, body: MessagesRequest) -> dict[str, Any]:
    plan = await MessagesPlan.make(frontend, body)
    frontend.check_capacity(1)
    message_id = f"msg_{uuid.uuid4().hex}"
    acc = ChoiceAccumulator(1)
    async for update in frontend.generate(message_id, plan.prompt_ids, plan.params, plan.processors(frontend),
                                          session_id=body.session_id(), kv_transfer_params=body.kv_transfer_params,
                                          images=plan.images):
        acc.add(update)
    c = acc.choices[0]
    content: list[dict[str, Any]] = []
    if plan.thinking and c.reasoning:
        content.append({"type": "thinking", "thinking": c.reasoning, "signature": ""})
    text = c.content
    calls = []
    for call in c.tool_calls:
        args = _tool_input(call.arguments)
        if args is None:  # unparsable arguments degrade to text
            text += call.arguments
        else:
            calls.append({"type": "tool_use", "id": call.id, "name": call.name, "input": args})
    if text:
        content.append({"type": "text", "text": text})
    content += calls
    response = {"id": message_id, "type": "message", "role": "assistant", "model": frontend.model_name,
                "content": content, "stop_reason": _stop_reason(c.finish_reason, c.stop_string, bool(calls)),
                "stop_sequence": c.stop_string,
                "usage": {"input_tokens": len(plan.prompt_ids), "output_tokens": len(c.token_ids),
                          "cache_read_input_tokens": acc.num_cached_tokens}}
    if acc.kv_transfer_params is not None:
        response["kv_transfer_params"] = acc.kv_transfer_params
    return response


async def create_message_stream(frontend: Frontend, body: MessagesRequest) -> AsyncIterator[str]:
    plan = await MessagesPlan.make(frontend, body)
    frontend.check_capacity(1)
    message_id = f"msg_{uuid.uuid4().hex}"
    stream = frontend.stream(message_id, frontend.generate(message_id, plan.prompt_ids, plan.params,
                                                           plan.processors(frontend), session_id=body.session_id(),
                                                           kv_transfer_params=body.kv_transfer_params,
                                                           images=plan.images))
    return _events(frontend, plan, message_id, stream)


def _event(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"


class _Blocks:
    """The open content block of a streamed message; a new channel (or tool call) closes it and opens another."""

    def __init__(self) -> None:
        self.index = -1
        self.key: tuple[str, int] | None = None

    def switch(self, key: tuple[str, int], start: dict[str, Any]) -> list[str]:
        if self.key == key:
            return []
        events = self.close()
        self.index += 1
        self.key = key
        return [*events, _event("content_block_start", {"index": self.index, "content_block": start})]

    def close(self) -> list[str]:
        if self.key is None:
            return []
        self.key = None
        return [_event("content_block_stop", {"index": self.index})]


async def _events(frontend: Frontend, plan: MessagesPlan, message_id: str,
                  stream: AsyncGenerator[SequenceUpdate, None]) -> AsyncIterator[str]:
    yield _event("message_start", {"message": {
        "id": message_id, "type": "message", "role": "assistant", "model": frontend.model_name, "content": [],
        "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": len(plan.prompt_ids), "output_tokens": 0}}})
    blocks = _Blocks()
    acc = ChoiceAccumulator(1)
    try:
        async for update in stream:
            acc.add(update)
            d = update.delta
            if d.reasoning:
                for e in blocks.switch(("thinking", 0), {"type": "thinking", "thinking": "", "signature": ""}):
                    yield e
                yield _event("content_block_delta", {"index": blocks.index,
                                                     "delta": {"type": "thinking_delta", "thinking": d.reasoning}})
            if d.content:
                for e in blocks.switch(("text", 0), {"type": "text", "text": ""}):
                    yield e
                yield _event("content_block_delta", {"index": blocks.index,
                                                     "delta": {"type": "text_delta", "text": d.content}})
            # Tool calls are sent when the output ends (they end it in practice): only then is it known whether
            # a call's arguments parse, and unparsable ones become text, as in the non-streamed message.
        c = acc.choices[0]
        calls = [(call, _tool_input(call.arguments)) for call in c.tool_calls]
        broken = "".join(call.arguments for call, args in calls if args is None)
        if broken:
            for e in blocks.switch(("text", 1), {"type": "text", "text": ""}):
                yield e
            yield _event("content_block_delta", {"index": blocks.index, "delta": {"type": "text_delta",
                                                                                   "text": broken}})
        for i, (call, args) in enumerate(calls):
            if args is None:
                continue
            for e in blocks.switch(("tool_use", i), {"type": "tool_use", "id": call.id, "name": call.name,
                                                     "input": {}}):
                yield e
            yield _event("content_block_delta", {"index": blocks.index, "delta": {
                "type": "input_json_delta", "partial_json": json.dumps(args, ensure_ascii=False)}})
        for e in blocks.close():
            yield e
        parsed = any(args is not None for _, args in calls)
        yield _event("message_delta", {
            "delta": {"stop_reason": _stop_reason(c.finish_reason, c.stop_string, parsed),
                      "stop_sequence": c.stop_string},
            "usage": {"output_tokens": len(c.token_ids)}})
        yield _event("message_stop", {})
    except Exception as exc:  # noqa: BLE001 - after the headers went out, an error can only be an event
        err = frontend.stream_error(exc)
        yield err.anthropic_event()
    finally:
        await stream.aclose()  # aborts the sequence when the client went away mid-stream


async def count_tokens(frontend: Frontend, body: CountTokensRequest) -> dict[str, Any]:
    """POST /v1/messages/count_tokens: the prompt's token count, rendered exactly as /v1/messages would."""
    check_prompt_length(frontend, body)
    return {"input_tokens": len((await frontend.offload(render_messages_prompt, frontend, body)).prompt_ids)}
