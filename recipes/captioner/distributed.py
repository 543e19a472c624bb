"""Process setup for the training job: one process, or many under ``torchrun`` (DDP / FSDP2)."""

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel

from fusion import EarlyFusion
from fusion.parallel import apply_fsdp
from recipes.captioner.errors import TrainingError, one_line


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
        return self.rank == 0


def launched_by_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def resolve_device(name: str, local_rank: int) -> torch.device:
    """``auto``: CUDA when available; a process gets the GPU of its local rank.

    Raises:
        TrainingError: ``cuda`` requested without a CUDA device, or too few GPUs.
    """
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


def shutdown(runtime: Runtime) -> None:
    if runtime.distributed and dist.is_initialized():
        dist.destroy_process_group()


def wrap_model(model: EarlyFusion, runtime: Runtime, parallel: str) -> nn.Module:
    """Move ``model`` to the device and, when distributed, wrap it.

    ``ddp``: ``DistributedDataParallel``, a full replica per process, gradients averaged.
    ``fsdp``: FSDP2 ``fully_shard`` on every encoder and decoder block, then on the whole model
    (embeddings, norms, patch embedding and projection head), so each process holds a shard of
    every parameter and of the optimizer state (:func:`fusion.parallel.apply_fsdp` with
    ``per_module=False``).
    Both average gradients over processes; the training loss is scaled to match.
    """
    model = model.to(runtime.device)
    if not runtime.distributed:
        return model
    if parallel == "ddp":
        device_ids = [runtime.device.index] if runtime.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids)
    mesh = init_device_mesh(runtime.device.type, (runtime.world_size,))
    return apply_fsdp(model, mesh, per_module=False)
