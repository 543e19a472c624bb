"""The end of a run: ``<output-dir>/final/``, a Hugging Face directory of the fine-tuned model
(LoRA merged) that transformers loads, plus ``final/adapter.safetensors`` for LoRA runs."""

import os
import shutil
from pathlib import Path

from fusion.checkpoint.files import fsync_path
from fusion.lora import merge_lora, save_adapter
from fusion.training import read_model_state_dict
from recipes.finetune.config import FinetuneConfig
from recipes.finetune.trainer import build_model

FINAL = "final"
ADAPTER = "adapter.safetensors"


def export_final(config: FinetuneConfig, checkpoint: Path, output_dir: Path) -> Path:
    """Build the model again in this process alone (CPU, float32), load checkpoint
    ``checkpoint`` into it, and write ``output_dir/final``: staged under a temporary name and
    renamed into place once complete, so a crash leaves the previous ``final/`` (if any) or
    none, never a partial one. Returns the directory.

    Raises:
        TrainingError: the checkpoint does not fit the model.
        OSError: the file system failed.
    """
    assert config.model is not None
    model = build_model(config)
    model.load_state_dict(read_model_state_dict(checkpoint), strict=True)
    model.eval()
    final = output_dir / FINAL
    staging = output_dir / f".tmp-{FINAL}"
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    if config.train == "lora":
        save_adapter(model, staging / ADAPTER)
        merge_lora(model)
    _export_hf(model, staging, Path(config.model))
    fsync_path(staging)
    old = output_dir / f".old-{FINAL}"
    if final.exists():
        if old.exists():
            shutil.rmtree(old)
        os.replace(final, old)
    os.replace(staging, final)
    fsync_path(output_dir)
    if old.exists():
        shutil.rmtree(old)
    return final


def _export_hf(model, directory: Path, source: Path) -> None:  # interim, until fusion's lands
    from fusion import EarlyFusion
    from fusion.checkpoint import save_hf_idefics3, save_hf_llama, save_hf_llava
    from fusion.checkpoint.hf_vlm import hf_model_kind

    kind = hf_model_kind(source)
    if not isinstance(model, EarlyFusion):
        save_hf_llama(model, directory, overwrite=True)
    elif kind == "llava":
        save_hf_llava(model, directory, overwrite=True)
    else:
        save_hf_idefics3(model, directory, overwrite=True)
    for file in source.iterdir():
        if file.is_file() and not file.name.startswith(("model", "config.json", "pytorch_model")):
            shutil.copyfile(file, directory / file.name)
