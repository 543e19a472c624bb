"""The end of a fine-tuning run: the trained model as a Hugging Face directory that
transformers loads (LoRA merged), with the LoRA adapters beside it in PEFT's format, written
whole or not at all."""

import os
import shutil
from pathlib import Path

from torch import nn

from fusion.checkpoint.export import export_hf
from fusion.checkpoint.files import fsync_path
from fusion.hf.errors import CheckpointError
from fusion.lora import merge_lora, save_peft_adapter
from fusion.training.errors import TrainingError, one_line


def _remove(path: Path) -> None:
    """Remove what a crash left at ``path`` (a directory, a file or a link)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif os.path.lexists(path):
        path.unlink()


def export_trained(
    model: nn.Module, source_dir: str, out_dir: Path, *, peft_adapter: str | None = None
) -> Path:
    """Write the single-process ``model`` (unwrapped, in eval mode) as the Hugging Face
    directory ``out_dir`` (:func:`fusion.checkpoint.export.export_hf`, with ``source_dir``'s
    tokenizer and processor files), replacing one there. With ``peft_adapter``, ``model``'s
    LoRA adapters are first written as a PEFT adapter to ``out_dir/<peft_adapter>``
    (:func:`fusion.lora.save_peft_adapter`, ``base_model_name_or_path`` ``source_dir``), then
    merged into ``model`` in place (:func:`fusion.lora.merge_lora`). Returns ``out_dir``.

    Everything is staged beside ``out_dir`` (``.tmp-<name>``) and renamed into place once
    complete, so a crash leaves the previous ``out_dir`` (or ``.old-<name>``, if it struck
    between the two renames) or none, never a partial one; what a crash left is removed first.

    Raises:
        TrainingError: no Hugging Face directory or adapter can be written for ``model``
            (naming the directory).
        OSError: the file system failed.
    """
    staging = out_dir.with_name(f".tmp-{out_dir.name}")
    adapter = out_dir.with_name(f".tmp-{out_dir.name}-{peft_adapter}")
    old = out_dir.with_name(f".old-{out_dir.name}")
    for stale in (staging, adapter, old):
        _remove(stale)
    if peft_adapter is not None:
        try:
            save_peft_adapter(model, adapter, base_model_name_or_path=source_dir)
        except (CheckpointError, ValueError, TypeError) as error:
            raise TrainingError(
                f"cannot export {out_dir / peft_adapter}: {one_line(error)}"
            ) from None
        merge_lora(model)
    try:
        export_hf(model, source_dir, staging)
    except (CheckpointError, ValueError, TypeError) as error:
        raise TrainingError(f"cannot export {out_dir}: {one_line(error)}") from None
    if peft_adapter is not None:
        os.replace(adapter, staging / peft_adapter)
        fsync_path(staging)
    if out_dir.exists():
        os.replace(out_dir, old)
    os.replace(staging, out_dir)
    fsync_path(out_dir.parent)
    _remove(old)
    return out_dir
