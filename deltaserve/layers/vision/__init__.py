"""The Kimi vision tower's modules: patch embedding, encoder blocks, projector (patch merging is an op)."""

from deltaserve.layers.vision.encoder_block import LayerNorm, Linear, VisionEncoderBlock
from deltaserve.layers.vision.patch_embed import VisionPatchEmbed
from deltaserve.layers.vision.projector import VisionProjector

__all__ = ["LayerNorm", "Linear", "VisionEncoderBlock", "VisionPatchEmbed", "VisionProjector"]
