"""Request body of POST /v1/messages (Anthropic Messages API), as pydantic models.

An explicit `null` for an optional field means "not given" (as on the OpenAI routes).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from deltaserve.entrypoints.server.json_body import drop_optional_nulls


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_is_not_given(cls, data: Any) -> Any:
        return drop_optional_nulls(cls, data)


class ContentBlock(_Model):
    """Any content block; which fields matter depends on `type` (checked when converting)."""

    type: str
    text: str | None = None
    thinking: str | None = None
    signature: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None
    content: str | list[ContentBlock] | None = None
    is_error: bool | None = None
    source: ImageSource | None = None
    """An `image` block's data."""


class ImageSource(_Model):
    type: str
    media_type: str | None = None
    data: str | None = None
    url: str | None = None


class MessageParam(_Model):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class ToolDef(_Model):
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    """Required by the API: a missing one is a 400 (Anthropic's status), checked when the prompt is rendered."""


class ToolChoice(_Model):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class ThinkingConfig(_Model):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None


class OutputFormat(_Model):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Model):
    format: OutputFormat | None = None


class CountTokensRequest(_Model):
    """POST /v1/messages/count_tokens: what shapes the prompt of a Messages request."""

    model: str
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[ContentBlock] | None = None
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    """Structured output: `{"format": {"type": "json_schema", "schema": {...}}}`."""


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages."""

    max_tokens: int
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    """Prefill/decode disaggregation, as on the OpenAI routes (vLLM's field)."""

    def session_id(self) -> str | None:
        """`metadata.user_id` when it is a string: the session the data-parallel router keeps on one replica."""
        user = (self.metadata or {}).get("user_id")
        return user if isinstance(user, str) else None
