"""The training job's configuration: one dataclass, its command-line flags, its checks, and
what a resumed run takes from its checkpoint."""

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from fusion.training import config as shared
from fusion.training.config import config_group, flag_name, option

# What --resume does with each group of settings (see resumed_config).
GROUP_TITLES, FIXED_GROUPS = shared.group_titles(), shared.FIXED_GROUPS
# An option of each group (fusion.training.config.option without its group argument).
_data, _model, _optim, _run, _session = (partial(option, group=g) for g in GROUP_TITLES)


@dataclass
class TrainConfig:
    """Everything a run depends on, in groups (:data:`GROUP_TITLES`)."""

    seed: int = _data(0, "seed of the dataset, the model's initialisation and the order")
    num_train: int = _data(10_000, "training images", positive=True)
    num_heldout: int = _data(1_000, "held-out images (accuracy is measured on them)", positive=True)
    image_size: int = _data(32, "image side in pixels", positive=True)

    patch_size: int = _model(
        8, "vision encoder patch side; one image token per patch", positive=True
    )
    encoder_dim: int = _model(64, "vision encoder width", positive=True)
    encoder_layers: int = _model(2, "vision transformer blocks", non_negative=True)
    encoder_heads: int = _model(4, "vision attention heads", positive=True)
    decoder_dim: int = _model(64, "decoder width", positive=True)
    decoder_layers: int = _model(2, "decoder blocks", positive=True)
    decoder_heads: int = _model(4, "decoder query heads", positive=True)
    decoder_kv_heads: int = _model(
        2, "decoder key/value heads (grouped-query attention)", positive=True
    )
    decoder_mlp_dim: int = _model(192, "decoder MLP hidden width", positive=True)

    batch_size: int = _optim(64, "global batch size (split across processes)", positive=True)
    lr: float = _optim(3e-3, "peak learning rate (AdamW)")
    warmup_steps: int = _optim(
        50, "linear warm-up steps, then cosine decay to 0", non_negative=True
    )
    weight_decay: float = _optim(0.01, "AdamW weight decay", non_negative=True)
    grad_clip: float = _optim(
        1.0, "clip the global gradient norm to this (0: no clipping)", non_negative=True
    )

    steps: int = _run(2_000, "total optimiser steps (a resumed run may extend them)", positive=True)
    checkpoint_every: int = _run(
        250, "save a checkpoint every N steps (and at the end)", positive=True
    )
    keep_checkpoints: int = _run(2, "how many of the latest checkpoints to keep", positive=True)
    parallel: str = _run(
        "ddp",
        "under torchrun: 'ddp' (DistributedDataParallel) or 'fsdp' (FSDP2 fully_shard)",
        choices=("ddp", "fsdp"),
    )
    log_every: int = _run(
        10, "read the loss back every N steps (a host sync on GPU)", positive=True
    )
    num_samples: int = _run(8, "held-out sample generations to print", non_negative=True)
    eval_batch_size: int = _run(256, "batch size of the held-out greedy generation", positive=True)

    output_dir: str | None = _session(
        None,
        "where checkpoints, the loss plot and the metrics go; unset: a new "
        "runs/shapes-<date>-<time>",
    )
    resume: bool = _session(
        False,
        "continue the run in --output-dir from its latest intact checkpoint, with its stored "
        "configuration",
    )
    device: str = _session(
        "auto", "'auto' (CUDA if available), 'cpu' or 'cuda'", choices=("auto", "cpu", "cuda")
    )
    threads: int = _session(
        1,
        "CPU threads per process (0: torch's default); 1 is fastest for this small model on a "
        "shared machine",
        non_negative=True,
    )
    progress: bool = _session(True, "show the progress bar")

    def group(self, name: str) -> dict[str, Any]:
        """The fields of one group (:data:`GROUP_TITLES`) as a dict."""
        return config_group(self, name)


def check_config(config: TrainConfig, name: Callable[[str], str] = flag_name) -> None:
    """Raise ``ValueError`` naming the first setting that does not fit (by ``name``: a flag)."""

    fail = partial(shared.refuse, config, name=name)
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
        fail("decoder_heads", f"a multiple of {name('decoder_kv_heads')}={config.decoder_kv_heads}")
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
