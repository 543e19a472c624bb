"""Hugging Face directories (``config.json`` + weights) <-> models of this library.

:func:`load_hf_llama` and :func:`save_hf_llama` for Llama decoders; :func:`load_hf` and
:func:`save_hf` are what they share with the vision-language models of :mod:`.hf_vlm`, whose
text model is a Llama too.
"""

import json
import math
import os
import re
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from fusion._wrappers import unwrap
from fusion.checkpoint.files import (
    CheckpointFiles,
    check_not_sharded,
    check_save_options,
    prepare_tensors,
    write_checkpoint,
)
from fusion.checkpoint.hf_config import hf_config_from_decoder, llama_kwargs
from fusion.decoder import RotaryPositionalEmbeddings, TransformerDecoder
from fusion.early_fusion import EarlyFusion
from fusion.hf.config import CONFIG_NAME, ConfigReader, read_hf_config
from fusion.hf.errors import CheckpointError, as_path, check_positive_int
from fusion.hf.keys import fusion_to_hf, rope_heads, rotate_half_to_interleaved
from fusion.hf.layout import KeyLayout
from fusion.models import llama3_2

_LOADABLE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# Bytes of rotary table allowed whatever the size of the weights (a 256k-position table at
# head_dim 64); beyond it the table may not outweigh the weights themselves.
_ROPE_TABLE_FLOOR = 64 * 2**20


@dataclass
class HfSpec:
    """What a Hugging Face ``config.json`` describes, to be checked against the weights."""

    kind: str  # named in errors: the family's name
    config_file: Path
    text: dict[str, Any]  # the text model's llama3_2 arguments (max_seq_len may be overridden)
    build: Callable[[], nn.Module]  # the model, from ``text`` and the rest of the config
    layout: KeyLayout = field(default_factory=KeyLayout)
    text_key: str = ""  # where config.json keeps the text model's settings
    # config key -> (pattern of our keys with the layer index, the layers it claims)
    layers: dict[str, tuple[str, int]] = field(default_factory=dict)
    # the config key behind a builder argument a constructor's error names (None: unknown)
    config_key: Callable[[str], str | None] = lambda argument: None


def load_hf_llama(
    path: str | bytes | os.PathLike,
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    max_seq_len: int | None = None,
) -> TransformerDecoder:
    """Build the ``llama3_2`` decoder a Hugging Face Llama directory describes, with its weights.

    The directory is untrusted input. Everything is checked from ``config.json`` and the
    weights' headers before anything is allocated: the config's values, that its layer count is
    backed by weights, every name, shape and dtype, that the files hold the bytes the weights
    claim (no storage shared or expanded to inflate a small file) and that the rotary table is
    not larger than the weights. The decoder is then allocated once, on ``device``, and filled.
    Weights are relabelled (see :mod:`fusion.checkpoint.keys`), never recomputed.

    Args:
        path: a directory with ``config.json`` and ``model.safetensors``,
            ``model.safetensors.index.json`` + shards, or ``pytorch_model.bin`` (+ index), the
            latter read with ``torch.load(weights_only=True)``. str, bytes or PathLike.
        dtype: parameter dtype (float16, bfloat16, float32 or float64). None: the dtype the
            weights are stored in.
        device: where the decoder lives.
        max_seq_len: override ``max_position_embeddings`` (the longest sequence, and the
            default KV-cache length), e.g. to save memory with long-context checkpoints.

    Returns:
        the decoder, in training mode as freshly built modules are; call ``.eval()`` for
        inference.

    Raises:
        TypeError: an argument of the wrong type (``path``, ``dtype``, ``device``,
            ``max_seq_len``).
        ValueError: ``dtype`` not a floating dtype listed above; ``device`` unknown,
            unavailable or ``meta``; ``max_seq_len`` not in [1, 2**31), or its rotary table
            larger than the weights.
        CheckpointError: naming the file and key: an unreadable, unsupported, degenerate or
            inconsistent config (see :func:`~fusion.checkpoint.hf_config.
            llama3_2_kwargs_from_hf_config`); more layers than the checkpoint has weights for;
            a missing, truncated, corrupt or hostile file or shard (see
            :class:`~fusion.checkpoint.files.CheckpointFiles`); a missing or unexpected key; a
            shape that differs from the config's; weights not stored as float16, bfloat16,
            float32 or float64 (e.g. float8); files holding fewer bytes than the weights need;
            ``max_position_embeddings`` whose rotary table outweighs the weights;
            ``lm_head.weight`` present in a tied model but different from the embedding; mixed
            stored dtypes with ``dtype=None``; a value beyond the range of ``dtype`` (e.g.
            1e6 loaded as float16 would become inf).
    """

    def read_spec(config_file: Path) -> HfSpec:
        text = llama_kwargs(ConfigReader(read_hf_config(config_file), config_file))
        layers = {"num_hidden_layers": (r"layers\.(\d{1,9})\.", text["num_layers"])}
        return HfSpec("llama", config_file, text, lambda: llama3_2(**text), layers=layers)

    decoder = load_hf(path, read_spec, dtype=dtype, device=device, max_seq_len=max_seq_len)
    return cast(TransformerDecoder, decoder)


def load_hf(
    path: object,
    read_spec: Callable[[Path], HfSpec],
    *,
    dtype: torch.dtype | None,
    device: str | torch.device,
    max_seq_len: int | None,
) -> nn.Module:
    """The model ``read_spec(config file)`` describes, filled from the weights next to it, as
    :func:`load_hf_llama` describes (same arguments, checks and errors)."""
    path = as_path(path, "path")
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype: expected a torch.dtype or None, got {type(dtype).__name__}")
    if dtype is not None and dtype not in _LOADABLE_DTYPES:
        raise ValueError(f"dtype: expected float16, bfloat16, float32 or float64, got {dtype}")
    parsed_device = _check_device(device)
    if max_seq_len is not None and check_positive_int(max_seq_len, "max_seq_len") >= 2**31:
        raise ValueError(f"max_seq_len: expected less than 2**31, got {max_seq_len}")
    spec = read_spec(path / CONFIG_NAME)
    checkpoint = CheckpointFiles(path)
    sources = _match_keys(checkpoint, spec)
    if max_seq_len is not None:
        spec.text["max_seq_len"] = max_seq_len
    try:
        with torch.device("meta"):
            model = spec.build()
    except (ValueError, TypeError) as error:  # a constructor's, naming its argument first
        key = spec.config_key(str(error).split(":", 1)[0])
        raise CheckpointError(
            spec.config_file, key, f"describes no {spec.kind} model: {error}"
        ) from error
    expected = {key: tuple(t.shape) for key, t in model.state_dict().items()}
    decoder = spec.layout.decoder
    output, embedding = decoder + "output.weight", decoder + "tok_embeddings.weight"
    tied = spec.text["tie_word_embeddings"]
    _check_entries(checkpoint, sources, expected | ({output: expected[embedding]} if tied else {}))
    for key in expected:
        if key not in sources:
            name = spec.layout.theirs(key)
            raise CheckpointError(checkpoint.path, name, "missing from the checkpoint")
    tied_copy = sources.pop(output, None) if tied else None  # compared after loading
    _check_sizes(checkpoint, sources, spec, max_seq_len is not None)
    if dtype is None:
        stored = {checkpoint.entries[name].dtype for name in sources.values()}
        if len(stored) != 1:
            dtypes = sorted(map(str, stored))
            raise CheckpointError(
                path, None, f"weights stored in several dtypes {dtypes}: pass dtype"
            )
        dtype = stored.pop()

    model = model.to(dtype).to_empty(device=parsed_device)  # uninitialised until filled below
    for module in model.modules():
        if isinstance(module, RotaryPositionalEmbeddings):
            module.reset_parameters()  # the rotary table, in float32, on ``device``
    _check_all_filled(model, set(sources), spec.kind)
    heads = spec.text["num_heads"], spec.text["num_kv_heads"]
    targets = model.state_dict()
    with torch.no_grad():
        for key, name in sources.items():
            tensor = checkpoint.load(name)
            _check_fits(tensor, dtype, checkpoint.entries[name].file, name)
            rows = rope_heads(key[len(decoder) :], *heads) if key.startswith(decoder) else None
            if rows and spec.layout.permute_rope:
                tensor = rotate_half_to_interleaved(tensor, rows)
            targets[key].copy_(tensor)
        weight = targets[embedding]
        if tied_copy is not None and not torch.equal(checkpoint.load(tied_copy).to(weight), weight):
            raise CheckpointError(
                checkpoint.entries[tied_copy].file,
                tied_copy,
                f"config.json says tie_word_embeddings=true, but this differs from "
                f"{sources[embedding]}",
            )
    return model


def _check_device(device: object) -> torch.device:
    if not isinstance(device, str | torch.device):
        raise TypeError(f"device: expected a str or torch.device, got {type(device).__name__}")
    try:
        parsed = torch.device(device)
        torch.empty(0, device=parsed)
    except (RuntimeError, AssertionError) as error:  # unknown, or not built / not present
        raise ValueError(f"device: {device!r} is not available: {error}") from None
    if parsed.type == "meta":
        raise ValueError("device: expected a device that holds data, got meta")
    return parsed


def _match_keys(checkpoint: CheckpointFiles, spec: HfSpec) -> dict[str, str]:
    """Our key -> the checkpoint's, refusing keys of no part and two keys for one weight; then,
    before anything is built (a config may claim millions of layers), the layer counts."""
    sources: dict[str, str] = {}
    ignored = 0
    for name, entry in checkpoint.entries.items():
        try:
            key = spec.layout.ours(name)
        except KeyError:
            raise CheckpointError(
                entry.file, name, f"unexpected key for a {spec.kind} model"
            ) from None
        if key in sources:
            raise CheckpointError(
                entry.file,
                name,
                f"the same weight as {sources[key]!r}: the checkpoint mixes two key layouts",
            )
        if key is not None:
            sources[key] = name
        elif spec.layout.is_ignored(name):
            ignored += 1
    if ignored:
        warnings.warn(
            f"{checkpoint.path}: {ignored} weights the model does not use were not loaded "
            f"(keys matching {spec.layout.ignored!r})",
            stacklevel=4,
        )
    for config_key, (pattern, claimed) in spec.layers.items():
        held = {m.group(1) for key in sources if (m := re.match(pattern, key))}
        if claimed > len(held):
            raise CheckpointError(
                spec.config_file,
                config_key,
                f"{claimed}, but the checkpoint holds weights for {len(held)} layers",
            )
    return sources


def _check_entries(
    checkpoint: CheckpointFiles, sources: Mapping[str, str], shapes: Mapping[str, tuple[int, ...]]
) -> None:
    for key, name in sources.items():
        entry = checkpoint.entries[name]
        if key not in shapes:
            raise CheckpointError(entry.file, name, "unexpected key for a model with this config")
        if entry.shape != shapes[key]:
            raise CheckpointError(
                entry.file,
                name,
                f"shape {list(entry.shape)} differs from {list(shapes[key])} that config.json "
                "implies",
            )
        if entry.dtype not in _LOADABLE_DTYPES:
            raise CheckpointError(
                entry.file,
                name,
                f"stored as {entry.dtype}: expected float16, bfloat16, float32 or float64 "
                "(quantized, float8 or integer weights are not supported)",
            )


def _check_sizes(
    checkpoint: CheckpointFiles, sources: Mapping[str, str], spec: HfSpec, overridden: bool
) -> None:
    """Refuse what would allocate more than the files back: the weights (tensors sharing or
    re-reading storage) and the rotary table (``max_seq_len`` x head_dim float32)."""
    entries = [checkpoint.entries[name] for name in sources.values()]
    needed = sum(math.prod(e.shape) * e.dtype.itemsize for e in entries)
    if needed > checkpoint.stored_bytes:
        raise CheckpointError(
            checkpoint.path,
            None,
            f"the weights take {needed} bytes, but the files hold only "
            f"{checkpoint.stored_bytes}: tensors share storage; refused",
        )
    positions = spec.text["max_seq_len"]
    table = positions * spec.text["embed_dim"] // spec.text["num_heads"] * 4
    if table > max(needed, _ROPE_TABLE_FLOOR):
        message = (
            f"{positions} positions need a {table}-byte rotary table, more than the weights "
            f"({needed} bytes)"
        )
        if overridden:
            raise ValueError(f"max_seq_len: {message}")
        raise CheckpointError(
            spec.config_file,
            spec.text_key + "max_position_embeddings",
            f"{message}; pass max_seq_len to load fewer",
        )


def _check_fits(tensor: torch.Tensor, dtype: torch.dtype, file: Path, key: str) -> None:
    """Refuse values that ``dtype`` cannot hold (they would become inf)."""
    limit = torch.finfo(dtype).max
    if tensor.numel() == 0 or limit >= torch.finfo(tensor.dtype).max:
        return
    low, high = torch.aminmax(tensor)
    largest = max(-low.item(), high.item())  # NaN, already there, compares False
    if largest > limit:
        raise CheckpointError(
            file,
            key,
            f"holds {largest:g}, beyond the range of {dtype} (max {limit:g}): load it with a "
            "wider dtype",
        )


def _check_all_filled(model: nn.Module, loaded: set[str], kind: str) -> None:
    """Guard against a module gaining state that neither the checkpoint nor a rebuild fills."""
    rebuilt = {
        f"{name}.{buffer}" if name else buffer
        for name, module in model.named_modules(remove_duplicate=False)
        if isinstance(module, RotaryPositionalEmbeddings)
        for buffer, _ in module.named_buffers()
    }
    names = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    names |= {name for name, _ in model.named_buffers(remove_duplicate=False)}
    unfilled = sorted(names - loaded - rebuilt)
    if unfilled:
        raise RuntimeError(f"{kind} loader: no value for {unfilled}; the loader needs updating")


def save_hf_llama(
    decoder: TransformerDecoder | EarlyFusion | nn.Module,
    directory: str | bytes | os.PathLike,
    *,
    max_shard_size: int | None = None,
    overwrite: bool = False,
) -> list[Path]:
    """Write ``decoder`` as a Hugging Face Llama directory: ``config.json`` and safetensors.

    ``transformers.LlamaForCausalLM.from_pretrained(directory)`` loads it, and
    :func:`load_hf_llama` gives back the same parameters bit for bit. Written crash-safely as
    :func:`~fusion.checkpoint.save_state_dict` describes, ``config.json`` included (renamed in
    right after the weights): a checkpoint being replaced stays loadable until the new one is
    complete, and a failed save leaves nothing behind. Links named like its files are replaced,
    never written through.

    The format holds a text decoder only. Given an :class:`~fusion.EarlyFusion`, its
    ``decoder`` is saved and its encoders are **not**: save them separately, e.g.
    ``save_state_dict(model.encoders.state_dict(), path)``.

    Args:
        decoder: a ``llama3_2``-built decoder (any device and dtype; stored as they are), or
            an ``EarlyFusion`` over one (its decoder is saved); either may be wrapped by
            ``torch.compile``, ``DistributedDataParallel`` or ``DataParallel``.
        directory: created if needed (str, bytes or PathLike).
        max_shard_size: bytes per safetensors shard (then with an index); None: one file.
        overwrite: replace a checkpoint already in ``directory``; other files there are kept.

    Returns:
        the files written.

    Raises:
        TypeError: ``decoder`` neither a ``TransformerDecoder`` nor an ``EarlyFusion`` (once
            unwrapped); ``directory``, ``max_shard_size`` or ``overwrite`` of the wrong type.
        ValueError: ``decoder`` is not a homogeneous Llama (see
            :func:`~fusion.checkpoint.hf_config.hf_config_from_decoder`) or has tensors without
            data (meta device) or sharded (FSDP2: load a full state dict into a plain decoder
            and save that); ``max_shard_size`` not positive.
        CheckpointError: ``directory`` already holds a checkpoint or ``config.json`` and
            ``overwrite`` is False; it is a file.
        OSError: the file system failed (a checkpoint being replaced is then left as it was).
    """
    decoder = text_decoder(decoder)
    config = hf_config_from_decoder(decoder)
    return save_hf(
        decoder.state_dict(),
        config,
        KeyLayout(),
        directory,
        max_shard_size=max_shard_size,
        overwrite=overwrite,
        argument="decoder",
    )


def save_hf(
    state_dict: Mapping[str, torch.Tensor],
    config: Mapping[str, Any],
    layout: KeyLayout,
    directory: str | bytes | os.PathLike,
    *,
    max_shard_size: int | None,
    overwrite: bool,
    argument: str,
) -> list[Path]:
    """Write a model's ``state_dict`` (this library's keys) and its Hugging Face ``config`` into
    ``directory``, in ``layout``, as :func:`save_hf_llama` describes (errors name
    ``argument``)."""
    path = as_path(directory, "directory")
    check_save_options(max_shard_size, overwrite)
    try:
        text = json.dumps(config, indent=2, allow_nan=False) + "\n"
    except ValueError as error:
        raise ValueError(f"{argument}: its config cannot be written as JSON: {error}") from None
    check_not_sharded(state_dict, argument)  # before permuting rows across shards
    text_config = config.get("text_config", config)
    decoder = fusion_to_hf(
        {
            k.removeprefix(layout.decoder): v
            for k, v in state_dict.items()
            if k.startswith(layout.decoder)
        },
        num_heads=text_config["num_attention_heads"],
        num_kv_heads=text_config["num_key_value_heads"],
        permute_rope=layout.permute_rope,
        renamed=layout.renamed,
    )
    others = {k: v for k, v in state_dict.items() if not k.startswith(layout.decoder)}
    state = {layout.decoder + k: v for k, v in decoder.items()} | others
    tensors = prepare_tensors(
        {layout.saved(k): v for k, v in state.items()}, argument, safetensors=True
    )
    return write_checkpoint(
        tensors,
        path,
        max_shard_size=max_shard_size,
        overwrite=overwrite,
        extra_files={CONFIG_NAME: text},
    )


def text_decoder(model: object) -> TransformerDecoder:
    """The ``TransformerDecoder`` that ``model`` is or holds, through wrappers that keep the
    whole model inside them unchanged (``torch.compile``, DDP, DataParallel)."""
    inner = unwrap(model)
    if isinstance(inner, EarlyFusion):
        inner = inner.decoder
    if not isinstance(inner, TransformerDecoder):
        raise TypeError(
            "decoder: expected a TransformerDecoder or an EarlyFusion (possibly wrapped by "
            f"torch.compile, DistributedDataParallel or DataParallel), got "
            f"{type(model).__name__}"
            + (f" around a {type(inner).__name__}" if inner is not model else "")
        )
    return inner
