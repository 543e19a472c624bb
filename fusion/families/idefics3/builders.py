"""Idefics3 / SmolVLM: a SigLIP vision tower and a pixel-shuffle connector fused into a
``llama3_2`` decoder."""

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from fusion.early_fusion import EarlyFusion, register_fusion_module
from fusion.encoders.connectors import Idefics3Connector
from fusion.encoders.siglip import SiglipVisionTransformer
from fusion.families.llama.builders import llama3_2

# SmolVLM-256M's shape: SmolLM2-135M's decoder, SigLIP base patch-16/512, 4x4 pixel shuffle
# (64 rows per 512 x 512 tile).
SMOLVLM_256M_TEXT: dict[str, Any] = {
    "vocab_size": 49_280,
    "num_layers": 30,
    "num_heads": 9,
    "num_kv_heads": 3,
    "embed_dim": 576,
    "max_seq_len": 8192,
    "intermediate_dim": 1536,
    "rope_base": 100_000,
    "norm_eps": 1e-5,
    "scale_factor": None,
    "tie_word_embeddings": False,
}
SMOLVLM_256M_VISION: dict[str, Any] = {
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "image_size": 512,
    "patch_size": 16,
    "hidden_act": "gelu_pytorch_tanh",
    "layer_norm_eps": 1e-6,
}
SMOLVLM_256M_SCALE_FACTOR = 4
SMOLVLM_256M_IMAGE_TOKEN_ID = 49_190


class Idefics3ImageEncoder(nn.Module):
    """Image tiles -> rows for :class:`fusion.EarlyFusion`, as Idefics3 computes them: the
    SigLIP tower's output, then the connector (registered with
    :func:`fusion.register_fusion_module`).

    Each tile (a crop of an image, or the whole image resized, see
    :class:`fusion.preprocessing.Idefics3ImageProcessor`) gives ``tokens_per_image`` rows, so
    an image split into ``k`` tiles fills ``k`` runs of placeholders.

    Args:
        vision_model: the vision tower (kept as ``self.vision_model``).
        connector: the connector (kept as ``self.connector``); its input width must be the
            tower's width times ``scale_factor**2``, and ``scale_factor`` must divide the side
            of the tower's patch grid.

    Raises:
        ValueError: the connector does not fit the tower.
    """

    def __init__(self, vision_model: SiglipVisionTransformer, connector: Idefics3Connector) -> None:
        super().__init__()
        scale = connector.scale_factor
        side = vision_model.image_size // vision_model.patch_size
        if side % scale:
            raise ValueError(
                f"scale_factor: expected a divisor of the patch grid's side {side} "
                f"(image_size / patch_size), got {scale}"
            )
        expected = vision_model.hidden_size * scale**2
        if connector.modality_projection.proj.in_features != expected:
            raise ValueError(
                f"connector: expected an input width of {expected} (width "
                f"{vision_model.hidden_size} x scale_factor**2), got "
                f"{connector.modality_projection.proj.in_features}"
            )
        self.vision_model = vision_model
        self.connector = connector
        register_fusion_module(connector)

    @property
    def tokens_per_image(self) -> int:
        """Rows (placeholder tokens) per tile."""
        return self.vision_model.num_patches // self.connector.scale_factor**2

    @property
    def out_dim(self) -> int:
        return self.connector.modality_projection.proj.out_features

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Tiles [n, channels, image_size, image_size] -> packed rows [n, tokens_per_image, d].

        Raises:
            TypeError, ValueError: ``pixel_values`` of another type, shape or a non-floating
                dtype, before any computation.
        """
        return self.connector(self.vision_model(pixel_values))


def idefics3(
    *,
    text: Mapping[str, Any],
    vision: Mapping[str, Any],
    image_token_id: int,
    scale_factor: int = 2,
) -> EarlyFusion:
    """An Idefics3 / SmolVLM model: ``EarlyFusion(llama3_2(**text), {"image":
    Idefics3ImageEncoder}, ...)``.

    Args:
        text: keyword arguments of :func:`fusion.models.llama3_2`.
        vision: keyword arguments of :class:`fusion.encoders.SiglipVisionTransformer`
            (``position_scheme`` is set to ``"bucketed"``, as Idefics3 assigns positions).
        image_token_id: the placeholder id of image rows.
        scale_factor: the connector's pixel-shuffle factor.

    Returns:
        the model (randomly initialised), with ``EarlyFusion``'s default trainable flags.

    Raises:
        TypeError: ``image_token_id`` not an int.
        ValueError: any argument the parts refuse (named by the part).
    """
    decoder = llama3_2(**text)
    tower = SiglipVisionTransformer(**{**vision, "position_scheme": "bucketed"})
    connector = Idefics3Connector(tower.hidden_size, decoder.embed_dim, scale_factor)
    encoder = Idefics3ImageEncoder(tower, connector)
    return EarlyFusion(decoder, {"image": encoder}, {"image": image_token_id})


def smolvlm_256m(max_seq_len: int = 8192) -> EarlyFusion:
    """A randomly initialised model of SmolVLM-256M's shape (see :data:`SMOLVLM_256M_TEXT`,
    :data:`SMOLVLM_256M_VISION`): about 256M parameters, 64 rows per 512 x 512 tile."""
    return idefics3(
        text={**SMOLVLM_256M_TEXT, "max_seq_len": max_seq_len},
        vision=SMOLVLM_256M_VISION,
        image_token_id=SMOLVLM_256M_IMAGE_TOKEN_ID,
        scale_factor=SMOLVLM_256M_SCALE_FACTOR,
    )
