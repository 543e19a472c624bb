"""Hooks a family gives :class:`fusion.EarlyFusion` for what its decoder computes beyond the
merge: M-RoPE positions derived from the placeholders (Qwen-VL), rows added after decoder
layers (Qwen3-VL's DeepStack), images attending to themselves both ways (Gemma 3).
``EarlyFusion`` calls each hook without knowing the family.

A hook is any object with :meth:`FusionHook.check` (at construction) and
:meth:`FusionHook.before_decoder` (each forward through this library's decoder, after the
encoders ran and before the decoder is called).
"""

from collections.abc import Mapping
from typing import Any, Protocol

import torch
from torch import nn

from fusion.merge.placement import Placement
from fusion.positions import grids_from, mrope_positions


class FusionHook(Protocol):
    def check(self, decoder: nn.Module, encoder_tokens: Mapping[str, int]) -> None:
        """Raise ``ValueError`` unless the hook fits this decoder and these encoders."""

    def before_decoder(
        self,
        decoder: Any,
        tokens: torch.Tensor,
        placeholders: Mapping[str, int],
        rows: dict[str, Any],
        encoder_input: Mapping[str, Any],
        input_pos: torch.Tensor | None,
        kwargs: dict[str, Any],
    ) -> torch.Tensor | None:
        """Before ``decoder(tokens, input_pos=..., **kwargs)``: the ``input_pos`` to pass
        (given: as the caller passed it). May replace encoder ``rows`` (the merge's input) and
        add decoder keyword arguments to ``kwargs``."""
        ...


class MRopePositions:
    """[3, b, s] M-RoPE positions for a decoder with multimodal rotary embeddings, derived as
    :func:`fusion.positions.mrope_positions` does from the 1-D ``input_pos`` (or none), the
    placeholders of ``encoder`` and its input's ``image_grid_thw``; 3-D positions given pass
    through. With an enabled KV cache they are carried on in the decoder's ``mrope_deltas``,
    so that decoding steps fed to the decoder continue them.

    Args:
        encoder: the name of the encoder whose rows carry positions of their own.
        merge_size: its spatial merge size (patches per row side).
    """

    def __init__(self, encoder: str, merge_size: int) -> None:
        self.encoder, self.merge_size = encoder, merge_size

    def __repr__(self) -> str:
        return f"MRopePositions({self.encoder!r}, {self.merge_size})"

    def check(self, decoder: nn.Module, encoder_tokens: Mapping[str, int]) -> None:
        if not getattr(decoder, "multimodal_rope", False) or self.encoder not in encoder_tokens:
            raise ValueError(
                "mrope: expected an encoder name of this model over this library's decoder "
                f"with M-RoPE, got {(self.encoder, self.merge_size)!r}"
            )

    def before_decoder(
        self,
        decoder: Any,
        tokens: torch.Tensor,
        placeholders: Mapping[str, int],
        rows: dict[str, Any],
        encoder_input: Mapping[str, Any],
        input_pos: torch.Tensor | None,
        kwargs: dict[str, Any],
    ) -> torch.Tensor | None:
        if isinstance(input_pos, torch.Tensor) and input_pos.dim() == 3:
            return input_pos
        given = encoder_input.get(self.encoder)
        if given is not None and not isinstance(given, Mapping):
            # Rows computed beforehand (encode()) do not say where each image's rows sit.
            raise ValueError(
                f"encoder_input[{self.encoder!r}]: rows computed beforehand carry no "
                "image_grid_thw for the M-RoPE positions; pass the encoder's input "
                "(pixel_values and image_grid_thw) or [3, b, s] input_pos"
            )
        cached = decoder.caches_are_enabled()
        if input_pos is None and cached:  # the cache's next slots, as the decoder's default
            input_pos = decoder.kv_caches()[0].fill + torch.arange(
                tokens.size(1), device=tokens.device
            )
        positions, offsets = mrope_positions(
            tokens,
            input_pos,
            placeholders[self.encoder],
            grids_from(encoder_input, self.encoder),
            self.merge_size,
            carry=decoder.mrope_deltas if cached else None,
        )
        if cached:
            decoder.mrope_deltas.copy_(offsets)
        return positions


class DeepStackRows:
    """For an encoder that returns ``(rows, layer_rows)`` (Qwen3-VL's DeepStack): ``rows``
    replace its placeholders as any encoder's, and ``layer_rows[k]`` (each shaped like
    ``rows``) is added to the output of decoder layer ``k`` at the same placeholders, through
    the decoder's ``after_layer`` (this library's decoder only; no layer is replaced, no key
    changes).

    Args:
        encoder: the name of that encoder.
    """

    def __init__(self, encoder: str) -> None:
        self.encoder = encoder

    def __repr__(self) -> str:
        return f"DeepStackRows({self.encoder!r})"

    def check(self, decoder: nn.Module, encoder_tokens: Mapping[str, int]) -> None:
        if self.encoder not in encoder_tokens:
            raise ValueError(
                "deepstack: expected an encoder name of this model over this library's "
                f"decoder, got {self.encoder!r}"
            )

    def before_decoder(
        self,
        decoder: Any,
        tokens: torch.Tensor,
        placeholders: Mapping[str, int],
        rows: dict[str, Any],
        encoder_input: Mapping[str, Any],
        input_pos: torch.Tensor | None,
        kwargs: dict[str, Any],
    ) -> torch.Tensor | None:
        layer_rows = self._split(rows)
        if layer_rows:
            placeholder = placeholders[self.encoder]

            def after_layer(index: int, hidden: torch.Tensor) -> torch.Tensor:
                if index >= len(layer_rows):
                    return hidden
                return add_at_placeholders(hidden, tokens, placeholder, layer_rows[index])

            kwargs["after_layer"] = after_layer
        return input_pos

    def _split(self, rows: dict[str, Any]) -> tuple[torch.Tensor, ...]:
        """Take the encoder's ``(rows, layer_rows)`` apart: its ``rows`` stay in ``rows`` for
        the merge, its layer rows are returned (checked to be shaped alike)."""
        name = self.encoder
        if not isinstance(rows.get(name), tuple):
            return ()
        main, layer_rows = rows[name]
        rows[name] = main
        for k, extra in enumerate(layer_rows):
            if not isinstance(extra, torch.Tensor) or extra.shape != main.shape:
                got = list(extra.shape) if isinstance(extra, torch.Tensor) else type(extra)
                raise ValueError(
                    f"encoder {name!r}: its layer rows [{k}] must be shaped like its rows "
                    f"{list(main.shape)}, got {got}"
                )
        return tuple(layer_rows)


class ImageBlocks:
    """Gemma 3's attention over images: the placeholders of ``encoder`` attend to each other
    both ways within each image's run of them, text and the rest causal, no image seeing a
    later one (the decoder's ``bidirectional`` block ids, derived here from where the rows
    are merged: each maximal run of placeholders in a row is one block, numbered 1, 2, ...
    along the row). Sync-free, in every mask form the decoder takes: padded, left-padded
    with a cache, packed rows (whose samples' blocks never meet: attention stays within a
    sample). Only where the encoder has input: decoding steps, and text, attend causally.

    Args:
        encoder: the name of the encoder whose placeholders attend both ways.
    """

    def __init__(self, encoder: str) -> None:
        self.encoder = encoder

    def __repr__(self) -> str:
        return f"ImageBlocks({self.encoder!r})"

    def check(self, decoder: nn.Module, encoder_tokens: Mapping[str, int]) -> None:
        if self.encoder not in encoder_tokens:
            raise ValueError(
                "image blocks: expected an encoder name of this model over this library's "
                f"decoder, got {self.encoder!r}"
            )

    def before_decoder(
        self,
        decoder: Any,
        tokens: torch.Tensor,
        placeholders: Mapping[str, int],
        rows: dict[str, Any],
        encoder_input: Mapping[str, Any],
        input_pos: torch.Tensor | None,
        kwargs: dict[str, Any],
    ) -> torch.Tensor | None:
        if self.encoder in rows:
            kwargs["bidirectional"] = placeholder_blocks(tokens, placeholders[self.encoder])
        return input_pos


def placeholder_blocks(tokens: torch.Tensor, placeholder_id: int) -> torch.Tensor:
    """Block ids [b, s] (int64) of the runs of ``placeholder_id`` in ``tokens`` [b, s]: the
    k-th run of a row is k, other tokens 0."""
    image = tokens == placeholder_id
    before = torch.nn.functional.pad(image, (1, 0))[:, :-1]  # the previous token's
    starts = image & ~before
    return torch.where(image, starts.long().cumsum(dim=1), 0)


def add_at_placeholders(
    hidden: torch.Tensor, tokens: torch.Tensor, placeholder_id: int, rows: torch.Tensor
) -> torch.Tensor:
    """``hidden`` [b, s, d] with packed ``rows`` [n, d] added at the ``n`` placeholders of
    ``tokens`` [b, s]: row ``k`` at the ``k``-th placeholder across the batch, placed as the
    merge places an encoder's rows (:meth:`fusion.merge.placement.Placement.destinations`),
    so each row stays in its sample; sync-free. Other positions are left as they are."""
    if rows.size(0) == 0:
        return hidden
    placement = Placement("deepstack", placeholder_id, rows, None, tokens == placeholder_id)
    flat = hidden.reshape(-1, hidden.size(-1))
    spill = flat.new_zeros(1, flat.size(1))  # where rows without a placeholder would go
    added = torch.cat([flat, spill]).index_add(0, placement.destinations(), rows.to(flat.dtype))
    return added[:-1].view_as(hidden)
