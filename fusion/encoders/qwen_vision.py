"""Qwen2-VL's, Qwen2.5-VL's and Qwen3-VL's vision towers (patches -> merged rows of the
decoder's width), in plain PyTorch.

All take the image processor's flattened patches of any number of images (or videos) of any
size, concatenated, and a grid ``[n_images, 3]`` of each one's (t, h, w) in patches; they return
one row per ``spatial_merge_size`` x ``spatial_merge_size`` block of patches, images in order:
what transformers' vision model returns as ``pooler_output``. Qwen3-VL's also returns, per
DeepStack layer, rows of the same shape from an intermediate block (``deepstack_features``).

Parameter names are those of the checkpoints' ``visual.`` module without that prefix
(``patch_embed.proj.weight``, ``blocks.{i}.norm1``, ``blocks.{i}.attn.qkv``,
``blocks.{i}.attn.proj``, ``blocks.{i}.mlp...``, ``merger.ln_q``, ``merger.mlp.0``,
``merger.mlp.2``; Qwen3-VL: ``pos_embed``, ``merger.norm``, ``merger.linear_fc1``,
``merger.linear_fc2``, ``deepstack_merger_list.{j}...``), so they load by prefix alone.

The mergers are the connectors to the text decoder. This layer imports nothing above it, so
marking them for ``EarlyFusion(fusion_trainable=...)`` is the model builder's job
(``register_fusion_module(tower.merger)``, and each of Qwen3-VL's ``deepstack_merger_list``),
as for LLaVA's projector.

Grids are read on the host: keep ``image_grid_thw`` on the CPU, as preprocessing gives it (on
an accelerator, reading it costs one synchronisation). The attention plans built from it are
copied to the patches' device once per forward.

The code is in five modules, re-exported here (import from this module):
:mod:`~fusion.encoders.qwen_vision_plans` (patch positions and attention plans, from the grid),
:mod:`~fusion.encoders.qwen_vision_blocks` (norms, patch embedding, MLPs, mergers, rotary
attention, blocks), :mod:`~fusion.encoders.qwen_vision_tower` (what the towers share),
:mod:`~fusion.encoders.qwen2_vision` (Qwen2-VL, Qwen2.5-VL) and
:mod:`~fusion.encoders.qwen3_vision` (Qwen3-VL).
"""

from fusion.encoders.qwen2_vision import Qwen2VisionTransformer, Qwen25VisionTransformer
from fusion.encoders.qwen3_vision import Qwen3VisionTransformer, Qwen35VisionTransformer
from fusion.encoders.qwen_vision_blocks import (
    PatchEmbed,
    PatchMerger,
    Qwen3PatchMerger,
    Qwen3VisionMLP,
    QwenVisionAttention,
    QwenVisionBlock,
    RMSNorm,
    SwiGLU,
    rotary_angles,
)
from fusion.encoders.qwen_vision_plans import (
    AttentionPlan,
    Grid,
    bilinear_taps,
    frame_plan,
    merge_block_positions,
    window_plan,
)

__all__ = [
    "AttentionPlan",
    "Grid",
    "PatchEmbed",
    "PatchMerger",
    "Qwen2VisionTransformer",
    "Qwen3PatchMerger",
    "Qwen3VisionMLP",
    "Qwen3VisionTransformer",
    "Qwen25VisionTransformer",
    "Qwen35VisionTransformer",
    "QwenVisionAttention",
    "QwenVisionBlock",
    "RMSNorm",
    "SwiGLU",
    "bilinear_taps",
    "frame_plan",
    "merge_block_positions",
    "rotary_angles",
    "window_plan",
]
