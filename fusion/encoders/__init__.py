"""Encoders whose outputs an EarlyFusion model writes into its decoder's input embeddings."""

from fusion.encoders.patch_embedding import PatchEmbedding
from fusion.encoders.vision_encoder import VisionEncoder
from fusion.encoders.vision_layer import VisionTransformerLayer

__all__ = ["PatchEmbedding", "VisionEncoder", "VisionTransformerLayer"]
