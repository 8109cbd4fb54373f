"""OpenAI logprobs objects from the sampler's `TokenLogprobs` (chat: `content` entries; completions: legacy lists)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from deltaserve.text.tokenizer import Tokenizer


def _token(tokenizer: Tokenizer, token_id: int) -> tuple[str, list[int]]:
    raw = tokenizer.decode_bytes([token_id])
    return raw.decode("utf-8", errors="replace"), list(raw)


def chat_logprobs(tokenizer: Tokenizer, entries: Sequence[Any]) -> list[dict[str, Any]]:
    """`[{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]`, one per token with logprobs."""
    out = []
    for lp in entries:
        if lp is None:
            continue
        text, raw = _token(tokenizer, lp.token_id)
        top = []
        for tid, value in lp.top:
            t, b = _token(tokenizer, tid)
            top.append({"token": t, "logprob": value, "bytes": b})
        out.append({"token": text, "logprob": lp.logprob, "bytes": raw, "top_logprobs": top})
    return out


def completion_logprobs(tokenizer: Tokenizer, entries: Sequence[Any], text_offset: int = 0) -> dict[str, Any]:
    """Legacy completions logprobs: parallel lists of tokens, their logprobs, top alternatives and text offsets."""
    tokens, values, tops, offsets = [], [], [], []
    offset = text_offset
    for lp in entries:
        if lp is None:
            continue
        text, _ = _token(tokenizer, lp.token_id)
        tokens.append(text)
        values.append(lp.logprob)
        tops.append({_token(tokenizer, tid)[0]: value for tid, value in lp.top} or None)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}
