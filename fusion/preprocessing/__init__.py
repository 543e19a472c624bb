"""From image files and prompts to token ids and pixels, for LLaVA and Idefics3 / SmolVLM.

Decoding uses Pillow (the ``vision`` extra), imported only by :func:`load_image` and
:func:`from_pil`, and by the resize where it is installed (Pillow's own ``Image.resize``,
the fastest way to its pixels); everything else is torch, and computes the pixels Hugging
Face's image processors compute (their Pillow backend), resizing included without Pillow (see
:mod:`fusion.preprocessing.resize`).

    from fusion.preprocessing import load_image, prepare_inputs

    inputs = prepare_inputs(directory, "<image>\\nWhat is this?", [load_image("cat.png")])
    tokens = inputs.tokens(pad_id)                 # [b, s], image markers expanded
    encoder_input = inputs.encoder_input()         # {"image": {"pixel_values": ...}}
"""

from fusion.preprocessing.clip import ClipImageProcessor
from fusion.preprocessing.idefics3 import Idefics3ImageProcessor, TiledImage, idefics3_image_text
from fusion.preprocessing.images import (
    as_uint8_image,
    default_max_pixels,
    from_pil,
    load_image,
    normalize,
    rescale,
    to_rgb,
)
from fusion.preprocessing.processor import (
    VisionInputs,
    VisionLanguageProcessor,
    detect_model_kind,
    prepare_inputs,
)
from fusion.preprocessing.prompts import expand_markers
from fusion.preprocessing.resize import resize

__all__ = [
    "ClipImageProcessor",
    "Idefics3ImageProcessor",
    "TiledImage",
    "VisionInputs",
    "VisionLanguageProcessor",
    "as_uint8_image",
    "default_max_pixels",
    "detect_model_kind",
    "expand_markers",
    "from_pil",
    "idefics3_image_text",
    "load_image",
    "normalize",
    "prepare_inputs",
    "rescale",
    "resize",
    "to_rgb",
]
