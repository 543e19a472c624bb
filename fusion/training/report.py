"""What a training job shows and writes besides checkpoints: log lines and a progress bar on
the main process, one-line warnings, ``metrics.json`` and the loss plot (``loss.png``), both
written atomically.

The progress bar (tqdm) and the plot (matplotlib) come from the optional ``train`` extra
(:data:`INSTALL_TRAIN_EXTRA`); without them a job warns once at the start
(:func:`progress_unavailable`, :func:`plotting_unavailable`) and runs on.
"""

import io
import json
import resource
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from fusion.training.checkpoint import atomic_write_bytes
from fusion.training.distributed import Runtime

try:
    from tqdm import tqdm
except ImportError:  # part of the optional `train` extra: without it, no progress bar
    tqdm = None

INSTALL_TRAIN_EXTRA = "pip install -e '.[train]'"


def flat(message: object) -> str:
    """``message`` on one line, even with a newline in a path it names."""
    return " ".join(str(message).splitlines())


def warn(prog: str, message: str) -> None:
    """One line on stderr from recipe ``prog``, as its errors are."""
    print(f"{prog}: warning: {flat(message)}", file=sys.stderr, flush=True)


def log(runtime: Runtime, message: str) -> None:
    """Print ``message`` on the main process only, without breaking the progress bar."""
    if runtime.is_main:
        if tqdm is None:
            print(message)
        else:
            tqdm.write(message, file=sys.stdout)
        sys.stdout.flush()


def progress_unavailable(install: str = INSTALL_TRAIN_EXTRA) -> str | None:
    """Why there can be no progress bar (tqdm, installed by ``install``, is missing), or
    None."""
    if tqdm is None:
        return f"no progress bar: tqdm is not installed; install it with: {install}"
    return None


class NoBar:
    """The progress bar's interface, doing nothing (bar off, another process, or no tqdm)."""

    def set_postfix(self, **kwargs: object) -> None:
        pass

    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(
    runtime: Runtime, *, total: int, initial: int = 0, enabled: bool = True, unit: str = "step"
) -> Any:
    """tqdm's bar on stderr, on the main process when ``enabled`` and tqdm is installed; a
    :class:`NoBar` otherwise. Either has ``set_postfix(**values, refresh=False)`` (say the
    loss and tokens/s), ``update(n)`` and ``close()``."""
    if not (runtime.is_main and enabled and tqdm is not None):
        return NoBar()
    return tqdm(
        total=total,
        initial=initial,
        desc="training",
        unit=unit,
        dynamic_ncols=True,
        file=sys.stderr,
    )


def plotting_unavailable(install: str = INSTALL_TRAIN_EXTRA) -> str | None:
    """Why the loss plot cannot be drawn (matplotlib, of the optional extra installed by
    ``install``, missing or broken), or None."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as error:
        return f"no loss plot: matplotlib cannot be imported ({error}); install it with: {install}"
    return None


def warn_missing_extras(prog: str, runtime: Runtime, progress: bool) -> None:
    """Say, on the main process and before any work, what the ``train`` extra would add that
    is missing: the loss plot, and the progress bar when ``progress``."""
    if runtime.is_main:
        missing = [plotting_unavailable(INSTALL_TRAIN_EXTRA)]
        missing.append(progress_unavailable() if progress else None)
        for message in filter(None, missing):
            warn(prog, message)


def plot_if_available(prog: str, losses: list[float], path: Path, **kwargs: Any) -> Path | None:
    """:func:`plot_losses` (``kwargs``: its options) to ``path``, which it returns; None
    without matplotlib (said at the start: :func:`warn_missing_extras`), or with a warning
    from ``prog`` when a part of matplotlib does not import.

    Raises:
        OSError: the file cannot be written.
    """
    if plotting_unavailable(INSTALL_TRAIN_EXTRA) is not None:
        return None
    try:
        plot_losses(losses, path, **kwargs)
    except ImportError as error:  # matplotlib is there but a part of it is not
        warn(prog, f"no loss plot: {error}; reinstall matplotlib with: {INSTALL_TRAIN_EXTRA}")
        return None
    return path


def plot_losses(
    losses: list[float],
    path: Path,
    *,
    title: str,
    eval_losses: Sequence[tuple[int, float]] = (),
    ylabel: str = "loss",
) -> None:
    """Write the loss curve (log scale) to ``path`` as a PNG, atomically: the training loss of
    every step (``losses[i]`` is step ``i + 1``'s), its running mean when there are many, and
    the ``(step, loss)`` points of ``eval_losses`` if any. Non-finite losses leave gaps.

    Raises:
        ImportError: matplotlib is not installed.
        OSError: the file cannot be written (an existing one is then kept).
    """
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    steps = range(1, len(losses) + 1)
    ax.plot(steps, losses, linewidth=0.8, label="per step")
    window = max(1, len(losses) // 50)
    if window > 1:
        smooth = [
            sum(losses[max(0, i - window + 1) : i + 1])
            / len(losses[max(0, i - window + 1) : i + 1])
            for i in range(len(losses))
        ]
        ax.plot(steps, smooth, linewidth=1.6, label=f"mean of {window}")
    if eval_losses:
        at, values = zip(*eval_losses, strict=True)
        ax.plot(at, values, marker="o", linewidth=1.2, label="eval")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    atomic_write_bytes(path, buffer.getvalue())


def peak_memory(device: torch.device) -> dict[str, Any]:
    """This process's peak memory, for ``metrics.json``: ``{"kind", "bytes"}``, the CUDA
    allocator's peak on ``device`` (``cuda_max_allocated``) or else the peak resident set
    (``cpu_max_rss``)."""
    if device.type == "cuda":
        return {"kind": "cuda_max_allocated", "bytes": torch.cuda.max_memory_allocated(device)}
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return {"kind": "cpu_max_rss", "bytes": kib * 1024}


def write_json(data: dict[str, Any], path: Path) -> None:
    """Write ``data`` to ``path`` as indented JSON, atomically (metrics.json).

    Raises:
        TypeError: a value JSON cannot store.
        OSError: the file cannot be written (an existing one is then kept).
    """
    atomic_write_bytes(path, (json.dumps(data, indent=2) + "\n").encode())
