"""Gemma 3: a sliding-window and full-attention text stack, and a SigLIP tower whose images
attend to themselves both ways: its builders (:mod:`.builders`), families (:mod:`.family`) and
image processor (:mod:`.images`)."""

from fusion.families.gemma3.builders import Gemma3ImageEncoder, Gemma3Projector, gemma3, gemma3_text
from fusion.families.gemma3.family import GEMMA3, GEMMA3_TEXT
from fusion.families.gemma3.images import Gemma3ImageProcessor, Gemma3Processor, gemma3_image_text

__all__ = [
    "GEMMA3",
    "GEMMA3_TEXT",
    "Gemma3ImageEncoder",
    "Gemma3ImageProcessor",
    "Gemma3Processor",
    "Gemma3Projector",
    "gemma3",
    "gemma3_image_text",
    "gemma3_text",
]
