import torch
from torch import nn


class KVCache(nn.Module):
    """Key/value cache of one attention layer, filled left to right.

    The fill level is a host-side integer: sequence lengths are always known on the host, so
    tracking it there costs no device synchronisation and lets overflow be checked eagerly.

    Args:
        batch_size: number of sequences cached.
        max_seq_len: number of cache slots per sequence.
        num_kv_heads, head_dim: shape of one cached position.
        dtype, device: dtype and device of the cache.
    """

    def __init__(
        self,
        batch_size: int,
        max_seq_len: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        shape = (batch_size, num_kv_heads, max_seq_len, head_dim)
        self.register_buffer(
            "k_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False
        )
        self.register_buffer(
            "v_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False
        )
        self.batch_size = batch_size
        self.max_seq_len = max_seq_len
        self.size = 0

    def reset(self) -> None:
        self.k_cache.zero_()
        self.v_cache.zero_()
        self.size = 0

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``k``, ``v`` [b, n_kv_heads, s, head_dim]; return the whole caches."""
        seq_len = k.size(2)  # the decoder has checked that it fits
        self.k_cache[:, :, self.size : self.size + seq_len] = k
        self.v_cache[:, :, self.size : self.size + seq_len] = v
        self.size += seq_len
        return self.k_cache, self.v_cache
