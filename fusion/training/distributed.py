"""Process setup for a training job: one process, or many under ``torchrun`` (DDP / FSDP2).

A recipe calls :func:`init_runtime` first (it starts the process group when ``torchrun``
launched it), :func:`wrap_model` on the model it built, and :func:`shutdown` at the end::

    runtime = init_runtime("auto")          # Runtime(rank, world_size, ..., device)
    model = wrap_model(model, runtime, "fsdp")
    ...
    shutdown(runtime)
"""

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel

from fusion.parallel import apply_fsdp
from fusion.training.errors import TrainingError, one_line

PARALLEL_CHOICES = ("ddp", "fsdp")
T = TypeVar("T")


@dataclass(frozen=True)
class Runtime:
    """Where this process runs: its rank among ``world_size`` processes and its device."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    distributed: bool

    @property
    def is_main(self) -> bool:
        """Whether this is rank 0, the process that writes reports and logs."""
        return self.rank == 0


def launched_by_torchrun() -> bool:
    """Whether ``torchrun`` started this process (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def resolve_device(name: str, local_rank: int) -> torch.device:
    """The device ``name`` (``"auto"``, ``"cpu"`` or ``"cuda"``) names for the process of
    ``local_rank``: ``auto`` is CUDA when available; a process gets the GPU of its local rank.

    Raises:
        TrainingError: another name, ``cuda`` requested without a CUDA device, or too few
            GPUs.
    """
    if name not in ("auto", "cpu", "cuda"):
        raise TrainingError(f"--device: expected 'auto', 'cpu' or 'cuda', got {name!r:.40}")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise TrainingError("--device: 'cuda' requested, but torch sees no CUDA device")
    if local_rank >= torch.cuda.device_count():
        raise TrainingError(
            f"--device: local rank {local_rank} needs a GPU of its own, "
            f"but only {torch.cuda.device_count()} are visible"
        )
    return torch.device("cuda", local_rank)


def _env_int(name: str, low: int) -> int:
    value = os.environ[name]
    try:
        number = int(value)
    except ValueError:
        number = low - 1
    if number < low:
        raise TrainingError(
            f"environment variable {name}: expected an integer >= {low}, "
            f"got {value!r:.40} (set by torchrun)"
        )
    return number


def init_runtime(device: str) -> Runtime:
    """Start the process group when launched by ``torchrun``: NCCL on GPU, gloo on CPU.

    Raises:
        TrainingError: the device cannot be used, torchrun's environment is malformed, or
            the process group does not start.
    """
    if not launched_by_torchrun():
        return Runtime(0, 1, 0, resolve_device(device, 0), distributed=False)
    world = _env_int("WORLD_SIZE", 1)
    rank, local_rank = _env_int("RANK", 0), _env_int("LOCAL_RANK", 0)
    if rank >= world:
        raise TrainingError(f"environment variable RANK: expected < WORLD_SIZE={world}, got {rank}")
    resolved = resolve_device(device, local_rank)
    try:
        if resolved.type == "cuda":
            torch.cuda.set_device(resolved)
            dist.init_process_group("nccl", device_id=resolved)
        else:
            dist.init_process_group("gloo")
    except (RuntimeError, ValueError, OSError) as error:  # rendezvous, backend, network
        raise TrainingError(f"cannot start the process group: {one_line(error)}") from None
    return Runtime(rank, world, local_rank, resolved, distributed=True)


def agree_on_rank0(
    runtime: Runtime,
    plan: Callable[[], T],
    encode: Callable[[T], Any],
    decode: Callable[[Any], T],
) -> T:
    """Run ``plan`` on rank 0 alone and give every process its verdict, so all of them go on
    with the same result, or fail alike with rank 0's :class:`TrainingError` message.

    Args:
        runtime: this process's :class:`Runtime`; with one process ``plan`` just runs here.
        plan: what rank 0 decides (it may read and change the disk; the others never run it).
        encode: rank 0's result as plain picklable values (paths as str, dataclasses as dicts),
            for ``broadcast_object_list``.
        decode: the result back from what ``encode`` returned, on every rank (rank 0 too).

    Raises:
        TrainingError: the one ``plan`` raised on rank 0, with its message, on every rank.
    """
    if not runtime.distributed:
        return plan()
    verdict: list[Any] = [None]
    if runtime.is_main:
        try:
            verdict = [("ok", encode(plan()))]
        except TrainingError as error:
            verdict = [("error", str(error))]
    dist.broadcast_object_list(verdict, src=0)
    status, value = verdict[0]
    if status == "error":
        raise TrainingError(value)
    return decode(value)


def shutdown(runtime: Runtime) -> None:
    """End the process group :func:`init_runtime` started (if any, and not ended yet)."""
    if runtime.distributed and dist.is_initialized():
        dist.destroy_process_group()


def wrap_model(
    model: nn.Module, runtime: Runtime, parallel: str, *, per_module: bool = True
) -> nn.Module:
    """Move ``model`` to the device and, when distributed, wrap it; one process gets the model
    back unwrapped.

    ``ddp``: ``DistributedDataParallel``, a full replica per process, gradients averaged.
    ``fsdp``: FSDP2 ``fully_shard`` by :func:`fusion.parallel.apply_fsdp` (``model`` is a
    ``TransformerDecoder`` or has one as ``.decoder``, such as ``EarlyFusion``): with
    ``per_module`` each block of the encoders and the decoder, the embedding and the norm with
    the output, then the root; without it the blocks, then the whole model (embeddings, norms,
    the rest). Each process holds a shard of every parameter and of the optimizer state.
    Both average gradients over processes; a recipe scales its loss to match.

    Raises:
        ValueError: ``parallel`` is not ``"ddp"`` or ``"fsdp"``.
        TypeError: ``fsdp`` for a model with no decoder (from ``apply_fsdp``).
    """
    if parallel not in PARALLEL_CHOICES:
        raise ValueError(f"parallel: expected one of {list(PARALLEL_CHOICES)}, got {parallel!r}")
    model = model.to(runtime.device)
    if not runtime.distributed:
        return model
    if parallel == "ddp":
        device_ids = [runtime.device.index] if runtime.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids)
    mesh = init_device_mesh(runtime.device.type, (runtime.world_size,))
    return apply_fsdp(model, mesh, per_module=per_module)
