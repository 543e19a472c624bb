"""The public merge: encoder rows written into the text embeddings at placeholder tokens."""

from collections.abc import Callable, Mapping
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from fusion._validation import check_token_ids, describe, is_dtensor
from fusion.merge.fused import check_fused, fused_supported, merge_fused
from fusion.merge.index import merge_index
from fusion.merge.layouts import EncoderRows
from fusion.merge.placement import Placement, resolve_placements
from fusion.merge.reference import merge_reference

Embedding = nn.Module | Callable[[torch.Tensor], torch.Tensor] | torch.Tensor

IMPLEMENTATIONS = ("reference", "index", "fused")


def embedding_table(embedding: Embedding) -> torch.Tensor | None:
    """The table that reading directly is provably the same as calling ``embedding``, or None:
    a plain tensor ``[vocab, d]``, or the plain-tensor weight (not a DTensor or other subclass)
    of an exact ``nn.Embedding`` (not a subclass, so not FSDP-managed or parametrized) with no
    hooks, ``max_norm``, ``padding_idx``, ``scale_grad_by_freq`` or ``sparse``."""
    if isinstance(embedding, torch.Tensor):
        weight = embedding
    elif type(embedding) is nn.Embedding:
        hooks = (
            embedding._forward_hooks
            or embedding._forward_pre_hooks
            or nn.modules.module._global_forward_hooks
            or nn.modules.module._global_forward_pre_hooks
        )
        special = embedding.max_norm is not None or embedding.padding_idx is not None
        if hooks or special or embedding.scale_grad_by_freq or embedding.sparse:
            return None
        weight = embedding.weight
    else:
        return None
    return weight if type(weight) in (torch.Tensor, nn.Parameter) else None


def default_impl(device: torch.device, embedding: Embedding) -> str:
    """What ``impl="auto"`` picks: ``"fused"`` on CUDA with Triton when :func:`embedding_table`
    finds a table of 1, 2, 4 or 8-byte elements, else ``"index"``, which calls the embedding as
    the decoder does. Neither synchronises with the host (``benchmarks/README.md``)."""
    table = embedding_table(embedding)
    fused = table is not None and device.type == "cuda" and fused_supported(device, table.dtype)
    return "fused" if fused else "index"


def merge_embeddings(
    tokens: torch.Tensor,
    embedding: Embedding,
    encoder_rows: Mapping[str, EncoderRows],
    encoder_tokens: Mapping[str, int],
    *,
    impl: str = "auto",
    vocab_size: int | None = None,
    eager_checks: bool | None = None,
) -> torch.Tensor:
    """Embed the text of ``tokens`` and write each encoder's rows at its placeholders.

    Args:
        tokens: ids [b, s]. Placeholder ids may lie inside or outside the vocabulary; they
            never reach the embedding (placeholders are embedded as id 0, then overwritten).
        embedding: a module (or callable) mapping ids [b, s] to [b, s, d], called exactly as
            the decoder calls it (``decoder.tok_embeddings``, whatever wraps it), or a table
            tensor [vocab, d].
        encoder_rows: encoder name -> rows, a :class:`Packed` or :class:`Padded` layout (a
            bare tensor is packed). An encoder in ``encoder_tokens`` without rows has none.
        encoder_tokens: encoder name -> placeholder id (a Python int).
        impl: ``"auto"`` (:func:`default_impl`), ``"reference"`` (embed, then
            ``masked_scatter``), ``"index"`` (embed, then ``index_copy_``) or ``"fused"`` (one
            Triton kernel reading the table itself: CUDA, a plain table).
        vocab_size: text ids must lie in ``[0, vocab_size)``. Default: the table's rows, or
            the module's ``num_embeddings``; unchecked if neither exists.
        eager_checks: check placeholder counts on the host, raising ``ValueError`` (a sync on
            accelerators). Default: on CPU; elsewhere a device-side assertion (``RuntimeError``).

    Returns:
        embeddings [b, s, d] in the text embeddings' dtype, differentiable w.r.t. the embedding
        and the rows: the same bits and gradients from every implementation for a table. Rows
        of another floating dtype are cast under ``torch.autocast`` and refused outside it.

    Raises:
        ValueError: before any row is written, naming the argument: an unknown ``impl``
            (``"compiled"`` was removed); bad shapes, dtypes, devices or encoder names; row
            counts that do not fit the placeholders (packed: as many; padded: at most the
            width); text ids outside the vocabulary; an embedding output not [b, s, d] floating.
        TypeError: an argument of the wrong type (e.g. rows that are not tensors).
        ImportError: ``impl="fused"`` without Triton installed.
    """
    impl, table, placements, text_ids = _check_inputs(
        tokens, embedding, encoder_rows, encoder_tokens, impl, vocab_size, eager_checks
    )
    if impl == "fused" and table is not None:  # _check_inputs refused a fused call without one
        return merge_fused(text_ids, table, placements)
    if isinstance(embedding, torch.Tensor):
        embedding = partial(F.embedding, weight=embedding)
    merge = merge_index if impl == "index" else merge_reference
    return merge(text_ids, _checked(embedding), placements)


def _check_inputs(
    tokens: torch.Tensor,
    embedding: Embedding,
    encoder_rows: Mapping[str, EncoderRows],
    encoder_tokens: Mapping[str, int],
    impl: str,
    vocab_size: int | None,
    eager_checks: bool | None,
) -> tuple[str, torch.Tensor | None, list[Placement], torch.Tensor]:
    """Every check of :func:`merge_embeddings` but the embedding's output, in order (tokens,
    impl, embedding, rows); the impl, the table to read (None: call it), placements, text ids."""
    check_token_ids(tokens)
    if impl == "auto":
        impl = default_impl(tokens.device, embedding)
    if impl not in IMPLEMENTATIONS:
        removed = " ('compiled' was removed: 'auto' merges with 'index' on CPU)"
        raise ValueError(
            f"impl: expected 'auto' or one of {list(IMPLEMENTATIONS)}, got {impl!r}"
            f"{removed if impl == 'compiled' else ''}"
        )
    if isinstance(embedding, torch.Tensor):
        if embedding.dim() != 2 or not embedding.is_floating_point():
            raise ValueError(
                f"embedding: expected a floating table [vocab, d], got {describe(embedding)}"
            )
        if embedding.device != tokens.device:
            raise ValueError(
                f"embedding: expected device {tokens.device} (the tokens'), got {embedding.device}"
            )
    elif not callable(embedding):
        raise TypeError(
            "embedding: expected a module mapping ids to rows, or a table tensor, got "
            f"{type(embedding).__name__}"
        )
    table = embedding_table(embedding)
    if impl == "fused":
        if table is None:
            raise ValueError(
                "impl: 'fused' reads the embedding table directly, which is the same as calling "
                "the embedding only for a plain table or nn.Embedding (no hooks, no subclass, no "
                f"DTensor weight); got {type(embedding).__name__}: use impl='auto' or 'index'"
            )
        for device in (tokens.device, table.device):
            check_fused(device, table.dtype)
    if vocab_size is None:
        vocab_size = (
            table.size(0) if table is not None else getattr(embedding, "num_embeddings", None)
        )
    placements, text_ids = resolve_placements(
        tokens, encoder_rows, encoder_tokens, vocab_size=vocab_size, eager_checks=eager_checks
    )
    return impl, table, placements, text_ids


def _checked(
    embedding: Callable[[torch.Tensor], torch.Tensor],
) -> Callable[[torch.Tensor], torch.Tensor]:
    """``embedding``, refusing an output that is not a local floating tensor [*ids.shape, d]."""

    def embed(ids: torch.Tensor) -> torch.Tensor:
        out = embedding(ids)
        shaped = isinstance(out, torch.Tensor) and out.shape[:-1] == ids.shape  # one more dim
        if not shaped or not out.is_floating_point():
            got = describe(out) if isinstance(out, torch.Tensor) else type(out).__name__
            raise ValueError(
                f"embedding: expected floating rows [{', '.join(map(str, ids.shape))}, d] for "
                f"ids {list(ids.shape)}, got {got}"
            )
        if out.device != ids.device:
            raise ValueError(
                f"embedding: expected rows on {ids.device} (the tokens' device), got them on "
                f"{out.device}"
            )
        if is_dtensor(out):
            raise ValueError(
                "embedding: returned a DTensor; the merge writes local rows, so its output must "
                "be a local tensor (e.g. RowwiseParallel(output_layouts=Replicate()), the "
                "default use_local_output=True)"
            )
        return out

    return embed
