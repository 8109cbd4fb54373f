"""Images for the vision tower, without torch: decoding (Pillow), content hashes, and Kimi K2.5 / K3 preprocessing
in numpy (resize, normalise, patches, grid, placeholder-token count)."""

from deltaserve.multimodal.errors import ImageError, ImageErrorKind
from deltaserve.multimodal.image_hash import image_content_hash
from deltaserve.multimodal.image_loader import DEFAULT_MAX_PIXELS, FORMATS, LoadedImage, load_image
from deltaserve.multimodal.image_processor import (
    ImageProcessingConfig,
    ProcessedImage,
    ResizePlan,
    num_image_tokens,
    plan_resize,
    preprocess_image,
)

__all__ = [
    "DEFAULT_MAX_PIXELS",
    "FORMATS",
    "ImageError",
    "ImageErrorKind",
    "ImageProcessingConfig",
    "LoadedImage",
    "ProcessedImage",
    "ResizePlan",
    "image_content_hash",
    "load_image",
    "num_image_tokens",
    "plan_resize",
    "preprocess_image",
]
