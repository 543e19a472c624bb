"""The optimizer and learning-rate schedule of the recipes: AdamW, linear warm-up, then cosine
decay to 0."""

import math
from collections.abc import Iterable

import torch

# The device types torch's fused AdamW runs on (torch 2.13).
FUSED_DEVICES = ("cpu", "cuda", "xpu", "mps", "hpu")


def lr_factor(step: int, warmup: int, total: int) -> float:
    """The factor of the peak learning rate at ``step`` (counted from 0): linear warm-up over
    ``warmup`` steps, then cosine decay to 0 at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.5 * (1 + math.cos(math.pi * progress))


def warmup_cosine(
    optimizer: torch.optim.Optimizer, warmup: int, total: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """``optimizer``'s schedule of :func:`lr_factor` over ``total`` steps.

    The factor is a plain function, not a callable object: ``LambdaLR`` stores a callable
    object's attributes in its state dict, which a checkpoint keeps and a resumed run compares.
    """

    def factor(step: int) -> float:
        return lr_factor(step, warmup, total)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def adamw_warmup_cosine(
    parameters: Iterable[torch.nn.Parameter],
    *,
    lr: float,
    weight_decay: float,
    warmup: int,
    total: int,
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """The recipes' optimizer: AdamW over ``parameters`` (peak ``lr``, betas (0.9, 0.95),
    ``weight_decay``) with :func:`warmup_cosine` over ``total`` steps.

    It is torch's fused AdamW: one kernel per dtype and device for all parameters, where the
    default on CPU loops over them with a dozen passes each (a step over 460M float32
    parameters on 2 CPU threads: 0.19 s fused, 1.95 s looping, ``benchmarks/optimizer_step.py``).
    Its updates differ from the loop's by rounding (about one float32 ulp). Parameters on a
    device without the fused kernel (the meta device) get torch's default instead. Checkpoints
    written with either resume with the other
    (:data:`~fusion.training.state.IMPLEMENTATION_FLAGS`).
    """
    parameters = list(parameters)
    fused = all(p.device.type in FUSED_DEVICES for p in parameters)
    optimizer = torch.optim.AdamW(
        parameters, lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay, fused=fused or None
    )
    return optimizer, warmup_cosine(optimizer, warmup, total)
