"""LLaVA: a CLIP tower and a projector fused into a Llama decoder: its builder
(:mod:`.builders`), its family (:mod:`.family`) and its image processor (:mod:`.images`)."""

from fusion.families.llava.builders import LlavaImageEncoder, llava
from fusion.families.llava.family import LLAVA, LlavaFamily
from fusion.families.llava.images import ClipImageProcessor, LlavaProcessor

__all__ = [
    "LLAVA",
    "ClipImageProcessor",
    "LlavaFamily",
    "LlavaImageEncoder",
    "LlavaProcessor",
    "llava",
]
