"""The public merge: encoder rows written into the text embeddings at placeholder tokens."""

from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from fusion._validation import check_token_ids, describe, is_dtensor
from fusion.merge.compiled import merge_compiled
from fusion.merge.fused import check_fused, fused_supported, merge_fused
from fusion.merge.index import merge_index
from fusion.merge.layouts import EncoderRows, Packed, Padded
from fusion.merge.placement import resolve_placements
from fusion.merge.reference import merge_reference

Embedding = nn.Module | Callable[[torch.Tensor], torch.Tensor] | torch.Tensor

IMPLEMENTATIONS = ("reference", "index", "fused", "compiled")
# ``auto`` merges with ``compiled`` on CPU from this many output bytes (tokens x d x element
# size); None: never. In the paired sweep of benchmarks/README.md ("The compiled single pass")
# it beat ``index`` in every case with encoder rows from 4 MiB, the smallest output measured,
# forward and forward+backward; text-only merges are the embedding's call (``index``).
COMPILED_MIN_BYTES: int | None = 4 << 20


def embedding_table(embedding: Embedding) -> torch.Tensor | None:
    """The table that reading directly is provably the same as calling ``embedding``, or None.

    That is a plain tensor ``[vocab, d]``, or the weight of an exact ``nn.Embedding`` (not a
    subclass, so not FSDP-managed or parametrized) with no hooks, ``max_norm``,
    ``padding_idx``, ``scale_grad_by_freq`` or ``sparse`` and a weight that is a plain tensor
    (not a DTensor or another tensor subclass). Anything else must be called.
    """
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


def default_impl(
    device: torch.device,
    embedding: Embedding,
    tokens: int | None = None,
    *,
    encoder_rows: int | None = None,
) -> str:
    """The implementation ``impl="auto"`` picks for ``embedding`` on ``device``.

    Only for a plain table that :func:`embedding_table` finds (reading it is provably what
    calling the embedding does), a single-pass merge that writes each output row once:
    ``"fused"`` (one Triton kernel) on CUDA with Triton installed and 1, 2, 4 or 8-byte
    elements; ``"compiled"`` (a C loop built on first use) on CPU when the output, ``tokens``
    x d x element size, holds at least ``COMPILED_MIN_BYTES`` (4 MiB), there are encoder
    rows to merge and no ``torch.compile`` is tracing. ``"index"`` everywhere else: the
    embedding is called as a module (so FSDP, tensor parallel, LoRA or quantized embeddings
    behave as in the decoder, and a text-only batch is the embedding's own call) and encoder
    rows are written into its output.
    Measurements in ``benchmarks/README.md``. None of them synchronises with the host.

    Args:
        device: where the tokens are.
        embedding: as :func:`merge_embeddings` takes it.
        tokens: the number of tokens merged (b x s); None: as many as ``compiled`` needs.
        encoder_rows: the number of encoder rows merged, all encoders together (a shape, so
            known without reading data); None: some.

    Raises:
        TypeError: ``encoder_rows`` is neither None nor an int.
        ValueError: ``encoder_rows`` is negative.
    """
    if encoder_rows is not None:
        if not isinstance(encoder_rows, int) or isinstance(encoder_rows, bool):
            raise TypeError(f"encoder_rows: expected an int or None, got {encoder_rows!r:.40}")
        if encoder_rows < 0:
            raise ValueError(f"encoder_rows: expected a count >= 0, got {encoder_rows}")
    return _auto_impl(device, embedding_table(embedding), tokens, encoder_rows)


def _auto_impl(
    device: torch.device, table: torch.Tensor | None, tokens: int | None, encoder_rows: int | None
) -> str:
    if table is None:
        return "index"
    if device.type == "cuda" and fused_supported(device, table.dtype):
        return "fused"
    threshold = COMPILED_MIN_BYTES
    cpu = device.type == "cpu" == table.device.type and table.dim() == 2
    # Inside torch.compile the C loop cannot run; inductor's own loop was not measured faster.
    eager = not torch.compiler.is_compiling()
    if threshold is not None and cpu and eager and encoder_rows != 0:
        size = table.size(1) * table.element_size()
        if tokens is None or tokens * size >= threshold:
            return "compiled"
    return "index"


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
        embedding: what embeds text ids: a module (or callable) mapping ids [b, s] to
            [b, s, d], e.g. ``decoder.tok_embeddings`` whatever wraps it, called exactly like
            the decoder calls it; or a table tensor [vocab, d].
        encoder_rows: encoder name -> rows, a :class:`Packed` or :class:`Padded` layout (a
            bare tensor is packed). An encoder in ``encoder_tokens`` without rows has none.
        encoder_tokens: encoder name -> placeholder id (a Python int).
        impl: ``"auto"`` (see :func:`default_impl`), ``"reference"`` (embed, then
            ``masked_scatter``), ``"index"`` (embed, then ``index_copy_``), ``"fused"`` (one
            Triton kernel reading the table itself; CUDA, needs Triton and a plain table, see
            :func:`embedding_table`) or ``"compiled"`` (one pass, a C loop built on the
            process's first call; CPU, needs a plain table, see :mod:`fusion.merge.compiled`).
        vocab_size: text ids must lie in ``[0, vocab_size)``. Default: the table's rows, or
            the module's ``num_embeddings``; unchecked if neither exists.
        eager_checks: check placeholder counts on the host and raise ``ValueError`` (a host
            synchronisation on accelerators). Default: eager on CPU; elsewhere a device-side
            assertion that fails as ``RuntimeError`` without synchronising.

    Returns:
        embeddings [b, s, d] in the text embeddings' dtype; differentiable w.r.t. the
        embedding and the rows. Every implementation returns the same bits and gradients for a
        table. Rows of another floating dtype are cast under ``torch.autocast`` and refused
        outside it.

    Raises:
        ValueError: unknown ``impl``; bad shapes, dtypes or devices; unknown encoder names;
            packed row counts different from the placeholder count; more placeholders in a
            sample than the padded width; text ids outside the vocabulary; an embedding output
            that is not [b, s, d] floating. All raised before any row is written.
        TypeError: an argument of the wrong type (e.g. rows that are not tensors).
        ImportError: ``impl="fused"`` without Triton installed.
    """
    check_token_ids(tokens)
    table = embedding_table(embedding)
    if impl == "auto":
        impl = _auto_impl(tokens.device, table, tokens.numel(), _row_count(encoder_rows))
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"impl: expected 'auto' or one of {list(IMPLEMENTATIONS)}, got {impl!r}")
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
    if impl in ("fused", "compiled") and table is None:
        raise ValueError(
            f"impl: {impl!r} reads the embedding table directly, which is the same as calling "
            "the embedding only for a plain table or nn.Embedding (no hooks, no subclass, no "
            f"DTensor weight); got {type(embedding).__name__}: use impl='auto' or 'index'"
        )
    if impl == "fused" and table is not None:
        for device in (tokens.device, table.device):
            check_fused(device, table.dtype)
    if impl == "compiled" and table is not None:
        for device in (tokens.device, table.device):
            if device.type != "cpu":
                raise ValueError(
                    f"impl: 'compiled' expected CPU tensors (on CUDA 'fused' is the single "
                    f"pass), got device {device}"
                )
    if vocab_size is None:
        vocab_size = (
            table.size(0) if table is not None else getattr(embedding, "num_embeddings", None)
        )
    placements, text_ids = resolve_placements(
        tokens, encoder_rows, encoder_tokens, vocab_size=vocab_size, eager_checks=eager_checks
    )
    if impl == "fused" and table is not None:  # a fused call without a table was refused above
        return merge_fused(text_ids, table, placements)
    if impl == "compiled" and table is not None:  # likewise
        return merge_compiled(text_ids, table, placements)
    embed = _checked(_lookup(embedding) if isinstance(embedding, torch.Tensor) else embedding)
    merge = merge_index if impl == "index" else merge_reference
    return merge(text_ids, embed, placements)


def _row_count(encoder_rows: Mapping[str, EncoderRows]) -> int | None:
    """All encoders' rows (shapes only); None where something is not a layout (refused later)."""
    if not isinstance(encoder_rows, Mapping):
        return None
    count = 0
    for rows in encoder_rows.values():
        rows = rows.rows if isinstance(rows, Packed | Padded) else rows
        if not isinstance(rows, torch.Tensor) or rows.dim() == 0:
            return None
        count += rows.shape[:-1].numel()
    return count


def _lookup(table: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda ids: F.embedding(ids, table)


def _checked(
    embedding: Callable[[torch.Tensor], torch.Tensor],
) -> Callable[[torch.Tensor], torch.Tensor]:
    """``embedding``, refusing an output that is not a local floating tensor [*ids.shape, d]."""

    def embed(ids: torch.Tensor) -> torch.Tensor:
        out = embedding(ids)
        if (
            not isinstance(out, torch.Tensor)
            or out.shape[:-1] != ids.shape
            or out.dim() != ids.dim() + 1
            or not out.is_floating_point()
        ):
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
