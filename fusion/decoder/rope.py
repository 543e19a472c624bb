import math

import torch
from torch import nn


class RotaryPositionalEmbeddings(nn.Module):
    """Rotary position embeddings in Meta's (interleaved-pair) layout, as in torchtune's Llama 3.

    Channel pairs ``(2i, 2i + 1)`` of each head are rotated by ``position * theta_i``.
    With ``scale_factor`` set, the frequencies are rescaled as in Llama 3.1+ ("llama3" rope
    scaling): long wavelengths are divided by ``scale_factor``, short ones kept, and the band
    between ``old_context_len / high_freq_factor`` and ``old_context_len / low_freq_factor``
    interpolated smoothly.

    Args:
        dim: head dimension (even).
        max_seq_len: number of positions precomputed.
        base: rope base (theta).
        scale_factor: llama3 frequency scaling factor, or None for plain RoPE.
        low_freq_factor, high_freq_factor, old_context_len: llama3 scaling band.
    """

    cache: torch.Tensor  # [max_seq_len, dim / 2, 2]: cos and sin per position and pair

    def __init__(
        self,
        dim: int,
        max_seq_len: int,
        base: float = 500_000.0,
        scale_factor: float | None = None,
        low_freq_factor: float = 1.0,
        high_freq_factor: float = 4.0,
        old_context_len: int = 8192,
    ) -> None:
        super().__init__()
        if dim % 2:
            raise ValueError(f"dim: expected an even head dimension, got {dim}")
        self.dim = dim
        self.max_seq_len = max_seq_len
        self.base = base
        self.scale_factor = scale_factor
        self.low_freq_factor = low_freq_factor
        self.high_freq_factor = high_freq_factor
        self.old_context_len = old_context_len
        # Not in the state dict: it is a pure function of the config, as in torchtune.
        self.register_buffer("cache", self._build_cache(), persistent=False)

    def _frequencies(self) -> torch.Tensor:
        theta = 1.0 / (self.base ** (torch.arange(0, self.dim, 2, dtype=torch.float32) / self.dim))
        if self.scale_factor is None:
            return theta
        wavelen = 2 * math.pi / theta
        low_freq_wavelen = self.old_context_len / self.low_freq_factor
        high_freq_wavelen = self.old_context_len / self.high_freq_factor
        smooth = (self.old_context_len / wavelen - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor
        )
        interpolated = (1 - smooth) * theta / self.scale_factor + smooth * theta
        scaled = torch.where(wavelen > low_freq_wavelen, theta / self.scale_factor, interpolated)
        return torch.where(wavelen < high_freq_wavelen, theta, scaled)

    def _build_cache(self) -> torch.Tensor:
        positions = torch.arange(self.max_seq_len, dtype=torch.float32)
        angles = torch.outer(positions, self._frequencies())
        return torch.stack([angles.cos(), angles.sin()], dim=-1)  # [max_seq_len, dim / 2, 2]

    def reset_parameters(self) -> None:
        self.cache = self._build_cache().to(self.cache.device)

    def forward(self, x: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` [b, s, n_heads, head_dim] at positions ``input_pos`` [b, s] or [s]."""
        rope = self.cache[input_pos]  # [b, s, dim / 2, 2] or [s, dim / 2, 2]
        rope = rope.view(-1, x.size(1), 1, self.dim // 2, 2)
        pairs = x.float().reshape(*x.shape[:-1], self.dim // 2, 2)
        cos, sin = rope[..., 0], rope[..., 1]
        rotated = torch.stack(
            [pairs[..., 0] * cos - pairs[..., 1] * sin, pairs[..., 1] * cos + pairs[..., 0] * sin],
            dim=-1,
        )
        return rotated.flatten(-2).type_as(x)
