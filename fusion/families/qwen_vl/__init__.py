"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL: Qwen vision towers fused into Qwen2/Qwen3 decoders with
M-RoPE (and DeepStack): their builders (:mod:`.builders`), families (:mod:`.family`), image
processor (:mod:`.images`), processor kind (:mod:`.processor`; Qwen3.5 shares both) and video
processors (:mod:`.video`)."""

from fusion.families.qwen_vl.builders import qwen2, qwen2_vl, qwen3_vl
from fusion.families.qwen_vl.family import QWEN2_VL, QWEN3_VL
from fusion.families.qwen_vl.images import (
    PatchedImages,
    Qwen2VLImageProcessor,
    qwen2_vl_image_text,
    smart_resize,
)
from fusion.families.qwen_vl.processor import Qwen2VLProcessor, expand_video_pads
from fusion.families.qwen_vl.video import (
    PatchedVideos,
    Qwen2VLVideoProcessor,
    Qwen3VLVideoProcessor,
    read_video_processor,
)

__all__ = [
    "QWEN2_VL",
    "QWEN3_VL",
    "PatchedImages",
    "PatchedVideos",
    "Qwen2VLImageProcessor",
    "Qwen2VLProcessor",
    "Qwen2VLVideoProcessor",
    "Qwen3VLVideoProcessor",
    "expand_video_pads",
    "qwen2",
    "qwen2_vl",
    "qwen2_vl_image_text",
    "qwen3_vl",
    "read_video_processor",
    "smart_resize",
]
