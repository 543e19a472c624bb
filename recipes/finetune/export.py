"""The end of a run: ``<output-dir>/final/``, a Hugging Face directory of the fine-tuned model
(LoRA merged) that transformers loads, plus for LoRA runs ``final/adapter/``, the adapter in
PEFT's format (``adapter_config.json`` + ``adapter_model.safetensors``):
``peft.PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(base), final /
"adapter")`` gives the fine-tuned model's logits, vLLM serves it, and ``--init-adapter``
continues from it.

(Earlier versions wrote ``final/adapter.safetensors`` in this library's own format; it is no
longer written: one adapter, in the format the ecosystem loads, leaves no doubt which to use.
:func:`fusion.lora.load_peft_adapter` reads ``final/adapter/`` back.)"""

import os
import shutil
from pathlib import Path

from fusion.checkpoint import CheckpointError
from fusion.checkpoint.export import export_hf
from fusion.checkpoint.files import fsync_path
from fusion.lora import merge_lora, save_peft_adapter
from fusion.training import TrainingError, load_train_state, one_line, read_model_state_dict
from recipes.finetune.config import FinetuneConfig, config_from_json
from recipes.finetune.trainer import build_model, check_base_model

FINAL = "final"
ADAPTER = "adapter"  # final/adapter/: the LoRA adapter in PEFT's format


def export_final(config: FinetuneConfig, checkpoint: Path, output_dir: Path) -> Path:
    """Build the model again in this process alone (CPU, float32; the base from ``--model``),
    load checkpoint ``checkpoint`` into it (the whole model, or only the trained tensors of a
    ``--train lora`` / ``projector`` run, its base checked to be the same), and write
    ``output_dir/final``: staged under a temporary name and renamed into place once complete,
    so a crash leaves the previous ``final/`` (if any) or none, never a partial one. A LoRA
    run's adapter goes to ``final/adapter/`` in PEFT's format first
    (:func:`fusion.lora.save_peft_adapter`, ``base_model_name_or_path`` the ``--model`` given),
    then the model is merged and exported. Returns the directory.

    Raises:
        TrainingError: the checkpoint does not fit the model, its base model changed, or no
            Hugging Face directory can be written for it.
        OSError: the file system failed.
    """
    assert config.model is not None
    state = load_train_state(checkpoint, config_from_json)
    check_base_model(checkpoint, state, config)
    model = build_model(config)
    loaded = model.load_state_dict(read_model_state_dict(checkpoint), strict=False)
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    if not state.trainable_only:
        frozen = set()  # the whole model was saved
    missing = sorted(set(loaded.missing_keys) - frozen)
    if loaded.unexpected_keys or missing:
        raise TrainingError(
            f"{checkpoint}: its model tensors do not fit --model: missing {missing[:3]}, "
            f"unexpected {sorted(loaded.unexpected_keys)[:3]}"
        )
    model.eval()
    final = output_dir / FINAL
    staging = output_dir / f".tmp-{FINAL}"
    adapter = output_dir / f".tmp-{ADAPTER}"
    for stale in (staging, adapter, output_dir / f".old-{FINAL}"):  # left by a crash
        if stale.is_dir() and not stale.is_symlink():
            shutil.rmtree(stale)
        elif os.path.lexists(stale):
            stale.unlink()
    if config.train == "lora":
        try:
            save_peft_adapter(model, adapter, base_model_name_or_path=config.model)
        except (CheckpointError, ValueError, TypeError) as error:
            raise TrainingError(f"cannot export {final / ADAPTER}: {one_line(error)}") from None
        merge_lora(model)
    try:
        export_hf(model, config.model, staging)
    except (CheckpointError, ValueError, TypeError) as error:
        raise TrainingError(f"cannot export {final}: {one_line(error)}") from None
    if config.train == "lora":
        os.replace(adapter, staging / ADAPTER)
        fsync_path(staging)
    old = output_dir / f".old-{FINAL}"
    if final.exists():
        os.replace(final, old)
    os.replace(staging, final)
    fsync_path(output_dir)
    if old.exists():
        shutil.rmtree(old)
    return final
