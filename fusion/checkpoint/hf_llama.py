"""Hugging Face Llama directories (``config.json`` + weights) <-> ``llama3_2`` decoders."""

import json
import math
import os
import re
import sys
from pathlib import Path

import torch
from torch import nn
from torch.nn.parallel import DataParallel, DistributedDataParallel

from fusion.checkpoint._checks import as_path, check_positive_int
from fusion.checkpoint.errors import CheckpointError
from fusion.checkpoint.files import (
    CheckpointFiles,
    check_not_sharded,
    check_save_options,
    prepare_tensors,
    write_checkpoint,
)
from fusion.checkpoint.hf_config import (
    CONFIG_NAME,
    hf_config_from_decoder,
    llama3_2_kwargs_from_hf_config,
    read_hf_config,
)
from fusion.checkpoint.hf_keys import (
    HF_DERIVED_KEY,
    fusion_key_to_hf,
    fusion_to_hf,
    hf_key_to_fusion,
    needs_rope_permutation,
    rotate_half_to_interleaved,
)
from fusion.decoder import RotaryPositionalEmbeddings, TransformerDecoder
from fusion.early_fusion import EarlyFusion
from fusion.models import llama3_2

_LOADABLE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_LAYER_INDEX = re.compile(r"model\.layers\.(\d{1,9})\.")
# Bytes of rotary table allowed whatever the size of the weights (a 256k-position table at
# head_dim 64); beyond it the table may not outweigh the weights themselves.
_ROPE_TABLE_FLOOR = 64 * 2**20


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
    Weights are relabelled (see :mod:`fusion.checkpoint.hf_keys`), never recomputed.

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
            inconsistent config (see :func:`llama3_2_kwargs_from_hf_config`); more layers than
            the checkpoint has weights for; a missing, truncated, corrupt or hostile file or
            shard (see :class:`~fusion.checkpoint.CheckpointFiles`); a missing or unexpected
            key; a shape that differs from the config's; weights not stored as float16,
            bfloat16, float32 or float64 (e.g. float8); files holding fewer bytes than the
            weights need; ``max_position_embeddings`` whose rotary table outweighs the weights;
            ``lm_head.weight`` present in a tied model but different from the embedding; mixed
            stored dtypes with ``dtype=None``; a value beyond the range of ``dtype`` (e.g.
            1e6 loaded as float16 would become inf).
    """
    path = as_path(path, "path")
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype: expected a torch.dtype or None, got {type(dtype).__name__}")
    if dtype is not None and dtype not in _LOADABLE_DTYPES:
        raise ValueError(f"dtype: expected float16, bfloat16, float32 or float64, got {dtype}")
    device = _check_device(device)
    if max_seq_len is not None and check_positive_int(max_seq_len, "max_seq_len") >= 2**31:
        raise ValueError(f"max_seq_len: expected less than 2**31, got {max_seq_len}")
    config_file = path / CONFIG_NAME
    kwargs = llama3_2_kwargs_from_hf_config(read_hf_config(config_file), source=config_file)
    checkpoint = CheckpointFiles(path)
    # Building layers costs time and memory even on the meta device: only as many as the
    # checkpoint has weights for.
    layers = {m.group(1) for key in checkpoint.entries if (m := _LAYER_INDEX.match(key))}
    if kwargs["num_layers"] > len(layers):
        raise CheckpointError(
            config_file,
            "num_hidden_layers",
            f"{kwargs['num_layers']}, but the checkpoint holds weights for {len(layers)} layers",
        )
    if max_seq_len is not None:
        kwargs["max_seq_len"] = max_seq_len
    try:
        with torch.device("meta"):
            decoder = llama3_2(**kwargs)
    except ValueError as error:
        raise CheckpointError(config_file, None, f"describes no Llama decoder: {error}") from error
    expected = {key: tuple(t.shape) for key, t in decoder.state_dict().items()}

    sources = _match_keys(checkpoint, expected, tied=kwargs["tie_word_embeddings"])
    _check_sizes(checkpoint, sources, kwargs, config_file, max_seq_len)
    if dtype is None:
        stored = {checkpoint.entries[hf_key].dtype for hf_key in sources.values()}
        if len(stored) != 1:
            dtypes = sorted(map(str, stored))
            raise CheckpointError(
                path, None, f"weights stored in several dtypes {dtypes}: pass dtype"
            )
        dtype = stored.pop()

    decoder = decoder.to(dtype).to_empty(device=device)  # uninitialised until filled below
    for module in decoder.modules():
        if isinstance(module, RotaryPositionalEmbeddings):
            module.reset_parameters()  # the rotary table, in float32, on ``device``
    _check_all_filled(decoder, set(sources))
    num_heads, num_kv_heads = kwargs["num_heads"], kwargs["num_kv_heads"]
    targets = decoder.state_dict()
    with torch.no_grad():
        for key, hf_key in sources.items():
            tensor = checkpoint.load(hf_key)
            _check_fits(tensor, dtype, checkpoint.entries[hf_key].file, hf_key)
            if needs_rope_permutation(key):
                heads = num_heads if key.endswith("q_proj.weight") else num_kv_heads
                tensor = rotate_half_to_interleaved(tensor, heads)
            targets[key].copy_(tensor)
        if kwargs["tie_word_embeddings"] and "lm_head.weight" in checkpoint.entries:
            _check_tied_copy(checkpoint, decoder)
    return decoder


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


def _check_sizes(
    checkpoint: CheckpointFiles,
    sources: dict[str, str],
    kwargs: dict,
    config_file: Path,
    max_seq_len: int | None,
) -> None:
    """Refuse what would allocate more than the files back: the weights (tensors sharing or
    re-reading storage) and the rotary table (``max_seq_len`` x head_dim float32)."""
    entries = [checkpoint.entries[hf_key] for hf_key in sources.values()]
    needed = sum(math.prod(e.shape) * e.dtype.itemsize for e in entries)
    if needed > checkpoint.stored_bytes:
        raise CheckpointError(
            checkpoint.path,
            None,
            f"the weights take {needed} bytes, but the files hold only "
            f"{checkpoint.stored_bytes}: tensors share storage; refused",
        )
    positions = kwargs["max_seq_len"]
    table = positions * kwargs["embed_dim"] // kwargs["num_heads"] * 4
    if table > max(needed, _ROPE_TABLE_FLOOR):
        message = (
            f"{positions} positions need a {table}-byte rotary table, more than the weights "
            f"({needed} bytes)"
        )
        if max_seq_len is not None:
            raise ValueError(f"max_seq_len: {message}")
        raise CheckpointError(
            config_file, "max_position_embeddings", f"{message}; pass max_seq_len to load fewer"
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


def _match_keys(
    checkpoint: CheckpointFiles, expected: dict[str, tuple[int, ...]], *, tied: bool
) -> dict[str, str]:
    """Our key -> the checkpoint's key, after checking names and shapes against the config."""
    sources: dict[str, str] = {}
    for hf_key, entry in checkpoint.entries.items():
        if HF_DERIVED_KEY.fullmatch(hf_key):
            continue
        if tied and hf_key == "lm_head.weight":
            continue  # a redundant copy of the tied embedding; compared after loading
        try:
            key = hf_key_to_fusion(hf_key)
        except KeyError:
            key = None
        if key not in expected:
            raise CheckpointError(entry.file, hf_key, "unexpected key for a Llama with this config")
        if entry.shape != expected[key]:
            raise CheckpointError(
                entry.file,
                hf_key,
                f"shape {list(entry.shape)} differs from {list(expected[key])} that config.json "
                "implies",
            )
        if entry.dtype not in _LOADABLE_DTYPES:
            raise CheckpointError(
                entry.file,
                hf_key,
                f"stored as {entry.dtype}: expected float16, bfloat16, float32 or float64 "
                "(quantized, float8 or integer weights are not supported)",
            )
        sources[key] = hf_key
    for key in expected:
        if key not in sources:
            raise CheckpointError(
                checkpoint.path, fusion_key_to_hf(key), "missing from the checkpoint"
            )
    return sources


def _check_all_filled(decoder: TransformerDecoder, loaded: set[str]) -> None:
    """Guard against a decoder gaining state that neither the checkpoint nor a rebuild fills."""
    rebuilt = {
        f"{name}.cache" if name else "cache"
        for name, module in decoder.named_modules(remove_duplicate=False)
        if isinstance(module, RotaryPositionalEmbeddings)
    }
    names: dict[str, torch.Tensor] = dict(decoder.named_parameters(remove_duplicate=False))
    names |= dict(decoder.named_buffers(remove_duplicate=False))
    unfilled = sorted(set(names) - loaded - rebuilt)
    if unfilled:
        raise RuntimeError(f"load_hf_llama: no value for {unfilled}; the loader needs updating")


def _check_tied_copy(checkpoint: CheckpointFiles, decoder: TransformerDecoder) -> None:
    entry = checkpoint.entries["lm_head.weight"]
    embedding = decoder.tok_embeddings.weight
    if entry.shape != tuple(embedding.shape) or not torch.equal(
        checkpoint.load("lm_head.weight").to(embedding), embedding
    ):
        raise CheckpointError(
            entry.file,
            "lm_head.weight",
            "config.json says tie_word_embeddings=true, but this differs from "
            "model.embed_tokens.weight",
        )


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
        ValueError: ``decoder`` is not a homogeneous Llama (see :func:`hf_config_from_decoder`)
            or has tensors without data (meta device) or sharded (FSDP2: load a full state dict
            into a plain decoder and save that); ``max_shard_size`` not positive.
        CheckpointError: ``directory`` already holds a checkpoint or ``config.json`` and
            ``overwrite`` is False; it is a file.
        OSError: the file system failed (a checkpoint being replaced is then left as it was).
    """
    decoder = _text_decoder(decoder)
    config = hf_config_from_decoder(decoder)
    directory = as_path(directory, "directory")
    check_save_options(max_shard_size, overwrite)
    try:
        text = json.dumps(config, indent=2, allow_nan=False) + "\n"
    except ValueError as error:
        raise ValueError(f"decoder: its config cannot be written as JSON: {error}") from None
    state_dict = decoder.state_dict()
    check_not_sharded(state_dict, "decoder")  # before permuting rows across shards
    state_dict = fusion_to_hf(
        state_dict,
        num_heads=config["num_attention_heads"],
        num_kv_heads=config["num_key_value_heads"],
    )
    tensors = prepare_tensors(state_dict, "decoder", safetensors=True)
    if os.path.lexists(directory / CONFIG_NAME) and not overwrite:
        raise CheckpointError(directory / CONFIG_NAME, None, "exists; pass overwrite=True")
    return write_checkpoint(
        tensors,
        directory,
        max_shard_size=max_shard_size,
        overwrite=overwrite,
        extra_files={CONFIG_NAME: text},
    )


def _text_decoder(model: object) -> TransformerDecoder:
    """The ``TransformerDecoder`` that ``model`` is or holds, through wrappers that keep the
    whole model inside them unchanged (``torch.compile``, DDP, DataParallel)."""
    # No OptimizedModule can exist unless torch._dynamo was imported: do not import it here.
    compiled = getattr(sys.modules.get("torch._dynamo.eval_frame"), "OptimizedModule", None)
    inner = model
    while True:
        if compiled is not None and isinstance(inner, compiled):
            inner = inner._orig_mod
        elif isinstance(inner, DistributedDataParallel | DataParallel):
            inner = inner.module
        else:
            break
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
