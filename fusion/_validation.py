"""Input checks shared by the modules: eager on CPU, sync-free on accelerators."""

import torch


def check_in_range(values: torch.Tensor, name: str, low: int, high: int) -> None:
    """Raise unless every element of ``values`` lies in ``[low, high)``.

    On CPU the check is eager and raises ``ValueError``. On accelerators, and while
    ``torch.compile`` traces, it becomes a device-side assertion (``torch._assert_async``), so
    it never forces a host-device synchronisation; a failure surfaces as a ``RuntimeError``.
    """
    if values.numel() == 0:
        return
    message = f"{name}: expected values in [{low}, {high})"
    if values.device.type == "cpu" and not torch.compiler.is_compiling():
        smallest, largest = int(values.min()), int(values.max())
        if smallest < low or largest >= high:
            raise ValueError(f"{message}, got values from {smallest} to {largest}")
    else:
        torch._assert_async(((values >= low) & (values < high)).all(), message)


INDEX_DTYPES = (torch.int64, torch.int32)


def check_token_ids(tokens: torch.Tensor, name: str = "tokens") -> None:
    """Raise unless ``tokens`` is a [b, s] tensor of int64 or int32 ids (what embeddings and
    indexing take; uint8 or bool would index as masks)."""
    if not isinstance(tokens, torch.Tensor):
        raise TypeError(
            f"{name}: expected a tensor of integer ids [b, s], got {type(tokens).__name__}"
        )
    if tokens.dim() != 2 or tokens.dtype not in INDEX_DTYPES:
        raise ValueError(
            f"{name}: expected integer ids [b, s] of dtype torch.int64 or torch.int32, "
            f"got {describe(tokens)}"
        )


def describe(x: torch.Tensor) -> str:
    """``'shape [2, 3], dtype torch.float32'``: for error messages."""
    return f"shape {list(x.shape)}, dtype {x.dtype}"


def is_dtensor(x: object) -> bool:
    """Whether ``x`` is a ``torch.distributed.tensor.DTensor`` (False where distributed is
    not built)."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(x, DTensor)
