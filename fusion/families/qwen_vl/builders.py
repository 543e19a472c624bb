"""Qwen2-VL and Qwen2.5-VL (a Qwen vision tower fused into a Qwen2 text decoder with M-RoPE),
Qwen3-VL (its tower's DeepStack rows added to the first decoder layers' outputs, interleaved
M-RoPE), and the video entry all the Qwen vision-language builders share.

Videos run through the image tower (transformers' ``get_video_features`` is its image
features on the video patches). The ``"video"`` entry is a :class:`fusion.SharedEncoder`
(:data:`VIDEO_INPUT`), not a module: it has a placeholder id of its own (``<|video_pad|>``)
and calls ``encoders["image"]`` by name at each forward. Why this design rather than the
alternatives:

- a second module entry wrapping the tower would register it twice (duplicate state-dict
  keys under ``encoders.video.``), or, holding it outside the module tree, keep a reference
  that goes stale once FSDP, an adapter or ``torch.compile`` wraps or replaces the tower;
- one encoder taking both inputs would need two placeholder ids per entry, and the merge to
  interleave images' and videos' rows by position: the generic merge (one id per entry, rows
  in order of appearance) would no longer do.

So the model's modules, parameters and checkpoint keys are exactly those without videos,
whatever runs as the tower is what the video rows come from, what trains is the tower's, and
the merge stays the generic, sync-free one. The M-RoPE hook places videos as a placeholder
kind of their own (:class:`fusion.hooks.MRopeInput`).
"""

from collections.abc import Mapping, Sequence
from typing import Any

from fusion.decoder import TransformerDecoder
from fusion.early_fusion import EarlyFusion, SharedEncoder, register_fusion_module
from fusion.encoders.qwen_vision import (
    Qwen2VisionTransformer,
    Qwen3VisionTransformer,
    Qwen25VisionTransformer,
)
from fusion.families.llama.builders import llama3_2
from fusion.hooks import DeepStackRows, MRopeInput, MRopePositions

#: The vision towers by model type.
VISION_TOWERS = {"qwen2_vl": Qwen2VisionTransformer, "qwen2_5_vl": Qwen25VisionTransformer}
#: Qwen2.5-VL's temporal positions per second of video where its config says none
#: (transformers' ``Qwen2_5_VLVisionConfig`` default; the published models say 2).
TOKENS_PER_SECOND = 4
#: The ``"video"`` entry: transformers' video input names -> the image tower's arguments
#: (``second_per_grid_ts`` is the positions' alone).
VIDEO_INPUT = SharedEncoder(
    "image",
    {
        "pixel_values_videos": "pixel_values",
        "video_grid_thw": "image_grid_thw",
        "second_per_grid_ts": None,
    },
)


def qwen2(
    vocab_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    embed_dim: int,
    intermediate_dim: int,
    max_seq_len: int,
    *,
    rope_base: float = 1_000_000.0,
    norm_eps: float = 1e-6,
    tie_word_embeddings: bool = False,
    mrope_section: Sequence[int] | None = (16, 24, 24),
    attn_dropout: float = 0.0,
) -> TransformerDecoder:
    """Qwen2's text stack: the Llama layout with biases on q, k and v, plain rotary
    frequencies, and M-RoPE by ``mrope_section`` (None: 1-D RoPE, the text-only Qwen2)."""
    return llama3_2(
        vocab_size,
        num_layers,
        num_heads,
        num_kv_heads,
        embed_dim,
        max_seq_len,
        attn_dropout=attn_dropout,
        rope_base=rope_base,
        intermediate_dim=intermediate_dim,
        norm_eps=norm_eps,
        scale_factor=None,
        tie_word_embeddings=tie_word_embeddings,
        qkv_bias=True,
        mrope_section=mrope_section,
    )


def qwen2_vl(
    *,
    text: Mapping[str, Any],
    vision: Mapping[str, Any],
    image_token_id: int,
    model_type: str = "qwen2_5_vl",
    video_token_id: int | None = None,
    tokens_per_second: float | None = None,
) -> EarlyFusion:
    """A Qwen2-VL (``model_type="qwen2_vl"``) or Qwen2.5-VL model: ``EarlyFusion(decoder,
    {"image": tower}, {"image": image_token_id}, hooks=[MRopePositions(...)])``, with a
    ``"video"`` entry sharing the tower when ``video_token_id`` is given (see
    :func:`qwen_fusion`).

    The tower's merger is registered with :func:`fusion.register_fusion_module`. Called
    without positions, or with fusion's 1-D ones, the model derives M-RoPE positions from its
    ``<|image_pad|>`` (and ``<|video_pad|>``) placeholders and their inputs' grids.

    Args:
        text: keyword arguments of :func:`fusion.models.llama3_2` (with ``qkv_bias=True`` and
            an ``mrope_section`` for Qwen2's stack, as :func:`qwen2` passes them).
        vision: keyword arguments of the tower,
            :class:`~fusion.encoders.Qwen2VisionTransformer` or
            :class:`~fusion.encoders.Qwen25VisionTransformer`.
        image_token_id: the ``<|image_pad|>`` id.
        model_type: ``"qwen2_vl"`` or ``"qwen2_5_vl"``: which tower.
        video_token_id: the ``<|video_pad|>`` id; None: no video entry.
        tokens_per_second: Qwen2.5-VL's ``vision_config.tokens_per_second`` (transformers'
            default 4 when None); ignored for Qwen2-VL, whose videos' temporal row is the
            frame index.

    Raises:
        ValueError: an unknown ``model_type``, a decoder without M-RoPE, a tower whose output
            width is not the decoder's, or any argument the parts refuse.
    """
    if model_type not in VISION_TOWERS:
        raise ValueError(f"model_type: expected one of {list(VISION_TOWERS)}, got {model_type!r}")
    if model_type == "qwen2_5_vl":
        tokens_per_second = TOKENS_PER_SECOND if tokens_per_second is None else tokens_per_second
        if isinstance(tokens_per_second, bool) or not (
            isinstance(tokens_per_second, int | float) and 0 < tokens_per_second < 2**31
        ):
            raise ValueError(
                f"tokens_per_second: expected a positive number, got {tokens_per_second!r}"
            )
    else:
        tokens_per_second = None
    return qwen_fusion(
        llama3_2(**text),
        VISION_TOWERS[model_type](**vision),
        image_token_id,
        video_token_id=video_token_id,
        tokens_per_second=tokens_per_second,
    )


def qwen_fusion(
    decoder: TransformerDecoder,
    tower: Any,
    image_token_id: int,
    *,
    video_token_id: int | None = None,
    tokens_per_second: float | None = None,
    split_frames: bool = False,
) -> EarlyFusion:
    """``EarlyFusion(decoder, {"image": tower}, {"image": image_token_id},
    hooks=[MRopePositions(...)])`` for a Qwen tower (its merger registered with
    :func:`fusion.register_fusion_module`), what the Qwen-VL builders without DeepStack share.

    Videos: with ``video_token_id``, a ``"video"`` entry sharing the tower (see the module
    docstring), its input ``pixel_values_videos``, ``video_grid_thw`` and optionally
    ``second_per_grid_ts`` as transformers' processors name them; a video's temporal row is
    the frame index, or with ``tokens_per_second`` (Qwen2.5-VL) ``long(frame *
    tokens_per_second * second_per_grid_ts)``; with ``split_frames`` (Qwen3.5) each temporal
    patch is a media of its own, as per-frame timestamps separate them.

    Raises:
        ValueError: a tower whose output width is not the decoder's.
    """
    if tower.out_dim != decoder.embed_dim:
        raise ValueError(
            f"vision: the tower writes rows of width {tower.out_dim}, the decoder's width is "
            f"{decoder.embed_dim}"
        )
    register_fusion_module(tower.merger)
    tokens, shared, inputs = video_entry(
        image_token_id, video_token_id, tokens_per_second, split_frames
    )
    return EarlyFusion(
        decoder,
        {"image": tower},
        tokens,
        shared_encoders=shared,
        hooks=[MRopePositions(inputs, tower.spatial_merge_size)],
    )


def video_entry(
    image_token_id: int,
    video_token_id: int | None,
    tokens_per_second: float | None = None,
    split_frames: bool = False,
) -> tuple[dict[str, int], dict[str, SharedEncoder], list[str | MRopeInput]]:
    """The Qwen builders' placeholder ids, shared entries and M-RoPE inputs: the image entry,
    and with ``video_token_id`` the ``"video"`` entry (:data:`VIDEO_INPUT`), its temporal row
    scaled by ``tokens_per_second`` (Qwen2.5-VL) or each temporal patch a media of its own
    (``split_frames``: Qwen3-VL, Qwen3.5)."""
    if video_token_id is None:
        return {"image": image_token_id}, {}, ["image"]
    video = MRopeInput("video", "video_grid_thw", tokens_per_second, split_frames=split_frames)
    tokens = {"image": image_token_id, "video": video_token_id}
    return tokens, {"video": VIDEO_INPUT}, ["image", video]


def qwen3_vl(
    *,
    text: Mapping[str, Any],
    vision: Mapping[str, Any],
    image_token_id: int,
    video_token_id: int | None = None,
) -> EarlyFusion:
    """A Qwen3-VL model: ``EarlyFusion(decoder, {"image": tower}, {"image": image_token_id},
    hooks=[MRopePositions(...), DeepStackRows(...)])``, with a ``"video"`` entry sharing the
    tower when ``video_token_id`` is given (as this module's docstring describes).

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
