"""peft's ``adapter_config.json``, read strictly (:func:`read_peft_config`): the settings of a
LoRA adapter directory this library applies (:class:`PeftLoraConfig`); what it cannot compute
is refused by name, never ignored."""

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fusion.checkpoint.errors import CheckpointError, as_path, short_repr
from fusion.checkpoint.files import read_bounded

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_WEIGHTS_BIN = "adapter_model.bin"  # peft with safe_serialization=False (read only)
MAX_CONFIG_BYTES = 1 << 20  # peft's are about 1.5 kB


@dataclass(frozen=True)
class PeftLoraConfig:
    """The settings of a peft LoRA adapter directory that this library applies.

    Attributes:
        rank: ``r``.
        alpha: ``lora_alpha``.
        dropout: ``lora_dropout``.
        use_rslora: scale by ``alpha / sqrt(rank)`` (rank-stabilised LoRA) instead of
            ``alpha / rank``.
        target_modules: peft's: a list of module names (matched exactly or as the last
            names), or a regular expression (a str).
        exclude_modules: the same, or None.
        base_model_name_or_path: the model the adapter was trained on, as written (or None).
    """

    rank: int
    alpha: float
    dropout: float
    use_rslora: bool
    target_modules: tuple[str, ...] | str | None
    exclude_modules: tuple[str, ...] | str | None
    base_model_name_or_path: str | None

    @property
    def scale(self) -> float:
        """What the adapter's output is multiplied by."""
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


# Options whose value changes nothing this library computes (bookkeeping, or settings of
# features that other options switch on and that are refused there).
_INFORMATIONAL = {
    "auto_mapping",
    "base_model_name_or_path",
    "inference_mode",
    "megatron_core",
    "peft_version",
    "qalora_group_size",
    "revision",
    "task_type",
    "ensure_weight_tying",  # ties adapters of tied embeddings: none are loaded (refused)
}
# Options for features this library does not compute, explained when refused.
_UNSUPPORTED = {
    "use_dora": "DoRA (weight-decomposed LoRA)",
    "modules_to_save": "full copies of layers trained beside the adapter",
    "rank_pattern": "per-layer ranks",
    "alpha_pattern": "per-layer alphas",
    "lora_bias": "LoRA biases",
    "layers_to_transform": "adapters on some layers only, chosen by index",
    "layers_pattern": "adapters on some layers only, chosen by index",
    "fan_in_fan_out": "Conv1D layers (GPT-2 style)",
    "trainable_token_indices": "trained embedding rows",
    "target_parameters": "adapters on parameters, not layers",
    "layer_replication": "replicated layers",
    "use_qalora": "quantization-aware LoRA",
    "alora_invocation_tokens": "activated LoRA",
    "megatron_config": "Megatron parallel layers",
}


def _is_default(value: object) -> bool:
    return value is None or value is False or value == {} or value == [] or value == ""


def _strict_json(raw: bytes, file: Path) -> Any:
    """Parse untrusted JSON strictly: UTF-8, no NaN/Infinity, no duplicate keys, integers of
    at most 40 digits, bounded nesting."""

    def constant(name: str) -> None:
        raise ValueError(f"{name} is not JSON")

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        result: dict[str, Any] = {}
        for key, value in items:
            if key in result:
                raise ValueError(f"duplicate key {short_repr(key)}")
            result[key] = value
        return result

    def integer(text: str) -> int:
        if len(text.lstrip("-")) > 40:
            raise ValueError(f"an integer of {len(text)} digits")
        return int(text)

    try:
        return json.loads(
            raw.decode("utf-8"), parse_constant=constant, object_pairs_hook=pairs, parse_int=integer
        )
    except RecursionError:
        raise CheckpointError(file, None, "unreadable JSON: nested too deeply") from None
    except ValueError as error:  # JSONDecodeError, UnicodeDecodeError, ours
        raise CheckpointError(file, None, f"unreadable JSON: {error}") from None


def _names(value: object, file: Path, key: str) -> tuple[str, ...] | str | None:
    """peft's ``target_modules`` / ``exclude_modules``: None, a str, or a list of str."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(v, str) and v for v in value):
        return tuple(value)
    raise CheckpointError(
        file, key, f"expected null, a string or a list of module names, got {short_repr(value)}"
    )


def read_peft_config(directory: str | bytes | os.PathLike) -> PeftLoraConfig:
    """Read and check a peft adapter directory's ``adapter_config.json``.

    The file is untrusted input: at most :data:`MAX_CONFIG_BYTES`, a regular file, strict JSON
    (no NaN, no duplicate keys), every value of the expected type. Options this library does not
    compute are refused by name, never ignored: ``use_dora``, ``modules_to_save``,
    ``rank_pattern`` / ``alpha_pattern``, ``bias`` other than ``"none"``, ``lora_bias``,
    ``layers_to_transform``, ``fan_in_fan_out``, initialisations that change the base weights
    (``init_lora_weights`` other than true, false or ``"gaussian"``: PiSSA, OLoRA, LoftQ, ...),
    and any option unknown here that is set to something other than its off value.
    ``use_rslora`` is supported.

    Raises:
        TypeError, ValueError: ``directory`` is not a path.
        CheckpointError: naming the file and key: missing, too large or not a regular file;
            malformed JSON; not a LoRA adapter (``peft_type``); a value of the wrong type or
            out of range (``r``, ``lora_alpha``, ``lora_dropout``, ...); an unsupported option.
    """
    file = as_path(directory, "directory") / ADAPTER_CONFIG
    if not os.path.lexists(file):
        raise CheckpointError(file, None, "missing: not a peft adapter directory")
    content = _strict_json(read_bounded(file, MAX_CONFIG_BYTES), file)
    if not isinstance(content, dict):
        raise CheckpointError(file, None, "expected a JSON object")

    def fail(key: str, message: str) -> CheckpointError:
        return CheckpointError(file, key, message)

    peft_type = content.get("peft_type")
    if peft_type != "LORA":
        raise fail("peft_type", f"expected 'LORA' (a LoRA adapter), got {short_repr(peft_type)}")
    rank = content.get("r", 8)
    if type(rank) is not int or not 0 < rank < 2**31:
        raise fail("r", f"expected a positive int, got {short_repr(rank)}")
    alpha = content.get("lora_alpha", 8)
    if type(alpha) not in (int, float) or not (math.isfinite(alpha) and alpha > 0):
        raise fail("lora_alpha", f"expected a positive finite number, got {short_repr(alpha)}")
    dropout = content.get("lora_dropout", 0.0)
    if type(dropout) not in (int, float) or not 0 <= dropout < 1:
        raise fail("lora_dropout", f"expected a probability in [0, 1), got {short_repr(dropout)}")
    rslora = content.get("use_rslora", False)
    if not isinstance(rslora, bool):
        raise fail("use_rslora", f"expected true or false, got {short_repr(rslora)}")
    bias = content.get("bias", "none")
    if bias != "none":
        raise fail(
            "bias",
            f"{short_repr(bias)}: trained biases are not supported (expected 'none': no bias "
            "trains)",
        )
    init = content.get("init_lora_weights", True)
    if not (isinstance(init, bool) or init == "gaussian"):
        raise fail(
            "init_lora_weights",
            f"{short_repr(init)} is not supported: such an initialisation changes the base "
            "weights, which a base model loaded elsewhere does not have (expected true, false "
            "or 'gaussian'; peft's path_initial_model_for_weight_conversion converts it)",
        )
    base = content.get("base_model_name_or_path")
    if base is not None and not isinstance(base, str):
        raise fail("base_model_name_or_path", f"expected a string, got {short_repr(base)}")
    handled = {"peft_type", "r", "lora_alpha", "lora_dropout", "use_rslora", "bias"}
    handled |= {"init_lora_weights", "target_modules", "exclude_modules"}
    for key, value in content.items():
        if key in handled or key in _INFORMATIONAL or _is_default(value):
            continue
        what = _UNSUPPORTED.get(key, "an option this library does not implement")
        raise fail(key, f"{short_repr(value)}: not supported ({what}); refused, not ignored")
    return PeftLoraConfig(
        rank=rank,
        alpha=float(alpha),
        dropout=float(dropout),
        use_rslora=rslora,
        target_modules=_names(content.get("target_modules"), file, "target_modules"),
        exclude_modules=_names(content.get("exclude_modules"), file, "exclude_modules"),
        base_model_name_or_path=base,
    )
