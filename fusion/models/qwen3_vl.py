"""Qwen3-VL: a Qwen3-VL vision tower fused into a Qwen3 text decoder with interleaved M-RoPE,
its DeepStack rows added to the first decoder layers' outputs."""

from collections.abc import Mapping
from typing import Any

from fusion.early_fusion import EarlyFusion, register_fusion_module
from fusion.encoders.qwen_vision import Qwen3VisionTransformer
from fusion.hooks import DeepStackRows, MRopePositions
from fusion.models.llama3_2 import llama3_2
from fusion.models.qwen2_vl import video_entry


def qwen3_vl(
    *,
    text: Mapping[str, Any],
    vision: Mapping[str, Any],
    image_token_id: int,
    video_token_id: int | None = None,
) -> EarlyFusion:
    """A Qwen3-VL model: ``EarlyFusion(decoder, {"image": tower}, {"image": image_token_id},
    hooks=[MRopePositions(...), DeepStackRows(...)])``, with a ``"video"`` entry sharing the
    tower when ``video_token_id`` is given (as :mod:`fusion.models.qwen2_vl` describes).

    The tower returns its rows and one set of DeepStack rows per ``deepstack_visual_indexes``
    entry; ``EarlyFusion`` writes the rows at the ``<|image_pad|>`` (``<|video_pad|>``)
    placeholders and adds the DeepStack rows ``k`` to the output of decoder layer ``k`` there.
    A video's temporal patches are media of their own in the positions (t = 1 each), as
    Qwen3-VL's per-frame timestamps separate them. The tower's mergers (main and DeepStack)
    are registered with :func:`fusion.register_fusion_module`.

    Args:
        text: keyword arguments of :func:`fusion.models.llama3_2` for Qwen3's stack
            (``qk_norm=True``, ``head_dim``, an interleaved ``mrope_section``).
        vision: keyword arguments of :class:`~fusion.encoders.Qwen3VisionTransformer`.
        image_token_id: the ``<|image_pad|>`` id.
        video_token_id: the ``<|video_pad|>`` id; None: no video entry.

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
    tokens, shared, inputs = video_entry(image_token_id, video_token_id, split_frames=True)
    return EarlyFusion(
        decoder,
        {"image": tower},
        tokens,
        shared_encoders=shared,
        hooks=[
            MRopePositions(inputs, tower.spatial_merge_size),
            DeepStackRows(list(tokens)),
        ],
    )
