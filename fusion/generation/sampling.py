"""Choosing the next token from logits: greedy, temperature, top-k and top-p (nucleus)."""

import math

import torch


def check_sampling_args(
    temperature: float, top_k: int | None, top_p: float | None, vocab_size: int
) -> None:
    """Raise ``ValueError`` naming the argument unless the sampling arguments are valid.

    ``temperature`` finite and >= 0; ``top_k`` None or an integer in ``[1, vocab_size]``;
    ``top_p`` None or in ``(0, 1]``.
    """
    if isinstance(temperature, bool) or not isinstance(temperature, int | float):
        raise ValueError(f"temperature: expected a number >= 0, got {temperature!r}")
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature: expected a finite number >= 0, got {temperature}")
    if top_k is not None and (
        isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= vocab_size
    ):
        raise ValueError(f"top_k: expected None or an integer in [1, {vocab_size}], got {top_k!r}")
    if top_p is not None and (
        isinstance(top_p, bool) or not isinstance(top_p, int | float) or not 0 < top_p <= 1
    ):
        raise ValueError(f"top_p: expected None or a number in (0, 1], got {top_p!r}")


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
    the logits are divided by ``temperature``; ``top_k`` keeps the k largest (ties with the k-th
    are kept too); ``top_p`` keeps the smallest set of most likely tokens whose probability
    reaches ``top_p`` (the most likely token always stays). The draw is
    ``argmax(p / Exp(1))``, which is distributed as ``p`` and needs no host synchronisation.

    Args:
        logits: [b, vocab], any float dtype (computed in float32).
        generator: source of randomness, on ``logits``' device; None uses the global one.

    Raises:
        ValueError: bad arguments (see :func:`check_sampling_args`) or ``logits`` not [b, vocab].
    """
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(
            f"logits: expected float [b, vocab], got shape {list(logits.shape)}, {logits.dtype}"
        )
    check_sampling_args(temperature, top_k, top_p, logits.size(-1))
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
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
