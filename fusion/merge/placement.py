"""Where each encoder row goes: resolved, validated inputs shared by every merge implementation."""

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

from fusion._validation import check_in_range, check_values, describe, host_reads_are_free, is_int
from fusion.merge.layouts import EncoderRows, Packed, Padded


@dataclass(frozen=True)
class Placement:
    """One encoder's rows, 2-D (``[n_rows, d]`` packed, ``width`` None; ``[b * width, d]``
    padded), and its placeholders ``is_placeholder`` [b, s], validated against the tokens."""

    name: str
    token_id: int
    rows: torch.Tensor
    width: int | None
    is_placeholder: torch.Tensor

    def destinations(self, *, spill_column: bool = False) -> torch.Tensor:
        """Output row of each of ``rows`` in the flat ``[b * s]`` output (with ``spill_column``:
        ``[b * (s + 1)]``, its last column dropped): the ``r``-th placeholder (per sample when
        padded), by a binary search in the running count (O(tokens), sync-free, static shapes).
        Padding rows, and placeholders missing when counts went unchecked on the host, go to a
        spill row that the implementations allocate and drop (``b * s``, or the spill column)."""
        batch, seq_len = self.is_placeholder.shape
        stride = seq_len + spill_column
        device = self.rows.device
        if self.width is None:
            running = self.is_placeholder.reshape(-1).cumsum(0)
            wanted = torch.arange(1, self.rows.size(0) + 1, device=device)
            flat = torch.searchsorted(running, wanted)  # b * s when missing
            if not spill_column:
                return flat
            sample = torch.div(flat, max(seq_len, 1), rounding_mode="floor")  # a spill column each
            return torch.where(flat < batch * seq_len, flat + sample, batch * stride - 1)
        running = self.is_placeholder.cumsum(1)
        wanted = torch.arange(1, self.width + 1, device=device).expand(batch, self.width)
        position = torch.searchsorted(running, wanted.contiguous())  # [b, width], s when missing
        sample_start = torch.arange(batch, device=device)[:, None] * stride
        if spill_column:  # position s is the sample's own spill column
            return (sample_start + position).reshape(-1)
        spill = torch.full_like(position, batch * seq_len)
        return torch.where(position < seq_len, sample_start + position, spill).reshape(-1)


def resolve_placements(
    tokens: torch.Tensor,
    encoder_rows: Mapping[str, EncoderRows],
    encoder_tokens: Mapping[str, int],
    *,
    vocab_size: int | None,
    eager_checks: bool | None,
) -> tuple[list[Placement], torch.Tensor]:
    """The placements and the text ids: ``tokens`` (ids [b, s]) with placeholders as 0, so
    placeholder ids never reach the embedding, checked to lie in ``[0, vocab_size)``. Rows are
    checked against the tokens here, against the text embeddings by :func:`match_text`."""
    if not isinstance(encoder_rows, Mapping):
        raise TypeError(
            f"encoder_rows: expected a mapping of encoder name -> rows, got "
            f"{type(encoder_rows).__name__}"
        )
    check_encoder_tokens(encoder_tokens)
    unknown = sorted(set(encoder_rows) - set(encoder_tokens))
    if unknown:
        raise ValueError(
            f"encoder_rows: names {unknown} have no placeholder id in encoder_tokens "
            f"(known: {sorted(encoder_tokens)})"
        )
    eager = host_reads_are_free(tokens.device) if eager_checks is None else eager_checks
    eager = eager and not torch.compiler.is_compiling()
    placements = []
    any_placeholder = torch.zeros_like(tokens, dtype=torch.bool)
    for name, token_id in encoder_tokens.items():
        is_placeholder = tokens == token_id
        any_placeholder |= is_placeholder
        if name in encoder_rows:
            rows, width = _checked_rows(name, encoder_rows[name], tokens)
        else:  # no rows: its placeholders must not appear
            rows, width = tokens.new_empty(0, 0, dtype=torch.float32), None
        placement = Placement(name, token_id, rows, width, is_placeholder)
        _check_counts(placement, eager)
        placements.append(placement)
    text_ids = tokens.masked_fill(any_placeholder, 0)
    if vocab_size is not None:
        check_in_range(text_ids, "tokens (text positions)", 0, vocab_size)
    return placements, text_ids


class PlaceholderIds(Mapping[str, int]):
    """Encoder name -> placeholder id, read-only and checked once when built, so a model that
    merges on every forward does not check them again."""

    def __init__(self, encoder_tokens: Mapping[str, int]) -> None:
        check_encoder_tokens(encoder_tokens)
        self._ids = dict(encoder_tokens)

    def __getitem__(self, name: str) -> int:
        return self._ids[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._ids)

    def __len__(self) -> int:
        return len(self._ids)

    def __repr__(self) -> str:
        return repr(self._ids)


def check_encoder_tokens(encoder_tokens: Mapping[str, int]) -> None:
    """Raise unless ``encoder_tokens`` maps names to distinct Python int placeholder ids."""
    if isinstance(encoder_tokens, PlaceholderIds):
        return  # checked when built
    if not isinstance(encoder_tokens, Mapping):
        raise TypeError(
            "encoder_tokens: expected a mapping of encoder name -> placeholder id, got "
            f"{type(encoder_tokens).__name__}"
        )
    for name, token_id in encoder_tokens.items():
        if not isinstance(name, str) or not is_int(token_id):
            raise TypeError(
                "encoder_tokens: expected str names and int placeholder ids, got "
                f"{name!r}: {token_id!r} ({type(token_id).__name__})"
            )
    ids = list(encoder_tokens.values())
    if len(set(ids)) != len(ids):
        raise ValueError(
            f"encoder_tokens: expected distinct placeholder ids, got {dict(encoder_tokens)}"
        )


def match_text(placements: list[Placement], text: torch.Tensor) -> list[Placement]:
    """Check each encoder's rows against the text embeddings ``text`` [..., d]: same width,
    same dtype (under ``torch.autocast``, floating rows are cast to the text's dtype)."""
    dim, dtype = text.size(-1), text.dtype
    autocast = torch.is_autocast_enabled(text.device.type)
    matched = []
    for p in placements:
        rows = p.rows
        what = f"encoder {p.name!r} rows"
        if rows.numel() == 0 and rows.size(-1) != dim:  # no rows at all: any empty shape
            rows = text.new_empty(rows.size(0), dim)
        if rows.size(-1) != dim:
            raise ValueError(
                f"{what}: expected width {dim} (the text embeddings'), got {describe(rows)}"
            )
        if rows.dtype != dtype:
            if not autocast:
                raise ValueError(
                    f"{what}: expected dtype {dtype} (the text embeddings'), got {rows.dtype}; "
                    "cast the encoder output, or run under torch.autocast, which casts it"
                )
            rows = rows.to(dtype)
        matched.append(dataclasses.replace(p, rows=rows))
    return matched


def _checked_rows(
    name: str, given: EncoderRows, tokens: torch.Tensor
) -> tuple[torch.Tensor, int | None]:
    """An encoder's rows checked against the tokens, as [n_rows, d], and the padded width."""
    what = f"encoder {name!r} rows"
    layout = Packed(given) if isinstance(given, torch.Tensor) else given  # a bare tensor: packed
    if not isinstance(layout, Packed | Padded) or not isinstance(layout.rows, torch.Tensor):
        raise TypeError(
            f"{what}: expected a tensor, or a Packed or Padded of a tensor, got {given!r:.80}"
        )
    rows, padded = layout.rows, isinstance(layout, Padded)
    if padded:
        expected = f"padded rows [{tokens.size(0)}, max_tokens, d]"
        ok = rows.dim() == 3 and rows.size(0) == tokens.size(0)
    else:
        expected = "packed rows [n_rows, d] or [n_media, tokens_per_media, d]"
        ok = rows.dim() in (2, 3)
    if not ok:
        raise ValueError(f"{what}: expected {expected}, got {describe(rows)}")
    if not rows.is_floating_point():
        raise ValueError(f"{what}: expected floating rows, got {describe(rows)}")
    if rows.device != tokens.device:
        raise ValueError(
            f"{what}: expected device {tokens.device} (the tokens'), got {rows.device}"
        )
    return rows.reshape(-1, rows.size(-1)), rows.size(1) if padded else None


def _check_counts(p: Placement, eager: bool) -> None:
    """Placeholder counts against rows: exact for packed, at most ``width`` per padded sample."""
    per_sample = p.is_placeholder.sum(1)
    if p.width is None:
        ok = per_sample.sum() == p.rows.size(0)
        wrong = f"the tokens' placeholder count (id {p.token_id}) must equal the {p.rows.size(0)}"
        message = f"encoder {p.name!r}: {wrong} packed rows given"
    else:
        ok = (per_sample <= p.width).all()
        wrong = f"a sample holds more placeholders (id {p.token_id}) than the padded width"
        message = f"encoder {p.name!r}: {wrong} {p.width}"

    def counts() -> str:
        shown: list = per_sample.tolist()
        shown = shown if len(shown) <= 16 else [*shown[:16], "..."]
        return f"; per-sample placeholder counts: {shown}"

    check_values(ok, message, eager=eager, details=counts)
