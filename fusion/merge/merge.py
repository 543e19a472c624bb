"""The public merge: encoder rows written into the text embeddings at placeholder tokens."""

from collections.abc import Callable, Mapping

import torch

from fusion.merge.fused import check_fused, fused_supported, merge_fused
from fusion.merge.index import merge_index
from fusion.merge.layouts import EncoderRows
from fusion.merge.placement import Placement, resolve_placements
from fusion.merge.reference import merge_reference

MergeImpl = Callable[[torch.Tensor, torch.Tensor, list[Placement]], torch.Tensor]

IMPLEMENTATIONS: dict[str, MergeImpl] = {
    "reference": merge_reference,
    "index": merge_index,
    "fused": merge_fused,
}


def default_impl(device: torch.device, dtype: torch.dtype) -> str:
    """The implementation ``impl="auto"`` picks for ``device`` and ``dtype``.

    The rule: ``"fused"`` on CUDA when Triton is installed and the element size is 1, 2, 4 or
    8 bytes (one kernel that writes each output row once: the fewest bytes moved);
    ``"index"`` everywhere else (on CPU, Triton runs only through its slow interpreter; there
    ``index`` measured 1.1x to 1.3x the time of copying the output once for outputs of 64 MiB
    and more, see ``benchmarks/README.md``). Neither synchronises with the host.
    """
    if device.type == "cuda" and fused_supported(device, dtype):
        return "fused"
    return "index"


def merge_embeddings(
    tokens: torch.Tensor,
    weight: torch.Tensor,
    encoder_rows: Mapping[str, EncoderRows],
    encoder_tokens: Mapping[str, int],
    *,
    impl: str = "auto",
    eager_checks: bool | None = None,
) -> torch.Tensor:
    """Embed ``tokens`` with ``weight`` and write each encoder's rows at its placeholders.

    Args:
        tokens: ids [b, s]. Placeholder ids may lie inside or outside the vocabulary; they
            never reach the embedding table. Every other id must lie in ``[0, vocab)``.
        weight: the embedding table [vocab, d].
        encoder_rows: encoder name -> rows, a :class:`Packed` or :class:`Padded` layout (a
            bare tensor is packed). An encoder in ``encoder_tokens`` without rows has none.
        encoder_tokens: encoder name -> placeholder id.
        impl: ``"auto"`` (see :func:`default_impl`) or a key of ``IMPLEMENTATIONS``:
            ``"reference"`` (embed all, then ``masked_scatter``), ``"index"`` (embed all, then
            ``index_copy_``), ``"fused"`` (one Triton kernel; CUDA, needs Triton).
        eager_checks: check placeholder counts on the host and raise ``ValueError`` (a host
            synchronisation on accelerators). Default: eager on CPU; elsewhere a device-side
            assertion that fails as ``RuntimeError`` without synchronising.

    Returns:
        embeddings [b, s, d] in ``weight``'s dtype; differentiable w.r.t. ``weight`` and rows.
        Every implementation returns the same bits, and the same gradients.

    Raises:
        ValueError: unknown ``impl``; bad shapes, dtypes or devices; unknown encoder names;
            packed row counts different from the placeholder count; more placeholders in a
            sample than the padded width; text ids outside the vocabulary. All raised before
            any row is written.
        ImportError: ``impl="fused"`` without Triton installed.
        ValueError: ``impl="fused"`` on a device or dtype it does not support.
    """
    if impl == "auto":
        impl = default_impl(tokens.device, weight.dtype)
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"impl: expected 'auto' or one of {sorted(IMPLEMENTATIONS)}, got {impl!r}")
    if impl == "fused":
        for device in (tokens.device, weight.device):
            check_fused(device, weight.dtype)
    placements, text_ids = resolve_placements(
        tokens, weight, encoder_rows, encoder_tokens, eager_checks
    )
    return IMPLEMENTATIONS[impl](text_ids, weight, placements)
