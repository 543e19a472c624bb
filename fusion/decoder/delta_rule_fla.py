"""The packed gated delta rule on flash-linear-attention's varlen chunk kernel (optional).

Where ``fla`` (the ``fla`` extra: ``fla-core``, the kernels of flash-linear-attention) is
installed and the tensors are on CUDA, :class:`~fusion.decoder.GatedDeltaNet`'s packed path
(training, prefill of packed rows) calls FLA's Triton ``chunk_gated_delta_rule`` instead of
:func:`~fusion.decoder.delta_rule.chunk_gated_delta_rule`. Everywhere else (the CPU, FLA
missing, padded batches, decoding) the pure-torch kernels run, unchanged.

The choice is :func:`delta_rule_backend`: the layer's ``delta_rule_backend`` argument, else
the ``FUSION_DELTA_RULE_BACKEND`` environment variable, each ``"auto"`` (the default),
``"torch"`` or ``"fla"``. Forcing ``"torch"`` compares the two on a GPU; forcing ``"fla"``
where it cannot run raises (FLA's errors propagate: there is no silent fallback).

The layout is :class:`~fusion.decoder.delta_rule.SampleRegions`' re-laid rows, as the torch
path takes them (the conv is unchanged), flattened to one row of ``b * s'`` positions with a
sequence starting at every region's start (and every row's): see
:attr:`SampleRegions.cu_seqlens`. Both paths then zero the state at each region's start and
run the same recurrence through it (the gaps are identity steps, ``g = beta = 0``), so each
sample's outputs are the same; the gaps' outputs, which could differ, are dropped by
:meth:`SampleRegions.scatter`.
"""

import functools
import importlib.util
import os
from typing import Literal

import torch

from fusion.decoder.delta_rule import SampleRegions

#: The environment variable read when a layer's ``delta_rule_backend`` is ``"auto"``.
BACKEND_ENV = "FUSION_DELTA_RULE_BACKEND"
BACKENDS = ("auto", "torch", "fla")

Backend = Literal["torch", "fla"]


def check_backend(value: object, name: str) -> str:
    """``value`` if it is one of :data:`BACKENDS`, else a ValueError naming ``name``."""
    if value not in BACKENDS:
        raise ValueError(f"{name}: expected one of {', '.join(BACKENDS)}, got {value!r}")
    return str(value)


@functools.cache
def fla_installed() -> bool:
    """Whether the ``fla`` package is installed (found, not imported: an installed but broken
    FLA then fails where it is used, rather than passing for absent). Looked up once."""
    return importlib.util.find_spec("fla") is not None


def delta_rule_backend(device: str | torch.device, override: str | None = None) -> Backend:
    """Which kernel runs the packed gated delta rule for tensors on ``device``.

    Args:
        device: where the layer's tensors are.
        override: ``"auto"``, ``"torch"`` or ``"fla"``; None or ``"auto"`` reads
            :data:`BACKEND_ENV` (unset: ``"auto"``).

    Returns:
        ``"fla"`` where forced, or on ``"auto"`` for a CUDA device with FLA installed;
        ``"torch"`` otherwise.

    Raises:
        ValueError: an override or environment value other than those above.
    """
    choice = check_backend("auto" if override is None else override, "delta_rule_backend")
    if choice == "auto":
        choice = check_backend(os.environ.get(BACKEND_ENV, "auto") or "auto", BACKEND_ENV)
    if choice == "auto":
        return "fla" if torch.device(device).type == "cuda" and fla_installed() else "torch"
    return "fla" if choice == "fla" else "torch"


def fla_packed_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    regions: SampleRegions,
) -> torch.Tensor:
    """The gated delta rule over ``regions``' re-laid rows by FLA's varlen chunk kernel: what
    ``chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=regions.chunk_size,
    resets=regions.resets)[0]`` computes, at every sample position.

    Args:
        q, k: [b, s', hk, dk] (not normalised: FLA L2-normalises them in the kernel, with
            :data:`~fusion.decoder.delta_rule.L2NORM_EPS`'s epsilon, and scales q by
            ``dk ** -0.5``).
        v: [b, s', h, dv], ``h`` a multiple of ``hk``: FLA's grouped values map value head
            ``i`` to key head ``i // (h // hk)``, as Qwen3.5 (and the torch kernel) do.
        g, beta: [b, s', h] log decays and write strengths, zero in the gaps.
        regions: the layout of the rows.

    Returns:
        [b, s', h, dv] in v's dtype (the gaps' outputs are not the torch kernel's).

    Raises:
        ImportError: FLA is not installed; FLA's own errors (a CPU tensor, for instance).
    """
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    b, s2, heads, dv = v.shape
    if b * s2 == 0:
        return v.new_zeros(b, s2, heads, dv)
    flat = [x.reshape(1, b * s2, *x.shape[2:]) for x in (q, k, v, g, beta)]
    out, _ = chunk_gated_delta_rule(
        *flat,
        scale=q.shape[-1] ** -0.5,
        initial_state=None,
        output_final_state=False,
        use_qk_l2norm_in_kernel=True,
        cu_seqlens=regions.cu_seqlens_on(q.device),
        # The host copy: FLA reads the lengths from it instead of the device (no sync).
        cu_seqlens_cpu=regions.cu_seqlens_on(torch.device("cpu")),
    )
    return out.reshape(b, s2, heads, dv)
