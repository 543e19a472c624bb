"""From image files and prompts to token ids and pixels, for every family of
:data:`fusion.families.FAMILIES` that takes images (its ``processor``).

Decoding and resizing use Pillow (the ``vision`` extra), imported only by :func:`load_image`,
:func:`from_pil` and :func:`resize` (Pillow's own ``Image.resize``, as Hugging Face's image
processors call it); everything else is torch, and computes the pixels those processors
compute (their Pillow backend), bit for bit.

    from fusion.preprocessing import load_image, prepare_inputs

    inputs = prepare_inputs(directory, "<image>\\nWhat is this?", [load_image("cat.png")])
    tokens = inputs.tokens(pad_id)                 # [b, s], image markers expanded
    encoder_input = inputs.encoder_input()         # {"image": {"pixel_values": ...}}

Qwen2-VL, Qwen2.5-VL and Qwen3-VL mark each image as their chat template does,
``"<|vision_start|><|image_pad|><|vision_end|>"``, and their ``encoder_input`` also holds the
images' ``image_grid_thw``.

Clips are read by :func:`load_video` (PyAV, the ``video`` extra): a file, frame images or
decoded frames, sampled and bounded before decoding; :class:`Qwen2VLVideoProcessor` and
:class:`Qwen3VLVideoProcessor` make their patches and prompt text.
"""

from fusion.families.gemma3 import Gemma3ImageProcessor, Gemma3Processor, gemma3_image_text
from fusion.families.idefics3 import Idefics3ImageProcessor, TiledImage, idefics3_image_text
from fusion.families.llava import ClipImageProcessor
from fusion.families.processor import (
    VisionInputs,
    VisionLanguageProcessor,
    detect_model_kind,
    prepare_inputs,
)
from fusion.families.qwen_vl import (
    PatchedImages,
    PatchedVideos,
    Qwen2VLImageProcessor,
    Qwen2VLVideoProcessor,
    Qwen3VLVideoProcessor,
    expand_video_pads,
    qwen2_vl_image_text,
    read_video_processor,
    smart_resize,
)
from fusion.media.images import (
    as_uint8_image,
    default_max_pixels,
    from_pil,
    load_image,
    normalize,
    rescale,
    to_rgb,
)
from fusion.media.prompts import expand_markers
from fusion.media.resize import resize
from fusion.media.video import (
    Video,
    VideoBounds,
    VideoError,
    VideoMetadata,
    default_sample_indices,
    load_video,
    probe_video,
)

__all__ = [
    "ClipImageProcessor",
    "Gemma3ImageProcessor",
    "Gemma3Processor",
    "Idefics3ImageProcessor",
    "PatchedImages",
    "PatchedVideos",
    "Qwen2VLImageProcessor",
    "Qwen2VLVideoProcessor",
    "Qwen3VLVideoProcessor",
    "TiledImage",
    "Video",
    "VideoBounds",
    "VideoError",
    "VideoMetadata",
    "VisionInputs",
    "VisionLanguageProcessor",
    "as_uint8_image",
    "default_max_pixels",
    "default_sample_indices",
    "detect_model_kind",
    "expand_markers",
    "expand_video_pads",
    "from_pil",
    "gemma3_image_text",
    "idefics3_image_text",
    "load_image",
    "load_video",
    "normalize",
    "prepare_inputs",
    "probe_video",
    "qwen2_vl_image_text",
    "read_video_processor",
    "rescale",
    "resize",
    "smart_resize",
    "to_rgb",
]
