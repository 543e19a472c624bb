"""Argument checks of the public entry points (generation, padding): each error names the
argument.

Numbers are taken as Python numbers, NumPy scalars or (for ids) 0-dim integer tensors and
returned as plain Python values; bools are refused wherever a number is expected, and floats
wherever an integer is.
"""

import math
import numbers
import operator
from typing import Any

import torch

INTEGER_DTYPES = frozenset(
    {torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64}
    | {torch.uint16, torch.uint32, torch.uint64}
)


def show(value: Any) -> str:
    """A short ``repr`` for error messages (huge ints and long containers stay readable)."""
    try:
        text = repr(value)
    except ValueError:  # an int above Python's digit limit for str()
        return f"<an integer of {value.bit_length()} bits>"
    return text if len(text) <= 80 else text[:77] + "..."


def as_int(value: Any, name: str) -> int:
    """``value`` as a Python int: an int, a NumPy integer or a 0-dim integer tensor.

    Raises:
        ValueError: a bool, a float, or anything else that is not an integer.
    """
    if isinstance(value, torch.Tensor):
        if value.dim() != 0 or value.dtype not in INTEGER_DTYPES or value.device.type == "meta":
            raise ValueError(
                f"{name}: expected an integer, got a tensor of shape {list(value.shape)}, "
                f"dtype {value.dtype} on {value.device}"
            )
    elif isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise ValueError(f"{name}: expected an integer, got {show(value)}")
    try:
        return operator.index(value)
    except (TypeError, ValueError, RuntimeError) as error:  # e.g. NumPy's bool
        raise ValueError(f"{name}: expected an integer, got {show(value)}") from error


def as_id(value: Any, name: str, vocab_size: int) -> int:
    """``value`` as a token id in ``[0, vocab_size)`` (see :func:`as_int`)."""
    index = as_int(value, name)
    if not 0 <= index < vocab_size:
        raise ValueError(f"{name}: expected an id in [0, {vocab_size}), got {show(index)}")
    return index


def as_positive_int(value: Any, name: str) -> int:
    """``value`` as an integer >= 1 (see :func:`as_int`)."""
    number = as_int(value, name)
    if number < 1:
        raise ValueError(f"{name}: expected a positive integer, got {show(number)}")
    return number


def as_finite_float(value: Any, name: str) -> float:
    """``value`` as a finite Python float: an int, a float or a NumPy real; never a bool."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name}: expected a number, got {show(value)}")
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"{name}: expected a finite number, got {number}")
    return number


def as_device(value: Any, name: str) -> torch.device:
    """``value`` as a ``torch.device`` that can be used here (probed with an empty tensor).

    Raises:
        ValueError: not a device string or ``torch.device``, or a device this machine lacks
            (``cuda:7`` on a machine with fewer GPUs, or without CUDA).
    """
    expected = f"{name}: expected a device such as 'cpu' or 'cuda:0', got {show(value)}"
    if not isinstance(value, str | torch.device):
        raise ValueError(expected)
    try:
        device = torch.device(value)
    except (RuntimeError, ValueError) as error:
        raise ValueError(expected) from error
    try:
        torch.empty(0, device=device)
    except Exception as error:  # torch raises RuntimeError or AssertionError, by backend
        reason = " ".join(str(error).split())
        raise ValueError(f"{name}: device {device} is not available here ({reason})") from error
    return device


def same_device(a: torch.device, b: torch.device) -> bool:
    """Whether two devices are the same, with an accelerator's missing index read as 0."""
    return a.type == b.type and (a.type == "cpu" or (a.index or 0) == (b.index or 0))
