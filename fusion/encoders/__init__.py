"""Encoders whose outputs an EarlyFusion model writes into its decoder's input embeddings."""

from fusion.encoders.clip import ClipVisionTransformer
from fusion.encoders.connectors import Idefics3Connector, LlavaProjector, pixel_shuffle
from fusion.encoders.qwen_vision import Qwen2VisionTransformer, Qwen25VisionTransformer
from fusion.encoders.siglip import SiglipVisionTransformer

__all__ = [
    "ClipVisionTransformer",
    "Idefics3Connector",
    "LlavaProjector",
    "Qwen2VisionTransformer",
    "Qwen25VisionTransformer",
    "SiglipVisionTransformer",
    "pixel_shuffle",
]
