"""POST /v1/completions: one prompt or a batch (text or token ids), streamed or not; choice i*n+j = prompt i, seq j."""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, cast

import msgspec

from deltaserve.engine.output_processor import SequenceUpdate, TextProcessor, merge
from deltaserve.entrypoints.openai.logprobs import (
    char_len,
    completion_logprobs,
    echo_prompt_logprobs,
    vllm_prompt_logprobs,
)
from deltaserve.entrypoints.openai.protocol import CompletionRequest
from deltaserve.entrypoints.server.accumulate import ChoiceAccumulator
from deltaserve.entrypoints.server.errors import bad_request
from deltaserve.entrypoints.server.frontend import Frontend
from deltaserve.sampling_params import SamplingParams


class CompletionPlan:
    """Prompt ids and sampling params of every prompt in the request."""

    def __init__(self, frontend: Frontend, body: CompletionRequest) -> None:
        frontend.check_model(body.model)
        if body.suffix:
            raise bad_request("suffix is not supported", param="suffix")
        if body.best_of is not None and body.best_of != body.n:
            raise bad_request("best_of other than n is not supported", param="best_of")
        if body.logprobs is not None and not 0 <= body.logprobs <= 20:
            raise bad_request(f"logprobs must be between 0 and 20, got {body.logprobs}", param="logprobs")
        prompts = _prompt_list(body.prompt)
        if not prompts:
            raise bad_request("prompt is empty", param="prompt")
        self.prompts: list[list[int]] = []
        self.texts: list[str] = []
        for p in prompts:
            ids = (frontend.encode_prompt(p, truncate_prompt_tokens=body.truncate_prompt_tokens) if isinstance(p, str)
                   else frontend.check_prompt_ids(p))
            if body.truncate_prompt_tokens is not None:
                ids = ids[-frontend.truncation(body.truncate_prompt_tokens):]
            if not ids:
                raise bad_request("prompt is empty", param="prompt")
            self.prompts.append(ids)
            untouched = isinstance(p, str) and body.truncate_prompt_tokens is None
            self.texts.append(p if untouched and isinstance(p, str) else frontend.tokenizer.decode(ids))  # for echo
        bad_words = frontend.bad_words_token_ids(body.bad_words)
        # OpenAI's echo with logprobs returns the prompt's logprobs too (how evaluation harnesses score text)
        echo_logprobs = body.logprobs if body.echo and body.logprobs is not None else None
        structured = body.structured_extra()
        if structured is not None:
            frontend.validate_structured(structured, param="structured_outputs")
        self.params: list[SamplingParams] = []
        for ids in self.prompts:
            if body.max_tokens is None:  # OpenAI's default for completions: 16, within the context
                max_tokens = min(16, frontend.resolve_max_tokens(len(ids), None, prompt_param="prompt"))
            else:
                max_tokens = frontend.resolve_max_tokens(len(ids), body.max_tokens, prompt_param="prompt")
            self.params.append(body.sampling_params(max_tokens=max_tokens, logprobs=body.logprobs,
                                                    max_n=frontend.config.max_n,
                                                    vocab_size=frontend.client.info.vocab_size,
                                                    structured=structured, bad_words_token_ids=bad_words,
                                                    prompt_logprobs=echo_logprobs,
                                                    max_stop=frontend.config.max_stop_sequences))
        self.n = body.n
        self.echo = body.echo
        self.priority = frontend.check_priority(body.priority)

    @classmethod
    async def make(cls, frontend: Frontend, body: CompletionRequest) -> CompletionPlan:
        """The plan, tokenized and validated off the event loop after the cheap length check of text prompts."""
        if body.truncate_prompt_tokens is None:
            for p in _prompt_list(body.prompt):
                if isinstance(p, str):
                    frontend.check_text_length(len(p), param="prompt")
        return await frontend.offload(cls, frontend, body)


async def _merge(streams: list[AsyncGenerator[SequenceUpdate, None]], n: int
                 ) -> AsyncGenerator[SequenceUpdate, None]:
    """Interleave the prompts' update streams, renumbering choices to prompt * n + index."""
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]) as only:
            async for u in only:
                yield u
        return
    async with contextlib.aclosing(merge(streams)) as merged:
        async for p, u in merged:
            yield msgspec.structs.replace(u, index=p * n + u.index)


def _start(frontend: Frontend, plan: CompletionPlan, request_id: str, body: CompletionRequest
           ) -> AsyncGenerator[SequenceUpdate, None]:
    frontend.check_capacity(plan.n * len(plan.prompts))
    if body.kv_transfer_params is not None and len(plan.prompts) != 1:
        raise bad_request("kv_transfer_params applies to a single prompt", param="kv_transfer_params")
    streams = [frontend.generate(f"{request_id}-p{p}", ids, params,
                                 lambda sp: TextProcessor(frontend.tokenizer, sp), priority=plan.priority,
                                 session_id=body.user, kv_transfer_params=body.kv_transfer_params)
               for p, (ids, params) in enumerate(zip(plan.prompts, plan.params, strict=True))]
    return _merge(streams, plan.n)


def _with_prompt(frontend: Frontend, prompt_ids: list[int], prompt_logprobs: list | None,
                 generated: dict[str, Any], as_ids: bool) -> dict[str, Any]:
    """Echoed logprobs: the prompt's tokens (the first without a logprob) before the generated ones."""
    prompt = echo_prompt_logprobs(frontend.tokenizer, prompt_ids, prompt_logprobs or [], as_ids)
    return {key: prompt[key] + generated[key] for key in generated}


async def completion(frontend: Frontend, body: CompletionRequest) -> dict[str, Any]:
    plan = await CompletionPlan.make(frontend, body)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    acc = ChoiceAccumulator(plan.n * len(plan.prompts))
    async for update in _start(frontend, plan, request_id, body):
        acc.add(update)
    choices = []
    for i, c in enumerate(acc.choices):
        prefix = plan.texts[i // plan.n] if plan.echo else ""
        choice: dict[str, Any] = {"index": i, "text": prefix + c.content, "finish_reason": c.finish_reason,
                  "stop_reason": c.stop_string, "logprobs": None}
        if body.logprobs is not None:
            choice["logprobs"] = completion_logprobs(frontend.tokenizer, c.logprobs, len(prefix),
                                                     body.return_tokens_as_token_ids)
            if plan.echo:
                choice["logprobs"] = _with_prompt(frontend, plan.prompts[i // plan.n], c.prompt_logprobs,
                                                  choice["logprobs"], body.return_tokens_as_token_ids)
        if body.prompt_logprobs is not None:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(frontend.tokenizer, c.prompt_logprobs or [])
        choices.append(choice)
    prompt_tokens = sum(len(p) for p in plan.prompts)
    response = {"id": request_id, "object": "text_completion", "created": int(time.time()),
                "model": frontend.model_name, "choices": choices, "usage": acc.usage(prompt_tokens)}
    if acc.kv_transfer_params is not None:
        response["kv_transfer_params"] = acc.kv_transfer_params
    return response


async def completion_stream(frontend: Frontend, body: CompletionRequest) -> AsyncIterator[str]:
    plan = await CompletionPlan.make(frontend, body)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    stream = frontend.stream(request_id, _start(frontend, plan, request_id, body))
    usage_mode = body.stream_options.usage_mode() if body.stream_options else None
    return _events(frontend, plan, body, request_id, stream, usage_mode)


async def _events(frontend: Frontend, plan: CompletionPlan, body: CompletionRequest, request_id: str,
                  stream: AsyncGenerator[SequenceUpdate, None], usage_mode: str | None) -> AsyncIterator[str]:
    created = int(time.time())
    acc = ChoiceAccumulator(plan.n * len(plan.prompts))
    prompt_tokens = sum(len(p) for p in plan.prompts)
    echoed: set[int] = set()
    offsets: dict[int, int] = {}  # text_offset of each choice's next token, counted over the chunks sent
    try:
        async for u in stream:
            acc.add(u)
            text = u.delta.content
            first = plan.echo and u.index not in echoed
            if first:
                echoed.add(u.index)
                text = plan.texts[u.index // plan.n] + text
            wants_logprobs = body.logprobs is not None and any(lp is not None for lp in u.logprobs)
            if not text and u.finish_reason is None and not wants_logprobs:
                continue  # tokens without text (special ones) still get their logprobs chunk
            logprobs = None
            if body.logprobs is not None:
                start = offsets.get(u.index, len(text) - len(u.delta.content))  # after an echoed prompt
                logprobs = completion_logprobs(frontend.tokenizer, u.logprobs, start,
                                               as_ids=body.return_tokens_as_token_ids)
                offsets[u.index] = start + sum(char_len(frontend.tokenizer.decode_bytes([t])) for t in u.token_ids)
                if first:
                    logprobs = _with_prompt(frontend, plan.prompts[u.index // plan.n], u.prompt_logprobs, logprobs,
                                            body.return_tokens_as_token_ids)
            choice = {"index": u.index, "text": text, "finish_reason": u.finish_reason, "stop_reason": u.stop_string,
                      "logprobs": logprobs}
            if body.prompt_logprobs is not None and u.prompt_logprobs is not None:
                choice["prompt_logprobs"] = vllm_prompt_logprobs(frontend.tokenizer, u.prompt_logprobs)
            event: dict[str, Any] = {"id": request_id, "object": "text_completion", "created": created,
                                     "model": frontend.model_name, "choices": [choice]}
            if usage_mode is not None:
                # continuous: this choice's own prompt and tokens so far, as vLLM reports them
                event["usage"] = (acc.usage(len(plan.prompts[u.index // plan.n]), u.index)
                                  if usage_mode == "continuous" else None)
            yield f"data: {json.dumps(event, ensure_ascii=False)}\n\n"
        if usage_mode is not None:
            event = {"id": request_id, "object": "text_completion", "created": created, "model": frontend.model_name,
                     "choices": [], "usage": acc.usage(prompt_tokens)}
            yield f"data: {json.dumps(event)}\n\n"
    except Exception as exc:  # noqa: BLE001 - after the headers went out, an error can only be an event
        err = frontend.stream_error(exc)
        yield err.openai_event()
    finally:
        await stream.aclose()  # aborts sequences still running when the client went away mid-stream
    yield "data: [DONE]\n\n"


def _prompt_list(prompt: str | list[int] | list[str] | list[list[int]]) -> list[str | list[int]]:
    """The API's `prompt` (one text, one token-id list, or a list of either) as a list of prompts."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt and isinstance(prompt[0], int):  # the element type tells the list's type
        return [prompt]
    return list(cast(list[str] | list[list[int]], prompt))
