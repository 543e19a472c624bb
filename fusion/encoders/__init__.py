"""Encoders whose outputs an EarlyFusion model writes into its decoder's input embeddings."""

from fusion.encoders.clip import ClipVisionTransformer
from fusion.encoders.connectors import Idefics3Connector, LlavaProjector, pixel_shuffle
from fusion.encoders.patch_embedding import PatchEmbedding
from fusion.encoders.siglip import SiglipVisionTransformer
from fusion.encoders.vision_encoder import VisionEncoder
from fusion.encoders.vision_layer import VisionTransformerLayer

__all__ = [
    "ClipVisionTransformer",
    "Idefics3Connector",
    "LlavaProjector",
    "PatchEmbedding",
    "SiglipVisionTransformer",
    "VisionEncoder",
    "VisionTransformerLayer",
    "pixel_shuffle",
]
