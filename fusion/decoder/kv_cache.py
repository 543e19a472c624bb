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
        max_seq_len: number of positions per sequence the cache takes (its slots, here one
            per position: ``num_slots == max_seq_len``).
        num_kv_heads, head_dim: shape of one cached position.
        dtype, device: dtype and device of the cache.
    """

    k_cache: torch.Tensor  # [b, n_kv_heads, num_slots, head_dim]
    v_cache: torch.Tensor
    fill: torch.Tensor  # 0-dim int64: positions written so far

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
        self._allocate(batch_size, max_seq_len, num_kv_heads, head_dim, dtype, device)
        self.max_seq_len = max_seq_len

    def _allocate(
        self,
        batch_size: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | None,
    ) -> None:
        shape = (batch_size, num_kv_heads, num_slots, head_dim)
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
        #: Slots allocated per sequence (the third dimension of ``k_cache`` and ``v_cache``).
        self.num_slots = num_slots

    @property
    def size(self) -> int:
        """Positions written so far, read on the host (a synchronisation on accelerators)."""
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
        # ``_as``: under autocast the projections may come out in another dtype than the cache.
        self.k_cache.index_copy_(2, slots, _as(k, self.k_cache.dtype))
        self.v_cache.index_copy_(2, slots, _as(v, self.v_cache.dtype))
        self.fill.add_(k.size(2))
        return _as(self.k_cache, k.dtype), _as(self.v_cache, v.dtype)


class SlidingWindowKVCache(KVCache):
    """The cache of a layer that attends to its ``window`` latest positions only: a ring
    buffer of ``window`` slots, where position ``j`` lives in slot ``j % window``, however
    long the sequence (up to ``max_seq_len`` positions, as a :class:`KVCache` of that length
    would take).

    ``fill`` counts positions written (as :class:`KVCache`'s, so that every layer's fill
    level is the decoder's), ``max_seq_len`` is the positions the cache takes, ``num_slots``
    (= ``window``) what it holds. Each cache tensor is ``[b, n_kv_heads, window, head_dim]``
    instead of ``[b, n_kv_heads, max_seq_len, head_dim]``: ``window / max_seq_len`` of the
    memory (Gemma 3 4B at 8192 positions: 1024 slots, an eighth).

    What :meth:`update` returns, and so which position each column of the attention holds,
    is :meth:`key_slots` (the decoder maps the mask over positions onto those columns):

    - one position (a decoding step): written first, then the ring is returned; it holds the
      ``window`` latest positions, this one included, which is all the window lets the
      query see;
    - several (a prefill, a chunk): the ring as it was before the write, followed by the new
      keys (``window + s`` columns), then the last ``min(s, window)`` of them are written.
      Writing first would overwrite positions the call's first queries still see (their
      window reaches ``window - 1`` positions before them), and image blocks attend forward
      within the call: every query of a chunk longer than the window sees exactly what it
      sees with a full cache, at the cost of one copy of the ring per call (not per step).
      A ring of ``window + chunk`` slots would avoid the copy, but tie the cache to one
      chunk length.

    Args:
        batch_size, max_seq_len, num_kv_heads, head_dim, dtype, device: as :class:`KVCache`.
        window: slots of the ring, the layer's ``sliding_window``; less than ``max_seq_len``
            (else a :class:`KVCache` holds every position in fewer slots).
    """

    def __init__(
        self,
        batch_size: int,
        max_seq_len: int,
        window: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | None = None,
    ) -> None:
        if not 0 < window < max_seq_len:
            raise ValueError(
                f"window: expected 1 to max_seq_len - 1 = {max_seq_len - 1} slots, got {window}"
            )
        nn.Module.__init__(self)
        self._allocate(batch_size, window, num_kv_heads, head_dim, dtype, device)
        self.max_seq_len = max_seq_len
        self.window = window

    def key_slots(self, seq_len: int) -> torch.Tensor:
        """The position [kv_len] int64 each column of the next :meth:`update` of ``seq_len``
        positions will hold (``kv_len``: ``window`` for one position, ``window + seq_len``
        for more), -1 for a slot not written yet. Read before that update (from the fill
        level, on the device: no sync, the same shapes at every step)."""
        ring = torch.arange(self.window, device=self.fill.device)
        # The latest position the ring part holds: this one for a step (written first), the
        # one before the call otherwise. Slot p holds the latest j <= last with j % window
        # == p (negative: none yet; ``remainder`` is never negative).
        last = self.fill if seq_len == 1 else self.fill - 1
        held = last - torch.remainder(last - ring, self.window)
        if seq_len == 1:
            return held
        return torch.cat([held, self.fill + torch.arange(seq_len, device=self.fill.device)])

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``k``, ``v`` [b, n_kv_heads, s, head_dim] at positions ``fill..fill+s-1``
        (slots modulo ``window``); return the keys and values to attend to, [b, n_kv_heads,
        kv_len, head_dim] in ``k``'s dtype, their columns' positions as :meth:`key_slots`
        says (read before this call)."""
        s = k.size(2)
        dtype, out_dtype = self.k_cache.dtype, k.dtype
        if s == 1:
            slot = torch.remainder(self.fill, self.window)[None]
            self.k_cache.index_copy_(2, slot, k.to(dtype))
            self.v_cache.index_copy_(2, slot, v.to(dtype))
            self.fill.add_(1)
            return self.k_cache.to(k.dtype), self.v_cache.to(v.dtype)
        # The ring before the write, then the new keys: a copy (``cat``) made before the ring
        # is overwritten below. The new keys pass through the cache's dtype, as a full cache
        # returns them (written, then read): the same attention in any cache dtype.
        k, v = k.to(dtype), v.to(dtype)
        keys = torch.cat([self.k_cache, k], dim=2).to(out_dtype)
        values = torch.cat([self.v_cache, v], dim=2).to(out_dtype)
        kept = min(s, self.window)  # distinct slots: no index written twice
        first = self.fill + (s - kept)
        slots = torch.remainder(first + torch.arange(kept, device=self.fill.device), self.window)
        self.k_cache.index_copy_(2, slots, k[:, :, s - kept :])
        self.v_cache.index_copy_(2, slots, v[:, :, s - kept :])
        self.fill.add_(s)
        return keys, values


def _as(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor.to(dtype)``, without the call where it would return ``tensor`` itself (each
    call costs a dispatch: four per layer and decoding step)."""
    return tensor if tensor.dtype == dtype else tensor.to(dtype)
