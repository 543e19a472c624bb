"""The training job's configuration: one dataclass, its command-line flags and its checks."""

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any


def _opt(default: Any, help: str, group: str, **kwargs: Any) -> Any:
    return field(default=default, metadata={"help": help, "group": group, **kwargs})


@dataclass
class TrainConfig:
    """Everything a run depends on. Groups: ``data`` and ``model`` and ``optim`` must match a
    checkpoint to resume from it; ``run`` may change between a run and its resumption."""

    # data
    seed: int = _opt(0, "seed of the dataset, the model's initialisation and the order", "data")
    num_train: int = _opt(10_000, "training images", "data")
    num_heldout: int = _opt(1_000, "held-out images (accuracy is measured on them)", "data")
    image_size: int = _opt(32, "image side in pixels", "data")
    # model
    patch_size: int = _opt(8, "vision encoder patch side; one image token per patch", "model")
    encoder_dim: int = _opt(64, "vision encoder width", "model")
    encoder_layers: int = _opt(2, "vision transformer blocks", "model")
    encoder_heads: int = _opt(4, "vision attention heads", "model")
    decoder_dim: int = _opt(64, "decoder width", "model")
    decoder_layers: int = _opt(2, "decoder blocks", "model")
    decoder_heads: int = _opt(4, "decoder query heads", "model")
    decoder_kv_heads: int = _opt(2, "decoder key/value heads (grouped-query attention)", "model")
    decoder_mlp_dim: int = _opt(192, "decoder MLP hidden width", "model")
    # optimisation
    batch_size: int = _opt(64, "global batch size (split across processes)", "optim")
    lr: float = _opt(3e-3, "peak learning rate (AdamW)", "optim")
    warmup_steps: int = _opt(50, "linear warm-up steps, then cosine decay to 0", "optim")
    weight_decay: float = _opt(0.01, "AdamW weight decay", "optim")
    grad_clip: float = _opt(1.0, "clip the global gradient norm to this (0: no clipping)", "optim")
    # run: may differ when resuming
    steps: int = _opt(1_000, "total optimiser steps (a resumed run may extend them)", "run")
    output_dir: str | None = _opt(
        None,
        "where checkpoints, the loss plot and the metrics go; unset: a new "
        "runs/shapes-<date>-<time>",
        "run",
    )
    resume: bool = _opt(False, "continue from the latest checkpoint in --output-dir", "run")
    checkpoint_every: int = _opt(250, "save a checkpoint every N steps (and at the end)", "run")
    keep_checkpoints: int = _opt(2, "how many of the latest checkpoints to keep", "run")
    parallel: str = _opt(
        "ddp",
        "under torchrun: 'ddp' (DistributedDataParallel) or 'fsdp' (FSDP2 fully_shard)",
        "run",
        choices=("ddp", "fsdp"),
    )
    device: str = _opt(
        "auto",
        "'auto' (CUDA if available), 'cpu' or 'cuda'",
        "run",
        choices=("auto", "cpu", "cuda"),
    )
    threads: int = _opt(
        1,
        "CPU threads per process (0: torch's default); 1 is fastest for this small model on a "
        "shared machine",
        "run",
    )
    log_every: int = _opt(10, "read the loss back every N steps (a host sync on GPU)", "run")
    num_samples: int = _opt(8, "held-out sample generations to print", "run")
    eval_batch_size: int = _opt(256, "batch size of the held-out greedy generation", "run")
    progress: bool = _opt(True, "show the progress bar", "run")

    def group(self, name: str) -> dict[str, Any]:
        """The fields of one group (``data``, ``model``, ``optim``, ``run``) as a dict."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.metadata["group"] == name
        }


_POSITIVE = (
    "num_train",
    "num_heldout",
    "image_size",
    "patch_size",
    "encoder_dim",
    "encoder_heads",
    "decoder_dim",
    "decoder_layers",
    "decoder_heads",
    "decoder_kv_heads",
    "decoder_mlp_dim",
    "batch_size",
    "steps",
    "checkpoint_every",
    "keep_checkpoints",
    "log_every",
    "eval_batch_size",
)
_NON_NEGATIVE = ("encoder_layers", "warmup_steps", "weight_decay", "grad_clip", "threads")


def check_config(config: TrainConfig) -> None:
    """Raise ``ValueError`` naming the flag when a value is out of range or sizes do not fit."""

    def fail(name: str, expected: str) -> None:
        flag = "--" + name.replace("_", "-")
        raise ValueError(f"{flag}: expected {expected}, got {getattr(config, name)!r}")

    for name in _POSITIVE:
        if getattr(config, name) <= 0:
            fail(name, "a positive value")
    for name in _NON_NEGATIVE:
        if getattr(config, name) < 0:
            fail(name, "a value >= 0")
    if config.num_samples < 0:
        fail("num_samples", "a value >= 0")
    if not config.lr > 0:
        fail("lr", "a positive learning rate")
    if config.image_size % config.patch_size:
        fail("image_size", f"a multiple of --patch-size={config.patch_size}")
    if config.encoder_dim % config.encoder_heads:
        fail("encoder_dim", f"a multiple of --encoder-heads={config.encoder_heads}")
    if config.decoder_dim % config.decoder_heads:
        fail("decoder_dim", f"a multiple of --decoder-heads={config.decoder_heads}")
    if config.decoder_heads % config.decoder_kv_heads:
        fail("decoder_heads", f"a multiple of --decoder-kv-heads={config.decoder_kv_heads}")
    if (config.decoder_dim // config.decoder_heads) % 2:
        fail("decoder_dim", "an even head size (decoder_dim / decoder_heads) for RoPE")
    if config.resume and config.output_dir is None:
        raise ValueError("--resume: expected --output-dir, the directory of the run to resume")


def build_parser() -> argparse.ArgumentParser:
    """The command line: one flag per :class:`TrainConfig` field, grouped as in the dataclass."""
    parser = argparse.ArgumentParser(
        prog="python -m fusion.training",
        description=(
            "Train an early-fusion captioner (vision encoder + Llama-style decoder) from scratch "
            "on generated shapes, report held-out exact-match accuracy with greedy generation, "
            "and check that the checkpoint's decoder loads into a plain TransformerDecoder. "
            "Runs under torchrun for DDP or FSDP2."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    titles = {
        "data": "data (must match when resuming)",
        "model": "model (must match when resuming)",
        "optim": "optimisation (must match when resuming)",
        "run": "run",
    }
    groups = {name: parser.add_argument_group(title) for name, title in titles.items()}
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        group = groups[f.metadata["group"]]
        if f.type is bool:
            action = "store_true" if f.default is False else argparse.BooleanOptionalAction
            group.add_argument(flag, action=action, default=f.default, help=f.metadata["help"])
            continue
        kind = f.type if f.type in (int, float) else str
        group.add_argument(
            flag,
            type=kind,
            default=f.default,
            help=f.metadata["help"],
            choices=f.metadata.get("choices"),
            metavar=None if f.metadata.get("choices") else f.name.upper(),
        )
    return parser


def parse_config(argv: list[str] | None = None) -> TrainConfig:
    """Parse ``argv`` into a checked :class:`TrainConfig`; exits with status 2 (argparse's)
    and a message naming the flag on unknown flags or bad values."""
    parser = build_parser()
    args = parser.parse_args(argv)
    config = TrainConfig(**vars(args))
    try:
        check_config(config)
    except ValueError as error:
        parser.error(str(error))
    return config
