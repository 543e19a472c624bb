"""What the job writes besides checkpoints: the loss-curve PNG and a metrics JSON."""

import json
from pathlib import Path
from typing import Any

from recipes.captioner.train_checkpoint import atomic_write_bytes


def plotting_unavailable(install: str) -> str | None:
    """Why the loss plot cannot be drawn (matplotlib, of the optional extra installed by
    ``install``, missing or broken), or None."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as error:
        return f"no loss plot: matplotlib cannot be imported ({error}); install it with: {install}"
    return None


def plot_losses(losses: list[float], path: Path, *, title: str) -> None:
    """Write the per-step training loss (log scale) to ``path`` as a PNG, atomically.

    Raises:
        ImportError: matplotlib is not installed.
    """
    import io

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
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy on caption tokens")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    atomic_write_bytes(path, buffer.getvalue())


def write_json(data: dict[str, Any], path: Path) -> None:
    atomic_write_bytes(path, (json.dumps(data, indent=2) + "\n").encode())
