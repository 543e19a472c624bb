"""Chunked-loss scenarios: :func:`fusion.chunked_token_loss` over the hidden states of a
sharded model, on 2 gloo processes, for ``tests/parallel/test_chunked_loss_sharded.py``.

``python -m parallel.chunked_loss_scenarios RANK WORLD_SIZE INIT_FILE OUT_DIR`` (``tests`` on
``PYTHONPATH``) runs every scenario in turn and saves this rank's results (summed loss, count,
full gradients, or the error) to ``OUT_DIR/rank{RANK}.pt``.
"""

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.nn.parallel import DistributedDataParallel

from fusion import TransformerDecoder, chunked_token_loss, fused_token_loss, masked_token_loss
from fusion.parallel import apply_fsdp, apply_tp
from parallel.sharding_scenarios import (
    BATCH,
    WORLD_SIZE,
    batch,
    build,
    full_grads,
    join_group,
    run_jobs,
)

CHUNK = 3  # target positions per chunk: the ranks' samples need different numbers of chunks
# Per sample, the positions with a target: many, a few after the audio clip (so that its
# encoder has a gradient when samples 2-3 have none), none, a few. One micro-batch a sample:
# rank 0's need 3 and 1 chunks, rank 1's 1 (empty) and 2; ``starved`` leaves rank 1 no
# target at all.
TARGETS = [range(0, 9), range(7, 10), range(0), range(6, 10)]


@dataclass(frozen=True)
class Case:
    """One training step whose loss is ``chunked_token_loss`` over ``skip_output_layer``
    hidden states, compared with ``masked_token_loss`` over the unsharded model's logits.

    ``plan``: ``fsdp`` (:func:`fusion.parallel.apply_fsdp`, per module, the recipe's),
    ``fsdp_root`` (``per_module=False``: blocks, then the root), ``ddp``, ``tp``
    (:func:`fusion.parallel.apply_tp`: both ranks see the whole batch), ``fsdp_tp`` (a 2-D
    mesh of 1 data-parallel and 2 tensor-parallel ranks). ``resharded_root``: the root FSDP
    unit is resharded after its forward (``set_reshard_after_forward(True, recurse=False)``;
    ``apply_fsdp`` keeps it gathered), which a tied output or ``per_module=False`` cannot
    work with.
    """

    plan: str
    model: str  # "decoder" or "fusion"
    tied: bool
    starved: bool = False  # rank 1's samples have no target
    resharded_root: bool = False
    fused: bool = False  # fusion.fused_token_loss instead (the output's backward in the forward)
    deferred: bool = False  # fused, with defer_output_grad (the output's at the backward's end)

    @property
    def name(self) -> str:
        tied = "tied" if self.tied else "untied"
        return (
            f"{self.plan}-{self.model}-{tied}"
            + ("-resharded" if self.resharded_root else "")
            + ("-starved" if self.starved else "")
            + ("-fused" if self.fused else "")
            + ("-deferred" if self.deferred else "")
        )

    @property
    def data_parallel(self) -> bool:
        return self.plan not in ("tp", "fsdp_tp")

    @property
    def images(self) -> bool:
        return self.model == "fusion"


CASES = [
    Case("fsdp", "decoder", tied=False),
    Case("fsdp", "fusion", tied=False),
    Case("fsdp", "fusion", tied=False, starved=True),
    Case("fsdp", "decoder", tied=True),
    Case("fsdp", "fusion", tied=True),
    Case("fsdp", "decoder", tied=True, starved=True),
    Case("fsdp_root", "fusion", tied=False),
    Case("fsdp_root", "fusion", tied=True, starved=True),
    Case("ddp", "fusion", tied=False, starved=True),
    Case("ddp", "decoder", tied=True),
    Case("tp", "decoder", tied=False),
    Case("tp", "fusion", tied=False),
    Case("fsdp_tp", "fusion", tied=False),
    # The fused loss: the output layer's backward runs inside the loss's forward, chunk by
    # chunk: with the output in the root FSDP2 unit (tied, or per_module=False) and tensor
    # parallel. (Not DDP, whose all-reduce would run per chunk: refused in its docstring.)
    Case("fsdp", "fusion", tied=True, fused=True),
    Case("fsdp", "decoder", tied=True, starved=True, fused=True),
    Case("fsdp_root", "fusion", tied=False, fused=True),
    Case("tp", "decoder", tied=False, fused=True),
    # Deferred, the output's gradient at the end of the backward: FSDP2 with the output in the
    # root unit, whose reduce-scatter comes after the whole backward.
    Case("fsdp", "fusion", tied=True, fused=True, deferred=True),
    Case("fsdp_root", "fusion", tied=False, starved=True, fused=True, deferred=True),
]
# Sharded where the output projection cannot gather its weight: refused by name.
REFUSED = [
    Case("fsdp", "decoder", tied=True, resharded_root=True),
    Case("fsdp", "fusion", tied=True, resharded_root=True),
    Case("fsdp_root", "fusion", tied=False, resharded_root=True),
]


# The fused loss where the output is its own FSDP2 unit: refused by name (a reduce-scatter per
# chunk, in the forward: ranks with different numbers of chunks would deadlock).
FUSED_REFUSED = [
    Case("fsdp", "decoder", tied=False, fused=True),
    Case("fsdp", "fusion", tied=False, starved=True, fused=True),
    Case("fsdp_tp", "fusion", tied=False, fused=True),
]
# Deferred with a sharded output parameter (tensor parallel): refused by name.
DEFERRED_REFUSED = [Case("tp", "decoder", tied=False, fused=True, deferred=True)]


def labels_of(case: Case, rows: slice) -> torch.Tensor:
    """The targets of ``batch`` kept at :data:`TARGETS` only (none for samples 2-3 when
    ``starved``), -100 elsewhere."""
    _, _, targets = batch(case.images, slice(None))
    labels = torch.full_like(targets, -100)
    for i, kept in enumerate(TARGETS):
        if not (case.starved and i >= 2):
            labels[i, kept] = targets[i, kept]
    return labels[rows]


def decoder_of(model: nn.Module) -> TransformerDecoder:
    inner = model.module if isinstance(model, DistributedDataParallel) else model
    return inner if isinstance(inner, TransformerDecoder) else inner.decoder


def reference(case: Case) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """The step in one process over the whole batch with full logits: the summed loss, the
    count, and the gradients of the mean loss for every parameter."""
    model = build(case.model, case.tied)
    tokens, encoder_input, _ = batch(case.images, slice(None))
    kwargs = {} if encoder_input is None else {"encoder_input": encoder_input}
    total, count = masked_token_loss(model(tokens, **kwargs), labels_of(case, slice(None)))
    (total / count).backward()
    return total.detach(), count, full_grads(model)


def shard(model: nn.Module, plan: str, mesh: DeviceMesh) -> nn.Module:
    if plan == "fsdp":
        return apply_fsdp(model, mesh)
    if plan == "fsdp_root":
        return apply_fsdp(model, mesh, per_module=False)
    if plan == "ddp":
        return DistributedDataParallel(model)
    if plan == "tp":
        return apply_tp(model, mesh)
    mesh_2d = init_device_mesh("cpu", (1, WORLD_SIZE), mesh_dim_names=("dp", "tp"))
    apply_tp(model, mesh_2d["tp"])
    return apply_fsdp(model, mesh_2d["dp"])


def run_case(case: Case, mesh: DeviceMesh) -> dict:
    """This rank's step, as the recipe takes it: two micro-batches (one half of its samples
    each), hidden states, the chunked loss with the host's count, scaled by the step's
    targets over every rank and by the ranks that average gradients."""
    rank = torch.distributed.get_rank()
    per_rank = BATCH // WORLD_SIZE
    rows = slice(rank * per_rank, (rank + 1) * per_rank) if case.data_parallel else slice(None)
    model = shard(build(case.model, case.tied), case.plan, mesh)
    if case.resharded_root:
        model.set_reshard_after_forward(True, recurse=False)
    decoder = decoder_of(model)
    decoder.skip_output_layer = True
    step_targets = int((labels_of(case, slice(None)) != -100).sum())
    averaged = WORLD_SIZE if case.data_parallel else 1
    start, stop = rows.start or 0, rows.stop or BATCH
    half = (stop - start) // 2
    sums, counts = [], []
    for micro in (slice(start, start + half), slice(start + half, stop)):
        tokens, encoder_input, _ = batch(case.images, micro)
        kwargs = {} if encoder_input is None else {"encoder_input": encoder_input}
        labels = labels_of(case, micro)
        hidden = model(tokens, **kwargs)
        assert hidden.shape == (*tokens.shape, decoder.embed_dim)
        num_targets = int((labels != -100).sum())  # the host count a recipe has
        scale = averaged / step_targets
        if case.fused:
            total, count = fused_token_loss(
                hidden, labels, decoder.unembed, grad_scale=scale, chunk_size=CHUNK,
                num_targets=num_targets, defer_output_grad=case.deferred,
            )  # fmt: skip
        else:
            total, count = chunked_token_loss(
                hidden, labels, decoder.unembed, chunk_size=CHUNK, num_targets=num_targets
            )
        (total * scale).backward()
        sums.append(total.detach())
        counts.append(count)
    return {
        "rows": [start, stop],
        "sum": sum(sums),
        "count": sum(counts),
        "grads": full_grads(model.module if case.plan == "ddp" else model),
    }


def run_all(rank: int, world_size: int, init_file: str, out_dir: Path) -> None:
    mesh = join_group(rank, world_size, init_file)
    jobs: dict[str, Callable[[], dict]] = {
        c.name: (lambda c=c: run_case(c, mesh))
        for c in [*CASES, *REFUSED, *FUSED_REFUSED, *DEFERRED_REFUSED]
    }
    run_jobs(jobs, rank, out_dir)


if __name__ == "__main__":
    rank, world_size, init_file, out_dir = sys.argv[1:]
    run_all(int(rank), int(world_size), init_file, Path(out_dir))
