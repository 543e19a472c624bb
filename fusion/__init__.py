"""fusion: early-fusion multimodal models in PyTorch."""

from fusion.decoder import TransformerDecoder

__version__ = "0.1.0"

__all__ = ["TransformerDecoder"]
