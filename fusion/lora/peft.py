"""LoRA adapters in peft's own format, both ways: a directory holding ``adapter_config.json`` and
``adapter_model.safetensors``, as ``peft.PeftModel.save_pretrained`` writes it for transformers'
class of the model, and ``PeftModel.from_pretrained`` (or vLLM) loads it.

- :func:`save_peft_adapter`: this library's adapters written under the names peft gives them
  on transformers' model (``base_model.model.model.language_model.layers.0.self_attn.q_proj.
  lora_A.weight``: no adapter name, no base weights), with the ``target_modules`` peft writes.
- :func:`load_peft_adapter`: an adapter peft wrote for a supported model applied onto this
  library's model (rank, alpha, dropout and layers from the directory); what this library
  cannot compute is refused by name, never dropped.
- :func:`read_peft_config`: the settings of such a directory, checked, without the weights.

Supported: the transformers classes of every registered family (their ``architectures``,
:data:`fusion.families.FAMILIES`), as :func:`fusion.checkpoint.load_hf_model` loads them.

This library's decoder keeps the rows of ``q_proj`` and ``k_proj`` permuted for its
interleaved rotary embedding (:func:`fusion.checkpoint.keys.rotate_half_to_interleaved`): an
adapter's B factor of those layers (its rows) is permuted back on the way out and forth on the
way in; A (columns) is untouched. The result is the same function: logits equal peft's.
"""

import json
import os
import re
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from fusion.checkpoint.errors import CheckpointError, as_path
from fusion.checkpoint.files import CheckpointFiles, check_not_sharded, prepare_tensors, write_files
from fusion.checkpoint.hf_model import HfDirectory
from fusion.checkpoint.keys import interleaved_to_rotate_half, rotate_half_to_interleaved
from fusion.lora.apply import apply_lora, lora_linears, lora_settings
from fusion.lora.peft_config import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    ADAPTER_WEIGHTS_BIN,
    MAX_CONFIG_BYTES,
    PeftLoraConfig,
    read_peft_config,
)
from fusion.lora.peft_names import (
    _PREFIX,
    _check_targets,
    _describe,
    _get_linear,
    _linear,
    _literal,
    _Model,
    _target_modules,
)

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "ADAPTER_WEIGHTS_BIN",
    "MAX_CONFIG_BYTES",
    "PeftLoraConfig",
    "load_peft_adapter",
    "read_peft_config",
    "save_peft_adapter",
]

_KEY = re.compile(r"base_model\.model\.(.+)\.lora_([AB])\.weight")
# peft also saves the base weight of an adapted output layer or embedding ("save_embedding_
# layers", in case the vocabulary was resized): taken when it equals the model's own.
_BASE_COPY = re.compile(r"base_model\.model\.(.+)\.base_layer\.weight")


# ---------------------------------------------------------------------- loading


def load_peft_adapter(
    model: nn.Module, directory: str | bytes | os.PathLike, *, freeze_base: bool = True
) -> dict[str, nn.Linear]:
    """Apply the LoRA adapter peft saved in ``directory`` onto ``model``, in place: the layers
    it adapts get adapters (:func:`~fusion.lora.apply_lora`) of its rank, alpha and dropout,
    holding its weights. ``model``'s logits then equal ``PeftModel.from_pretrained(hf_model,
    directory)``'s on the same inputs, and training continues from the adapter.

    Which layers: those ``adapter_model.safetensors`` holds adapters for (``adapter_model.bin``,
    read with ``torch.load(weights_only=True)``, when there is no safetensors file). With
    ``target_modules`` a list (as peft saves it), the layers it names must be exactly those;
    a regular expression is not evaluated (an untrusted one could run for hours), so the
    weights alone decide.

    Args:
        model: as :func:`fusion.checkpoint.load_hf_model` builds it (an ``EarlyFusion`` of a
            registered family, or a text decoder), possibly
            wrapped by ``torch.compile`` or DDP; unsharded (apply before FSDP2). Layers that
            already carry adapters may not be among the adapter's.
        directory: written by peft's ``save_pretrained`` (or :func:`save_peft_adapter`).
        freeze_base: as :func:`~fusion.lora.apply_lora`.

    Returns:
        the layers given adapters: our qualified name -> module.

    Raises:
        TypeError: ``model`` of none of those kinds; ``directory`` not a path.
        CheckpointError, before anything changes, naming the file and key: everything
            :func:`read_peft_config` refuses; a weights file missing, corrupt or hostile (see
            :class:`~fusion.checkpoint.files.CheckpointFiles`); a key not of peft's
            ``base_model.model.<layer>.lora_A.weight`` / ``lora_B.weight`` form (e.g. an
            adapter name in it, an embedding adapter, DoRA magnitudes); an adapter for a layer
            ``model`` does not have; A without B or B without A; a shape that differs from
            the layer's and the config's rank; a non-floating dtype; ``target_modules`` that
            name other layers than the weights.
        ValueError: as :func:`~fusion.lora.apply_lora` (a layer already adapted, sharded).
    """
    path = as_path(directory, "directory")
    config = read_peft_config(path)
    target = _describe(model)
    file = path / ADAPTER_WEIGHTS
    if not os.path.lexists(file) and os.path.lexists(path / ADAPTER_WEIGHTS_BIN):
        file = path / ADAPTER_WEIGHTS_BIN
    if not os.path.lexists(file):
        raise CheckpointError(file, None, f"missing: {path} holds no adapter weights")
    weights = CheckpointFiles(file)
    layers: dict[str, dict[str, str]] = {}  # our layer -> {"A": key, "B": key}
    hf_names: dict[str, str] = {}
    copies: dict[str, str] = {}  # our layer -> the key of its base weight's copy
    for key, entry in weights.entries.items():
        match = _KEY.fullmatch(key)
        if match is None and (copy := _BASE_COPY.fullmatch(key)):
            ours = target.our_name(copy.group(1))
            if ours is not None and _get_linear(target.module, ours) is not None:
                copies[ours] = key
                continue
        if match is None:
            raise CheckpointError(file, key, _bad_key(key))
        hf, factor = match.groups()
        ours = target.our_name(hf)
        linear = _get_linear(target.module, ours)
        if ours is None or linear is None:
            raise CheckpointError(
                file,
                key,
                f"an adapter for {hf!r}, a layer this {target.family.architecture} has no "
                "linear layer for in this library's model (refused, not dropped)",
            )
        if factor in layers.setdefault(ours, {}):
            raise CheckpointError(
                file, key, f"a second adapter for the layer of {layers[ours][factor]!r}"
            )
        layers[ours][factor] = key
        hf_names[ours] = hf
        rows, columns = (
            (config.rank, linear.in_features)
            if factor == "A"
            else (linear.out_features, config.rank)
        )
        if entry.shape != (rows, columns) or not entry.dtype.is_floating_point:
            raise CheckpointError(
                file,
                key,
                f"expected a floating tensor of shape {(rows, columns)} (r={config.rank} of "
                f"{ADAPTER_CONFIG}, the layer's {linear.in_features} -> {linear.out_features}), "
                f"got {entry.dtype} of shape {entry.shape}",
            )
    if not layers:
        raise CheckpointError(file, None, "holds no adapter weights")
    for factors in layers.values():
        if len(factors) != 2:
            (have,) = factors.values()
            other = "B" if "A" in factors else "A"
            raise CheckpointError(file, have, f"has no lora_{other} beside it")
    for ours, key in copies.items():
        _check_base_copy(target, ours, weights, key, ours in layers)
    _check_targets(config, target, hf_names, path / ADAPTER_CONFIG)
    alpha = config.scale * config.rank  # rank-stabilised: the same scale, as alpha / rank
    adapted = apply_lora(
        target.module,
        [_literal(name) for name in layers],
        rank=config.rank,
        alpha=alpha,
        dropout=config.dropout,
        freeze_base=freeze_base,
    )
    with torch.no_grad():
        for ours, factors in layers.items():
            settings = lora_settings(adapted[ours] if ours in adapted else _linear(target, ours))
            a = weights.load(factors["A"])
            b = weights.load(factors["B"])
            if (heads := target.rope_rows(ours)) is not None:
                b = rotate_half_to_interleaved(b, heads)
            settings.lora_a.weight.copy_(a)
            settings.lora_b.weight.copy_(b)
    return adapted


def _check_base_copy(
    target: _Model, ours: str, weights: CheckpointFiles, key: str, adapted: bool
) -> None:
    """peft's copy of an adapted layer's base weight must equal the model's weight."""
    weight = _linear(target, ours).weight
    entry = weights.entries[key]
    same = adapted and entry.shape == tuple(weight.shape) and entry.dtype.is_floating_point
    if same:
        copy = weights.load(key)
        if (heads := target.rope_rows(ours)) is not None:
            copy = rotate_half_to_interleaved(copy, heads)
        same = torch.equal(copy.to(weight.dtype), weight.detach().cpu())
    if not same:
        raise CheckpointError(
            weights.entries[key].file,
            key,
            "a copy of the base layer's weight that differs from the model's (a resized or "
            "trained vocabulary?): not supported, refused"
            if adapted
            else "a copy of a base layer's weight without an adapter: not supported, refused",
        )


def _bad_key(key: str) -> str:
    if ".lora_embedding_" in key:
        return "an embedding adapter (lora_embedding_A/B): not supported, refused"
    if "lora_magnitude_vector" in key:
        return "a DoRA magnitude: DoRA is not supported, refused"
    if re.search(r"\.lora_[AB]\.[^.]+\.weight$", key):
        return (
            "names the adapter ('.lora_A.<name>.weight'): not peft's saved format, which "
            "has no adapter name in its keys"
        )
    if not key.startswith(_PREFIX):
        return f"expected peft's key form {_PREFIX}<layer>.lora_A.weight / .lora_B.weight"
    return (
        "not a LoRA factor of a linear layer (expected <layer>.lora_A.weight and "
        ".lora_B.weight only: no biases, no base weights, no modules_to_save)"
    )


# ---------------------------------------------------------------------- saving


def save_peft_adapter(
    model: nn.Module,
    directory: str | bytes | os.PathLike,
    *,
    base_model_name_or_path: str | os.PathLike | None = None,
    overwrite: bool = False,
) -> list[Path]:
    """Write ``model``'s LoRA adapters as peft does: ``adapter_config.json`` and
    ``adapter_model.safetensors`` in ``directory``, for transformers' class of ``model``.

    ``PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(base),
    directory)`` (``AutoModelForCausalLM`` for a Llama), with ``base`` the model's directory
    (or :func:`fusion.checkpoint.export_hf` of the model before training), gives ``model``'s
    logits; merged, the same as :func:`~fusion.lora.merge_lora` then ``export_hf``. The keys
    are peft's: ``base_model.model.<transformers' layer name>.lora_A.weight`` and
    ``.lora_B.weight``, in the adapters' dtype, nothing else (no adapter name, no base
    weights, no ``modules_to_save``), which vLLM's LoRA loader expects too. (vLLM does not
    serve adapters on the output layer, ``lm_head``: adapt ``output`` only for peft.)

    ``target_modules`` is what peft writes when given the same layers: for a Llama the list of
    layer names (``["q_proj", "v_proj"]``); for a vision-language model a regular expression
    naming the language model's layers only (``model\\.language_model\\.layers\\.\\d+\\.
    (?:self_attn\\.q_proj|self_attn\\.v_proj)``), since peft's list would also take the vision
    tower's layers of the same names. Adapters on only some decoder layers, or on the vision
    tower or connector, are named one by one.

    Written crash-safely (:func:`fusion.checkpoint.files.write_files`): both files are written
    and fsynced aside, then renamed into place, the config last; what they replace stays whole
    until then.

    Args:
        model: carrying adapters from :func:`~fusion.lora.apply_lora` (or
            :func:`load_peft_adapter`), all of one rank, alpha and dropout; a model as
            :func:`load_peft_adapter` takes, unsharded.
        directory: created if needed; other files in it are left alone.
        base_model_name_or_path: written into the config (peft's field: the base model's
            directory or Hub id), e.g. for ``AutoPeftModel``; or the base's
            :class:`~fusion.checkpoint.hf_model.HfDirectory` (its ``config.json`` not read again).
        overwrite: replace an adapter already in ``directory`` (a stale ``adapter_model.bin``
            is removed).

    Returns:
        the files written: ``adapter_model.safetensors``, ``adapter_config.json``.

    Raises:
        TypeError: ``model`` of none of the supported kinds; an argument of the wrong type.
        ValueError: ``model`` has no adapters; adapters of different rank, alpha or dropout
            (peft's rank_pattern is not written); an adapted layer transformers has no name
            for; adapters sharded (``DTensor``) or on the meta device.
        CheckpointError: ``directory`` is a file; it holds an adapter and ``overwrite`` is
            False.
        OSError: the file system failed (what was there is then left as it was).
    """
    out = as_path(directory, "directory")
    if not isinstance(overwrite, bool):
        raise TypeError(f"overwrite: expected a bool, got {type(overwrite).__name__}")
    if base_model_name_or_path is not None:
        if not isinstance(base_model_name_or_path, str | os.PathLike):
            raise TypeError(
                "base_model_name_or_path: expected a str, a path or None, got "
                f"{type(base_model_name_or_path).__name__}"
            )
        if not isinstance(base_model_name_or_path, HfDirectory):  # kept: its config is read
            base_model_name_or_path = os.fspath(base_model_name_or_path)
    target = _describe(model)
    linears = lora_linears(target.module)
    if not linears:
        raise ValueError("model: has no LoRA adapters (see fusion.lora.apply_lora)")
    settings = {name: lora_settings(linear) for name, linear in linears.items()}
    dropouts = {name: _dropout(linear) for name, linear in linears.items()}
    kinds = {name: (s.rank, s.alpha, dropouts[name]) for name, s in settings.items()}
    first = next(iter(linears))
    for name, kind in kinds.items():
        if kind != kinds[first]:
            raise ValueError(
                f"model: {first!r} and {name!r} have adapters of different (rank, alpha, "
                f"dropout) {kinds[first]} and {kind}: peft's format holds one (its per-layer "
                "rank_pattern is not written)"
            )
    hf_names = {}
    for name in linears:
        hf = target.hf_name(name)
        if hf is None or target.our_name(hf) != name:
            raise ValueError(
                f"model: {name!r} carries an adapter, but {target.family.architecture} has no "
                "layer of that name"
            )
        hf_names[name] = hf
    raw = {}
    for name, setting in settings.items():
        raw[f"{_PREFIX}{hf_names[name]}.lora_A.weight"] = setting.lora_a.weight.detach()
        raw[f"{_PREFIX}{hf_names[name]}.lora_B.weight"] = setting.lora_b.weight.detach()
    check_not_sharded(raw, "model")  # before permuting rows across shards
    for name in linears:
        if (heads := target.rope_rows(name)) is not None:
            key = f"{_PREFIX}{hf_names[name]}.lora_B.weight"
            raw[key] = interleaved_to_rotate_half(raw[key], heads)
    tensors = prepare_tensors(dict(sorted(raw.items())), "model", safetensors=True)
    adapted = set(hf_names.values())  # transformers' names of the adapted layers
    text = _adapter_config_text(target, base_model_name_or_path, adapted, *kinds[first])
    if os.path.lexists(out) and not out.is_dir():
        raise CheckpointError(out, None, "exists and is not a directory")
    present = [
        name
        for name in (ADAPTER_WEIGHTS, ADAPTER_CONFIG, ADAPTER_WEIGHTS_BIN)
        if os.path.lexists(out / name)
    ]
    if present and not overwrite:
        raise CheckpointError(
            out, None, f"already holds an adapter ({', '.join(present)}); pass overwrite=True"
        )
    for name in present:
        if (out / name).is_dir() and not (out / name).is_symlink():
            raise CheckpointError(out / name, None, "is a directory; remove it first")
    write: Callable[[Path], None] = partial(_save_tensors, tensors)
    stale = [ADAPTER_WEIGHTS_BIN] if ADAPTER_WEIGHTS_BIN in present else []
    return write_files(out, {ADAPTER_WEIGHTS: write, ADAPTER_CONFIG: text}, remove=stale)


def _adapter_config_text(
    target: _Model,
    base_model_name_or_path: str | HfDirectory | None,
    adapted: set[str],
    rank: int,
    alpha: float,
    dropout: float,
) -> str:
    """``adapter_config.json`` as peft writes it, for adapters of one ``rank``, ``alpha`` and
    ``dropout`` on the layers ``adapted`` (transformers' names): every field peft's
    ``LoraConfig`` saves, those this library does not use at their defaults."""
    family = target.family.named_by(base_model_name_or_path)
    config = {
        "alpha_pattern": {},
        "auto_mapping": {"base_model_class": family.architecture, "parent_library": family.library},
        "base_model_name_or_path": (
            None if base_model_name_or_path is None else os.fspath(base_model_name_or_path)
        ),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "layers_pattern": None,
        "layers_to_transform": None,
        "lora_alpha": int(alpha) if float(alpha).is_integer() else alpha,
        "lora_dropout": dropout,
        "modules_to_save": None,
        "peft_type": "LORA",
        "r": rank,
        "rank_pattern": {},
        "revision": None,
        "target_modules": _target_modules(target, adapted),
        "task_type": None,
        "use_dora": False,
        "use_rslora": False,
    }
    return json.dumps(config, indent=2, sort_keys=True, allow_nan=False) + "\n"


def _save_tensors(tensors: Mapping[str, torch.Tensor], file: Path) -> None:
    save_file(dict(tensors), file, metadata={"format": "pt"})  # as peft writes it


def _dropout(linear: nn.Linear) -> float:
    dropout = linear.get_submodule("lora_dropout")
    return float(dropout.p) if isinstance(dropout, nn.Dropout) else 0.0
