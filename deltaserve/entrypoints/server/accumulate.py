"""`ChoiceAccumulator`: joins a request's streamed `SequenceUpdate`s into whole choices (bodies and usage)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from deltaserve.engine.output_processor import SequenceUpdate
from deltaserve.parsers.types import ToolCall


@dataclass(slots=True)
class Choice:
    """One output sequence, joined."""

    reasoning: str = ""
    content: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)
    finish_reason: str | None = None
    stop_string: str | None = None
    calls: dict[int, list[str]] = field(default_factory=dict)
    """Tool call index -> [id, name, arguments]."""
    prompt_logprobs: list[Any] | None = None
    """With params.prompt_logprobs: one `TokenLogprobs` per prompt token after the first."""

    @property
    def tool_calls(self) -> list[ToolCall]:
        return [ToolCall(id=i, name=n, arguments=a) for i, n, a in (self.calls[k] for k in sorted(self.calls))]


class ChoiceAccumulator:
    """Accumulates every update of a request with `n` choices."""

    def __init__(self, n: int, hide_reasoning: bool = False) -> None:
        self.choices = [Choice() for _ in range(n)]
        self.num_cached_tokens = 0
        self.kv_transfer_params: dict[str, Any] | None = None
        """A prefill instance's answer: where a decode instance fetches the cache."""
        self.hide_reasoning = hide_reasoning
        """include_reasoning false: the logprobs of reasoning tokens are left out with the reasoning itself."""

    def add(self, update: SequenceUpdate) -> None:
        c = self.choices[update.index]
        c.reasoning += update.delta.reasoning
        c.content += update.delta.content
        c.token_ids.extend(update.token_ids)
        if not (self.hide_reasoning and update.delta.reasoning):
            c.logprobs.extend(update.logprobs)
        for d in update.delta.tool_calls:
            entry = c.calls.setdefault(d.index, ["", "", ""])
            if d.id is not None:
                entry[0] = d.id
            if d.name is not None:
                entry[1] = d.name
            entry[2] += d.arguments
        if update.finish_reason is not None:
            c.finish_reason = update.finish_reason
            c.stop_string = update.stop_string
        if update.prompt_logprobs is not None:
            c.prompt_logprobs = update.prompt_logprobs
        if update.index == 0 and update.num_cached_tokens:
            self.num_cached_tokens = update.num_cached_tokens
        if update.kv_transfer_params is not None:
            self.kv_transfer_params = update.kv_transfer_params

    def usage(self, prompt_tokens: int, index: int | None = None) -> dict[str, Any]:
        """OpenAI usage: completion tokens summed over the choices (or of choice `index` alone, as vLLM's
        continuous usage stats count them); cached prompt tokens from the prefix cache."""
        chosen = self.choices if index is None else [self.choices[index]]
        completion = sum(len(c.token_ids) for c in chosen)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                "total_tokens": prompt_tokens + completion,
                "prompt_tokens_details": {"cached_tokens": self.num_cached_tokens}}
