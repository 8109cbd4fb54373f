"""How a K3 checkpoint stores its routed experts: MXFP4 `quantization_config` (model-spec §9.2)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from deltaserve.config.fields import ConfigError, ConfigFields

MXFP4_FORMAT = "mxfp4-pack-quantized"


@dataclass(frozen=True, slots=True, kw_only=True)
class QuantizationConfig:
    """How a K3 checkpoint stores its routed-expert weights (`text_config.quantization_config`): MXFP4 (E2M1 values,
    one E8M0 scale per 32 inputs). Every other tensor is unquantised, whatever `ignore` lists (model-spec §9.2)."""

    layout: str
    """"compressed-tensors" (`mxfp4-pack-quantized`: per expert `w{1,2,3}.weight_packed` / `weight_scale`) or
    "gpt-oss" (`quant_method: mxfp4`: stacked `experts.{gate_up,down}_proj_blocks` / `_scales`, gate and up rows
    interleaved)."""
    ignore: tuple[str, ...] = ()
    """The checkpoint's list of unquantised modules (informational)."""


def parse_quantization(
    text: dict[str, Any], raw: dict[str, Any], prefix: str, is_k3: bool
) -> QuantizationConfig | None:
    """K3's MXFP4 `quantization_config` (inside `text_config`; a top-level copy is read if the text one is absent)."""
    if "quantization_config" not in text and is_k3 and "quantization_config" in raw:
        text, prefix = raw, ""
    q = text.get("quantization_config")
    name = f"{prefix}quantization_config"
    if q is None:
        return None
    if not is_k3:
        raise ConfigError(f"config field {name} is not supported for KimiLinearForCausalLM (unquantised weights only)")
    if not isinstance(q, dict):
        raise ConfigError(f"config field {name} must be an object")
    method = ConfigFields(q, prefix=f"{name}.").as_str("quant_method")
    if method == "mxfp4":
        return QuantizationConfig(layout="gpt-oss", ignore=tuple(q.get("modules_to_not_convert") or ()))
    if method != "compressed-tensors":
        raise ConfigError(
            f"config field {name}.quant_method={method!r} is not supported (supported: 'compressed-tensors' with "
            f"format {MXFP4_FORMAT!r}, 'mxfp4' for the gpt-oss layout)"
        )
    groups = q.get("config_groups") or {}
    found = [g.get("format") for g in groups.values() if isinstance(g, dict)] + [q.get("format")]
    formats = {f for f in found if f is not None}
    if formats != {MXFP4_FORMAT}:
        raise ConfigError(
            f"config field {name}.format={sorted(formats) if len(formats) != 1 else formats.pop()!r} is not "
            f"supported (supported: {MXFP4_FORMAT!r})"
        )
    for group_name, group in groups.items():
        _check_mxfp4_group(group, f"{name}.config_groups.{group_name}")
    return QuantizationConfig(layout="compressed-tensors", ignore=tuple(q.get("ignore") or ()))


def _check_mxfp4_group(group: Any, name: str) -> None:
    weights = (group.get("weights") or {}) if isinstance(group, dict) else {}
    for key, want in (("num_bits", 4), ("type", "float"), ("group_size", 32)):
        if weights.get(key, want) != want:
            raise ConfigError(f"config field {name}.weights.{key}={weights[key]!r} is not MXFP4 (expected {want!r})")
    if isinstance(group, dict) and group.get("input_activations") is not None:
        raise ConfigError(
            f"config field {name}.input_activations must be null: stored activation quantisation is not supported "
            "(MXFP8 activation rounding is a run-time option)"
        )
