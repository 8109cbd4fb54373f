"""`ImageEmbedder`: the vision part on the runner's side. For a step's chunks it finds the token rows that are image
placeholders (a chunk may start or end inside an image), runs the vision tower on the images whose features are not
in the encoder cache (all of them in one call) and returns those rows with their feature rows."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from deltaserve.models.kimi_vision import KimiVisionModel
from deltaserve.multimodal.inputs import ImageInput
from deltaserve.runner.encoder_cache import EncoderCache
from deltaserve.scheduler.output import EncoderStepStats, ScheduledChunk


class ImageEmbedder:
    """The vision model and its encoder cache (features kept in the language model's dtype, on its device)."""

    def __init__(self, model: KimiVisionModel, cache: EncoderCache, dtype: torch.dtype) -> None:
        self.model, self.cache, self.dtype = model, cache, dtype
        self.device = next(model.parameters()).device
        self.images_encoded = 0
        """Images the vision tower ran on (an image found in the encoder cache is not counted)."""
        self.encoder_calls = 0
        """Vision tower forwards (one per step that had any image to encode)."""
        self.step = EncoderStepStats()
        """What the current step did (`take_step_stats` hands it over and starts the next)."""

    def take_step_stats(self) -> EncoderStepStats:
        """The counts since the last call."""
        stats, self.step = self.step, EncoderStepStats()
        return stats

    def embeds(self, chunks: Sequence[ScheduledChunk], cu_seqlens: Sequence[int],
               images_of: Callable[[str], tuple[ImageInput, ...]]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows [n] int64, features [n, hidden]) for every placeholder token of `chunks` (in batch row order, chunk
        i owning rows cu_seqlens[i]:cu_seqlens[i + 1]); None when they cover no image."""
        spans: list[tuple[int, ImageInput, int, int]] = []  # (first batch row, image, first and end feature row)
        for i, chunk in enumerate(chunks):
            images = images_of(chunk.request_id)
            start, end = chunk.num_computed_tokens, chunk.num_computed_tokens + len(chunk.new_token_ids)
            for image in images:
                lo, hi = max(image.offset, start), min(image.end, end)
                if lo < hi:
                    spans.append((cu_seqlens[i] + lo - start, image, lo - image.offset, hi - image.offset))
        if not spans:
            return None
        features = self._features([image for _, image, _, _ in spans])
        rows = np.concatenate([np.arange(row, row + hi - lo) for row, _, lo, hi in spans])
        values = torch.cat([features[image.content_hash][lo:hi] for _, image, lo, hi in spans])
        return torch.from_numpy(rows).to(self.device), values

    @torch.inference_mode()
    def _features(self, images: Sequence[ImageInput]) -> dict[str, torch.Tensor]:
        """Each image's features [num_tokens, hidden], from the encoder cache or computed now; held here for the step
        whatever the cache evicts meanwhile."""
        found: dict[str, torch.Tensor] = {}
        missing: dict[str, ImageInput] = {}
        for image in images:
            if image.content_hash in found or image.content_hash in missing:
                continue
            cached = self.cache.get(image.content_hash)
            if cached is None:
                missing[image.content_hash] = image
            else:
                found[image.content_hash] = cached
        self.step = dataclasses.replace(self.step, cache_hits=self.step.cache_hits + len(found))
        if missing:
            start = time.perf_counter()
            todo = list(missing.values())
            pixels = torch.from_numpy(np.concatenate([image.pixel_array() for image in todo]))
            out = self.model(pixels.to(self.device, self.model.dtype), [image.grid_thw for image in todo])
            self.encoder_calls += 1
            self.images_encoded += len(todo)
            offset = 0
            for image in todo:
                n = image.num_tokens
                if out.shape[0] < offset + n:
                    raise ValueError(f"image {image.content_hash}: the vision tower gave {out.shape[0] - offset} "
                                     f"tokens, its placeholders are {n}")
                features = out[offset:offset + n].to(self.dtype).clone()
                offset += n
                self.cache.put(image.content_hash, features)
                found[image.content_hash] = features
            self.step = dataclasses.replace(self.step, images_encoded=self.step.images_encoded + len(todo),
                                            seconds=self.step.seconds + time.perf_counter() - start)
        return found
