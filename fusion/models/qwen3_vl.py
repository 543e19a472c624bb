"""Qwen3-VL: a Qwen3-VL vision tower fused into a Qwen3 text decoder with interleaved M-RoPE,
its DeepStack rows added to the first decoder layers' outputs."""

from collections.abc import Mapping
from typing import Any

from fusion.early_fusion import EarlyFusion, register_fusion_module
from fusion.encoders.qwen_vision import Qwen3VisionTransformer
from fusion.hooks import DeepStackRows, MRopePositions
from fusion.models.llama3_2 import llama3_2


def qwen3_vl(
    *, text: Mapping[str, Any], vision: Mapping[str, Any], image_token_id: int
) -> EarlyFusion:
    """A Qwen3-VL model: ``EarlyFusion(decoder, {"image": tower}, {"image": image_token_id},
    hooks=[MRopePositions(...), DeepStackRows("image")])``.

    The tower returns its rows and one set of DeepStack rows per ``deepstack_visual_indexes``
    entry; ``EarlyFusion`` writes the rows at the ``<|image_pad|>`` placeholders and adds the
    DeepStack rows ``k`` to the output of decoder layer ``k`` there. The tower's mergers (main
    and DeepStack) are registered with :func:`fusion.register_fusion_module`.

    Args:
        text: keyword arguments of :func:`fusion.models.llama3_2` for Qwen3's stack
            (``qk_norm=True``, ``head_dim``, an interleaved ``mrope_section``).
        vision: keyword arguments of :class:`~fusion.encoders.Qwen3VisionTransformer`.
        image_token_id: the ``<|image_pad|>`` id.

    Raises:
        ValueError: a decoder without M-RoPE, a tower whose output width is not the decoder's,
            more DeepStack layers than decoder layers, or any argument the parts refuse.
    """
    decoder = llama3_2(**text)
    tower = Qwen3VisionTransformer(**vision)
    if tower.out_dim != decoder.embed_dim:
        raise ValueError(
            f"vision: the tower writes rows of width {tower.out_dim}, the decoder's width is "
            f"{decoder.embed_dim}"
        )
    if tower.deepstack_layers > len(decoder.layers):
        raise ValueError(
            f"vision: {tower.deepstack_layers} DeepStack layers, but the decoder has only "
            f"{len(decoder.layers)} layers to add them to"
        )
    register_fusion_module(tower.merger)
    for merger in tower.deepstack_merger_list:
        register_fusion_module(merger)
    return EarlyFusion(
        decoder,
        {"image": tower},
        {"image": image_token_id},
        hooks=[MRopePositions("image", tower.spatial_merge_size), DeepStackRows("image")],
    )
