"""LLaVA: a CLIP vision tower and an MLP projector fused into a ``llama3_2`` decoder."""

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from fusion.early_fusion import EarlyFusion, register_fusion_module
from fusion.encoders.clip import ClipVisionTransformer
from fusion.encoders.connectors import LlavaProjector
from fusion.families.llama.builders import llama3_2

FEATURE_STRATEGIES = ("default", "full")


def rows_per_image(patches: int, strategy: str, class_tokens: int = 1) -> int:
    """The rows LLaVA gives an image of ``patches`` patches: those and the tower's
    ``class_tokens`` (CLIP's one), less the class token the ``"default"`` strategy drops
    (transformers' formula, ``num_additional_image_tokens`` being ``class_tokens``)."""
    return patches + class_tokens - int(strategy == "default")


class LlavaImageEncoder(nn.Module):
    """Images -> rows for :class:`fusion.EarlyFusion`, as LLaVA computes them.

    The hidden states ``vision_feature_layer`` of the tower (one number, or several whose
    features are concatenated) are taken without the class token (``"default"``) or with it
    (``"full"``), then projected. The projector is registered with
    :func:`fusion.register_fusion_module`.

    Args:
        vision_tower: the CLIP vision transformer (kept as ``self.vision_tower``).
        multi_modal_projector: the projector (kept as ``self.multi_modal_projector``); its
            input width must be the tower's width times the number of feature layers.
        vision_feature_layer: hidden-state number(s), as
            :meth:`~fusion.encoders.ClipVisionTransformer.hidden_states` numbers them.
        vision_feature_select_strategy: ``"default"`` (drop the class token) or ``"full"``.

    Raises:
        ValueError: an unknown strategy, a layer number out of range, no layer, or a projector
            whose input width does not match.
    """

    def __init__(
        self,
        vision_tower: ClipVisionTransformer,
        multi_modal_projector: LlavaProjector,
        *,
        vision_feature_layer: int | Sequence[int] = -2,
        vision_feature_select_strategy: str = "default",
    ) -> None:
        super().__init__()
        if vision_feature_select_strategy not in FEATURE_STRATEGIES:
            raise ValueError(
                f"vision_feature_select_strategy: expected one of {list(FEATURE_STRATEGIES)}, "
                f"got {vision_feature_select_strategy!r}"
            )
        layers = (
            [vision_feature_layer]
            if isinstance(vision_feature_layer, int)
            else list(vision_feature_layer)
        )
        if not layers:
            raise ValueError("vision_feature_layer: expected at least one layer, got none")
        for layer in layers:
            vision_tower.resolve_layer(layer)
        expected = vision_tower.hidden_size * len(layers)
        if multi_modal_projector.linear_1.in_features != expected:
            raise ValueError(
                f"multi_modal_projector: expected an input width of {expected} (width "
                f"{vision_tower.hidden_size} x {len(layers)} feature layers), got "
                f"{multi_modal_projector.linear_1.in_features}"
            )
        self.vision_tower = vision_tower
        self.multi_modal_projector = multi_modal_projector
        register_fusion_module(multi_modal_projector)
        self.vision_feature_layer = (
            vision_feature_layer if isinstance(vision_feature_layer, int) else layers
        )
        self.vision_feature_select_strategy = vision_feature_select_strategy
        self._layers = layers

    @property
    def tokens_per_image(self) -> int:
        """Rows (placeholder tokens) per image."""
        return rows_per_image(self.vision_tower.num_patches, self.vision_feature_select_strategy)

    @property
    def out_dim(self) -> int:
        return self.multi_modal_projector.linear_2.out_features

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Images [n, channels, image_size, image_size] -> packed rows [n, tokens_per_image, d].

        Raises:
            TypeError, ValueError: ``pixel_values`` of another type, shape or a non-floating
                dtype, before any computation.
        """
        states = self.vision_tower.hidden_states(pixel_values, self._layers)
        if self.vision_feature_select_strategy == "default":
            states = [state[:, 1:] for state in states]
        return self.multi_modal_projector(torch.cat(states, dim=-1))


def llava(
    *,
    text: Mapping[str, Any],
    vision: Mapping[str, Any],
    image_token_id: int,
    vision_feature_layer: int | Sequence[int] = -2,
    vision_feature_select_strategy: str = "default",
    projector_hidden_act: str = "gelu",
    projector_bias: bool = True,
) -> EarlyFusion:
    """A LLaVA model: ``EarlyFusion(llama3_2(**text), {"image": LlavaImageEncoder}, ...)``.

    Args:
        text: keyword arguments of :func:`fusion.models.llama3_2`.
        vision: keyword arguments of :class:`fusion.encoders.ClipVisionTransformer`.
        image_token_id: the placeholder id of image rows.
        vision_feature_layer, vision_feature_select_strategy: see :class:`LlavaImageEncoder`.
        projector_hidden_act, projector_bias: see :class:`fusion.encoders.LlavaProjector`.

    Returns:
        the model (randomly initialised), with ``EarlyFusion``'s default trainable flags.

    Raises:
        TypeError: ``image_token_id`` not an int.
        ValueError: any argument the parts refuse (named by the part).
    """
    decoder = llama3_2(**text)
    tower = ClipVisionTransformer(**vision)
    count = 1 if isinstance(vision_feature_layer, int) else len(list(vision_feature_layer))
    projector = LlavaProjector(
        tower.hidden_size * count, decoder.embed_dim, projector_hidden_act, projector_bias
    )
    encoder = LlavaImageEncoder(
        tower,
        projector,
        vision_feature_layer=vision_feature_layer,
        vision_feature_select_strategy=vision_feature_select_strategy,
    )
    return EarlyFusion(decoder, {"image": encoder}, {"image": image_token_id})
