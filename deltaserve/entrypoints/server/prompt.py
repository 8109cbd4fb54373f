"""`RenderedPrompt`: what the OpenAI chat and Anthropic Messages routes decide before generating (or counting)."""

from __future__ import annotations

from dataclasses import dataclass

from deltaserve.chat.messages import ToolSpec
from deltaserve.multimodal.inputs import ImageInput
from deltaserve.sampling_params import StructuredOutput


@dataclass(frozen=True, slots=True)
class RenderedPrompt:
    """A chat request's prompt and the tool and answer settings it was rendered with."""

    prompt_ids: list[int]
    tools: list[ToolSpec]
    forced: str | None
    """The function a named tool_choice forces, if any."""
    forcing: bool
    """A tool call is forced (tool_choice "required" / Anthropic "any", or a named function)."""
    thinking: bool
    answer: StructuredOutput | None
    """The response_format / structured_outputs / output_config.format constraint (never with forcing)."""
    tools_active: bool
    """Tools were offered and tool_choice is not "none": the output parser looks for calls."""
    images: tuple[ImageInput, ...] = ()
    """The conversation's images on their placeholder runs of `prompt_ids`."""
