"""Choosing the next token from logits: greedy, temperature, top-k and top-p (nucleus)."""

import math
from typing import Any

import torch

from fusion._arguments import as_finite_float, as_int, same_device, show


def check_sampling_args(
    temperature: float, top_k: int | None, top_p: float | None, vocab_size: int
) -> tuple[float, int | None, float | None]:
    """The sampling arguments as plain Python numbers; ``ValueError`` naming the argument
    unless they are valid.

    ``temperature`` a finite number >= 0; ``top_k`` None or an integer in ``[1, vocab_size]``;
    ``top_p`` None or a number in ``(0, 1]``. Numbers may be Python or NumPy scalars; bools
    are refused, and so is a float ``top_k``.
    """
    temperature = as_finite_float(temperature, "temperature")
    if temperature < 0:
        raise ValueError(f"temperature: expected a finite number >= 0, got {temperature}")
    if top_k is not None:
        top_k = as_int(top_k, "top_k")
        if not 1 <= top_k <= vocab_size:
            raise ValueError(
                f"top_k: expected None or an integer in [1, {vocab_size}], got {show(top_k)}"
            )
    if top_p is not None:
        top_p = as_finite_float(top_p, "top_p")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p: expected None or a number in (0, 1], got {top_p}")
    return temperature, top_k, top_p


def sample_next_token(
    logits: torch.Tensor,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Draw one token per row of ``logits`` [b, vocab]; returns int64 ids [b].

    ``temperature == 0`` is greedy (argmax; ``top_k``/``top_p`` then change nothing). Otherwise
    the logits are divided by ``temperature`` (after subtracting each row's maximum, so that a
    tiny temperature cannot overflow them); ``top_k`` keeps the k largest (ties with the k-th
    are kept too); ``top_p`` keeps the smallest set of most likely tokens whose probability
    reaches ``top_p`` (the most likely token always stays). The draw is
    ``argmax(p / Exp(1))``, which is distributed as ``p`` and needs no host synchronisation.

    Args:
        logits: [b, vocab] with ``vocab >= 1``, any float dtype (computed in float32).
        generator: source of randomness, on ``logits``' device; None uses the global one.

    Raises:
        ValueError: bad arguments (see :func:`check_sampling_args`); ``logits`` not a float
            [b, vocab] tensor; ``generator`` not a ``torch.Generator`` on ``logits``' device.
    """
    tensor = isinstance(logits, torch.Tensor)
    if not tensor or logits.dim() != 2 or not logits.is_floating_point() or not logits.size(-1):
        given = f"shape {list(logits.shape)}, {logits.dtype}" if tensor else type(logits).__name__
        raise ValueError(f"logits: expected float [b, vocab] with vocab >= 1, got {given}")
    temperature, top_k, top_p = check_sampling_args(temperature, top_k, top_p, logits.size(-1))
    check_generator(generator, logits.device)
    return draw(logits, temperature, top_k, top_p, generator)


def draw(
    logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None,
    generator: torch.Generator | None,
) -> torch.Tensor:  # fmt: skip
    """:func:`sample_next_token` without the argument checks, for callers that checked them
    once (a decoding loop): nothing here reads a value on the host."""
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits.float()
    shifted = logits - logits.amax(-1, keepdim=True)
    # The row maxima stay exactly 0: a temperature that underflows to 0 in float32 would
    # otherwise turn them into 0 / 0 = NaN.
    logits = torch.where(shifted == 0, shifted, shifted / temperature)
    if top_k is not None and top_k < logits.size(-1):
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
    probs = torch.softmax(logits, dim=-1)
    if top_p is not None and top_p < 1:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    noise = torch.empty_like(probs).exponential_(1.0, generator=generator)
    # An exact 0 draw would turn a removed token's 0 / 0 into NaN, which argmax would pick.
    return (probs / noise.clamp_min_(torch.finfo(noise.dtype).tiny)).argmax(-1)


def check_generator(generator: Any, device: torch.device) -> None:
    """Raise ``ValueError`` unless ``generator`` is None or a ``torch.Generator`` on ``device``."""
    if generator is None:
        return
    if not isinstance(generator, torch.Generator):
        raise ValueError(f"generator: expected None or a torch.Generator, got {show(generator)}")
    if not same_device(generator.device, device):
        raise ValueError(
            f"generator: expected a generator on {device}, got one on {generator.device}"
        )
