"""Gemma 3: its text stack (sliding-window and full-attention layers, each with its own rotary
base, GeGLU MLPs and four zero-centred norms per layer) and, for the vision models, a SigLIP
tower whose patches are average-pooled, normed and projected into it, the images attending
to themselves both ways."""

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from fusion._validation import check_int
from fusion.decoder import (
    FeedForward,
    FewRowsLinear,
    MultiHeadAttention,
    RotaryPositionalEmbeddings,
    ScaledEmbedding,
    TransformerDecoder,
    TransformerSelfAttentionLayer,
    ZeroCenteredRMSNorm,
)
from fusion.early_fusion import EarlyFusion, register_fusion_module
from fusion.encoders.siglip import SiglipVisionTransformer
from fusion.hooks import ImageBlocks

#: The layer kinds of ``layer_types``, as Hugging Face's configs name them.
LAYER_TYPES = ("sliding_attention", "full_attention")


def default_layer_types(num_layers: int, pattern: int = 6) -> list[str]:
    """Every ``pattern``-th layer full attention, the others sliding-window (transformers'
    default when a config gives no ``layer_types``, from its ``sliding_window_pattern``)."""
    return [
        "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
        for i in range(num_layers)
    ]


def gemma3_text(
    vocab_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    embed_dim: int,
    intermediate_dim: int,
    max_seq_len: int,
    *,
    head_dim: int = 256,
    layer_types: Sequence[str] | None = None,
    sliding_window: int | None = 4096,
    query_pre_attn_scalar: float = 256,
    rope_base: float = 1_000_000.0,
    rope_local_base: float = 10_000.0,
    rope_linear_factor: float | None = None,
    norm_eps: float = 1e-6,
    tie_word_embeddings: bool = True,
    final_logit_softcap: float | None = None,
    attn_dropout: float = 0.0,
) -> TransformerDecoder:
    """Gemma 3's text decoder, as transformers 5.24's ``Gemma3TextModel`` and
    ``Gemma3ForCausalLM`` compute it.

    - token embeddings multiplied by ``sqrt(embed_dim)``, rounded to the weights' dtype
      (:class:`~fusion.decoder.ScaledEmbedding`);
    - each layer ``h = x + post_attn(attn(input_norm(x)));
      out = h + post_ffn(mlp(pre_ffn(h)))``, the four norms zero-centred RMSNorms
      (``x * (1 + w)`` in float32), the last two of each pair the layer's ``sa_scale`` and
      ``mlp_scale``;
    - GQA attention with zero-centred q/k norms per head, scaled by
      ``query_pre_attn_scalar ** -0.5``, rotary in Hugging Face's rotate-half layout (the
      checkpoints load with no rows permuted): base ``rope_local_base`` on the
      ``"sliding_attention"`` layers, which attend to the ``sliding_window`` latest positions,
      and ``rope_base`` with the frequencies divided by ``rope_linear_factor`` (Hugging Face's
      ``"linear"`` scaling) on the ``"full_attention"`` layers;
    - a GeGLU MLP (tanh-approximated GELU);
    - a final zero-centred norm, the output tied to the embedding by default, the logits
      soft-capped by ``final_logit_softcap`` when given.

    ``layer_types`` default: :func:`default_layer_types`; ``sliding_window`` may be None
    only where no layer slides. Initialisation, for training from
    scratch: the embedding rows at std ``embed_dim ** -0.5`` (of std 1 once scaled), the norms
    at zero (the identity scaling), linear layers PyTorch's default.

    Raises:
        ValueError: ``layer_types`` of another length or with another kind, sizes or a window
            that are not positive, head counts that do not divide, an odd ``head_dim``, or
            what the parts refuse.
    """
    for name, value in (
        ("vocab_size", vocab_size),
        ("num_layers", num_layers),
        ("num_heads", num_heads),
        ("num_kv_heads", num_kv_heads),
        ("embed_dim", embed_dim),
        ("intermediate_dim", intermediate_dim),
        ("max_seq_len", max_seq_len),
        ("head_dim", head_dim),
    ):
        check_int(value, name, low=1)
    kinds = default_layer_types(num_layers) if layer_types is None else list(layer_types)
    if len(kinds) != num_layers or any(kind not in LAYER_TYPES for kind in kinds):
        raise ValueError(
            f"layer_types: expected {num_layers} entries (num_layers), each one of "
            f"{list(LAYER_TYPES)}, got {kinds!r:.200}"
        )
    if "sliding_attention" in kinds or sliding_window is not None:
        check_int(sliding_window, "sliding_window", low=1)
    ropes = {
        "sliding_attention": RotaryPositionalEmbeddings(
            head_dim, max_seq_len, base=rope_local_base, rotate_half=True
        ),
        "full_attention": RotaryPositionalEmbeddings(
            head_dim,
            max_seq_len,
            base=rope_base,
            rotate_half=True,
            linear_factor=rope_linear_factor,
        ),
    }

    def norm(dim: int = embed_dim) -> ZeroCenteredRMSNorm:
        return ZeroCenteredRMSNorm(dim, eps=norm_eps)

    layers = [
        TransformerSelfAttentionLayer(
            attn=MultiHeadAttention(
                embed_dim,
                num_heads,
                num_kv_heads,
                head_dim,
                ropes[kind],
                attn_dropout,
                q_norm=norm(head_dim),
                k_norm=norm(head_dim),
                attn_scale=query_pre_attn_scalar**-0.5,
                sliding_window=sliding_window if kind == "sliding_attention" else None,
            ),
            mlp=FeedForward(embed_dim, intermediate_dim, activation="gelu_tanh"),
            sa_norm=norm(),
            mlp_norm=norm(),
            sa_scale=norm(),
            mlp_scale=norm(),
        )
        for kind in kinds
    ]
    tok_embeddings = ScaledEmbedding(vocab_size, embed_dim, embed_dim**0.5)
    with torch.no_grad():  # scaled in place: the same random draws, reproducible seeds
        tok_embeddings.weight.mul_(embed_dim**-0.5)
    return TransformerDecoder(
        tok_embeddings=tok_embeddings,
        layers=layers,
        max_seq_len=max_seq_len,
        norm=norm(),
        output=None if tie_word_embeddings else FewRowsLinear(embed_dim, vocab_size, bias=False),
        final_logit_softcap=final_logit_softcap,
    )


class Gemma3Projector(nn.Module):
    """Gemma 3's multimodal projector: the tower's patch grid average-pooled to
    ``tokens_per_image`` rows, each normed (a zero-centred RMSNorm, ``norm``) and multiplied
    by ``projection`` [vision_dim, text_dim], a bare parameter (transformers'
    ``mm_input_projection_weight``; not a linear layer, so LoRA's ``all-linear`` leaves it
    out, as peft does).

    Raises:
        ValueError: ``tokens_per_image`` not a square, or its side not dividing
            ``patches_per_side``.

    Shapes: patches [n, patches_per_side ** 2, vision_dim] -> rows [n, tokens_per_image,
    text_dim].
    """

    def __init__(
        self,
        vision_dim: int,
        text_dim: int,
        patches_per_side: int,
        tokens_per_image: int,
        eps: float = 1e-6,
    ) -> None:
        super().__init__()
        side = math.isqrt(check_int(tokens_per_image, "tokens_per_image", low=1))
        if side * side != tokens_per_image or patches_per_side % side:
            raise ValueError(
                f"tokens_per_image: expected a square whose side divides the tower's "
                f"{patches_per_side} patches per side, got {tokens_per_image}"
            )
        self.patches_per_side = patches_per_side
        self.tokens_per_image = tokens_per_image
        self.kernel = patches_per_side // side
        self.norm = ZeroCenteredRMSNorm(vision_dim, eps=eps)
        # For training from scratch: rows of about unit scale (transformers starts at zero).
        self.projection = nn.Parameter(torch.randn(vision_dim, text_dim) * vision_dim**-0.5)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        n, _, d = patches.shape
        side = self.patches_per_side
        grid = patches.transpose(1, 2).reshape(n, d, side, side)  # [n, d, side, side]
        pooled = nn.functional.avg_pool2d(grid, self.kernel).flatten(2).transpose(1, 2)
        return (self.norm(pooled) @ self.projection).type_as(patches)


class Gemma3ImageEncoder(nn.Module):
    """Images -> rows for :class:`fusion.EarlyFusion`, as Gemma 3 computes them: the SigLIP
    tower's output (``vision_tower``), then :class:`Gemma3Projector` (``projector``,
    registered with :func:`fusion.register_fusion_module`).

    Raises:
        ValueError: the projector does not fit the tower.

    Shapes: images [n, channels, image_size, image_size] -> rows [n, tokens_per_image, d].
    """

    def __init__(self, vision_tower: SiglipVisionTransformer, projector: Gemma3Projector) -> None:
        super().__init__()
        side = vision_tower.image_size // vision_tower.patch_size
        if projector.patches_per_side != side or projector.norm.scale.numel() != (
            vision_tower.hidden_size
        ):
            raise ValueError(
                f"projector: expected one for {side} x {side} patches of width "
                f"{vision_tower.hidden_size} (the tower's)"
            )
        self.vision_tower = vision_tower
        self.projector = projector
        register_fusion_module(projector)

    @property
    def tokens_per_image(self) -> int:
        """Rows (placeholder tokens) per image."""
        return self.projector.tokens_per_image

    @property
    def out_dim(self) -> int:
        return self.projector.projection.size(1)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.projector(self.vision_tower(pixel_values))


def gemma3(
    *,
    text: Mapping[str, Any],
    vision: Mapping[str, Any],
    image_token_id: int,
    tokens_per_image: int = 256,
) -> EarlyFusion:
    """A Gemma 3 vision model: ``EarlyFusion(gemma3_text(**text), {"image":
    Gemma3ImageEncoder}, {"image": image_token_id}, hooks=[ImageBlocks("image")])``: each
    image's placeholders attend to each other both ways, on the sliding layers too (the
    window bounding how far back), text causal.

    Args:
        text: keyword arguments of :func:`gemma3_text`.
        vision: keyword arguments of :class:`fusion.encoders.SiglipVisionTransformer`
            (SigLIP's fixed positions).
        image_token_id: the placeholder id of image rows.
        tokens_per_image: rows per image (``mm_tokens_per_image``), a square.

    Raises:
        ValueError: any argument the parts refuse (named by the part).
    """
    decoder = gemma3_text(**text)
    tower = SiglipVisionTransformer(**vision)
    projector = Gemma3Projector(
        tower.hidden_size,
        decoder.embed_dim,
        tower.image_size // tower.patch_size,
        tokens_per_image,
        tower.layer_norm_eps,
    )
    encoder = Gemma3ImageEncoder(tower, projector)
    return EarlyFusion(
        decoder, {"image": encoder}, {"image": image_token_id}, hooks=[ImageBlocks("image")]
    )
