"""OpenAI logprobs objects from the sampler's `TokenLogprobs` (chat: `content` entries; completions: legacy lists)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from deltaserve.text.tokenizer import Tokenizer


def _token(tokenizer: Tokenizer, token_id: int, as_id: bool = False) -> tuple[str, list[int]]:
    """(the token's text, its bytes); with `as_id`, vLLM's `return_tokens_as_token_ids` text "token_id:N"."""
    raw = tokenizer.decode_bytes([token_id])
    text = f"token_id:{token_id}" if as_id else raw.decode("utf-8", errors="replace")
    return text, list(raw)


def char_len(raw: Sequence[int] | bytes) -> int:
    """Characters a token's UTF-8 bytes add to the text: every byte that does not continue a character. A character
    split over two tokens counts once (decoding each token alone would count two replacement characters), so text
    offsets stay on the text."""
    return sum(1 for b in raw if b & 0xC0 != 0x80)


def chat_logprobs(tokenizer: Tokenizer, entries: Sequence[Any], as_ids: bool = False) -> list[dict[str, Any]]:
    """`[{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]`, one per token with logprobs; tokens
    as "token_id:N" with `as_ids`."""
    out = []
    for lp in entries:
        if lp is None:
            continue
        text, raw = _token(tokenizer, lp.token_id, as_ids)
        top = []
        for tid, value in lp.top:
            t, b = _token(tokenizer, tid, as_ids)
            top.append({"token": t, "logprob": value, "bytes": b})
        out.append({"token": text, "logprob": lp.logprob, "bytes": raw, "top_logprobs": top})
    return out


def completion_logprobs(tokenizer: Tokenizer, entries: Sequence[Any], text_offset: int = 0,
                        as_ids: bool = False) -> dict[str, Any]:
    """Legacy completions logprobs: parallel lists of tokens, their logprobs, top alternatives and text offsets
    (offsets count the tokens' text even when they are shown as "token_id:N" with `as_ids`)."""
    tokens, values, tops, offsets = [], [], [], []
    offset = text_offset
    for lp in entries:
        if lp is None:
            continue
        text, raw = _token(tokenizer, lp.token_id, as_ids)
        tokens.append(text)
        values.append(lp.logprob)
        tops.append({_token(tokenizer, tid, as_ids)[0]: value for tid, value in lp.top})  # {} for logprobs=0
        offsets.append(offset)
        offset += char_len(raw)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def echo_prompt_logprobs(tokenizer: Tokenizer, prompt_ids: Sequence[int], entries: Sequence[Any],
                         as_ids: bool = False) -> dict[str, Any]:
    """Legacy completions logprobs of an echoed prompt: every prompt token, the first with no logprob (None), as
    OpenAI's echo with logprobs returns them; offsets from 0."""
    tokens = [_token(tokenizer, prompt_ids[0], as_ids)[0]] if prompt_ids else []
    rest = completion_logprobs(tokenizer, entries, char_len(tokenizer.decode_bytes(list(prompt_ids[:1]))), as_ids)
    return {"tokens": tokens + rest["tokens"], "token_logprobs": [None] * len(tokens) + rest["token_logprobs"],
            "top_logprobs": [None] * len(tokens) + rest["top_logprobs"],
            "text_offset": [0] * len(tokens) + rest["text_offset"]}


def vllm_prompt_logprobs(tokenizer: Tokenizer, entries: Sequence[Any]) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs` response field: None for the first prompt token, then per token a map
    {token id: {logprob, rank, decoded_token}} of the prompt token and its top alternatives."""
    out: list[dict[str, Any] | None] = [None]
    for lp in entries:
        ranked = {lp.token_id: (lp.logprob, lp.rank)}
        for rank, (tid, value) in enumerate(lp.top, start=1):
            ranked.setdefault(tid, (value, rank))
        out.append({str(tid): {"logprob": value, "rank": rank, "decoded_token": _token(tokenizer, tid)[0]}
                    for tid, (value, rank) in ranked.items()})
    return out
