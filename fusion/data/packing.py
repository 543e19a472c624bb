"""Samples -> batches: packed (several samples per row, apart) or padded (one per row).

A packed row holds whole samples one after the other, then padding. Positions restart at 0
at every sample, and attention is block-causal: a token sees the earlier tokens of its own
sample only. The images of all samples are concatenated in order of appearance across the
batch (row by row, sample by sample), which is where :class:`fusion.EarlyFusion` puts packed
encoder rows: each sample's rows land at its own placeholders.

The batch's ``mask`` is the rows' :class:`fusion.decoder.PackedSegments` (each sample's
length on the host, segment ids and cumulative lengths on the device: O(b * s) memory), which
``TransformerDecoder.forward(mask=..., input_pos=...)`` attends with the backend its
``attention`` names: by default per-sample ``scaled_dot_product_attention`` on CPU,
``varlen_attn`` or FlexAttention on CUDA (see :mod:`fusion.decoder.packed_attention`).
``attention="mask"`` gives the boolean ``[b, s, s]`` block-causal mask instead (O(b * s^2);
padding sees earlier padding there, so no row of it is empty).

So a sample's logits in a packed row equal its logits alone (tested to 1e-5 in fp32), and
:func:`fusion.masked_token_loss` over a packed batch sums the same per-token losses.
"""

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from fusion._validation import check_int
from fusion.data.sample import IGNORE_INDEX, Sample
from fusion.decoder.packed import PACKED_BACKENDS, PackedSegments

#: What ``collate_packed(attention=...)`` takes: a packed-attention backend, or ``"mask"``.
ATTENTION_CHOICES = (*PACKED_BACKENDS, "mask")
#: The encoder inputs that stay on the CPU, uncast: read on the host as sizes and times.
HOST_INPUTS = ("image_grid_thw", "video_grid_thw", "second_per_grid_ts")
#: The encoder entry a batch's videos go to (the Qwen models' shared ``"video"`` entry).
VIDEO_ENCODER = "video"


@dataclass(frozen=True)
class Batch:
    """A training batch.

    Attributes:
        tokens: int64 [b, s], padded with the pad id.
        labels: int64 [b, s]: the target of each position or ``IGNORE_INDEX`` (prompt,
            placeholders, padding, each sample's last token).
        mask: the rows' :class:`~fusion.decoder.PackedSegments` (packed; O(b * s)), or with
            ``collate_packed(attention="mask")`` a bool [b, s, s] tensor, True where a query
            may attend to a key; None for a padded batch (plain causal attention: right
            padding is never seen by a real token).
        input_pos: int64 [b, s] positions restarting at every sample (packed); None for a
            padded batch (0, 1, ... in every row).
        encoder_input: ``{"image": {"pixel_values": float32 [tiles, 3, h, w]}}`` in order of
            appearance across the batch, or ``{}`` without images; for Qwen2-VL the patches
            ``[n_patches, d]`` and ``"image_grid_thw"`` [n_images, 3] (on the CPU, where the
            tower reads it); with videos, ``"video"``: ``"pixel_values_videos"`` [n_patches,
            d], ``"video_grid_thw"`` [n_videos, 3] and float32 ``"second_per_grid_ts"``
            [n_videos] (both on the CPU), in order of appearance across the batch as images.
        num_tokens: tokens that are not padding.
        num_targets: positions with a target (what the loss averages over).
        num_samples: samples in the batch.
    """

    tokens: torch.Tensor
    labels: torch.Tensor
    mask: PackedSegments | torch.Tensor | None
    input_pos: torch.Tensor | None
    encoder_input: dict[str, Any]
    num_tokens: int
    num_targets: int
    num_samples: int

    @property
    def padding_fraction(self) -> float:
        """The share of positions that are padding."""
        return 1.0 - self.num_tokens / max(self.tokens.numel(), 1)

    def model_inputs(self) -> dict[str, Any]:
        """Keyword arguments for ``model(**batch.model_inputs())`` (an ``EarlyFusion``; for a
        text-only decoder, drop ``encoder_input``, which is then empty)."""
        inputs: dict[str, Any] = {"tokens": self.tokens, "mask": self.mask}
        inputs["input_pos"] = self.input_pos
        if self.encoder_input:
            inputs["encoder_input"] = self.encoder_input
        return inputs

    def to(
        self,
        device: str | torch.device,
        *,
        pixel_dtype: torch.dtype | None = None,
        non_blocking: bool = False,
    ) -> "Batch":
        """The batch on ``device`` (pixels and video patches cast to ``pixel_dtype`` if
        given; grids and seconds, :data:`HOST_INPUTS`, stay on the CPU as they are)."""

        def move(tensor: Any, dtype: torch.dtype | None = None) -> Any:
            if tensor is None:
                return None
            if isinstance(tensor, PackedSegments):
                return tensor.to(device, non_blocking=non_blocking)
            return tensor.to(device=device, dtype=dtype, non_blocking=non_blocking)

        # Grids stay on the CPU: the vision tower reads them on the host (no synchronisation).
        encoder_input = {
            name: {
                key: value if key in HOST_INPUTS else move(value, pixel_dtype)
                for key, value in kwargs.items()
            }
            for name, kwargs in self.encoder_input.items()
        }
        return replace(
            self,
            tokens=move(self.tokens),
            labels=move(self.labels),
            mask=move(self.mask),
            input_pos=move(self.input_pos),
            encoder_input=encoder_input,
        )

    def pin_memory(self) -> "Batch":
        """The batch with its tensors (the mask's included) in pinned host memory, what a
        ``DataLoader`` with ``pin_memory=True`` calls, so that ``to(device,
        non_blocking=True)`` copies asynchronously."""

        def pin(value: Any) -> Any:
            if isinstance(value, dict):
                return {key: pin(item) for key, item in value.items()}
            return None if value is None else value.pin_memory()

        return replace(
            self,
            tokens=pin(self.tokens),
            labels=pin(self.labels),
            mask=pin(self.mask),
            input_pos=pin(self.input_pos),
            encoder_input=pin(self.encoder_input),
        )


def pack(lengths: Sequence[int], max_seq_len: int) -> list[list[int]]:
    """Greedy first-fit: each length, in the order given, goes to the first row with room.

    Deterministic (shuffle the samples beforehand with a seeded generator for randomness);
    O(n log n) with a max-tree over the rows' free space.

    Args:
        lengths: sample lengths, each in ``[1, max_seq_len]``.
        max_seq_len: the most tokens per row.

    Returns:
        the rows, each a list of indices into ``lengths`` in increasing order.

    Raises:
        ValueError: ``max_seq_len`` not a positive integer, a length that is not an integer in
            ``[1, max_seq_len]`` (named by index; fit samples first, see
            :func:`fusion.data.fit_sample`).
    """
    check_int(max_seq_len, "max_seq_len", low=1)
    for i, length in enumerate(lengths):
        if (
            isinstance(length, bool)
            or not isinstance(length, int)
            or not 1 <= length <= max_seq_len
        ):
            raise ValueError(
                f"lengths[{i}]: expected an integer in [1, max_seq_len={max_seq_len}], got "
                f"{length!r}"
            )
    size = 1
    while size < max(len(lengths), 1):
        size *= 2
    free = [0] * (2 * size)  # leaves: each row's free space (0 for rows not opened)
    rows: list[list[int]] = []
    for i, length in enumerate(lengths):
        if free[1] >= length:
            node = 1
            while node < size:  # leftmost leaf with room
                node = 2 * node if free[2 * node] >= length else 2 * node + 1
            row = node - size
        else:
            row = len(rows)
            rows.append([])
            node = size + row
            free[node] = max_seq_len
        rows[row].append(i)
        free[node] -= length
        node //= 2
        while node:
            free[node] = max(free[2 * node], free[2 * node + 1])
            node //= 2
    return rows


def pack_samples(samples: Sequence[Sample], max_seq_len: int) -> list[list[Sample]]:
    """:func:`pack` on the samples' lengths: the rows as lists of samples."""
    rows = pack([len(sample) for sample in samples], max_seq_len)
    return [[samples[i] for i in row] for row in rows]


def collate_packed(
    rows: Sequence[Sequence[Sample]],
    *,
    pad_id: int,
    seq_len: int | None = None,
    encoder: str = "image",
    attention: str = "auto",
) -> Batch:
    """Packed rows (e.g. from :func:`pack_samples`) -> a :class:`Batch` with block-causal
    attention and positions restarting per sample.

    Args:
        rows: each row's samples, in order.
        pad_id: the id padding takes.
        seq_len: the row length (default: the longest row), e.g. ``max_seq_len`` for shapes
            that never change.
        encoder: the name of the image encoder in ``encoder_input``.
        attention: how the decoder attends the rows: ``"auto"`` (per device and dtype),
            ``"sdpa"``, ``"flex"`` or ``"varlen"`` (``Batch.mask`` is then the rows'
            :class:`~fusion.decoder.PackedSegments` with that backend; see
            :mod:`fusion.decoder.packed_attention`), or ``"mask"``: a boolean [b, s, s]
            block-causal mask, the O(s^2) baseline.

    Raises:
        ValueError: no row, an empty row, a row longer than ``seq_len``, samples whose pixels
            (or video patches) differ in shape or dtype, a sample whose images or videos are
            not loaded
            (:meth:`ConversationEncoder.load_pixels`), an unknown ``attention``.
    """
    if attention not in ATTENTION_CHOICES:
        raise ValueError(f"attention: expected one of {ATTENTION_CHOICES}, got {attention!r}")
    return _collate(rows, pad_id, seq_len, encoder, attention=attention)


def collate_padded(
    samples: Sequence[Sample],
    *,
    pad_id: int,
    seq_len: int | None = None,
    encoder: str = "image",
) -> Batch:
    """One sample per row, right-padded (the ``--no-packing`` baseline): ``mask`` and
    ``input_pos`` are None (causal attention, positions from 0). Raises as
    :func:`collate_packed`."""
    return _collate([[sample] for sample in samples], pad_id, seq_len, encoder, attention=None)


def _collate(
    rows: Sequence[Sequence[Sample]],
    pad_id: int,
    seq_len: int | None,
    encoder: str,
    *,
    attention: str | None,
) -> Batch:
    """``attention``: what ``collate_packed`` takes; None for a padded batch."""
    check_int(pad_id, "pad_id", low=0, expected="an integer >= 0")
    if not rows:
        raise ValueError("rows: expected at least one row of samples, got none")
    lengths = []
    for r, row in enumerate(rows):
        if not row:
            raise ValueError(f"rows[{r}]: expected at least one sample, got none")
        lengths.append(sum(len(sample) for sample in row))
    if seq_len is None:
        seq_len = max(lengths)
    check_int(seq_len, "seq_len", low=1)
    for r, length in enumerate(lengths):
        if length > seq_len:
            raise ValueError(f"rows[{r}]: {length} tokens, more than seq_len={seq_len}")
    batch = len(rows)
    tokens = torch.full((batch, seq_len), pad_id, dtype=torch.int64)
    labels = torch.full((batch, seq_len), IGNORE_INDEX, dtype=torch.int64)
    positions = torch.zeros(batch, seq_len, dtype=torch.int64)
    pixels, grids = [], []
    videos: list[Sample] = []
    for r, row in enumerate(rows):
        start = 0
        for s, sample in enumerate(row):
            if not sample.pixels_loaded:
                raise ValueError(
                    f"rows[{r}][{s}]: {sample.source or 'a sample'} has images or videos whose "
                    "pixels are not loaded; pass the batch's samples through "
                    "ConversationEncoder.load_pixels"
                )
            end = start + len(sample)
            tokens[r, start:end] = sample.tokens
            labels[r, start:end] = sample.labels
            positions[r, start:end] = torch.arange(len(sample))
            if sample.pixel_values.numel():
                pixels.append(sample.pixel_values)
                grids.append(sample.image_grid_thw)
            if sample.pixel_values_videos.numel():
                videos.append(sample)
            start = end
        positions[r, start:] = torch.arange(seq_len - start)
    mask: PackedSegments | torch.Tensor | None = None
    input_pos = None
    if attention is not None:
        backend = "auto" if attention == "mask" else attention
        sample_lengths = [[len(sample) for sample in row] for row in rows]
        mask = PackedSegments.from_lengths(sample_lengths, seq_len, backend=backend)
        if attention == "mask":
            mask = mask.dense_mask()
        input_pos = positions
    encoder_input: dict[str, Any] = {}
    if pixels:
        shapes = {(p.shape[1:], p.dtype) for p in pixels}
        if len(shapes) > 1:
            raise ValueError(f"samples: pixel values of different shapes or dtypes {shapes}")
        encoder_input = {encoder: {"pixel_values": torch.cat(pixels)}}
        if any(len(grid) for grid in grids):
            encoder_input[encoder]["image_grid_thw"] = torch.cat(grids)
    if videos:
        shapes = {(v.pixel_values_videos.shape[1:], v.pixel_values_videos.dtype) for v in videos}
        if len(shapes) > 1:
            raise ValueError(f"samples: video patches of different shapes or dtypes {shapes}")
        encoder_input[VIDEO_ENCODER] = {
            "pixel_values_videos": torch.cat([v.pixel_values_videos for v in videos]),
            "video_grid_thw": torch.cat([v.video_grid_thw for v in videos]),
            "second_per_grid_ts": torch.cat([v.second_per_grid_ts for v in videos]).float(),
        }
    return Batch(
        tokens=tokens,
        labels=labels,
        mask=mask,
        input_pos=input_pos,
        encoder_input=encoder_input,
        num_tokens=sum(lengths),
        num_targets=int((labels != IGNORE_INDEX).sum()),
        num_samples=sum(len(row) for row in rows),
    )
