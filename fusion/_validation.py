"""Input checks shared by the modules: eager on CPU, sync-free on accelerators."""

import sys
from collections.abc import Callable
from typing import TypeGuard

import torch


def host_reads_are_free(device: torch.device) -> bool:
    """Whether reading tensor values on the host costs nothing now: on CPU, outside
    ``torch.compile``. Checks then raise before any work (elsewhere they are device-side
    assertions), and cached attention skips the cache's unfilled slots."""
    return device.type == "cpu" and not torch.compiler.is_compiling()


def is_int(value: object, low: int | None = None, high: int | None = None) -> TypeGuard[int]:
    """Whether ``value`` is an int (a bool is not) in ``[low, high]``, either bound optional."""
    return (
        isinstance(value, int)
        and not isinstance(value, bool)
        and (low is None or value >= low)
        and (high is None or value <= high)
    )


def check_int(
    value: object,
    name: str,
    *,
    low: int | None = None,
    high: int | None = None,
    expected: str | None = None,
) -> int:
    """``value`` if :func:`is_int` (an int in ``[low, high]``, never a bool); otherwise
    ``ValueError(f"{name}: expected {expected}, got {value!r}")``, ``expected`` saying by
    default "a positive integer" (``low=1``), "a non-negative integer" (``low=0``), "an
    integer in [low, high]", ...: the one integer check of the library's arguments."""
    if is_int(value, low, high):
        return value
    if expected is None:
        words = {1: "a positive integer", 0: "a non-negative integer", None: "an integer"}
        if high is None:
            expected = words.get(low, f"an integer >= {low}")
        else:
            expected = f"an integer <= {high}" if low is None else f"an integer in [{low}, {high}]"
    raise ValueError(f"{name}: expected {expected}, got {value!r}")


def check_values(
    ok: torch.Tensor, message: str, *, eager: bool, details: Callable[[], str] = str
) -> None:
    """The one rule for checks of tensor values: with ``eager``, raise ``ValueError(message +
    details())`` now unless ``ok``; otherwise enqueue a device-side assertion
    (``torch._assert_async``), which never synchronises with the host and fails later as a
    ``RuntimeError`` with ``message``."""
    if not eager:
        torch._assert_async(ok, message)
    elif not bool(ok):
        raise ValueError(message + details())


def check_in_range(values: torch.Tensor, name: str, low: int, high: int) -> None:
    """Raise unless every element of ``values`` lies in ``[low, high)`` (see
    :func:`check_values`: eager on CPU, a device-side assertion on accelerators and under
    ``torch.compile``)."""
    if values.numel() == 0:
        return
    check_values(
        ((values >= low) & (values < high)).all(),
        f"{name}: expected values in [{low}, {high})",
        eager=host_reads_are_free(values.device),
        details=lambda: f", got values from {int(values.min())} to {int(values.max())}",
    )


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
    not built). Never imports it: no DTensor can exist before ``torch.distributed.tensor``
    is imported, and importing it takes half a second, which a first call must not cost (a
    Hypothesis test's first example would exceed its default 200 ms deadline)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(x, module.DTensor)
