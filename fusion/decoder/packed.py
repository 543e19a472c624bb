"""Where the samples of packed rows start and end: what attention needs instead of a dense mask.

A packed row holds whole samples one after the other, then padding. Attention is causal within
each sample and never crosses a boundary. :class:`PackedSegments` says so in O(b * s) memory,
where the boolean ``[b, s, s]`` block-causal mask took O(b * s^2): the segments' lengths on
the host (so a backend can slice samples without reading the device), and on the device what
each backend takes (segment ids for FlexAttention, cumulative lengths for varlen attention).
"""

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from fusion._validation import check_int, describe, is_int

#: The attention backends over packed segments (see :mod:`fusion.decoder.packed_attention`):
#: ``"auto"`` (chosen per device and dtype), ``"sdpa"`` (one ``scaled_dot_product_attention``
#: call per sample), ``"flex"`` (compiled FlexAttention with a document-causal block mask) and
#: ``"varlen"`` (``torch.nn.attention.varlen.varlen_attn`` over cumulative lengths, CUDA).
PACKED_BACKENDS = ("auto", "sdpa", "flex", "varlen")


@dataclass(frozen=True)
class PackedSegments:
    """The segments of packed rows: each row's samples, in order, then its padding.

    Build it with :meth:`from_lengths` (as :func:`fusion.data.collate_packed` does) and pass it
    as ``mask`` to :class:`fusion.decoder.TransformerDecoder` (or an ``EarlyFusion`` around
    one): a token attends causally to the earlier tokens of its own sample only. The trailing
    padding of a row is a segment of its own; no sample attends to it and it attends to no
    sample, and its outputs are finite (which values depends on the backend, see
    :func:`fusion.decoder.packed_attention.packed_attention`).

    Attributes:
        lengths: per row, the lengths of its segments in order, summing to ``seq_len``: its
            samples', then its padding's when it has some.
        padding: per row, the length of its trailing padding (0: none; otherwise also the last
            entry of its ``lengths``).
        segment_ids: int32 [b, s]: each position's sample within its row (0, 1, ...), -1 for
            padding (FlexAttention's mask reads it).
        cu_seqlens: int32 [n_segments + 1]: where each segment starts in the flattened
            ``[b * s]`` positions, padding segments included, then ``b * s`` (varlen
            attention's cumulative lengths).
        max_length: the longest segment's length rounded up to a power of two (at most
            ``seq_len``): the bound varlen attention sizes its work by, rounded so that a
            compiled graph sees few distinct values.
        backend: one of :data:`PACKED_BACKENDS`.
        block_mask: FlexAttention's ``BlockMask`` for these segments on their device, made once
            per decoder forward for the ``"flex"`` backend (every layer shares it); None
            otherwise. Not moved by :meth:`to`.
        window: a token attends only to the ``window`` latest tokens of its sample, itself
            included (a sliding-window layer's segments, :meth:`with_window`); None: to all of
            them.
        blocks: integer [b, s] or None: within a sample, the tokens of one block (the same id
            > 0: one image's placeholders, Gemma 3) attend to each other both ways, the
            window bounding only how far back a query reaches; 0: causal
            (:meth:`with_blocks`). Only per-sample SDPA takes them.
    """

    lengths: tuple[tuple[int, ...], ...]
    padding: tuple[int, ...]
    segment_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    max_length: int
    backend: str = "auto"
    block_mask: Any = field(default=None, repr=False, compare=False)
    window: int | None = None
    blocks: torch.Tensor | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.backend not in PACKED_BACKENDS:
            raise ValueError(f"backend: expected one of {PACKED_BACKENDS}, got {self.backend!r}")
        if self.window is not None:
            check_int(self.window, "window", low=1)
        _check_lengths(self.lengths, self.padding)
        batch, seq_len = len(self.lengths), sum(self.lengths[0])
        ids = self.segment_ids
        if (
            not isinstance(ids, torch.Tensor)
            or ids.shape != (batch, seq_len)
            or (ids.dtype != torch.int32)
        ):
            got = describe(ids) if isinstance(ids, torch.Tensor) else type(ids).__name__
            raise ValueError(f"segment_ids: expected int32 [{batch}, {seq_len}], got {got}")
        segments = sum(len(row) for row in self.lengths)
        cu = self.cu_seqlens
        if (
            not isinstance(cu, torch.Tensor)
            or cu.shape != (segments + 1,)
            or (cu.dtype != torch.int32)
        ):
            got = describe(cu) if isinstance(cu, torch.Tensor) else type(cu).__name__
            raise ValueError(f"cu_seqlens: expected int32 [{segments + 1}], got {got}")
        if cu.device != ids.device:
            raise ValueError(
                f"cu_seqlens: expected the device of segment_ids ({ids.device}), got {cu.device}"
            )
        if self.max_length != _bound(self.lengths):
            raise ValueError(
                f"max_length: expected {_bound(self.lengths)} (the longest segment rounded up "
                f"to a power of two, at most seq_len), got {self.max_length!r}"
            )

    @classmethod
    def from_lengths(
        cls,
        lengths: Sequence[Sequence[int]],
        seq_len: int,
        *,
        backend: str = "auto",
        device: str | torch.device | None = None,
    ) -> "PackedSegments":
        """The segments of rows of ``seq_len`` positions holding samples of ``lengths``.

        Args:
            lengths: per row, its samples' lengths in order (at least one, each >= 1, at most
                ``seq_len`` in all); the rest of the row is padding.
            seq_len: positions per row, ``s``.
            backend: one of :data:`PACKED_BACKENDS`.
            device: where the tensors go (default: the CPU).

        Raises:
            ValueError: no row, an empty row, a length that is not a positive integer, a row
                longer than ``seq_len``, an unknown backend.
        """
        check_int(seq_len, "seq_len", low=1)
        if isinstance(lengths, str | bytes) or not isinstance(lengths, Sequence) or not lengths:
            raise ValueError(
                f"lengths: expected a list of rows of sample lengths, got {lengths!r:.80}"
            )
        rows, padding = [], []
        for r, row in enumerate(lengths):
            if isinstance(row, str | bytes) or not isinstance(row, Sequence) or not row:
                raise ValueError(
                    f"lengths[{r}]: expected a non-empty list of lengths, got {row!r:.80}"
                )
            for n in row:
                check_int(n, f"lengths[{r}]", low=1, expected="positive integers")
            used = sum(row)
            if used > seq_len:
                raise ValueError(f"lengths[{r}]: {used} tokens, more than seq_len={seq_len}")
            padding.append(seq_len - used)
            rows.append((*row, seq_len - used) if used < seq_len else tuple(row))
        ids = torch.full((len(rows), seq_len), -1, dtype=torch.int32)
        for r, row in enumerate(rows):
            samples = len(row) - (padding[r] > 0)
            counts = torch.tensor(row[:samples])
            ids[r, : seq_len - padding[r]] = torch.repeat_interleave(
                torch.arange(samples, dtype=torch.int32), counts
            )
        flat = [n for row in rows for n in row]
        cu = torch.zeros(len(flat) + 1, dtype=torch.int32)
        cu[1:] = torch.tensor(flat).cumsum(0)
        segments = cls(
            lengths=tuple(rows),
            padding=tuple(padding),
            segment_ids=ids,
            cu_seqlens=cu,
            max_length=_bound(rows),
            backend=backend,
        )
        return segments if device is None else segments.to(device)

    @property
    def batch_size(self) -> int:
        return len(self.lengths)

    @property
    def seq_len(self) -> int:
        return sum(self.lengths[0])

    @property
    def device(self) -> torch.device:
        return self.segment_ids.device

    def to(self, device: str | torch.device, *, non_blocking: bool = False) -> "PackedSegments":
        """The segments with their tensors on ``device`` (the host lengths as they are)."""
        return replace(
            self,
            segment_ids=self.segment_ids.to(device, non_blocking=non_blocking),
            blocks=None
            if self.blocks is None
            else self.blocks.to(device, non_blocking=non_blocking),
            cu_seqlens=self.cu_seqlens.to(device, non_blocking=non_blocking),
            block_mask=None,
        )

    def pin_memory(self) -> "PackedSegments":
        """The segments with their tensors in pinned host memory (a ``DataLoader``'s
        ``pin_memory=True`` calls this), for ``to(device, non_blocking=True)``."""
        return replace(
            self,
            segment_ids=self.segment_ids.pin_memory(),
            blocks=None if self.blocks is None else self.blocks.pin_memory(),
            cu_seqlens=self.cu_seqlens.pin_memory(),
            block_mask=None,
        )

    def with_backend(self, backend: str) -> "PackedSegments":
        """The same segments, attended by ``backend`` (one of :data:`PACKED_BACKENDS`)."""
        return replace(self, backend=backend, block_mask=None)

    def with_window(self, window: int | None) -> "PackedSegments":
        """The same segments, each token attending to the ``window`` latest tokens of its
        sample only (None: all of them)."""
        return replace(self, window=window, block_mask=None)

    def with_blocks(self, blocks: torch.Tensor | None) -> "PackedSegments":
        """The same segments, the tokens of each block attending to each other both ways
        (``blocks``: integer [b, s] on their device, 0 for causal tokens; see the
        attribute)."""
        return replace(self, blocks=blocks, block_mask=None)

    def dense_mask(self) -> torch.Tensor:
        """The boolean block-causal mask [b, s, s] these segments stand for, True where a query
        may attend to a key (padding attends causally among itself, so no row is empty): what
        ``collate_packed(..., attention="mask")`` returns. O(b * s^2) memory."""
        # Padding as its own segment: every segment gets an id of its own within its row.
        ids = torch.where(self.segment_ids >= 0, self.segment_ids, self.seq_len)
        same = ids[:, :, None] == ids[:, None, :]
        return same & causal_band(self.seq_len, self.window, self.device, self.blocks)


def causal_band(
    seq_len: int,
    window: int | None,
    device: torch.device,
    blocks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Boolean [s, s], True where query ``i`` may attend to key ``j``: ``j <= i``, and with a
    ``window`` also ``i - j < window`` (the query and the ``window - 1`` before it). With
    ``blocks`` ([..., s], 0 for causal tokens), [..., s, s]: also ``j > i`` where both are of
    one block (the same id > 0), the window still bounding ``i - j`` only, as transformers'
    Gemma 3 masks compose it."""
    allowed = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()
    if blocks is not None:
        same = (blocks[..., :, None] == blocks[..., None, :]) & (blocks[..., :, None] > 0)
        allowed = allowed | same
    if window is None:
        return allowed
    index = torch.arange(seq_len, device=device)
    return allowed & (index[:, None] - index[None, :] < window)


def _check_lengths(lengths: Any, padding: Any) -> None:
    """Rows of positive integer lengths, each summing to the first row's total, with padding
    lengths that are their rows' last segments."""
    if not isinstance(lengths, tuple) or not lengths:
        raise ValueError(f"lengths: expected a non-empty tuple of rows, got {lengths!r:.80}")
    if not isinstance(padding, tuple) or len(padding) != len(lengths):
        raise ValueError(
            f"padding: expected a tuple of {len(lengths)} lengths (one per row), got "
            f"{padding!r:.80}"
        )
    seq_len = None
    for r, (row, pad) in enumerate(zip(lengths, padding, strict=True)):
        if not isinstance(row, tuple) or not row or any(not is_int(n, 1) for n in row):
            raise ValueError(
                f"lengths[{r}]: expected a non-empty tuple of positive integers, got {row!r:.80}"
            )
        if seq_len is None:
            seq_len = sum(row)
        if sum(row) != seq_len:
            raise ValueError(
                f"lengths[{r}]: expected segments summing to seq_len={seq_len} (row 0's), got "
                f"{sum(row)}"
            )
        if not is_int(pad) or not (pad == 0 or pad == row[-1]):
            raise ValueError(
                f"padding[{r}]: expected 0 or the row's last segment ({row[-1]}), got {pad!r}"
            )
        if pad == sum(row):
            raise ValueError(f"lengths[{r}]: expected at least one sample, got padding only")


def _bound(lengths: Sequence[Sequence[int]]) -> int:
    longest, seq_len = max(max(row) for row in lengths), sum(lengths[0])
    return min(1 << (longest - 1).bit_length(), seq_len)
