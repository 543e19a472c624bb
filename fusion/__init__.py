"""fusion: early-fusion multimodal models in PyTorch."""

from fusion.decoder import TransformerDecoder
from fusion.early_fusion import EarlyFusion, register_fusion_module
from fusion.merge import Packed, Padded, merge_embeddings

__version__ = "0.1.0"

__all__ = [
    "EarlyFusion",
    "Packed",
    "Padded",
    "TransformerDecoder",
    "merge_embeddings",
    "register_fusion_module",
]
