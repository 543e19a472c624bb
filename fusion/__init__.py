"""fusion: early-fusion multimodal models in PyTorch."""

from fusion import checkpoint
from fusion.decoder import TransformerDecoder
from fusion.early_fusion import EarlyFusion, SharedEncoder, register_fusion_module
from fusion.errors import FusionError
from fusion.generation import generate
from fusion.labels import (
    chunked_token_loss,
    fused_token_loss,
    masked_token_loss,
    next_token_labels,
)
from fusion.merge import Packed, Padded, merge_embeddings

__version__ = "0.1.0"

__all__ = [
    "EarlyFusion",
    "FusionError",
    "Packed",
    "Padded",
    "SharedEncoder",
    "TransformerDecoder",
    "checkpoint",
    "chunked_token_loss",
    "fused_token_loss",
    "generate",
    "masked_token_loss",
    "merge_embeddings",
    "next_token_labels",
    "register_fusion_module",
]
