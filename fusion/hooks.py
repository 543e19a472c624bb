"""Hooks a family gives :class:`fusion.EarlyFusion` for what its decoder computes beyond the
merge: M-RoPE positions derived from the placeholders (Qwen-VL), rows added after decoder
layers (Qwen3-VL's DeepStack), images attending to themselves both ways (Gemma 3).
``EarlyFusion`` calls each hook without knowing the family.

A hook is any object with :meth:`FusionHook.check` (at construction) and
:meth:`FusionHook.before_decoder` (each forward through this library's decoder, after the
encoders ran and before the decoder is called).
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from fusion._validation import INDEX_DTYPES, describe
from fusion.merge.placement import Placement
from fusion.positions import MediaGrids, mrope_positions


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


@dataclass(frozen=True)
class MRopeInput:
    """Where an encoder's input keeps what its M-RoPE positions need.

    Attributes:
        encoder: the encoder name (a shared entry too, :class:`fusion.SharedEncoder`).
        grids: the key of its ``[n, 3]`` (t, h, w) grids.
        tokens_per_second: None: the temporal row is the frame index (images, Qwen2-VL's
            videos). A number: it steps by ``tokens_per_second * seconds`` per temporal grid
            step (Qwen2.5-VL's videos), ``seconds`` taken from the input's ``seconds`` key
            (1 per media where the input has none, as transformers defaults it).
        seconds: the key of the ``[n]`` seconds one temporal grid step spans (a tensor, as
            the processor's ``second_per_grid_ts``; a sequence is taken as float32, as
            transformers' ``BatchFeature`` converts it).
        split_frames: each temporal patch of a media is a media of its own (t = 1), as
            Qwen3-VL's per-frame timestamps separate a video's frames (the grids are read on
            the host for it: keep them on the CPU, as the processors give them).
    """

    encoder: str
    grids: str = "image_grid_thw"
    tokens_per_second: float | None = None
    seconds: str = "second_per_grid_ts"
    split_frames: bool = False

    def media(self, value: Mapping[str, Any], placeholder_id: int) -> MediaGrids:
        """The :class:`~fusion.positions.MediaGrids` of this encoder's input ``value``.

        Raises:
            ValueError: ``seconds`` that are not one real number per grid row.
        """
        grids = value.get(self.grids)
        if (
            self.split_frames
            and isinstance(grids, torch.Tensor)
            and grids.dim() == 2
            and grids.size(1) == 3
            and grids.dtype in INDEX_DTYPES
        ):
            frames = grids[:, :1]
            grids = grids.repeat_interleave(frames.flatten(), dim=0)
            grids = torch.cat([torch.ones_like(grids[:, :1]), grids[:, 1:]], dim=1)
        if self.tokens_per_second is None or not isinstance(grids, torch.Tensor):
            return MediaGrids(placeholder_id, grids, None, self.grids)
        seconds = value.get(self.seconds)
        where = f"encoder_input[{self.encoder!r}][{self.seconds!r}]"
        if seconds is None:
            seconds = torch.ones(grids.size(0), dtype=torch.long)
        elif not isinstance(seconds, torch.Tensor):
            try:
                seconds = torch.tensor(seconds, dtype=torch.float32)
            except (TypeError, ValueError, RuntimeError):
                raise ValueError(
                    f"{where}: expected one number per {self.grids} row, got "
                    f"{type(seconds).__name__}"
                ) from None
        if (
            seconds.shape != (grids.size(0),)
            or seconds.dtype == torch.bool
            or seconds.dtype.is_complex
        ):
            raise ValueError(
                f"{where}: expected one number per {self.grids} row, [{grids.size(0)}], got "
                f"{describe(seconds)}"
            )
        return MediaGrids(placeholder_id, grids, self.tokens_per_second * seconds, self.grids)


class MRopePositions:
    """[3, b, s] M-RoPE positions for a decoder with multimodal rotary embeddings, derived as
    :func:`fusion.positions.mrope_positions` does from the 1-D ``input_pos`` (or none), the
    placeholders of ``encoders`` and their inputs' grids (and video seconds); 3-D positions
    given pass through. With an enabled KV cache they are carried on in the decoder's
    ``mrope_deltas``, so that decoding steps fed to the decoder continue them.

    Args:
        encoders: the encoders whose rows carry positions of their own: a name (its input's
            ``image_grid_thw``, the temporal row a frame index), a :class:`MRopeInput`, or
            a sequence of either (kinds placed on their own, e.g. images and videos).
        merge_size: the towers' spatial merge size (patches per row side).
    """

    def __init__(
        self, encoders: str | MRopeInput | Sequence[str | MRopeInput], merge_size: int
    ) -> None:
        listed = [encoders] if isinstance(encoders, str | MRopeInput) else list(encoders)
        self.inputs = tuple(e if isinstance(e, MRopeInput) else MRopeInput(e) for e in listed)
        self.merge_size = merge_size

    def __repr__(self) -> str:
        plain = all(i == MRopeInput(i.encoder) for i in self.inputs)
        names = [i.encoder if plain else i for i in self.inputs]
        shown = names[0] if len(names) == 1 else names
        return f"MRopePositions({shown!r}, {self.merge_size})"

    @property
    def encoder(self) -> str:
        """The first encoder's name (the image encoder's, for the families)."""
        return self.inputs[0].encoder

    def check(self, decoder: nn.Module, encoder_tokens: Mapping[str, int]) -> None:
        names = [i.encoder for i in self.inputs]
        if (
            not getattr(decoder, "multimodal_rope", False)
            or not names
            or any(name not in encoder_tokens for name in names)
            or len(set(names)) < len(names)
        ):
            raise ValueError(
                "mrope: expected distinct encoder names of this model over this library's "
                f"decoder with M-RoPE, got {self!r}"
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
        media = []
        for spec in self.inputs:
            given = encoder_input.get(spec.encoder)
            if given is not None and not isinstance(given, Mapping):
                # Rows computed beforehand (encode()) do not say where each media's rows sit.
                raise ValueError(
                    f"encoder_input[{spec.encoder!r}]: rows computed beforehand carry no "
                    f"{spec.grids} for the M-RoPE positions; pass the encoder's input "
                    f"(with {spec.grids}) or [3, b, s] input_pos"
                )
            media.append(spec.media(given or {}, placeholders[spec.encoder]))
        cached = decoder.caches_are_enabled()
        if input_pos is None and cached:  # the cache's next slots, as the decoder's default
            input_pos = decoder.kv_caches()[0].fill + torch.arange(
                tokens.size(1), device=tokens.device
            )
        # Every kind through ``media`` (the positional image kind left empty).
        positions, offsets = mrope_positions(
            tokens,
            input_pos,
            media[0].placeholder_id,
            None,
            self.merge_size,
            carry=decoder.mrope_deltas if cached else None,
            media=media,
        )
        if cached:
            decoder.mrope_deltas.copy_(offsets)
        return positions


class DeepStackRows:
    """For encoders that return ``(rows, layer_rows)`` (Qwen3-VL's DeepStack): ``rows``
    replace their placeholders as any encoder's, and ``layer_rows[k]`` (each shaped like
    ``rows``) is added to the output of decoder layer ``k`` at the same placeholders, through
    the decoder's ``after_layer`` (this library's decoder only; no layer is replaced, no key
    changes).

    Args:
        encoders: the name of such an encoder, or several (e.g. images and the videos that
            share their tower): one ``after_layer`` adds each one's rows at its own
            placeholders.
    """

    def __init__(self, encoders: str | Sequence[str]) -> None:
        self.encoders = (encoders,) if isinstance(encoders, str) else tuple(encoders)

    def __repr__(self) -> str:
        shown = self.encoders[0] if len(self.encoders) == 1 else list(self.encoders)
        return f"DeepStackRows({shown!r})"

    @property
    def encoder(self) -> str:
        """The first encoder's name (the image encoder's, for the families)."""
        return self.encoders[0]

    def check(self, decoder: nn.Module, encoder_tokens: Mapping[str, int]) -> None:
        if not self.encoders or any(name not in encoder_tokens for name in self.encoders):
            raise ValueError(
                "deepstack: expected encoder names of this model over this library's "
                f"decoder, got {self!r}"
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
        found = [(placeholders[name], self._split(rows, name)) for name in self.encoders]
        added = [(placeholder, layers) for placeholder, layers in found if layers]
        if added:

            def after_layer(index: int, hidden: torch.Tensor) -> torch.Tensor:
                for placeholder, layer_rows in added:
                    if index < len(layer_rows):
                        hidden = add_at_placeholders(hidden, tokens, placeholder, layer_rows[index])
                return hidden

            kwargs["after_layer"] = after_layer
        return input_pos

    @staticmethod
    def _split(rows: dict[str, Any], name: str) -> tuple[torch.Tensor, ...]:
        """Take encoder ``name``'s ``(rows, layer_rows)`` apart: its ``rows`` stay in ``rows``
        for the merge, its layer rows are returned (checked to be shaped alike)."""
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
