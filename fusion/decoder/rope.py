import math
from collections.abc import Sequence
from typing import cast

import torch
from torch import nn

from fusion._validation import is_int


class RotaryPositionalEmbeddings(nn.Module):
    """Rotary position embeddings in Meta's (interleaved-pair) layout, as in torchtune's Llama 3.

    Channel pairs ``(2i, 2i + 1)`` of each head are rotated by ``position * theta_i``.
    With ``scale_factor`` set, the frequencies are rescaled as in Llama 3.1+ ("llama3" rope
    scaling): long wavelengths are divided by ``scale_factor``, short ones kept, and the band
    between ``old_context_len / high_freq_factor`` and ``old_context_len / low_freq_factor``
    interpolated smoothly.

    With ``mrope_section`` set this is multimodal RoPE (M-RoPE, Qwen2-VL): positions come as
    three rows ``[3, b, s]`` (temporal, height, width), and each frequency reads its position
    from one row: chunked, the first ``mrope_section[0]`` frequencies the temporal row, the
    next ``mrope_section[1]`` the height row, the rest the width row (Qwen2-VL, Qwen2.5-VL);
    ``mrope_interleaved`` cycles t, h, w over the first ``3 * min(section)`` frequencies
    instead and gives the rest to the temporal row (Qwen3-VL). The rotation itself is the
    1-D one, whose cos/sin table entries are copied, never recomputed, so positions whose three
    rows are equal (text) rotate bitwise as the 1-D positions do, and ``[b, s]`` or ``[s]``
    positions are accepted as text.

    Args:
        dim: head dimension (even).
        max_seq_len: number of positions precomputed.
        base: rope base (theta).
        scale_factor: llama3 frequency scaling factor, or None for plain RoPE.
        low_freq_factor, high_freq_factor, old_context_len: llama3 scaling band.
        mrope_section: frequencies per position row (t, h, w), summing to ``dim / 2``; None
            for 1-D RoPE.
        mrope_interleaved: the Qwen3-VL assignment of frequencies to rows (see above).
        rotate_half: pair channel ``i`` with ``i + dim / 2`` (Hugging Face's ``rotate_half``
            layout) instead of ``(2i, 2i + 1)``: for stacks whose checkpoints are used as they
            are, with no rows permuted on load (Qwen3.5's gated query rows).
        linear_factor: every frequency divided by it, after any llama3 scaling (Hugging
            Face's ``"linear"`` rope scaling: Gemma 3's global layers); None for none.

    A head wider than ``dim`` is rotated on its first ``dim`` channels only, the rest passed
    through (partial rotary: Qwen3.5 rotates a quarter of its 256 channels).
    """

    cache: torch.Tensor  # [max_seq_len, dim / 2, 2]: cos and sin per position and pair
    # M-RoPE only: [dim / 2], the position row (0, 1, 2) each frequency reads
    frequency_rows: torch.Tensor | None

    def __init__(
        self,
        dim: int,
        max_seq_len: int,
        base: float = 500_000.0,
        scale_factor: float | None = None,
        low_freq_factor: float = 1.0,
        high_freq_factor: float = 4.0,
        old_context_len: int = 8192,
        mrope_section: Sequence[int] | None = None,
        mrope_interleaved: bool = False,
        rotate_half: bool = False,
        linear_factor: float | None = None,
    ) -> None:
        super().__init__()
        if dim % 2:
            raise ValueError(f"dim: expected an even head dimension, got {dim}")
        if mrope_section is not None and (
            len(mrope_section) != 3
            or not all(is_int(n, low=0) for n in mrope_section)
            or sum(mrope_section) != dim // 2
        ):
            raise ValueError(
                f"mrope_section: expected three non-negative ints summing to dim / 2 = "
                f"{dim // 2}, got {mrope_section!r}"
            )
        self.dim = dim
        self.max_seq_len = max_seq_len
        self.base = base
        self.scale_factor = scale_factor
        self.low_freq_factor = low_freq_factor
        self.high_freq_factor = high_freq_factor
        self.old_context_len = old_context_len
        self.mrope_section = None if mrope_section is None else list(mrope_section)
        self.mrope_interleaved = mrope_interleaved
        self.rotate_half = rotate_half
        self.linear_factor = linear_factor
        # Not in the state dict: pure functions of the config, as in torchtune.
        self.register_buffer("cache", self._build_cache(), persistent=False)
        self.register_buffer("frequency_rows", self._build_frequency_rows(), persistent=False)

    def _frequencies(self) -> torch.Tensor:
        theta = 1.0 / (self.base ** (torch.arange(0, self.dim, 2, dtype=torch.float32) / self.dim))
        if self.scale_factor is not None:
            theta = self._llama3_scaled(theta, self.scale_factor)
        return theta if self.linear_factor is None else theta / self.linear_factor

    def _llama3_scaled(self, theta: torch.Tensor, factor: float) -> torch.Tensor:
        wavelen = 2 * math.pi / theta
        low_freq_wavelen = self.old_context_len / self.low_freq_factor
        high_freq_wavelen = self.old_context_len / self.high_freq_factor
        smooth = (self.old_context_len / wavelen - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor
        )
        interpolated = (1 - smooth) * theta / factor + smooth * theta
        scaled = torch.where(wavelen > low_freq_wavelen, theta / factor, interpolated)
        return torch.where(wavelen < high_freq_wavelen, theta, scaled)

    def _build_cache(self) -> torch.Tensor:
        positions = torch.arange(self.max_seq_len, dtype=torch.float32)
        angles = torch.outer(positions, self._frequencies())
        return torch.stack([angles.cos(), angles.sin()], dim=-1)  # [max_seq_len, dim / 2, 2]

    def _build_frequency_rows(self) -> torch.Tensor | None:
        if self.mrope_section is None:
            return None
        t, h, w = self.mrope_section
        if self.mrope_interleaved:
            rows = [0] * (self.dim // 2)
            rows[1 : 3 * h : 3] = [1] * h
            rows[2 : 3 * w : 3] = [2] * w
        else:
            rows = [0] * t + [1] * h + [2] * w
        return torch.tensor(rows, dtype=torch.long)

    @property
    def is_multimodal(self) -> bool:
        """Whether this is M-RoPE, taking positions ``[3, b, s]``."""
        return self.mrope_section is not None

    def reset_parameters(self) -> None:
        """Recompute the buffers (e.g. after ``to_empty``), on the device they are on."""
        self.cache = self._build_cache().to(self.cache.device)
        if self.frequency_rows is not None:
            self.frequency_rows = cast(torch.Tensor, self._build_frequency_rows()).to(
                self.frequency_rows.device
            )

    def forward(self, x: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` [b, s, n_heads, head_dim] at positions ``input_pos`` [b, s] or [s];
        with M-RoPE also [3, b, s] (or [3, 1, s]). ``head_dim`` >= ``dim``: channels past
        ``dim`` pass through."""
        return self._rotate(x, self._angles(input_pos, x.size(1)))

    def rotate_pair(
        self, q: torch.Tensor, k: torch.Tensor, input_pos: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(self(q, input_pos), self(k, input_pos))``, bitwise, for queries [b, s, h, hd]
        and keys [b, s, h_kv, hd] at the same positions: the table is looked up once for both
        (an attention layer's two rotations; a decoding step's ops are its overhead)."""
        angles = self._angles(input_pos, q.size(1))
        return self._rotate(q, angles), self._rotate(k, angles)

    def _angles(self, input_pos: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The cos and signed sin factors of :meth:`_rotate` at ``input_pos``, shaped
        [b or 1, s, 1, dim / 2, 1] and [b or 1, s, 1, dim / 2, 2]: ``cos`` and ``(-sin, sin)``
        per channel pair (rotate-half: ``sin`` alone, [.., dim / 2])."""
        if input_pos.dim() == 3:  # M-RoPE: each frequency's cos/sin from its own row
            tables = self.cache[input_pos]  # [3, b, s, dim / 2, 2]
            rows = cast(torch.Tensor, self.frequency_rows).view(1, 1, 1, -1, 1)
            rope = tables.gather(0, rows.expand(1, *tables.shape[1:]))[0]  # [b, s, dim / 2, 2]
        else:
            rope = self.cache[input_pos]  # [b, s, dim / 2, 2] or [s, dim / 2, 2]
        rope = rope.view(-1, seq_len, 1, self.dim // 2, 2)
        if self.rotate_half:
            return rope[..., 0], rope[..., 1]
        sin = rope[..., 1]
        return rope[..., :1], torch.stack((-sin, sin), -1)

    def _rotate(self, x: torch.Tensor, angles: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """``x`` [b, s, n_heads, head_dim] rotated by :meth:`_angles`' factors, in float32.

        Interleaved pairs ``(x0, x1)`` become ``(x0 cos - x1 sin, x1 cos + x0 sin)`` computed
        as ``pairs * cos + swapped_pairs * (-sin, sin)``: the same products and sums (``a + (-b)``
        is ``a - b`` exactly in floating point), in six ops instead of a dozen. Casts are
        skipped where ``x`` is float32 already (no-op calls still cost a dispatch each)."""
        cos, sin = angles
        rotary = x if x.size(-1) == self.dim else x[..., : self.dim]
        if rotary.dtype != torch.float32:
            rotary = rotary.float()
        if self.rotate_half:
            first, second = rotary.chunk(2, dim=-1)
            rotated = torch.cat((first * cos - second * sin, second * cos + first * sin), -1)
        else:
            pairs = rotary.reshape(*rotary.shape[:-1], self.dim // 2, 2)  # [b, s, h, dim/2, 2]
            rotated = (pairs * cos + pairs.flip(-1) * sin).flatten(-2)
        if x.size(-1) > self.dim:
            rotated = torch.cat([rotated, x[..., self.dim :].float()], dim=-1)
        return rotated if rotated.dtype == x.dtype else rotated.type_as(x)
