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

Supported: ``LlavaForConditionalGeneration``, ``Idefics3ForConditionalGeneration`` (also
SmolVLM), ``LlamaForCausalLM``, ``Qwen2VLForConditionalGeneration``,
``Qwen2_5_VLForConditionalGeneration`` and ``Qwen3VLForConditionalGeneration``, as
:mod:`fusion.checkpoint` loads them.

This library's decoder keeps the rows of ``q_proj`` and ``k_proj`` permuted for its
interleaved rotary embedding (:func:`fusion.checkpoint.keys.rotate_half_to_interleaved`): an
adapter's B factor of those layers (its rows) is permuted back on the way out and forth on the
way in; A (columns) is untouched. The result is the same function: logits equal peft's.
"""

import json
import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any, cast

import torch
from safetensors.torch import save_file
from torch import nn

from fusion._wrappers import unwrap
from fusion.checkpoint.errors import CheckpointError, as_path, short_repr
from fusion.checkpoint.files import (
    CheckpointFiles,
    check_not_sharded,
    prepare_tensors,
    read_bounded,
    write_files,
)
from fusion.checkpoint.hf_model import HfDirectory
from fusion.checkpoint.keys import (
    fusion_key_to_hf,
    hf_key_to_fusion,
    interleaved_to_rotate_half,
    rope_heads,
    rotate_half_to_interleaved,
)
from fusion.decoder import MultiHeadAttention, TransformerDecoder
from fusion.early_fusion import EarlyFusion
from fusion.families import Family, family_of
from fusion.lora.apply import ADAPTER_CHILDREN, apply_lora, lora_linears, lora_settings

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_WEIGHTS_BIN = "adapter_model.bin"  # peft with safe_serialization=False (read only)
MAX_CONFIG_BYTES = 1 << 20  # peft's are about 1.5 kB
_PREFIX = "base_model.model."  # peft's prefix of every saved key (PeftModel -> LoraModel)
_KEY = re.compile(r"base_model\.model\.(.+)\.lora_([AB])\.weight")
# peft also saves the base weight of an adapted output layer or embedding ("save_embedding_
# layers", in case the vocabulary was resized): taken when it equals the model's own.
_BASE_COPY = re.compile(r"base_model\.model\.(.+)\.base_layer\.weight")


@dataclass(frozen=True)
class _Family:
    """A model family as peft sees it: transformers' class of one of its model types, and
    where that class keeps its layers in memory (peft's names)."""

    family: Family
    model_type: str

    @property
    def kind(self) -> str:
        return self.family.name

    @property
    def architecture(self) -> str:  # transformers' class
        return self.family.architectures[self.model_type]

    @property
    def library(self) -> str:  # the module defining it (peft's auto_mapping)
        return self.family.transformers_module(self.model_type)

    @property
    def text(self) -> str:  # the prefix of the text model's layers, where a Llama has "model."
        return self.family.peft_text

    @property
    def encoder(self) -> tuple[tuple[str, str], ...]:  # our prefix -> transformers' prefix
        return self.family.peft_encoder

    def named_by(self, base: str | HfDirectory | None) -> "_Family":
        """This family as the base directory's ``config.json`` names it, when that is another
        model type of the same family with a class of its own in transformers (SmolVLM is an
        Idefics3 to this library; same layer names); an :class:`HfDirectory`'s parsed config
        is used as it is."""
        if base is None or not os.path.isdir(base):
            return self
        try:
            model_type = HfDirectory.of(base, "base_model_name_or_path").config.get("model_type")
        except CheckpointError:  # not ours to judge here: the class stays the model's
            return self
        if model_type == self.model_type or model_type not in self.family.model_types:
            return self
        return replace(self, model_type=model_type)


@dataclass(frozen=True)
class _Model:
    """A model of this library, unwrapped, with transformers' class it corresponds to."""

    module: nn.Module  # the model inside torch.compile / DDP wrappers
    family: _Family
    decoder: str  # the decoder's prefix in ``module``: "" (a bare decoder) or "decoder."

    def hf_name(self, ours: str) -> str | None:
        """transformers' in-memory name of our linear layer ``ours``; None if it has none."""
        if self.family.kind == "llama" or ours.startswith("decoder."):
            if not ours.startswith(self.decoder):
                return None
            try:
                name = fusion_key_to_hf(ours.removeprefix(self.decoder) + ".weight")
            except KeyError:
                return None
            name = name.removesuffix(".weight")
            return self.family.text + name.removeprefix("model.") if name != "lm_head" else name
        for mine, theirs in self.family.encoder:
            if ours.startswith(mine):
                return theirs + ours.removeprefix(mine)
        return None

    def our_name(self, hf: str) -> str | None:
        """Our name of the layer transformers names ``hf`` (any layout the checkpoint loaders
        read); None for a layer this library has no name for."""
        try:
            if self.family.kind == "llama":
                key: str | None = self.decoder + hf_key_to_fusion(hf + ".weight")
            else:
                key = self.family.family.layout.ours(hf + ".weight")
        except KeyError:
            return None
        return None if key is None else key.removesuffix(".weight")

    def rope_rows(self, ours: str) -> int | None:
        """The head count whose rows the decoder permutes in layer ``ours`` (q_proj, k_proj);
        None for another layer."""
        if not ours.startswith(self.decoder) or "." not in ours:
            return None
        parent = self.module.get_submodule(ours.rsplit(".", 1)[0])
        if not isinstance(parent, MultiHeadAttention):
            return None
        key = ours.removeprefix(self.decoder) + ".weight"
        return rope_heads(key, parent.num_heads, parent.num_kv_heads)

    def linears(self) -> dict[str, nn.Linear]:
        """Our plain linear layers (not adapters' own) that transformers has a name for."""
        adapters = {
            id(getattr(linear, child))
            for linear in lora_linears(self.module).values()
            for child in ADAPTER_CHILDREN
        }
        return {
            name: module
            for name, module in self.module.named_modules()
            if type(module) is nn.Linear
            and id(module) not in adapters
            and self.hf_name(name) is not None
        }


def _describe(model: object) -> _Model:
    inner = unwrap(model)
    if isinstance(inner, TransformerDecoder | EarlyFusion):
        try:
            family = family_of(inner)
        except TypeError:
            encoders = cast(EarlyFusion, inner).encoders  # a decoder always has a family
            got = {name: type(e).__name__ for name, e in encoders.items()}
            raise TypeError(
                "model: expected a LLaVA, Idefics3, Qwen2-VL, Qwen2.5-VL or Qwen3-VL EarlyFusion "
                "(one 'image' encoder as fusion.checkpoint's loaders build it) or a text "
                f"decoder; got encoders {got}"
            ) from None
        peft = _Family(family, family.model_type_of(inner))
        return _Model(inner, peft, "" if isinstance(inner, TransformerDecoder) else "decoder.")
    raise TypeError(
        "model: expected an EarlyFusion or a TransformerDecoder (possibly wrapped by "
        f"torch.compile or DDP), got {type(model).__name__}"
    )


# ---------------------------------------------------------------------- the config file


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


def _listed(names: tuple[str, ...], module: str) -> bool:
    """peft's rule for a list of names: the module's whole name, or its last names."""
    return module in names or any(module.endswith(f".{name}") for name in names)


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
        model: as :func:`fusion.checkpoint.load_hf_vlm` or
            :func:`~fusion.checkpoint.load_hf_llama` builds it (a LLaVA, Idefics3 / SmolVLM,
            Qwen2-VL, Qwen2.5-VL or Qwen3-VL ``EarlyFusion``, or a Llama decoder), possibly
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


def _linear(target: _Model, ours: str) -> nn.Linear:
    linear = target.module.get_submodule(ours)
    assert isinstance(linear, nn.Linear)
    return linear


def _get_linear(model: nn.Module, name: str | None) -> nn.Linear | None:
    if name is None:
        return None
    try:
        module = model.get_submodule(name)
    except AttributeError:
        return None
    return module if type(module) is nn.Linear else None


def _literal(name: str) -> str:
    """A pattern for :func:`apply_lora` that matches the layer ``name`` only (module names
    hold no ``fnmatch`` wildcards; ``[`` is escaped anyway)."""
    return re.sub(r"([*?\[])", r"[\1]", name)


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


def _check_targets(
    config: PeftLoraConfig, target: _Model, adapted: Mapping[str, str], file: Path
) -> None:
    """A list of ``target_modules`` (or ``"all-linear"``) names exactly the layers the weights
    adapt (``adapted``: our name -> the file's), by peft's rule over our model's linear layers;
    a regular expression is not evaluated."""
    targets, excluded = config.target_modules, config.exclude_modules
    if isinstance(excluded, str) or not (isinstance(targets, tuple) or targets == "all-linear"):
        return

    listed = targets if isinstance(targets, tuple) else ()

    def chosen(names: set[str]) -> bool:  # a layer's names: the file's, and transformers' now
        if targets == "all-linear":  # peft's: every linear layer but the output layer
            hit = "lm_head" not in names
        else:
            hit = any(_listed(listed, name) for name in names)
        return hit and not (excluded and any(_listed(excluded, name) for name in names))

    layers = set(target.linears()) | set(adapted)
    expected = {
        ours
        for ours in layers
        if chosen({n for n in (target.hf_name(ours), adapted.get(ours)) if n is not None})
    }
    if expected != set(adapted):
        extra = sorted(filter(None, map(target.hf_name, expected - set(adapted))))
        missing = sorted(adapted[ours] for ours in set(adapted) - expected)
        raise CheckpointError(
            file,
            "target_modules",
            f"names other layers than {ADAPTER_WEIGHTS} adapts: targeted without weights "
            f"{extra[:4]}, weights not targeted {missing[:4]}",
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


def _target_modules(target: _Model, adapted: set[str]) -> list[str] | str:
    """peft's ``target_modules`` for exactly the layers ``adapted`` (transformers' names):
    checked against peft's matching rule over every layer of the model."""
    everything = {
        hf for ours in target.linears() if (hf := target.hf_name(ours)) is not None
    } | adapted
    text = target.family.text
    layer = re.compile(re.escape(text) + r"layers\.\d+\.(.+)")
    tails = {m.group(1) for name in adapted if (m := layer.fullmatch(name))}
    per_layer = {name for name in everything if (m := layer.fullmatch(name)) and m[1] in tails}
    if not per_layer <= adapted:  # some decoder layers only: every layer by name
        tails, per_layer = set(), set()
    one_by_one = sorted(adapted - per_layer)
    if target.family.kind == "llama":
        listed = sorted({tail.rsplit(".", 1)[-1] for tail in tails} | set(one_by_one))
        if {name for name in everything if _listed(tuple(listed), name)} == adapted:
            return listed
        return sorted(adapted)  # exact names match themselves only
    parts = []
    if tails:
        choices = "|".join(re.escape(tail) for tail in sorted(tails))
        parts.append(re.escape(text) + rf"layers\.\d+\.(?:{choices})")
    parts += [re.escape(name) for name in one_by_one]
    pattern = parts[0] if len(parts) == 1 else "|".join(f"(?:{part})" for part in parts)
    if {name for name in everything if re.fullmatch(pattern, name)} == adapted:
        return pattern
    return "|".join(re.escape(name) for name in sorted(adapted))
