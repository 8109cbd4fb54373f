"""The vision tower and projector of a Kimi K3 (K2.5-family) checkpoint: `VisionConfig`, read from `vision_config`
(Moonshot's MoonViT names, transformers' `Kimi_K25VisionConfig` names accepted) and the projector fields."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from deltaserve.config.fields import ConfigError, ConfigFields

DEFAULT_MEDIA_PLACEHOLDER_TOKEN_ID = 163605
"""`<|media_pad|>` (model-spec §11.2)."""
_TOWER_SIZE_KEYS = ("vt_hidden_size", "hidden_size")
_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu")
# Fields that select variants of the tower; each must hold the one value the tower implements.
_FIXED = {"pos_emb_type": "divided_fixed", "merge_type": "sd2_tpool", "mm_projector_type": "patchmerger",
          "video_attn_type": "spatial_temporal"}


@dataclass(frozen=True, slots=True, kw_only=True)
class VisionConfig:
    """MoonViT (native-resolution patches, a learned position grid resampled bicubically per image, 2D rotary
    attention within each image, 2x2 patch merging) and its projector into the language model."""

    patch_size: int
    """Pixels per side of a patch."""
    hidden_size: int
    """Tower width (`vt_hidden_size`)."""
    num_hidden_layers: int
    """Encoder blocks (`vt_num_hidden_layers`)."""
    num_attention_heads: int
    """Attention heads per block (`vt_num_attention_heads`); head_dim = hidden_size / this, a multiple of 4."""
    intermediate_size: int
    """MLP width (`vt_intermediate_size`)."""
    hidden_act: str = "gelu_pytorch_tanh"
    """Block MLP activation: "gelu_pytorch_tanh" (MoonViT) or "gelu"."""
    pos_emb_height: int
    """Rows of the learned position grid (`init_pos_emb_height`)."""
    pos_emb_width: int
    """Columns of the learned position grid (`init_pos_emb_width`)."""
    pos_emb_time: int = 4
    """Frames of the sinusoidal time embedding (`init_pos_emb_time`; unused by single images)."""
    merge_kernel_size: tuple[int, int] = (2, 2)
    """Patches per merged token, (rows, columns)."""
    rope_theta: float = 10000.0
    """Base of the 2D rotary frequencies."""
    projector_hidden_size: int
    """Width the projector's pre-norm runs on (`mm_hidden_size`, transformers' `projection_hidden_size`): the tower
    width."""
    projector_ln_eps: float = 1e-5
    """The projector pre-norm's eps (`projector_ln_eps`, transformers' `projection_layer_norm_eps`)."""
    text_hidden_size: int
    """The language model's hidden size: the projector's output width."""
    media_placeholder_token_id: int = DEFAULT_MEDIA_PLACEHOLDER_TOKEN_ID
    """The token id each image token takes in the prompt (top-level `media_placeholder_token_id`)."""
    max_patches: int = 16384
    """Images with more patches are scaled down to fit (`vision_config.max_patches`, transformers' image processor
    `max_patches`): a tower trained on small images sets a small limit."""
    max_patches_per_side: int = 512
    """Images with more patches along a side are scaled down (`vision_config.max_patches_per_side`, the image
    processor's `size.max_height`)."""

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def merge_area(self) -> int:
        """Patches per merged (placeholder) token."""
        return self.merge_kernel_size[0] * self.merge_kernel_size[1]

    @property
    def merged_hidden_size(self) -> int:
        """Width of a merged token before the projector: merge_area * hidden_size."""
        return self.merge_area * self.hidden_size


def parse_vision(raw: dict[str, Any], text_hidden_size: int) -> VisionConfig | None:
    """The `vision_config` of a K3 (or Kimi Linear) config.json, or None when it carries no tower (absent, or
    without a tower size: tiny text-only checkpoints keep a stub there). Errors name the field with its
    `vision_config.` prefix."""
    vision = raw.get("vision_config")
    if vision is None:
        return None
    if not isinstance(vision, dict):
        raise ConfigError("config field vision_config must be an object")
    if not any(key in vision for key in _TOWER_SIZE_KEYS):
        return None
    f = ConfigFields(vision, prefix="vision_config.")
    top = ConfigFields(raw)
    hidden = f.as_int("vt_hidden_size", "hidden_size")
    heads = f.as_int("vt_num_attention_heads", "num_attention_heads")
    if hidden % heads or (hidden // heads) % 4:
        raise ConfigError(f"config field vision_config.vt_num_attention_heads={heads} must divide "
                          f"vt_hidden_size={hidden} into heads of a multiple of 4 (2D rotary: two axes, pairs)")
    for name, want in _FIXED.items():
        got = vision.get(name, want)
        if got != want:
            raise ConfigError(f"config field vision_config.{name}={got!r} is not supported (supported: {want!r})")
    act = f.as_str("hidden_act", default="gelu_pytorch_tanh")
    if act not in _ACTIVATIONS:
        raise ConfigError(f"config field vision_config.hidden_act={act!r} is not supported (supported: "
                          f"{', '.join(repr(a) for a in _ACTIVATIONS)})")
    projector_act = f.as_str("projector_hidden_act", default="gelu")
    if projector_act != "gelu":
        raise ConfigError(f"config field vision_config.projector_hidden_act={projector_act!r} is not supported "
                          "(supported: 'gelu')")
    projector_hidden = _projector_hidden(f, top, hidden)
    text_hidden = f.as_int("text_hidden_size", default=text_hidden_size)
    if text_hidden != text_hidden_size:
        raise ConfigError(f"config field vision_config.text_hidden_size={text_hidden} disagrees with "
                          f"text_config.hidden_size={text_hidden_size}")
    return VisionConfig(
        patch_size=f.as_int("patch_size"),
        hidden_size=hidden,
        num_hidden_layers=f.as_int("vt_num_hidden_layers", "num_hidden_layers"),
        num_attention_heads=heads,
        intermediate_size=f.as_int("vt_intermediate_size", "intermediate_size"),
        hidden_act=act,
        pos_emb_height=f.as_int("init_pos_emb_height", "pos_emb_height"),
        pos_emb_width=f.as_int("init_pos_emb_width", "pos_emb_width"),
        pos_emb_time=f.as_int("init_pos_emb_time", "pos_emb_time", default=4),
        merge_kernel_size=_merge_kernel(f),
        rope_theta=_rope_theta(f),
        projector_hidden_size=projector_hidden,
        projector_ln_eps=_projector_eps(f, top),
        text_hidden_size=text_hidden_size,
        media_placeholder_token_id=top.as_int("media_placeholder_token_id", "image_token_id",
                                              default=DEFAULT_MEDIA_PLACEHOLDER_TOKEN_ID, minimum=0),
        max_patches=f.as_int("max_patches", default=16384, minimum=1),
        max_patches_per_side=f.as_int("max_patches_per_side", default=512, minimum=1),
    )


def _merge_kernel(f: ConfigFields) -> tuple[int, int]:
    kernel = f.get_raw("merge_kernel_size") if "merge_kernel_size" in f.raw else [2, 2]
    if (not isinstance(kernel, list | tuple) or len(kernel) != 2
            or not all(isinstance(k, int) and not isinstance(k, bool) and k >= 1 for k in kernel)):
        raise ConfigError(f"config field vision_config.merge_kernel_size={kernel!r} must be two integers >= 1")
    return int(kernel[0]), int(kernel[1])


def _rope_theta(f: ConfigFields) -> float:
    params = f.raw.get("rope_parameters")
    if isinstance(params, dict):
        rope_type = params.get("rope_type", "axial")
        if rope_type != "axial":
            raise ConfigError(f"config field vision_config.rope_parameters.rope_type={rope_type!r} is not supported "
                              "(supported: 'axial')")
        return ConfigFields(params, prefix="vision_config.rope_parameters.").as_float("rope_theta", default=10000.0)
    value: float = f.as_float("rope_theta", default=10000.0)
    return value


def _projector_hidden(f: ConfigFields, top: ConfigFields, hidden: int) -> int:
    value: int | None = f.as_int("mm_hidden_size", default=None)
    if value is None:
        value = top.as_int("projection_hidden_size", default=None)
    if value is None:
        return hidden
    if value != hidden:
        # The projector normalises each patch's tower output before merging: its width is the tower's.
        raise ConfigError(f"config field vision_config.mm_hidden_size={value} must equal vt_hidden_size={hidden}")
    return value


def _projector_eps(f: ConfigFields, top: ConfigFields) -> float:
    value: float | None = f.as_float("projector_ln_eps", default=None)
    if value is None:
        value = top.as_float("projection_layer_norm_eps", default=1e-5)
    if value is None or value <= 0:
        raise ConfigError(f"config field vision_config.projector_ln_eps={value} must be positive")
    return value
