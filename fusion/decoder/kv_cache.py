import torch
from torch import nn


class KVCache(nn.Module):
    """Key/value cache of one attention layer, filled left to right.

    The fill level is a device tensor (``fill``, 0-dim int64), advanced on the device by each
    write: a decoding step needs no host integer that changes from step to step, so a compiled
    step keeps static shapes and constants (no recompilation, safe to capture in a CUDA graph),
    and nothing synchronises with the host. Reading :attr:`size` does.

    Args:
        batch_size: number of sequences cached.
        max_seq_len: number of cache slots per sequence.
        num_kv_heads, head_dim: shape of one cached position.
        dtype, device: dtype and device of the cache.
    """

    k_cache: torch.Tensor  # [b, n_kv_heads, max_seq_len, head_dim]
    v_cache: torch.Tensor
    fill: torch.Tensor  # 0-dim int64: slots filled so far

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
        self.register_buffer(
            "fill", torch.zeros((), dtype=torch.long, device=device), persistent=False
        )
        self.batch_size = batch_size
        self.max_seq_len = max_seq_len

    @property
    def size(self) -> int:
        """Slots filled so far, read on the host (a synchronisation on accelerators)."""
        return int(self.fill)

    def reset(self) -> None:
        """Empty the cache. Slots are zeroed, not only forgotten: a masked slot still enters
        attention as ``0 * value``, which a NaN left there would turn into NaN."""
        self.k_cache.zero_()
        self.v_cache.zero_()
        self.fill.zero_()

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``k``, ``v`` [b, n_kv_heads, s, head_dim] at the next ``s`` slots; return the
        whole caches, in ``k``'s dtype (the cache itself when it is the same, a converted copy
        when the cache was set up in another dtype). The caller (the decoder) has checked
        that they fit."""
        slots = self.fill + torch.arange(k.size(2), device=self.fill.device)
        # ``to``: under autocast the projections may come out in another dtype than the cache.
        self.k_cache.index_copy_(2, slots, k.to(self.k_cache.dtype))
        self.v_cache.index_copy_(2, slots, v.to(self.v_cache.dtype))
        self.fill.add_(k.size(2))
        return self.k_cache.to(k.dtype), self.v_cache.to(v.dtype)
