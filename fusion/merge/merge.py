"""The public merge: encoder rows written into the text embeddings at placeholder tokens."""

from collections.abc import Callable, Mapping

import torch

from fusion.merge.index import merge_index
from fusion.merge.layouts import EncoderRows
from fusion.merge.placement import Placement, resolve_placements
from fusion.merge.reference import merge_reference

MergeImpl = Callable[[torch.Tensor, torch.Tensor, list[Placement]], torch.Tensor]

IMPLEMENTATIONS: dict[str, MergeImpl] = {"reference": merge_reference, "index": merge_index}


def default_impl(device: torch.device, dtype: torch.dtype) -> str:
    """The implementation ``impl="auto"`` picks: ``"index"`` on every device and dtype."""
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
        impl: ``"auto"`` (see :func:`default_impl`) or a key of ``IMPLEMENTATIONS``.
        eager_checks: check placeholder counts on the host and raise ``ValueError`` (a host
            synchronisation on accelerators). Default: eager on CPU; elsewhere a device-side
            assertion that fails as ``RuntimeError`` without synchronising.

    Returns:
        embeddings [b, s, d] in ``weight``'s dtype; differentiable w.r.t. ``weight`` and rows.

    Raises:
        ValueError: bad shapes, dtypes or devices; unknown encoder names; packed row counts
            different from the placeholder count; more placeholders in a sample than the padded
            width; text ids outside the vocabulary. All raised before any row is written.
    """
    if impl == "auto":
        impl = default_impl(tokens.device, weight.dtype)
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"impl: expected 'auto' or one of {sorted(IMPLEMENTATIONS)}, got {impl!r}")
    placements, text_ids = resolve_placements(
        tokens, weight, encoder_rows, encoder_tokens, eager_checks
    )
    return IMPLEMENTATIONS[impl](text_ids, weight, placements)
