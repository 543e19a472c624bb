"""Where each encoder row goes: resolved, validated inputs shared by every merge implementation."""

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from fusion._validation import check_in_range, check_token_ids, describe
from fusion.merge.layouts import EncoderRows, Padded, as_layout


@dataclass(frozen=True)
class Placement:
    """One encoder's rows and placeholders, validated against the tokens.

    ``rows`` is 2-D: ``[n_rows, d]`` for packed rows, ``[b * width, d]`` for padded ones
    (``width`` is None for packed rows). ``is_placeholder`` is ``[b, s]``.
    """

    name: str
    token_id: int
    rows: torch.Tensor
    width: int | None
    is_placeholder: torch.Tensor

    def destinations(self) -> torch.Tensor:
        """Flat output row ``[0, b * s]`` of each of ``rows``; padding rows get ``b * s``.

        Row ``r`` goes to the ``r``-th placeholder (per sample when padded), found by a
        binary search in the running placeholder count: O(tokens) metadata, no host
        synchronisation and no data-dependent shapes. Output row ``b * s`` is a spill row
        that the implementations allocate and drop, so padding rows need no filtering.
        """
        batch, seq_len = self.is_placeholder.shape
        device = self.rows.device
        if self.width is None:
            running = self.is_placeholder.reshape(-1).cumsum(0)
            wanted = torch.arange(1, self.rows.size(0) + 1, device=device)
            return torch.searchsorted(running, wanted)  # b * s when missing
        running = self.is_placeholder.cumsum(1)
        wanted = torch.arange(1, self.width + 1, device=device).expand(batch, self.width)
        position = torch.searchsorted(running, wanted.contiguous())  # [b, width], s when missing
        sample_start = torch.arange(batch, device=device)[:, None] * seq_len
        spill = torch.full_like(position, batch * seq_len)
        return torch.where(position < seq_len, sample_start + position, spill).reshape(-1)


def resolve_placements(
    tokens: torch.Tensor,
    weight: torch.Tensor,
    encoder_rows: Mapping[str, EncoderRows],
    encoder_tokens: Mapping[str, int],
    eager_checks: bool | None,
) -> tuple[list[Placement], torch.Tensor]:
    """Validate every input of a merge and return the placements and the text ids.

    Text ids are ``tokens`` with every placeholder replaced by 0, so out-of-vocabulary
    placeholder ids never reach the embedding table; the remaining ids must lie in
    ``[0, vocab_size)``.
    """
    check_token_ids(tokens)
    if weight.dim() != 2:
        raise ValueError(f"weight: expected an embedding table [vocab, d], got {describe(weight)}")
    unknown = sorted(set(encoder_rows) - set(encoder_tokens))
    if unknown:
        raise ValueError(
            f"encoder_rows: names {unknown} have no placeholder id in encoder_tokens "
            f"(known: {sorted(encoder_tokens)})"
        )
    ids = sorted(encoder_tokens.values())
    if len(set(ids)) != len(ids):
        raise ValueError(f"encoder_tokens: expected distinct placeholder ids, got {encoder_tokens}")

    dim = weight.size(1)
    eager = tokens.device.type == "cpu" if eager_checks is None else eager_checks
    eager = eager and not torch.compiler.is_compiling()
    placements = []
    any_placeholder = torch.zeros_like(tokens, dtype=torch.bool)
    for name, token_id in encoder_tokens.items():
        is_placeholder = tokens == token_id
        any_placeholder |= is_placeholder
        layout = as_layout(encoder_rows.get(name, weight.new_empty(0, dim)))
        rows = _check_rows(name, layout.rows, weight, tokens, isinstance(layout, Padded))
        width = rows.size(1) if isinstance(layout, Padded) else None
        placement = Placement(name, token_id, rows.reshape(-1, dim), width, is_placeholder)
        _check_counts(placement, eager)
        placements.append(placement)
    text_ids = tokens.masked_fill(any_placeholder, 0)
    check_in_range(text_ids, "tokens (text positions)", 0, weight.size(0))
    return placements, text_ids


def _check_rows(
    name: str, rows: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor, padded: bool
) -> torch.Tensor:
    dim = weight.size(1)
    what = f"encoder {name!r} rows"
    if padded:
        expected = f"padded rows [{tokens.size(0)}, max_tokens, {dim}]"
        ok = rows.dim() == 3 and rows.size(0) == tokens.size(0) and rows.size(2) == dim
    else:
        expected = f"packed rows [n_rows, {dim}] or [n_media, tokens_per_media, {dim}]"
        ok = rows.dim() in (2, 3) and rows.size(-1) == dim
    if not ok:
        raise ValueError(f"{what}: expected {expected}, got {describe(rows)}")
    if rows.dtype != weight.dtype:
        raise ValueError(
            f"{what}: expected dtype {weight.dtype} (the embedding table's), got {rows.dtype}; "
            "cast the encoder output"
        )
    if rows.device != tokens.device:
        raise ValueError(f"{what}: expected device {tokens.device}, got {rows.device}")
    return rows


def _check_counts(p: Placement, eager: bool) -> None:
    """Placeholder counts against rows: exact for packed, at most ``width`` per padded sample."""
    per_sample = p.is_placeholder.sum(1)
    if p.width is None:
        n_rows = p.rows.size(0)
        ok = per_sample.sum() == n_rows
        message = (
            f"encoder {p.name!r}: the tokens' placeholder count (id {p.token_id}) must equal "
            f"the {n_rows} packed rows given"
        )
    else:
        ok = (per_sample <= p.width).all()
        message = (
            f"encoder {p.name!r}: a sample holds more placeholders (id {p.token_id}) than the "
            f"padded width {p.width}"
        )
    if not eager:
        torch._assert_async(ok, message)
    elif not bool(ok):
        counts = per_sample.tolist()
        shown = counts if len(counts) <= 16 else [*counts[:16], "..."]
        raise ValueError(f"{message}; per-sample placeholder counts: {shown}")
