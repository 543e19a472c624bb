"""Hugging Face Llama directories (``config.json`` + weights) <-> ``llama3_2`` decoders."""

import json
import os
from pathlib import Path

import torch

from fusion.checkpoint.errors import CheckpointError
from fusion.checkpoint.files import CheckpointFiles, save_state_dict
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
from fusion.models import llama3_2


def load_hf_llama(
    path: str | os.PathLike,
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    max_seq_len: int | None = None,
) -> TransformerDecoder:
    """Build the ``llama3_2`` decoder a Hugging Face Llama directory describes, with its weights.

    Everything is checked from ``config.json`` and the safetensors headers (names, shapes,
    dtypes) before any tensor is read; the decoder is then allocated once, on ``device``, and
    filled. Weights are relabelled (see :mod:`fusion.checkpoint.hf_keys`), never recomputed.

    Args:
        path: a directory with ``config.json`` and ``model.safetensors``,
            ``model.safetensors.index.json`` + shards, or ``pytorch_model.bin`` (+ index), the
            latter read with ``torch.load(weights_only=True)``.
        dtype: parameter dtype. None: the dtype the weights are stored in.
        device: where the decoder lives.
        max_seq_len: override ``max_position_embeddings`` (the longest sequence, and the
            default KV-cache length), e.g. to save memory with long-context checkpoints.

    Returns:
        the decoder, in training mode as freshly built modules are; call ``.eval()`` for
        inference.

    Raises:
        CheckpointError: naming the file and key: an unreadable, unsupported or inconsistent
            config; a missing, truncated or corrupt file or shard; a missing or unexpected key;
            a shape that differs from the config's; ``lm_head.weight`` present in a tied model
            but different from the embedding; mixed stored dtypes with ``dtype=None``.
    """
    path = Path(path)
    config_file = path / CONFIG_NAME
    kwargs = llama3_2_kwargs_from_hf_config(read_hf_config(config_file), source=config_file)
    if max_seq_len is not None:
        kwargs["max_seq_len"] = max_seq_len
    checkpoint = CheckpointFiles(path)
    with torch.device("meta"):
        decoder = llama3_2(**kwargs)
    expected = {key: tuple(t.shape) for key, t in decoder.state_dict().items()}

    sources = _match_keys(checkpoint, expected, tied=kwargs["tie_word_embeddings"])
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
            if needs_rope_permutation(key):
                heads = num_heads if key.endswith("q_proj.weight") else num_kv_heads
                tensor = rotate_half_to_interleaved(tensor, heads)
            targets[key].copy_(tensor)
        if kwargs["tie_word_embeddings"] and "lm_head.weight" in checkpoint.entries:
            _check_tied_copy(checkpoint, decoder)
    return decoder


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
        if not entry.dtype.is_floating_point:
            raise CheckpointError(entry.file, hf_key, f"expected floating point, got {entry.dtype}")
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
    names = dict(decoder.named_parameters(remove_duplicate=False))
    names |= dict(decoder.named_buffers(remove_duplicate=False))
    unfilled = sorted(set(names) - loaded - rebuilt)
    if unfilled:
        raise RuntimeError(f"load_hf_llama: no value for {unfilled}; the loader needs updating")


def _check_tied_copy(checkpoint: CheckpointFiles, decoder: TransformerDecoder) -> None:
    entry = checkpoint.entries["lm_head.weight"]
    lm_head = checkpoint.load("lm_head.weight").to(decoder.tok_embeddings.weight)
    if entry.shape != tuple(decoder.tok_embeddings.weight.shape) or not torch.equal(
        lm_head, decoder.tok_embeddings.weight
    ):
        raise CheckpointError(
            entry.file,
            "lm_head.weight",
            "config.json says tie_word_embeddings=true, but this differs from "
            "model.embed_tokens.weight",
        )


def save_hf_llama(
    decoder: TransformerDecoder,
    directory: str | os.PathLike,
    *,
    max_shard_size: int | None = None,
    overwrite: bool = False,
) -> list[Path]:
    """Write ``decoder`` as a Hugging Face Llama directory: ``config.json`` and safetensors.

    ``transformers.LlamaForCausalLM.from_pretrained(directory)`` loads it, and
    :func:`load_hf_llama` gives back the same parameters bit for bit.

    Args:
        decoder: a ``llama3_2``-built decoder (any device and dtype; stored as they are).
        directory: created if needed.
        max_shard_size: bytes per safetensors shard (then with an index); None: one file.
        overwrite: replace a checkpoint already in ``directory``.

    Returns:
        the files written.

    Raises:
        ValueError: ``decoder`` is not a homogeneous Llama (see :func:`hf_config_from_decoder`).
        CheckpointError: ``directory`` already holds a checkpoint and ``overwrite`` is False.
    """
    config = hf_config_from_decoder(decoder)
    attn = decoder.layers[0].attn
    state_dict = fusion_to_hf(
        decoder.state_dict(), num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads
    )
    directory = Path(directory)
    if (directory / CONFIG_NAME).exists() and not overwrite:
        raise CheckpointError(directory / CONFIG_NAME, None, "exists; pass overwrite=True")
    written = save_state_dict(
        state_dict, directory, max_shard_size=max_shard_size, overwrite=overwrite
    )
    (directory / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
    return [*written, directory / CONFIG_NAME]
