"""vLLM's POST /tokenize and /detokenize: the token ids of a text prompt or of the prompt a chat request renders,
and the text of token ids, with the server's own tokenizer and chat format."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Discriminator, Tag, TypeAdapter

from deltaserve.entrypoints.openai.chat import render_chat_prompt
from deltaserve.entrypoints.openai.protocol import DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest
from deltaserve.entrypoints.server.frontend import Frontend

TOKENIZE_REQUEST: TypeAdapter[TokenizeChatRequest | TokenizeCompletionRequest] = TypeAdapter(Annotated[
    Annotated[TokenizeChatRequest, Tag("Chat")] | Annotated[TokenizeCompletionRequest, Tag("Text")],
    Discriminator(lambda body: "Chat" if isinstance(body, dict) and "messages" in body else "Text"),
])
"""A body with `messages` is a chat request, any other a text prompt (so errors name that kind's fields)."""


async def tokenize(frontend: Frontend, body: TokenizeChatRequest | TokenizeCompletionRequest) -> dict[str, Any]:
    """`{"count", "max_model_len", "tokens", "token_strs"}` as vLLM answers (token_strs only when asked)."""
    if isinstance(body, TokenizeChatRequest):  # rendered and tokenized off the event loop (a body of megabytes)
        ids = (await frontend.offload(render_chat_prompt, frontend, body)).prompt_ids
    else:
        frontend.check_model(body.model)
        ids = await frontend.offload(frontend.tokenizer.encode, body.prompt)
    if body.truncate_prompt_tokens is not None:  # as the generation routes would
        ids = ids[-frontend.truncation(body.truncate_prompt_tokens):]
    strs = [frontend.tokenizer.id_to_token(i) or "" for i in ids] if body.return_token_strs else None
    return {"count": len(ids), "max_model_len": frontend.max_model_len, "tokens": ids, "token_strs": strs}


async def detokenize(frontend: Frontend, body: DetokenizeRequest) -> dict[str, Any]:
    """`{"prompt": text}` (empty for no ids); ids outside the vocabulary are a 400 naming `tokens`."""
    frontend.check_model(body.model)
    ids = frontend.check_prompt_ids(body.tokens, param="tokens") if body.tokens else []
    return {"prompt": frontend.tokenizer.decode(ids)}
