"""Idefics3 and SmolVLM: a SigLIP tower with a pixel-shuffle connector fused into a Llama
decoder, images split into tiles: its builder (:mod:`.builders`), its family (:mod:`.family`)
and its image processor (:mod:`.images`)."""

from fusion.families.idefics3.builders import Idefics3ImageEncoder, idefics3, smolvlm_256m
from fusion.families.idefics3.family import IDEFICS3, Idefics3Family
from fusion.families.idefics3.images import (
    Idefics3ImageProcessor,
    Idefics3Processor,
    TiledImage,
    idefics3_image_text,
)

__all__ = [
    "IDEFICS3",
    "Idefics3Family",
    "Idefics3ImageEncoder",
    "Idefics3ImageProcessor",
    "Idefics3Processor",
    "TiledImage",
    "idefics3",
    "idefics3_image_text",
    "smolvlm_256m",
]
