"""The training job's configuration: one dataclass, its command-line flags, its checks, and
what a resumed run takes from its checkpoint."""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fusion.training import config as shared
from fusion.training.config import config_group, flag_name
from fusion.training.config import option as _opt

# What --resume does with each group of settings (see resumed_config).
GROUP_TITLES = {
    "data": "data (restored by --resume; a different value is refused)",
    "model": "model (restored by --resume; a different value is refused)",
    "optim": "optimisation (restored by --resume; a different value is refused)",
    "run": "run (restored by --resume unless given; --steps may extend the run)",
    "session": "this invocation (never restored)",
}
# The groups that define what a checkpoint continues: resuming with other values would train
# another model on other data.
FIXED_GROUPS = ("data", "model", "optim")


@dataclass
class TrainConfig:
    """Everything a run depends on, in groups (:data:`GROUP_TITLES`)."""

    # data
    seed: int = _opt(0, "seed of the dataset, the model's initialisation and the order", "data")
    num_train: int = _opt(10_000, "training images", "data", positive=True)
    num_heldout: int = _opt(
        1_000, "held-out images (accuracy is measured on them)", "data", positive=True
    )
    image_size: int = _opt(32, "image side in pixels", "data", positive=True)
    # model
    patch_size: int = _opt(
        8, "vision encoder patch side; one image token per patch", "model", positive=True
    )
    encoder_dim: int = _opt(64, "vision encoder width", "model", positive=True)
    encoder_layers: int = _opt(2, "vision transformer blocks", "model", non_negative=True)
    encoder_heads: int = _opt(4, "vision attention heads", "model", positive=True)
    decoder_dim: int = _opt(64, "decoder width", "model", positive=True)
    decoder_layers: int = _opt(2, "decoder blocks", "model", positive=True)
    decoder_heads: int = _opt(4, "decoder query heads", "model", positive=True)
    decoder_kv_heads: int = _opt(
        2, "decoder key/value heads (grouped-query attention)", "model", positive=True
    )
    decoder_mlp_dim: int = _opt(192, "decoder MLP hidden width", "model", positive=True)
    # optimisation
    batch_size: int = _opt(64, "global batch size (split across processes)", "optim", positive=True)
    lr: float = _opt(3e-3, "peak learning rate (AdamW)", "optim")
    warmup_steps: int = _opt(
        50, "linear warm-up steps, then cosine decay to 0", "optim", non_negative=True
    )
    weight_decay: float = _opt(0.01, "AdamW weight decay", "optim", non_negative=True)
    grad_clip: float = _opt(
        1.0, "clip the global gradient norm to this (0: no clipping)", "optim", non_negative=True
    )
    # run: stored; a resumed run may change them
    steps: int = _opt(
        2_000, "total optimiser steps (a resumed run may extend them)", "run", positive=True
    )
    checkpoint_every: int = _opt(
        250, "save a checkpoint every N steps (and at the end)", "run", positive=True
    )
    keep_checkpoints: int = _opt(
        2, "how many of the latest checkpoints to keep", "run", positive=True
    )
    parallel: str = _opt(
        "ddp",
        "under torchrun: 'ddp' (DistributedDataParallel) or 'fsdp' (FSDP2 fully_shard)",
        "run",
        choices=("ddp", "fsdp"),
    )
    log_every: int = _opt(
        10, "read the loss back every N steps (a host sync on GPU)", "run", positive=True
    )
    num_samples: int = _opt(8, "held-out sample generations to print", "run", non_negative=True)
    eval_batch_size: int = _opt(
        256, "batch size of the held-out greedy generation", "run", positive=True
    )
    # session: this invocation's alone
    output_dir: str | None = _opt(
        None,
        "where checkpoints, the loss plot and the metrics go; unset: a new "
        "runs/shapes-<date>-<time>",
        "session",
    )
    resume: bool = _opt(
        False,
        "continue the run in --output-dir from its latest intact checkpoint, with its stored "
        "configuration",
        "session",
    )
    device: str = _opt(
        "auto",
        "'auto' (CUDA if available), 'cpu' or 'cuda'",
        "session",
        choices=("auto", "cpu", "cuda"),
    )
    threads: int = _opt(
        1,
        "CPU threads per process (0: torch's default); 1 is fastest for this small model on a "
        "shared machine",
        "session",
        non_negative=True,
    )
    progress: bool = _opt(True, "show the progress bar", "session")

    def group(self, name: str) -> dict[str, Any]:
        """The fields of one group (``data``, ``model``, ``optim``, ``run``, ``session``) as a
        dict."""
        return config_group(self, name)


def check_config(config: TrainConfig, name: Callable[[str], str] = flag_name) -> None:
    """Raise ``ValueError`` naming the setting when a value is out of range or sizes do not
    fit. ``name`` turns a field name into how the message names it (default: its flag)."""

    def fail(field_name: str, expected: str) -> None:
        got = getattr(config, field_name)
        raise ValueError(f"{name(field_name)}: expected {expected}, got {got!r}")

    shared.check_ranges(config, name)
    if not config.lr > 0:
        fail("lr", "a positive learning rate")
    if config.image_size % config.patch_size:
        fail("image_size", f"a multiple of {name('patch_size')}={config.patch_size}")
    if config.encoder_dim % config.encoder_heads:
        fail("encoder_dim", f"a multiple of {name('encoder_heads')}={config.encoder_heads}")
    if config.decoder_dim % config.decoder_heads:
        fail("decoder_dim", f"a multiple of {name('decoder_heads')}={config.decoder_heads}")
    if config.decoder_heads % config.decoder_kv_heads:
        kv = f"{name('decoder_kv_heads')}={config.decoder_kv_heads}"
        fail("decoder_heads", f"a multiple of {kv}")
    if (config.decoder_dim // config.decoder_heads) % 2:
        fail("decoder_dim", "an even head size (decoder_dim / decoder_heads) for RoPE")
    if config.output_dir is not None and (not config.output_dir or "\0" in config.output_dir):
        fail("output_dir", "a directory path (not empty, no NUL character)")
    if config.resume and config.output_dir is None:
        raise ValueError(
            f"{name('resume')}: expected {name('output_dir')}, the directory of the run to resume"
        )


# The job's command line and what its checkpoints store (every field).
SPEC = shared.ConfigSpec(
    TrainConfig,
    prog="python -m recipes.captioner",
    description=(
        "Train an early-fusion captioner (vision encoder + Llama-style decoder) from scratch "
        "on generated shapes, report held-out exact-match accuracy with greedy generation, "
        "and check that the checkpoint's decoder loads into a plain TransformerDecoder. "
        "Runs under torchrun for DDP or FSDP2."
    ),
    group_titles=GROUP_TITLES,
    check=check_config,
    fixed_groups=FIXED_GROUPS,
)
build_parser, parse_args, resumed_config = SPEC.build_parser, SPEC.parse_args, SPEC.resumed
config_from_values = SPEC.from_json


def parse_config(argv: list[str] | None = None) -> TrainConfig:
    """:func:`parse_args` without the names of the flags given."""
    return parse_args(argv)[0]
