"""`FeatureTaps`: the outputs of chosen decoder layers of the target, captured during its forward (a block drafter's
conditioning features), through forward hooks, so the model code knows nothing of them."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.utils.hooks import RemovableHandle

from deltaserve.models.protocol import Model


class FeatureTaps:
    """Captures ``[T, d]`` outputs of `layers` (0-based decoder layers) on every forward of `model`; `take()`
    returns them concatenated, ``[T, len(layers) * d]``, and forgets them."""

    def __init__(self, model: Model, layers: Sequence[int]) -> None:
        decoder = list(getattr(model, "decoder_layers", ()))
        if not decoder:
            raise ValueError("the target model has no decoder_layers to tap for a block drafter")
        bad = [i for i in layers if not 0 <= i < len(decoder)]
        if bad:
            raise ValueError(f"dspark tap_layers {bad} out of range: the target has {len(decoder)} layers")
        self.layers = tuple(layers)
        self._captured: dict[int, torch.Tensor] = {}
        self._handles: list[RemovableHandle] = [
            decoder[i].register_forward_hook(self._hook(i)) for i in self.layers]

    def _hook(self, index: int):  # noqa: ANN202 - a torch hook
        def hook(_module: torch.nn.Module, _args: object, output: torch.Tensor) -> None:
            self._captured[index] = output
        return hook

    def take(self) -> torch.Tensor:
        """The last forward's taps, ``[T, len(layers) * d]``. RuntimeError when a tapped layer did not run through
        its module call (a model that bypasses `nn.Module.__call__`, such as K3's AttnRes path)."""
        return torch.cat(self.take_parts(), dim=-1)

    def take_parts(self) -> tuple[torch.Tensor, ...]:
        """`take` before the concatenation: one ``[T, d]`` output per tapped layer, in `layers` order (a caller that
        may never need them keeps them without a copy)."""
        missing = [i for i in self.layers if i not in self._captured]
        if missing:
            raise RuntimeError(f"feature taps: layers {missing} produced no output in the last forward (this model "
                               "does not run them through their module call)")
        out = tuple(self._captured[i] for i in self.layers)
        self._captured.clear()
        return out

    def remove(self) -> None:
        """Detach the hooks."""
        for handle in self._handles:
            handle.remove()
        self._captured.clear()
