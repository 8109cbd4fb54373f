"""Request bodies of the OpenAI routes (pydantic), and their translation into `SamplingParams`.

Field names and defaults follow the OpenAI API; vLLM's extra sampling fields (top_k, min_p, repetition_penalty,
min_tokens, ignore_eos, stop_token_ids, skip_special_tokens, include_stop_str_in_output) are accepted too.
Unknown fields are ignored, as the OpenAI API does, and an explicit `null` for an optional field means "not given"
(the OpenAI API and vLLM accept null wherever the spec marks a field nullable; here every optional field takes it).
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from deltaserve.entrypoints.server.errors import bad_request
from deltaserve.entrypoints.server.json_body import drop_optional_nulls
from deltaserve.sampling_params import SamplingParams, StructuredOutput


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_is_not_given(cls, data: Any) -> Any:
        return drop_optional_nulls(cls, data)



class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False
    """vLLM's: every chunk carries the usage so far (with include_usage)."""

    def usage_mode(self) -> str | None:
        """None (no usage in the stream), "final" (one last usage chunk) or "continuous" (also on every chunk)."""
        if not self.include_usage:
            return None
        return "continuous" if self.continuous_usage_stats else "final"


class StructuredOutputsParam(_Request):
    """vLLM's `structured_outputs`: one of a JSON schema, a regex, a list of choices, a Lark grammar or any JSON
    object."""

    json_schema: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False


class SamplingFields(_Request):
    """Sampling fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    n: int = 1
    seed: int | None = None
    kv_transfer_params: dict[str, Any] | None = None
    """Prefill/decode disaggregation (vLLM's field): `{"do_remote_decode": true}` to a prefill instance, or the
    object a prefill instance returned, to a decode instance."""
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    max_tokens: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    structured_outputs: StructuredOutputsParam | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    logit_bias: dict[str, float] | None = None
    """OpenAI's: token id (as a string) -> bias in [-100, 100] added to its logit."""
    allowed_token_ids: list[int] | None = None
    """vLLM's: only these token ids may be sampled."""
    bad_words: list[str] | None = None
    """vLLM's: words the output never completes (each tokenized alone and after a space)."""
    priority: int = 0
    """vLLM's: lower is served first, on a server started with `--policy priority`."""
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    """vLLM's: keep only the last this many prompt tokens (of the rendered prompt, for chat); -1: max_model_len."""
    prompt_logprobs: int | None = None
    """vLLM's: the logprobs of the prompt's tokens (and this many alternatives), as `prompt_logprobs` in each
    choice; such a request is not served from the prefix cache."""
    return_tokens_as_token_ids: bool = False
    """vLLM's: logprobs name tokens "token_id:N" (exact ids, also for tokens that are not valid UTF-8 alone)."""

    def structured_extra(self) -> StructuredOutput | None:
        """vLLM's structured-output fields (`structured_outputs`, or the older `guided_*`), if any is set."""
        so = self.structured_outputs or StructuredOutputsParam(json=self.guided_json, regex=self.guided_regex,
                                                               choice=self.guided_choice, grammar=self.guided_grammar)
        given = [k for k in ("json_schema", "regex", "choice", "grammar") if getattr(so, k) is not None] + (
            ["json_object"] if so.json_object else [])
        if len(given) > 1:
            raise bad_request(f"give one structured output constraint, got {given}", param="structured_outputs")
        if so.json_schema is not None:
            schema = so.json_schema
            return StructuredOutput("json_schema", schema if isinstance(schema, str) else json.dumps(schema))
        if so.regex is not None:
            return StructuredOutput("regex", so.regex)
        if so.choice is not None:
            return StructuredOutput("lark", choice_grammar(so.choice))
        if so.grammar is not None:
            return StructuredOutput("lark", so.grammar)
        return StructuredOutput("json_object") if so.json_object else None

    def sampling_params(self, *, max_tokens: int, logprobs: int | None, max_n: int, vocab_size: int,
                        structured: StructuredOutput | None = None, skip_special_tokens: bool | None = None,
                        bad_words_token_ids: tuple[tuple[int, ...], ...] = (), prompt_logprobs: int | None = None,
                        max_stop: int | None = None) -> SamplingParams:
        """SamplingParams from these fields; 400 naming the field for an invalid value (and for more than
        `max_stop` stop strings)."""
        if not 1 <= self.n <= max_n:
            raise bad_request(f"n must be between 1 and {max_n}, got {self.n}", param="n")
        bias = _token_bias(self.logit_bias or {}, vocab_size)
        if self.allowed_token_ids is not None and any(not 0 <= t < vocab_size for t in self.allowed_token_ids):
            raise bad_request(f"allowed_token_ids must be token ids in [0, {vocab_size})", param="allowed_token_ids")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if max_stop is not None and len(stop) > max_stop:
            raise bad_request(f"stop has {len(stop)} strings; the server accepts at most {max_stop} "
                              "(--max-stop-sequences)", param="stop")
        values: dict[str, Any] = {
            "n": self.n, "max_tokens": max_tokens, "min_tokens": self.min_tokens, "seed": self.seed,
            "stop": tuple(stop), "stop_token_ids": tuple(self.stop_token_ids or ()), "ignore_eos": self.ignore_eos,
            "logprobs": logprobs, "include_stop_str_in_output": self.include_stop_str_in_output,
            "skip_special_tokens": self.skip_special_tokens if skip_special_tokens is None else skip_special_tokens,
            "structured": structured, "logit_bias": bias, "allowed_token_ids": self.allowed_token_ids,
            "bad_words_token_ids": bad_words_token_ids,
            # vLLM's rule: an explicit prompt_logprobs wins; echo with logprobs only fills it in when absent
            "prompt_logprobs": self.prompt_logprobs if self.prompt_logprobs is not None else prompt_logprobs,
        }
        for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            if getattr(self, name) is not None:
                values[name] = getattr(self, name)
        try:
            return SamplingParams(**values)
        except ValueError as exc:
            message = str(exc)
            field = re.match(r"\w+", message)  # SamplingParams' messages start with the field's name
            param = field.group() if field and field.group() in values else None
            raise bad_request(message, param=param) from exc


MAX_CHOICES = 100_000


def choice_grammar(choices: list[str]) -> str:
    """vLLM's guided choice as a Lark grammar: the output is exactly one of `choices`. The alternatives form one
    terminal (one lexer token): as parser rules, llguidance fails past 2,000 choices sharing a prefix (its Earley
    rows hold at most 2,000 items), and only once generation reaches the shared prefix."""
    if not choices or not all(choices):
        raise bad_request("choice must be a non-empty list of non-empty strings", param="structured_outputs")
    if len(choices) > MAX_CHOICES:
        raise bad_request(f"at most {MAX_CHOICES} choices are supported, got {len(choices)}",
                          param="structured_outputs")
    return "start: CHOICE\nCHOICE: " + " | ".join(_lark_string(c) for c in dict.fromkeys(choices))


def _lark_string(text: str) -> str:
    """A Lark string literal matching exactly `text`: quotes and backslashes escaped, control characters (C0, DEL,
    C1, line and paragraph separators) as \\uXXXX, which the grammar lexer would otherwise reject."""
    out = []
    for ch in text:
        code = ord(ch)
        if ch in '"\\':
            out.append("\\" + ch)
        elif code < 0x20 or 0x7F <= code <= 0x9F or ch in "\u2028\u2029":
            out.append(f"\\u{code:04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _token_bias(bias: dict[str, float], vocab_size: int) -> dict[int, float]:
    out = {}
    for key, value in bias.items():
        # "²".isdigit() is True too, and int() refuses over 4,300 digits: check the text first.
        if not (key.isascii() and key.isdigit() and len(key) <= 19) or not int(key) < vocab_size:
            raise bad_request(f"logit_bias keys must be token ids in [0, {vocab_size}), got {key!r:.40}",
                              param="logit_bias")
        out[int(key)] = value
    return out


class CompletionRequest(SamplingFields):
    """POST /v1/completions."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class FunctionCall(_Request):
    name: str
    arguments: str = "{}"


class ToolCallParam(_Request):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ImageURL(_Request):
    url: str
    detail: str | None = None


class ContentPart(_Request):
    type: str
    text: str | None = None
    image_url: ImageURL | None = None


class ChatMessageParam(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None


class FunctionDef(_Request):
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolParam(_Request):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"] = "function"
    function: NamedFunction


class JsonSchemaFormat(_Request):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessageParam] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ToolParam] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    add_generation_prompt: bool = True
    """vLLM's: end the prompt with the opening of a new assistant turn."""
    continue_final_message: bool = False
    """vLLM's: continue the last (assistant) message instead (a prefill; set add_generation_prompt false)."""
    include_reasoning: bool = True
    """vLLM's: False leaves reasoning_content out of the response (the model still reasons)."""
    reasoning_effort: str | None = None
    """OpenAI's; for Kimi K3, the thinking effort the prompt announces: low, medium, high or max."""
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeCompletionRequest(_Request):
    """POST /tokenize with a text prompt (vLLM's API)."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    """Accepted for vLLM compatibility; Kimi tokenizers add no special tokens to a plain prompt either way."""
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    return_token_strs: bool = False


class TokenizeChatRequest(ChatCompletionRequest):
    """POST /tokenize with chat messages: the prompt /v1/chat/completions would build (vLLM's API)."""

    return_token_strs: bool = False


class DetokenizeRequest(_Request):
    """POST /detokenize (vLLM's API)."""

    model: str | None = None
    tokens: list[int]
