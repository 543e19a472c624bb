"""Targets for next-token training of a decoder or an early-fusion model."""

from collections.abc import Callable, Iterable
from contextlib import nullcontext
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from fusion._validation import (
    check_token_ids,
    check_values,
    describe,
    host_reads_are_free,
    is_dtensor,
    is_int,
)


def shift_targets(targets: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """The one label shift: ``labels[..., t]`` is ``targets[..., t + 1]``, what position ``t``
    predicts, and the last position is ``ignore_index`` (nothing follows it). ``targets``:
    each position's own id where it is a target, else ``ignore_index``."""
    labels = targets.roll(-1, dims=-1)
    labels[..., -1] = ignore_index
    return labels


def next_token_labels(
    tokens: torch.Tensor,
    *,
    ignore_ids: Iterable[int] = (),
    loss_start: torch.Tensor | None = None,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Labels for ``F.cross_entropy(logits.flatten(0, 1), labels.flatten())``.

    ``labels[i, t]`` is ``tokens[i, t + 1]``, the token position ``t`` predicts, or
    ``ignore_index`` where no loss belongs: the last position (nothing follows), targets that
    are one of ``ignore_ids`` (placeholder ids, which may lie outside the vocabulary, and
    padding), and targets before ``loss_start[i]`` (the prompt).

    Args:
        tokens: ids [b, s], placeholders included.
        ignore_ids: ids never to predict, e.g. ``model.encoder_tokens.values()`` and a pad id.
        loss_start: [b] index of each sample's first token to predict (tokens before it are
            context only); None: every token after the first.
        ignore_index: the label cross-entropy skips (PyTorch's default, -100).

    Returns:
        int64 labels [b, s].

    Raises:
        ValueError: ``tokens`` not ids [b, s]; ``loss_start`` not [b] integers on tokens'
            device; ``ignore_ids`` or ``ignore_index`` not integers.
    """
    check_token_ids(tokens)
    ignore_ids = list(ignore_ids)
    for value in [*ignore_ids, ignore_index]:
        if not is_int(value):
            raise ValueError(
                f"ignore_ids, ignore_index: expected Python ints, got {value!r} "
                f"({type(value).__name__})"
            )
    batch, seq_len = tokens.shape
    targets = shift_targets(tokens.long(), ignore_index)
    ignored = torch.zeros_like(targets, dtype=torch.bool)
    ignored[:, -1:] = True
    if ignore_ids:
        ignored |= torch.isin(targets, torch.tensor(ignore_ids, device=tokens.device))
    if loss_start is not None:
        if (
            not isinstance(loss_start, torch.Tensor)
            or loss_start.shape != (batch,)
            or loss_start.dtype.is_floating_point
            or loss_start.dtype == torch.bool
            or loss_start.device != tokens.device
        ):
            got = describe(loss_start) if isinstance(loss_start, torch.Tensor) else loss_start
            raise ValueError(
                f"loss_start: expected integer indices [{batch}] on {tokens.device}, got {got}"
            )
        predicted = torch.arange(1, seq_len + 1, device=tokens.device)  # position t predicts t+1
        ignored |= predicted[None, :] < loss_start[:, None]
    return targets.masked_fill(ignored, ignore_index)


def masked_token_loss(
    logits: torch.Tensor | list[torch.Tensor], labels: torch.Tensor, *, ignore_index: int = -100
) -> tuple[torch.Tensor, torch.Tensor]:
    """The summed cross-entropy over target positions, and how many there are.

    Divide the sums of all micro-batches of an optimizer step by the total count (known before
    the step, e.g. ``sum(batch.num_targets)``), not each by its own: then every target token
    weighs the same whatever batch it was packed or padded into, and the gradients are those
    of one big batch.

    Args:
        logits: [b, s, vocab] (upcast to float32), or the list of chunks along ``s`` a decoder
            with ``set_num_output_chunks`` returns.
        labels: int64 [b, s] targets, ``ignore_index`` where no loss belongs.
        ignore_index: the label skipped.

    Returns:
        (float32 scalar sum, int64 scalar count), both on ``labels``' device.

    Raises:
        ValueError: ``labels`` not integer [b, s] matching the logits' first two dimensions.
    """
    chunks = list(logits) if isinstance(logits, list | tuple) else [logits]
    if not chunks or any(chunk.dim() != 3 for chunk in chunks):
        raise ValueError("logits: expected [b, s, vocab] or a list of such chunks along s")
    batch = chunks[0].size(0)
    seq_len = sum(chunk.size(1) for chunk in chunks)
    if (
        labels.dim() != 2
        or labels.dtype.is_floating_point
        or labels.dtype == torch.bool
        or tuple(labels.shape) != (batch, seq_len)
    ):
        raise ValueError(
            f"labels: expected integer targets [{batch}, {seq_len}] (the logits' [b, s]), got "
            f"{describe(labels)}"
        )
    total = torch.zeros((), dtype=torch.float32, device=labels.device)
    start = 0
    for chunk in chunks:
        part = labels[:, start : start + chunk.size(1)]
        start += chunk.size(1)
        total = total + torch.nn.functional.cross_entropy(
            chunk.float().flatten(0, 1),
            part.long().flatten(),
            ignore_index=ignore_index,
            reduction="sum",
        )
    return total, (labels != ignore_index).sum()


_SHARDED_OUTPUT = (
    "the output projection failed on sharded parameters (DTensors): called after the "
    "model's forward, it reads them outside any forward that gathers them. Under FSDP2 make "
    "the output its own unit (fusion.parallel.apply_fsdp's per-module plan with an untied "
    "output), or keep the root unit gathered after its forward: call "
    "root.set_reshard_after_forward(False, recurse=False) once after sharding (needed for a "
    "tied output, which reads tok_embeddings.weight, and with per_module=False). A "
    "tensor-parallel output (fusion.parallel.apply_tp) works as it is"
)


def chunked_token_loss(
    hidden: torch.Tensor,
    labels: torch.Tensor,
    unembed: Callable[[torch.Tensor], torch.Tensor],
    *,
    ignore_index: int = -100,
    chunk_size: int = 1024,
    num_targets: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`masked_token_loss` without the full logits: the output projection and the
    cross-entropy run only at target positions, ``chunk_size`` of them at a time.

    No ``[tokens, vocab]`` tensor ever exists: the forward keeps one chunk's logits at a time,
    and each chunk is recomputed in the backward (``torch.utils.checkpoint``, non-reentrant),
    so forward and backward both peak at ``O(chunk_size x vocab)`` besides the hidden states.
    Same sum, count and gradients as ``masked_token_loss(unembed(hidden), labels)``.

    With a decoder: set ``decoder.skip_output_layer = True`` (it then returns the normed
    hidden states) and pass ``decoder.unembed``, which calls an untied output as a module (so
    FSDP2 gathers it, a tensor-parallel one gathers the chunk's logits) or projects with the
    tied embedding's weight.

    Args:
        hidden: floating hidden states [b, s, d] (after the final norm), a plain tensor.
        labels: integer targets [b, s], aligned with ``hidden`` (``labels[i, t]`` is what
            position ``t`` predicts, as :func:`next_token_labels` makes them), ``ignore_index``
            where no loss belongs.
        unembed: rows [1, n, d] -> logits [1, n, vocab] (upcast to float32 here), e.g.
            ``decoder.unembed`` or an ``nn.Linear``. Called once per chunk in the forward and
            again in the backward, at least once even without targets (so that every process
            of a sharded model makes the same collective calls and gradients are zeros, not
            missing).
        ignore_index: the label skipped.
        chunk_size: the most target positions a chunk projects at once: the targets go in
            the fewest chunks this allows, of even sizes (1540 targets in chunks of at most
            1024: two of 770).
        num_targets: how many labels are not ``ignore_index``, when the caller knows it on the
            host (``Batch.num_targets``): then nothing reads the device back. None: counted
            here, one host-device synchronisation (and not possible on the meta device). A
            wrong count is an error (eagerly on CPU, a device-side assertion on
            accelerators).

    Returns:
        (float32 scalar sum, int64 scalar count), both on ``labels``' device.

    Raises:
        ValueError: ``hidden`` not floating [b, s, d]; ``labels`` not integer [b, s] matching
            it; ``ignore_index`` not an int; ``chunk_size`` not a positive int;
            ``num_targets`` not None or an int in ``[0, b * s]``, None on the meta device, or
            (on CPU) not the number of targets; ``unembed`` returned something other than
            logits [1, n, vocab].
        TypeError: ``hidden`` is a DTensor (sequence-parallel hidden states), or ``unembed``
            is not callable.
        RuntimeError: ``unembed`` failed on sharded parameters it cannot gather: under FSDP2
            a tied output, or an output in the root unit, once the root resharded after its
            forward (the message says what to change).
    """
    _check_chunked_loss_arguments(hidden, labels, unembed, ignore_index, chunk_size, num_targets)
    rows, targets, count = _target_rows(hidden, labels, ignore_index, num_targets)
    sizes = _even_chunks(rows.size(0), chunk_size)
    pieces = zip(rows.split(sizes), targets.split(sizes), strict=True)
    total = torch.zeros((), dtype=torch.float32, device=labels.device)
    for chunk_rows, chunk_targets in pieces:  # at least one, empty without targets
        if torch.is_grad_enabled():
            # Saves only the chunk's rows and targets; its logits are recomputed in backward.
            part = checkpoint(_chunk_loss, chunk_rows, chunk_targets, unembed, use_reentrant=False)
        else:
            part = _chunk_loss(chunk_rows, chunk_targets, unembed)
        total = total + part
    return total, count


def _even_chunks(rows: int, chunk_size: int) -> list[int]:
    """The sizes of the fewest chunks of at most ``chunk_size`` rows that ``rows`` split into,
    as even as they go (at least one chunk, empty without rows). Each chunk costs one pass
    over the output's weight whatever its size, so a short last chunk would save no time,
    and even ones make the largest chunk's logits smaller: 1540 rows in chunks of 1024 go as
    770 + 770, not 1024 + 516."""
    count = max(1, -(-rows // chunk_size))
    base, longer = divmod(rows, count)
    return [base + 1] * longer + [base] * (count - longer)


def _target_rows(
    hidden: torch.Tensor, labels: torch.Tensor, ignore_index: int, num_targets: int | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The hidden states at the target positions [n, d] (gathered once, in the graph), their
    int64 targets [n] and the count (0-d), with ``num_targets`` checked against it."""
    tokens = labels.numel()  # b * s: the checks matched labels' shape to hidden's
    flat_labels = labels.reshape(tokens)
    targeted = flat_labels != ignore_index
    count = targeted.sum()
    if num_targets is None:
        positions = targeted.nonzero().squeeze(1)  # the one synchronisation: its size
    else:
        check_values(
            count == num_targets,
            f"num_targets: expected the number of labels that are not {ignore_index}, "
            f"got {num_targets}",
            eager=host_reads_are_free(labels.device),
            details=lambda: f" for {int(count)} targets",
        )
        # A static size: no host read. Fill with a valid index (a wrong count fails above).
        positions = torch.nonzero_static(targeted, size=num_targets, fill_value=0).squeeze(1)
    # Gathered once: chunks are slices of these, whose gradients the backward concatenates.
    rows = hidden.reshape(tokens, hidden.size(-1)).index_select(0, positions)  # [n, d]
    targets = flat_labels.index_select(0, positions).long()  # [n]
    return rows, targets, count


def _check_chunked_loss_arguments(
    hidden: torch.Tensor,
    labels: torch.Tensor,
    unembed: Callable[[torch.Tensor], torch.Tensor],
    ignore_index: int,
    chunk_size: int,
    num_targets: int | None,
) -> None:
    """The argument checks of :func:`chunked_token_loss`, made before anything is computed: the
    errors its docstring lists, except those about what ``unembed`` returns or raises."""
    if not isinstance(hidden, torch.Tensor) or is_dtensor(hidden):
        kind = "a DTensor" if is_dtensor(hidden) else type(hidden).__name__
        raise TypeError(
            f"hidden: expected a plain tensor [b, s, d] (gather sequence-parallel hidden "
            f"states first), got {kind}"
        )
    if hidden.dim() != 3 or not hidden.dtype.is_floating_point:
        raise ValueError(
            f"hidden: expected floating hidden states [b, s, d], got {describe(hidden)}"
        )
    batch, seq_len, _ = hidden.shape
    if (
        not isinstance(labels, torch.Tensor)
        or labels.dim() != 2
        or labels.dtype.is_floating_point
        or labels.dtype == torch.bool
        or tuple(labels.shape) != (batch, seq_len)
    ):
        got = describe(labels) if isinstance(labels, torch.Tensor) else type(labels).__name__
        raise ValueError(
            f"labels: expected integer targets [{batch}, {seq_len}] (hidden's [b, s]), got {got}"
        )
    if not callable(unembed):
        raise TypeError(
            f"unembed: expected a callable [1, n, d] -> [1, n, vocab] (e.g. decoder.unembed), "
            f"got {type(unembed).__name__}"
        )
    for name, value, low in (("ignore_index", ignore_index, None), ("chunk_size", chunk_size, 1)):
        if not is_int(value) or (low and value < low):
            expected = "a Python int" if low is None else f"an int >= {low}"
            raise ValueError(f"{name}: expected {expected}, got {value!r:.40}")
    tokens = batch * seq_len
    if num_targets is not None and (
        isinstance(num_targets, bool)
        or not isinstance(num_targets, int)
        or not 0 <= num_targets <= tokens
    ):
        raise ValueError(
            f"num_targets: expected None or an int in [0, {tokens}] (the labels' positions), "
            f"got {num_targets!r:.40}"
        )

    if num_targets is None and labels.device.type == "meta":
        raise ValueError(
            "num_targets: expected an int on the meta device (no labels to count), got None"
        )


def _chunk_loss(
    rows: torch.Tensor,
    targets: torch.Tensor,
    unembed: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """The summed float32 cross-entropy of one chunk: rows [n, d], targets [n]."""
    return _SummedCrossEntropy.apply(_chunk_logits(rows, unembed)[0], targets)


def _chunk_logits(rows: torch.Tensor, unembed: Callable[[torch.Tensor], torch.Tensor]):
    """``unembed`` of one chunk's rows [n, d]: float32 logits [1, n, vocab], checked."""
    try:
        logits = unembed(rows[None])
    except RuntimeError as error:
        owner = unembed if isinstance(unembed, nn.Module) else getattr(unembed, "__self__", None)
        if isinstance(owner, nn.Module) and any(is_dtensor(p) for p in owner.parameters()):
            raise RuntimeError(f"unembed: {_SHARDED_OUTPUT} ({error})") from error
        raise
    if is_dtensor(logits):
        raise TypeError(
            "unembed: returned a DTensor (logits left sharded by tensor parallelism); the "
            "loss needs plain logits: gather them in the output layer's plan "
            "(output_layouts=Replicate(), use_local_output=True, as fusion.parallel.apply_tp "
            "does)"
        )
    if (
        not isinstance(logits, torch.Tensor)
        or logits.dim() != 3
        or logits.shape[:2] != (1, rows.size(0))
        or not logits.dtype.is_floating_point
    ):
        got = describe(logits) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(f"unembed: expected logits [1, {rows.size(0)}, vocab], got {got}")
    return logits.float()


def _check_no_collective_backward(unembed: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """:func:`fused_token_loss`'s refusal of an output layer that is its own FSDP2 unit."""
    from torch.distributed.fsdp import FSDPModule

    # The unit whose forward hooks on its inputs run its reduce-scatter after their backward:
    # the output module itself (an untied decoder's, or one passed as ``unembed``). A tied
    # output reads the embedding's weight in the root's unit, which reduce-scatters once, at
    # the end of the step's backward.
    owner = getattr(unembed, "__self__", None)
    layer = unembed if isinstance(unembed, nn.Module) else getattr(owner, "output", None)
    if isinstance(layer, FSDPModule):
        raise ValueError(
            "unembed: the output layer is its own FSDP2 unit, whose backward reduce-scatters; "
            "fused_token_loss runs it chunk by chunk in the forward, where processes with "
            "different numbers of chunks would deadlock. Use chunked_token_loss, or shard the "
            "output with the root unit (tie it, or fusion.parallel.apply_fsdp(per_module=False))"
        )


def _check_incoming_gradient(grad_scale: float, grad: torch.Tensor) -> None:
    """:func:`fused_token_loss`'s backward: the sum must receive the ``grad_scale`` its output
    parameters' gradient was made with."""
    check_values(
        (grad - grad_scale).abs() <= 1e-6 * grad_scale,
        f"fused_token_loss: the output layer's gradient was made in the forward for an "
        f"incoming gradient of grad_scale={grad_scale!r}; pass the factor the sum is "
        f"multiplied by before its backward",
        eager=host_reads_are_free(grad.device),
        details=lambda: f", got {float(grad)}",
    )


class _SummedCrossEntropy(torch.autograd.Function):
    """``F.cross_entropy(logits, targets, reduction="sum")`` over float32 logits [n, vocab]
    whose every target is a class (the chunk's rows were chosen by their targets), with the
    same forward (log-softmax, then the negative log-likelihood), and a backward that turns
    the kept log-probabilities into their gradient in place: softmax minus one at the target.
    Autograd's own backward allocates two more [n, vocab] tensors (the likelihood's gradient,
    then the log-softmax's); one chunk's backward then holds one instead of three, and writes
    no fresh memory. Each chunk's forward runs again in the backward (checkpointed), so the
    in-place use of what this forward kept never meets a second backward."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        log_probs = torch.log_softmax(logits, dim=-1)
        ctx.save_for_backward(log_probs, targets)
        return F.nll_loss(log_probs, targets, reduction="sum")  # IndexError outside the vocab

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        log_probs, targets = ctx.saved_tensors
        grad_logits = log_probs.exp_().mul_(grad)
        rows = torch.arange(targets.numel(), device=targets.device)
        grad_logits[rows, targets] -= grad
        return grad_logits, None


def _graph_nodes(root: Any) -> list[Any]:
    """Every node of the autograd graph under ``root`` (a ``grad_fn``; None: none), once."""
    found, nodes, seen = [], [root], set()
    while nodes:
        node = nodes.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        found.append(node)
        nodes.extend(parent for parent, _ in node.next_functions)
    return found


def _trained_leaves(
    rows: torch.Tensor, unembed: Callable[[torch.Tensor], torch.Tensor]
) -> tuple[list[torch.Tensor], int, bool]:
    """The parameters ``unembed`` trains, the leaves of the autograd graph of ``unembed``
    called on no rows (their sizes are all that is read), its vocabulary, and whether that
    graph is a plain projection's (:func:`_projected_weight`, the rows' side unseen)."""
    probe = _chunk_logits(rows[:0].detach(), unembed)
    # AccumulateGrad nodes hold the trained leaves
    leaves = [getattr(node, "variable", None) for node in _graph_nodes(probe.grad_fn)]
    plain = _projected_weight(probe, None) is not None
    return [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)], probe.size(-1), plain


def _one_chunk_is_leaner(rows: int, chunk: int, vocab: int, trained: int) -> bool:
    """:func:`fused_token_loss`'s choice for ``rows`` targets that would go in chunks of
    ``chunk`` rows, with an output of ``vocab`` classes that trains ``trained`` bytes and is
    no plain projection: whether they hold less memory at once as one chunk. From the second
    chunk on, each chunk's gradient of the trained parameters is a fresh tensor of their size
    until autograd adds it into their ``.grad`` (a trained output of Qwen's width: 1.2 GB);
    one chunk is leaner when its extra rows' float32 logits take no more than that."""
    return (rows - chunk) * vocab * 4 <= trained


def _through(node: Any, names: tuple[str, ...]) -> Any:
    """The node reached from ``node`` through a chain of single-parent nodes named ``names``
    in order (``node`` itself the first), or None where the graph is not that chain."""
    for name in names:
        if node is None or node.name() != name or len(node.next_functions) != 1:
            return None
        node = node.next_functions[0][0]
    return node


def _projected_weight(logits: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor | None:
    """The weight ``W`` [vocab, d] for which the autograd graph of ``logits`` [1, n, vocab]
    (:func:`_chunk_logits` of the leaf ``rows`` [n, d]) proves ``logits = rows @ W.t()``, a
    plain tensor that trains; None where it proves no such thing (a bias, an adapter, a cast,
    a soft cap, a sharded weight, rows that are not this leaf). ``rows`` None: only the
    weight's side is read (the probe of :func:`_trained_leaves`, on rows without a gradient).

    The graph is ``F.linear``'s without a bias on [1, n, d]:
    ``_unsafe_view(mm(view(rows[None]), t(W)))``. Every node but the product is a pure
    reshaping, and the product's two inputs come from the rows leaf and the weight leaf alone.
    """
    product = _through(logits.grad_fn, ("UnsafeViewBackward0",))
    if product is None or product.name() != "MmBackward0" or len(product.next_functions) != 2:
        return None
    (from_rows, _), (from_weight, _) = product.next_functions
    if rows is not None:
        leaf = _through(from_rows, ("ViewBackward0", "UnsqueezeBackward0"))
        if getattr(leaf, "variable", None) is not rows:
            return None
    weight = getattr(_through(from_weight, ("TBackward0",)), "variable", None)
    if not isinstance(weight, torch.Tensor) or _storage(weight) is None or weight.dim() != 2:
        return None  # _storage: None for a tensor subclass (a DTensor)
    return weight


class _GivenGradient(torch.autograd.Function):
    """``_GivenGradient.apply(leaf, box)``: a 0-d zero whose backward hands ``leaf`` the one
    tensor in the list ``box`` as its gradient. Back-propagated, the leaf's own hooks run and
    its ``.grad`` takes the tensor itself when it has none (the box was its last reference),
    as for a gradient autograd made."""

    @staticmethod
    def forward(ctx: Any, leaf: torch.Tensor, box: list[torch.Tensor]) -> torch.Tensor:
        ctx.box = box
        return torch.zeros((), dtype=leaf.dtype, device=leaf.device)

    @staticmethod
    def backward(ctx: Any, _: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.box.pop(), None


class _WeightGradientSum:
    """The chunks' gradient of a plain projection's weight (:func:`_projected_weight`),
    ``G^T @ rows`` as autograd computes it, summed in one tensor (``addmm`` into it) instead of
    a fresh one per chunk added into the weight's ``.grad``; :meth:`deliver` hands the sum to
    the weight through autograd."""

    def __init__(self) -> None:
        self.weight: torch.Tensor | None = None
        self.total: torch.Tensor | None = None

    def add(self, logits: torch.Tensor, rows: torch.Tensor, grad: torch.Tensor) -> bool:
        """Adds the chunk's weight gradient for the logits' gradient ``grad`` [1, n, vocab];
        False (nothing added) where ``logits`` [1, n, vocab] are not proven ``rows @ W.t()``
        for this sum's weight: autograd must make it."""
        weight = _projected_weight(logits, rows)
        if weight is None or (self.weight is not None and weight is not self.weight):
            return False
        with torch.no_grad():  # rows is a leaf with a gradient: record no graph
            if self.total is None:
                self.weight, self.total = weight, grad[0].t().mm(rows)
            else:  # out=, not addmm_, which torch's FlopCounterMode misses
                torch.addmm(self.total, grad[0].t(), rows, out=self.total)
        return True

    def deliver(self) -> None:
        """Back-propagates the sum into the weight (its hooks run, its ``.grad`` takes the
        tensor or adds it in place), once; nothing without a sum."""
        if self.weight is None or self.total is None:
            return
        box = [self.total]
        self.total = None  # the box holds the last reference, which the weight's .grad takes
        torch.autograd.backward(_GivenGradient.apply(self.weight, box))


def _after_backward(tensor: torch.Tensor, run: Callable[[], None]) -> None:
    """Calls ``run`` in each backward through ``tensor`` once every node of its graph that
    hands a trained leaf its gradient has run: after the backward of everything under
    ``tensor`` (its saved activations freed), before those leaves' last ``.grad`` is
    accumulated. The hooks are on this graph's own nodes, so they go with it: a graph never
    back-propagated runs nothing later."""
    frontier = [
        node
        for node in _graph_nodes(tensor.grad_fn)
        if any(hasattr(parent, "variable") for parent, _ in node.next_functions)  # AccumulateGrad
    ]
    ran: set[int] = set()

    def node_ran(index: int, *_: Any) -> None:
        ran.add(index)
        if len(ran) == len(frontier):
            ran.clear()  # the next backward through a retained graph runs it again
            run()

    for index, node in enumerate(frontier):
        node.register_hook(partial(node_ran, index))


def _storage(tensor: torch.Tensor) -> int | None:
    """Where ``tensor``'s data lives; None for a tensor subclass (a DTensor, a fake tensor),
    whose storage cannot be read."""
    if type(tensor) not in (torch.Tensor, nn.Parameter):
        return None
    return tensor.untyped_storage().data_ptr()


def _note_storage(storages: set[int | None], tensor: torch.Tensor) -> torch.Tensor:
    """A saved-tensor pack hook: note where ``tensor`` lives (None: unknown), keep it as
    autograd would."""
    storages.add(_storage(tensor))
    return tensor


def _unpacked(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _chunk_gradient(
    rows: torch.Tensor,
    targets: torch.Tensor,
    unembed: Callable[[torch.Tensor], torch.Tensor],
    grad_scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One chunk of :func:`fused_token_loss`: rows [n, d] projected once; their summed
    cross-entropy (0-d float32), the logits [1, n, vocab] and, where they need one, their
    gradient [1, n, vocab] for an incoming ``grad_scale`` (else None)."""
    saved: set[int | None] = set()
    with torch.autograd.graph.saved_tensors_hooks(partial(_note_storage, saved), _unpacked):
        logits = _chunk_logits(rows, unembed)
    # _SummedCrossEntropy's arithmetic: the logits become the log-probabilities, then the
    # gradient, in place (one [n, vocab] tensor), unless the output's own backward may read
    # them (e.g. a final tanh; a saved tensor subclass, as under tensor parallelism, whose
    # storage is not known): then the log-probabilities are a copy.
    values = logits.detach()[0]
    if None in saved or _storage(values) in saved:
        log_probs = torch.log_softmax(values, dim=-1)
    else:
        log_probs = torch.log_softmax(values, dim=-1, out=values)
    chunk_sum = F.nll_loss(log_probs, targets, reduction="sum")
    if not logits.requires_grad:
        return chunk_sum, logits, None
    grad = log_probs.exp_().mul_(grad_scale)
    grad[torch.arange(grad.size(0), device=grad.device), targets] -= grad_scale
    # For the [1, n, vocab] logits themselves: a gradient of logits[0] would be copied into a
    # new [1, n, vocab] tensor by the indexing's backward.
    return chunk_sum, logits, grad[None]


def _autocast_now(device_type: str) -> torch.dtype | None:
    """The dtype ``device_type``'s autocast computes in now, None where it is off (or where
    there is none, as on the meta device): a deferred projection runs as the forward's."""
    try:
        if torch.is_autocast_enabled(device_type):
            return torch.get_autocast_dtype(device_type)
    except RuntimeError:  # no autocast for this device type
        pass
    return None


def _output_backward(
    rows: torch.Tensor,
    targets: torch.Tensor,
    sizes: list[int],
    unembed: Callable[[torch.Tensor], torch.Tensor],
    grad_scale: float,
    autocast: torch.dtype | None,
    plain: bool,
) -> None:
    """The deferred backward of :func:`fused_token_loss`'s output: each chunk of rows [n, d]
    (detached) projected again, under the forward's autocast, and its logits' gradient
    back-propagated into the output's parameters. ``plain``: the output was a plain projection
    in the forward; each chunk's rows are then a leaf with a gradient, so that the graph of
    its call can prove it again and the weight's gradient be summed (the rows' own gradient is
    never computed)."""
    device_type = rows.device.type
    within = nullcontext() if autocast is None else torch.autocast(device_type, dtype=autocast)
    summed = _WeightGradientSum()
    with torch.enable_grad(), within:
        for chunk_rows, chunk_targets in zip(rows.split(sizes), targets.split(sizes), strict=True):
            leaf = chunk_rows.detach().requires_grad_(plain)
            _, logits, grad = _chunk_gradient(leaf, chunk_targets, unembed, grad_scale)
            assert grad is not None  # the output trains
            if not summed.add(logits, leaf, grad):
                torch.autograd.backward(logits, grad)
            del logits, grad
        summed.deliver()  # in grad mode: the backward that runs this has it off


def fused_token_loss(
    hidden: torch.Tensor,
    labels: torch.Tensor,
    unembed: Callable[[torch.Tensor], torch.Tensor],
    *,
    grad_scale: float = 1.0,
    ignore_index: int = -100,
    chunk_size: int = 512,
    num_targets: int | None = None,
    defer_output_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`chunked_token_loss` with the output layer's backward done in the forward: a fused
    linear cross-entropy. Each chunk of ``chunk_size`` target rows is projected once
    (``unembed`` called as the model calls it, so FSDP2 gathers the output, a tensor-parallel
    one gathers the chunk's logits and adapters run), its logits turned into their gradient in
    place (softmax minus one at the target, times ``grad_scale``) and back-propagated through
    ``unembed`` at once (``torch.autograd.backward``): the output's parameters receive their
    gradient during this call, the rows' gradient is kept (``[n, d]``) for the backward pass,
    and the logits are freed before the next chunk. No ``[tokens, vocab]`` tensor is ever held,
    and, unlike the checkpointed chunks of :func:`chunked_token_loss`, no chunk is projected a
    second time in the backward: one output-sized matrix product fewer per target.

    The price of doing the backward early is that its scale must be known now:
    ``grad_scale`` is the gradient the returned sum will receive, e.g. ``world_size /
    num_targets`` when the sum is divided by the step's targets before its ``backward``
    (:func:`fusion.training.accumulate_step`'s). The hidden states' gradient follows whatever
    the sum receives; the output parameters' was made with ``grad_scale``, and an incoming
    gradient that differs (relative difference above 1e-6) is an error in the backward
    (eagerly on CPU, a device-side assertion on accelerators). Under ``torch.no_grad`` (eval)
    nothing is back-propagated and ``grad_scale`` is not used.

    Arguments, return value and the shape errors are :func:`chunked_token_loss`'s, but for
    ``chunk_size``'s default, plus:

    Args:
        grad_scale: the gradient the returned sum receives in its backward (a positive finite
            number).
        chunk_size: as :func:`chunked_token_loss`'s, 512 by default: a chunk's float32 logits
            are ``chunk_size x vocab`` (297 MiB at Qwen's 151,936), held while the rest of
            the step's activations are, and halving the chunks from 1024 rows cost the loss
            under 3% of its time on CPU (each chunk reads the whole output weight once more).
            When the output trains (full fine-tuning) and is a plain projection (its call's
            autograd graph proves ``logits = rows @ W.t()``: ``F.linear`` without a bias, as
            the decoder's untied output and its tied embedding are), the chunks' gradients
            of ``W`` are summed in one tensor, which is handed to ``W`` through autograd once
            the chunks are done: its hooks see the sum, and its ``.grad`` takes that tensor
            (or adds it in place). Any other trained output gets autograd's gradient chunk by
            chunk, each after the first a fresh tensor of the parameters' size ([vocab, d],
            1.2 GB at Qwen2.5-VL-3B's width) before it is added into their ``.grad``: its
            targets then go as one chunk where that holds less, i.e. where the rows beyond the
            first chunk's have logits no larger than that gradient (both seen from the
            autograd graph of one more call of ``unembed``, on no rows, made when the targets
            take more than one chunk).
        defer_output_grad: give the output's trained parameters their gradient at the end of
            the backward instead of in this call: each chunk's logits now make the rows'
            gradient alone, and once the backward has run every node under the hidden states
            that feeds a trained leaf (their saved activations freed), each chunk is projected
            again, under the forward's autocast, for the parameters' gradient. One more
            output-sized matrix product per target buys a peak without the parameters'
            gradient beside every saved activation: 1.2 GB of Qwen2.5-VL-3B's tied output in
            full fine-tuning. The targets then keep their chunks of ``chunk_size``. A frozen
            output, or hidden states without a gradient, have nothing to defer. A backward
            of only some ``inputs`` that skips a trained leaf under the hidden states gives the
            output no gradient.

    Raises:
        ValueError: ``grad_scale`` not a positive finite number; in the backward, the sum
            received another gradient than ``grad_scale``; ``defer_output_grad`` not a bool,
            or True with an output whose parameters are sharded (tensor parallel; FSDP2
            with the output in the root unit works).
        TypeError: ``unembed`` returned a DTensor (a tensor-parallel output that keeps its
            logits sharded, ``use_local_output=False``): gather them to plain logits, as
            :func:`fusion.parallel.apply_tp`'s plan does.
        ValueError: the output layer is its own FSDP2 unit (``apply_fsdp``'s per-module plan
            with an untied output), whose backward reduce-scatters: run chunk by chunk in the
            forward, processes with different numbers of chunks would wait on each other
            forever. The output in the root unit (tied, or ``per_module=False``) and a
            tensor-parallel output work. Under DDP the same holds for its all-reduce, which
            cannot be seen from ``unembed``: use :func:`chunked_token_loss` there.
    """
    _check_chunked_loss_arguments(hidden, labels, unembed, ignore_index, chunk_size, num_targets)
    if (
        isinstance(grad_scale, bool)
        or not isinstance(grad_scale, int | float)
        or not 0 < grad_scale < float("inf")
    ):
        raise ValueError(f"grad_scale: expected a positive finite number, got {grad_scale!r:.40}")
    if not isinstance(defer_output_grad, bool):
        raise ValueError(f"defer_output_grad: expected a bool, got {defer_output_grad!r:.40}")
    if torch.is_grad_enabled():
        _check_no_collective_backward(unembed)
    rows, targets, count = _target_rows(hidden, labels, ignore_index, num_targets)
    sizes = _even_chunks(rows.size(0), chunk_size)
    total = torch.zeros((), dtype=torch.float32, device=labels.device)
    if not torch.is_grad_enabled():
        for chunk_rows, chunk_targets in zip(rows.split(sizes), targets.split(sizes), strict=True):
            total = total + _chunk_loss(chunk_rows, chunk_targets, unembed)
        return total, count
    defer = defer_output_grad and rows.requires_grad
    if defer or len(sizes) > 1:
        leaves, vocab, plain = _trained_leaves(rows, unembed)
        if defer and any(is_dtensor(leaf) for leaf in leaves):
            raise ValueError(
                "defer_output_grad: expected an output whose parameters are plain tensors "
                "(as FSDP2's root unit gathers them), got a sharded one (tensor parallel), "
                "whose gradient's reduction the deferred backward would not follow; leave it "
                "False"
            )
        trained = sum(leaf.numel() * leaf.element_size() for leaf in leaves)
        defer = defer and trained > 0  # a frozen output has nothing to defer
        # A plain projection's chunks make no fresh gradient each (_WeightGradientSum)
        if not (defer or plain) and _one_chunk_is_leaner(rows.size(0), sizes[0], vocab, trained):
            sizes = [rows.size(0)]
    pieces = list(zip(rows.detach().split(sizes), targets.split(sizes), strict=True))
    rows_grad, back_propagated = [], False
    summed = _WeightGradientSum()
    for chunk_rows, chunk_targets in pieces:  # at least one, empty without targets
        leaf = chunk_rows.detach().requires_grad_(rows.requires_grad)
        chunk_sum, logits, grad = _chunk_gradient(leaf, chunk_targets, unembed, grad_scale)
        total = total + chunk_sum
        if grad is not None:
            # Deferred, or the weight's gradient summed here: to the rows alone now (autograd
            # then skips the weight's product).
            alone = defer or summed.add(logits, leaf, grad)
            torch.autograd.backward(logits, grad, inputs=[leaf] if alone else None)
            back_propagated = True
        del logits, grad
        if leaf.requires_grad:
            assert leaf.grad is not None
            rows_grad.append(leaf.grad)
    summed.deliver()
    if rows.requires_grad:
        # No autograd.Function: the sum's gradient reaches the rows as ``incoming * G`` through
        # a term that is exactly zero in the forward (G the rows' gradient of the sum).
        link = (rows * (torch.cat(rows_grad) / grad_scale)).sum()
        total = total + (link - link.detach())
        if defer:
            output_backward = partial(
                _output_backward, rows.detach(), targets, sizes, unembed, grad_scale,
                _autocast_now(rows.device.type), plain,
            )  # fmt: skip
            _after_backward(rows, output_backward)
    elif back_propagated:  # only the output trains: the sum still takes a backward, checked
        total = total + torch.zeros((), device=total.device, requires_grad=True)
    if total.requires_grad:
        total.register_hook(partial(_check_incoming_gradient, grad_scale))
    return total, count
