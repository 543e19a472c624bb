"""Micro-batches made ahead of training, in worker processes.

A run's data plan (each optimizer step's samples, :func:`fusion.training.steps.plan_steps`)
becomes, for one process, a sequence of micro-batches (:class:`StepBatches`): each step's
samples are dealt over the processes and micro-batches (:func:`split_step`), a process whose
share would leave it idle or without images gets a filler (a sample with no target:
:func:`fill`), then the pixels are decoded and processed, the samples packed or padded and
collated (:class:`Collate`). :class:`MicroBatches` makes them in ``num_workers`` processes of a
:class:`torch.utils.data.DataLoader` while the current micro-batch trains, and hands them over
in order on the device (pinned and copied without a host sync on CUDA).

A micro-batch is a pure function of the plan and the settings: making one draws no random
number, and the loader never draws from the training process's generators (it gets its
own), so the losses are the same with any number of workers, and a resumed run that starts the
loader at its step continues bit for bit.

A micro-batch that cannot be made (an image file that can no longer be read) is handed back
as a value, its error in one line, not raised in the worker (the loader would re-raise it with
a traceback of many lines); :class:`MicroBatches` raises it as a :class:`LoaderError`, and so a
worker that died (killed by a signal, out of memory).

    batches = StepBatches(data.samples, [s.samples for s in plan],
                          Collate(pad_id, max_seq_len, encoder=encoder),
                          micro_batches=grad_accum, world_size=world, rank=rank)
    with MicroBatches(batches, start=step * grad_accum, num_workers=2, device=device) as stream:
        for item in stream:  # MicroBatch: step, index, batch (None: skip), real tokens
            ...
"""

import multiprocessing
import signal
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from types import TracebackType
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from fusion._validation import check_int
from fusion.data.packing import Batch, collate_packed, collate_padded, pack_samples
from fusion.data.sample import IGNORE_INDEX, Sample
from fusion.data.samples import ConversationEncoder
from fusion.errors import FusionError, one_line

# torch's messages when a worker process dies (the SIGCHLD handler's and the status check's).
_WORKER_DIED = "DataLoader worker"


class LoaderError(FusionError, RuntimeError):
    """A micro-batch that could not be made, in one line.

    Attributes:
        died: True when a worker process died (killed by a signal, e.g. out of memory);
            False for a sample that could not be made (the message names it and its image
            file).
    """

    def __init__(self, message: str, *, died: bool = False) -> None:
        super().__init__(message)
        self.died = died


def ignored(sample: Sample) -> Sample:
    """``sample`` with no target: its loss and gradients are zero (a filler)."""
    return replace(sample, labels=torch.full_like(sample.labels, IGNORE_INDEX))


def has_images(samples: Sequence[Sample]) -> bool:
    """Whether any of ``samples`` shows images or videos (loaded or not): the vision tower
    runs for either."""
    return any(sample.has_images or sample.has_videos for sample in samples)


def image_filler(samples: Sequence[Sample]) -> Sample | None:
    """The shortest of ``samples`` with images (or videos), with no target; None if none has
    any."""
    with_images = [sample for sample in samples if sample.has_images or sample.has_videos]
    return ignored(min(with_images, key=len)) if with_images else None


def split_step(samples: Sequence[int], lengths: Sequence[int], parts: int) -> list[list[int]]:
    """Deal a step's samples into ``parts`` groups of about equal tokens: longest first, each
    to the group with the fewest tokens so far (ties: the lower group). Each group keeps the
    step's order. Group ``k`` is micro-batch ``k // world`` of process ``k % world``."""
    loads = [0] * parts
    groups: list[list[int]] = [[] for _ in range(parts)]
    for index in sorted(samples, key=lambda i: (-lengths[i], i)):
        target = min(range(parts), key=lambda g: (loads[g], g))
        groups[target].append(index)
        loads[target] += lengths[index]
    order = {index: position for position, index in enumerate(samples)}
    return [sorted(group, key=order.__getitem__) for group in groups]


def fill(
    groups: Sequence[Sequence[Sample]], rank: int, filler: Sample | None = None
) -> list[Sample] | None:
    """Process ``rank``'s samples among the ``groups`` of one micro-batch (one group per
    process), with fillers; None when it has nothing to run.

    Every process must run the same modules the same number of times (FSDP2 gathers each
    block's weights collectively, at each call), so a process whose group is empty, or has
    no images when another's has, or no videos when another's has (a video runs the vision
    tower once more: the Qwen models' shared ``"video"`` entry), or no media at all when DDP
    needs a gradient for the image encoder's parameters (``filler``, e.g.
    :func:`image_filler`), adds a filler: a sample of the micro-batch with no target
    (:func:`ignored`), the shortest showing what it lacks. One process skips an empty group,
    and every process skips an empty micro-batch.
    """
    mine = list(groups[rank])
    everyone = [sample for group in groups for sample in group]
    if not everyone or (not mine and len(groups) == 1):
        return None
    if not mine:
        mine.append(ignored(min(everyone, key=len)))
    for shows in (_shows_images, _shows_videos):
        if not any(shows(s) for s in mine) and any(shows(s) for s in everyone):
            mine.append(ignored(min((s for s in everyone if shows(s)), key=len)))
    if not has_images(mine) and filler is not None:
        mine.append(filler)
    return mine


def _shows_images(sample: Sample) -> bool:
    return sample.has_images


def _shows_videos(sample: Sample) -> bool:
    return sample.has_videos


@dataclass(frozen=True)
class Collate:
    """How a micro-batch's samples become a :class:`Batch`: their pixels made by ``encoder``
    (:meth:`ConversationEncoder.load_pixels`; None: the samples come with theirs), packed into
    rows of at most ``max_seq_len`` tokens (:func:`pack_samples`, :func:`collate_packed`) or,
    without ``packing``, one per row (:func:`collate_padded`), padded with ``pad_id``."""

    pad_id: int
    max_seq_len: int
    packing: bool = True
    encoder: ConversationEncoder | None = None

    def __call__(self, samples: Sequence[Sample]) -> Batch:
        """Raises ValueError: naming the sample and file, an image that can no longer be read
        (or changed size); the errors of :func:`collate_packed`."""
        if self.encoder is not None:  # this micro-batch's pixels, made now and freed with it
            samples = self.encoder.load_pixels(samples)
        if self.packing:
            return collate_packed(pack_samples(samples, self.max_seq_len), pad_id=self.pad_id)
        return collate_padded(samples, pad_id=self.pad_id)


@dataclass(frozen=True)
class MicroBatch:
    """Micro-batch ``index`` of step ``step`` for one process.

    Attributes:
        step: the step, an index into the plan.
        index: which of the step's micro-batches (``0 .. micro_batches - 1``).
        batch: the batch, fillers included; None when this process skips it (:func:`fill`).
        tokens: the tokens of real samples in it (not fillers').
        error: why it could not be made, in one line (None when it was).
    """

    step: int
    index: int
    batch: Batch | None
    tokens: int = 0
    error: str | None = None

    def pin_memory(self) -> "MicroBatch":
        """The micro-batch with its tensors in pinned memory (:meth:`Batch.pin_memory`, what
        the loader's ``pin_memory=True`` calls), so that copies to the GPU need no host
        sync."""
        return self if self.batch is None else replace(self, batch=self.batch.pin_memory())

    def to(self, device: torch.device, *, non_blocking: bool = False) -> "MicroBatch":
        """The micro-batch with its batch on ``device`` (:meth:`Batch.to`)."""
        if self.batch is None:
            return self
        return replace(self, batch=self.batch.to(device, non_blocking=non_blocking))


class StepBatches(Dataset[MicroBatch]):
    """The micro-batches of a plan for one process, in order: item ``i`` is micro-batch
    ``i % micro_batches`` of step ``i // micro_batches``.

    Step ``s``'s samples (``steps[s]``, indices into ``samples``) are dealt into
    ``world_size * micro_batches`` groups of about equal tokens (:func:`split_step`); group
    ``k * world_size + r`` is micro-batch ``k`` of process ``r``, with the fillers of
    :func:`fill` (``filler``), made by ``collate``. Every process computes the same deal, so
    together they train each step's samples exactly once.

    Args:
        samples: the data set's samples.
        steps: each step's samples, as indices into ``samples``.
        collate: how samples become a batch.
        micro_batches: micro-batches per step and process (gradient accumulation).
        world_size: how many processes share each step.
        rank: this process.
        filler: a sample with no target that every micro-batch without images gets (DDP with
            a trained image encoder), or None.

    Raises:
        ValueError: ``micro_batches`` or ``world_size`` not positive, ``rank`` outside
            ``[0, world_size)``.
    """

    def __init__(
        self,
        samples: Sequence[Sample],
        steps: Sequence[Sequence[int]],
        collate: Collate,
        *,
        micro_batches: int = 1,
        world_size: int = 1,
        rank: int = 0,
        filler: Sample | None = None,
    ) -> None:
        check_int(micro_batches, "micro_batches", low=1)
        check_int(world_size, "world_size", low=1)
        check_int(
            rank, "rank", low=0, high=world_size - 1, expected=f"an integer in [0, {world_size})"
        )
        self.samples = samples
        self.steps = steps
        self.collate = collate
        self.micro_batches = micro_batches
        self.world_size = world_size
        self.rank = rank
        self.filler = filler
        self.lengths = [len(sample) for sample in samples]

    def __len__(self) -> int:
        return len(self.steps) * self.micro_batches

    def __getitem__(self, index: int) -> MicroBatch:
        """Micro-batch ``index``, made now; an error making it comes back in
        :attr:`MicroBatch.error` (ValueError, OSError, MemoryError), not raised.

        Raises:
            IndexError: ``index`` outside ``[0, len(self))``.
        """
        if not 0 <= index < len(self):
            raise IndexError(f"index: expected an integer in [0, {len(self)}), got {index}")
        step, k = divmod(index, self.micro_batches)
        world = self.world_size
        groups = split_step(self.steps[step], self.lengths, world * self.micro_batches)
        micro = [[self.samples[i] for i in groups[k * world + r]] for r in range(world)]
        mine = fill(micro, self.rank, self.filler)
        if mine is None:
            return MicroBatch(step, k, None)
        try:
            batch = self.collate(mine)
        except ValueError as error:
            return MicroBatch(step, k, None, error=one_line(error))
        except OSError as error:
            return MicroBatch(step, k, None, error=f"I/O error: {one_line(error)}")
        except MemoryError:
            return MicroBatch(step, k, None, error=f"out of memory making step {step}'s batch")
        return MicroBatch(step, k, batch, sum(len(s) for s in micro[self.rank]))


def _as_is(item: Any) -> Any:  # batch_size=None: each item is already a micro-batch
    return item


class MicroBatches:
    """``batches`` from item ``start`` on, in order, made ``prefetch`` items ahead by each of
    ``num_workers`` worker processes (0: in this process, when asked for), on ``device``.

    Use it as a context manager: entering starts the workers (forked where the platform
    can: the samples are shared, not copied), leaving stops them. A worker that died (killed
    by a signal, out of memory) is a :class:`LoaderError` with ``died=True`` when its
    micro-batch is waited for, and so is a micro-batch that could not be made (``died``
    False) when it is its turn. On CUDA the batches come in pinned memory and are copied with
    ``non_blocking=True`` (no host sync).

    Raises:
        ValueError: ``start`` outside ``[0, len(batches)]``, ``num_workers`` negative,
            ``prefetch`` not positive.
    """

    def __init__(
        self,
        batches: StepBatches,
        *,
        start: int = 0,
        num_workers: int = 0,
        device: str | torch.device = "cpu",
        prefetch: int = 2,
    ) -> None:
        if not 0 <= start <= len(batches):
            raise ValueError(f"start: expected an integer in [0, {len(batches)}], got {start!r}")
        if num_workers < 0:
            raise ValueError(f"num_workers: expected an integer >= 0, got {num_workers!r}")
        if prefetch < 1:
            raise ValueError(f"prefetch: expected a positive integer, got {prefetch!r}")
        self.device = torch.device(device)
        self.pinned = self.device.type == "cuda"
        fork = num_workers > 0 and "fork" in multiprocessing.get_all_start_methods()
        self._loader = DataLoader(
            batches,
            batch_size=None,  # every item is a whole micro-batch
            sampler=range(start, len(batches)),
            num_workers=num_workers,
            collate_fn=_as_is,
            pin_memory=self.pinned,
            # Its own generator: the loader's seed draw must not move the training RNG.
            generator=torch.Generator().manual_seed(0),
            prefetch_factor=prefetch if num_workers else None,
            multiprocessing_context="fork" if fork else None,
        )
        self._iterator: Iterator[MicroBatch] | None = None

    def __enter__(self) -> "MicroBatches":
        sigchld: signal.Signals | None = getattr(signal, "SIGCHLD", None)  # none on Windows
        handler = None
        if sigchld is not None and threading.current_thread() is threading.main_thread():
            handler = signal.getsignal(sigchld)
        self._iterator = iter(self._loader)
        if sigchld is not None and handler is not None and signal.getsignal(sigchld) != handler:
            # torch's SIGCHLD handler raises a worker's death wherever the main thread is (in
            # the middle of a checkpoint's write, say); without it, the loader finds the dead
            # worker when it waits for its micro-batch (within 5 s), which is where we say so.
            signal.signal(sigchld, handler)
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._iterator = None  # the loader's iterator stops its workers when dropped
        # A handler torch installed for an earlier loader of this process still raises a
        # worker's death anywhere in the block.
        if isinstance(error, RuntimeError) and _worker_died(error):
            raise _died(error) from None

    def __iter__(self) -> "MicroBatches":
        return self

    def __next__(self) -> MicroBatch:
        """The next micro-batch, on the device.

        Raises:
            LoaderError: it could not be made, or a worker died.
            RuntimeError: used outside its ``with`` block.
        """
        if self._iterator is None:
            raise RuntimeError("MicroBatches: iterate inside its `with` block")
        died = None
        try:
            item = next(self._iterator)
        except (RuntimeError, ConnectionError, EOFError) as error:
            # A ConnectionError or EOFError: a micro-batch the worker sent just before it
            # died, whose tensors (shared by file descriptor) it can no longer hand over.
            if isinstance(error, RuntimeError) and not _worker_died(error):
                raise
            died = _died(error)
        if died is not None:  # raised outside the handler: no traceback into the loader
            raise died
        if item.error is not None:
            raise LoaderError(item.error)
        return item.to(self.device, non_blocking=self.pinned)


def _worker_died(error: RuntimeError) -> bool:
    return str(error).startswith(_WORKER_DIED)


def _died(error: BaseException) -> LoaderError:
    if isinstance(error, RuntimeError):
        reason = str(error).strip().splitlines()[0].rstrip(". ")
    else:
        reason = f"its last micro-batch could not be received: {error}"
    return LoaderError(
        f"a data loader worker process died ({reason}): out of memory, or killed from outside",
        died=True,
    )
