"""Hugging Face LLaVA and Idefics3 / SmolVLM directories <-> ready ``EarlyFusion`` models.

A loaded model is ``EarlyFusion(decoder, {"image": encoder}, {"image": image_token_id})``: the
decoder is this library's ``llama3_2`` built from ``text_config`` (its weights relabelled as
:mod:`fusion.checkpoint.hf_keys` describes), the encoder is
:class:`fusion.models.LlavaImageEncoder` or :class:`fusion.models.Idefics3ImageEncoder`, whose
parameters carry the checkpoint's own names below a prefix.

Both key layouts ``transformers`` writes are read, one per file set (mixing them is refused):

- LLaVA: ``language_model.model.*`` + ``language_model.lm_head.weight`` (on disk before
  transformers 4.52, and on the Hub) or ``model.language_model.*`` + ``lm_head.weight`` (the
  in-memory names); the vision tower under ``vision_tower.vision_model.*``,
  ``vision_tower.*`` or either with ``model.`` in front; ``(model.)multi_modal_projector.*``.
- Idefics3: ``model.text_model.*``, ``model.vision_model.*``, ``model.connector.*``,
  ``lm_head.weight``, or the same without ``model.`` (a bare ``Idefics3Model``).

The savers write the Hub layout (``language_model.model.*`` / ``vision_tower.vision_model.*``
for LLaVA, ``model.*`` for Idefics3), which every ``transformers`` version loads.
"""

import json
import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch

from fusion.checkpoint._checks import as_path, check_positive_int
from fusion.checkpoint.errors import CheckpointError
from fusion.checkpoint.files import (
    CheckpointFiles,
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
    fusion_to_hf,
    hf_key_to_fusion,
    rotate_half_to_interleaved,
)
from fusion.decoder import RotaryPositionalEmbeddings, TransformerSelfAttentionLayer
from fusion.early_fusion import EarlyFusion
from fusion.encoders.clip import ClipVisionTransformer
from fusion.encoders.siglip import SiglipVisionTransformer
from fusion.encoders.vit_blocks import ACTIVATIONS, VisionEncoderLayer
from fusion.models.idefics3 import Idefics3ImageEncoder, idefics3
from fusion.models.llava import FEATURE_STRATEGIES, LlavaImageEncoder, llava

LLAVA_MODEL_TYPES = ("llava",)
IDEFICS3_MODEL_TYPES = ("idefics3", "smolvlm")
_LOADABLE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_ROPE_TABLE_FLOOR = 64 * 2**20  # as load_hf_llama: a 256k-position table at head_dim 64

# transformers' defaults for keys a sub-config leaves out (configs written by transformers 4.x
# omit those equal to the defaults, e.g. llava-1.5's text_config has no hidden_size).
_LLAMA_DEFAULTS = {
    "vocab_size": 32_000,
    "hidden_size": 4096,
    "intermediate_size": 11_008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
}
_CLIP_VISION_DEFAULTS = {
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_channels": 3,
    "image_size": 224,
    "patch_size": 32,
    "hidden_act": "quick_gelu",
    "layer_norm_eps": 1e-5,
}
_IDEFICS3_VISION_DEFAULTS = {
    "hidden_size": 1152,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 16,
    "num_channels": 3,
    "image_size": 224,
    "patch_size": 32,
    "hidden_act": "gelu_pytorch_tanh",
    "layer_norm_eps": 1e-6,
}
_CLIP_VISION_TYPES = ("clip_vision_model",)
_IDEFICS3_VISION_TYPES = ("idefics3_vision", "smolvlm_vision")
_VISION_INTS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_channels",
    "image_size",
    "patch_size",
)

# Checkpoint key -> (part, rest of the key). Tried in order; the first match wins.
_LLAVA_LAYOUTS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("lm_head", re.compile(r"(?:language_model\.)?(lm_head\.weight)")),
    ("text", re.compile(r"(?:language_model\.model|model\.language_model)\.(.+)")),
    ("vision", re.compile(r"(?:model\.)?vision_tower\.(?:vision_model\.)?(.+)")),
    ("projector", re.compile(r"(?:model\.)?multi_modal_projector\.(.+)")),
)
_IDEFICS3_LAYOUTS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("lm_head", re.compile(r"(lm_head\.weight)")),
    ("text", re.compile(r"(?:model\.)?text_model\.(.+)")),
    ("vision", re.compile(r"(?:model\.)?vision_model\.(.+)")),
    ("projector", re.compile(r"(?:model\.)?connector\.(.+)")),
)
# Buffers older checkpoints saved that are functions of the config, not weights.
_DERIVED = re.compile(r"(?:embeddings\.position_ids|layers\.\d+\.self_attn\.rotary_emb\.inv_freq)")


@dataclass
class _Spec:
    """What a config describes, in this library's terms."""

    kind: str  # "llava" or "idefics3"
    text: dict[str, Any]  # llama3_2 keyword arguments
    vision: dict[str, Any]  # vision tower keyword arguments
    image_token_id: int
    options: dict[str, Any] = field(default_factory=dict)  # builder keyword arguments

    def build(self) -> EarlyFusion:
        builder = llava if self.kind == "llava" else idefics3
        return builder(
            text=self.text, vision=self.vision, image_token_id=self.image_token_id, **self.options
        )


# ---------------------------------------------------------------------- config reading


def hf_model_kind(path: str | bytes | os.PathLike) -> str:
    """What ``config.json`` describes: ``"llama"``, ``"llava"`` or ``"idefics3"`` (Idefics3 and
    SmolVLM), from its ``model_type`` (a config without one is a Llama, as for
    :func:`~fusion.checkpoint.load_hf_llama`).

    Args:
        path: a model directory, or its ``config.json``.

    Raises:
        TypeError, ValueError: ``path`` is not a path.
        CheckpointError: ``config.json`` missing or unreadable, or a ``model_type`` none of the
            loaders reads (named, with the ones they do).
    """
    path = as_path(path, "path")
    file = path / CONFIG_NAME if path.is_dir() else path
    model_type = read_hf_config(file).get("model_type", "llama")
    if model_type == "llama":
        return "llama"
    if model_type in LLAVA_MODEL_TYPES:
        return "llava"
    if model_type in IDEFICS3_MODEL_TYPES:
        return "idefics3"
    known = ["llama", *LLAVA_MODEL_TYPES, *IDEFICS3_MODEL_TYPES]
    raise CheckpointError(file, "model_type", f"expected one of {known}, got {_short(model_type)}")


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 200 else text[:200] + "..."


def _sub_config(config: Mapping[str, Any], key: str, source: Path, what: str) -> dict[str, Any]:
    value = config.get(key)
    if value is None:
        raise CheckpointError(source, key, f"missing; a {what} config needs it")
    if not isinstance(value, Mapping):
        raise CheckpointError(source, key, f"expected an object, got {_short(value)}")
    return dict(value)


def _text_kwargs(config: Mapping[str, Any], source: Path, what: str) -> dict[str, Any]:
    text = {**_LLAMA_DEFAULTS, **_sub_config(config, "text_config", source, what)}
    try:
        return llama3_2_kwargs_from_hf_config(text, source=source)
    except CheckpointError as error:
        # Name the key where it is: inside text_config.
        prefix = str(CheckpointError(error.file, error.key, ""))
        key = "text_config" if error.key is None else f"text_config.{error.key}"
        raise CheckpointError(source, key, str(error)[len(prefix) :]) from None


def _vision_kwargs(
    config: Mapping[str, Any],
    source: Path,
    what: str,
    model_types: tuple[str, ...],
    defaults: Mapping[str, Any],
) -> dict[str, Any]:
    vision = _sub_config(config, "vision_config", source, what)
    model_type = vision.get("model_type", model_types[0])
    if model_type not in model_types:
        raise CheckpointError(
            source,
            "vision_config.model_type",
            f"expected one of {list(model_types)}, got {_short(model_type)}",
        )
    merged = {**defaults, **{k: vision[k] for k in defaults if k in vision}}
    for key in _VISION_INTS:
        value = merged[key]
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**31:
            raise CheckpointError(
                source,
                f"vision_config.{key}",
                f"expected an integer in [0, 2**31), got {_short(value)}",
            )
    eps = merged["layer_norm_eps"]
    if isinstance(eps, bool) or not isinstance(eps, int | float) or not 0 < eps < 1:
        raise CheckpointError(
            source,
            "vision_config.layer_norm_eps",
            f"expected a number in (0, 1), got {_short(eps)}",
        )
    if merged["hidden_act"] not in ACTIVATIONS:
        raise CheckpointError(
            source,
            "vision_config.hidden_act",
            f"expected one of {sorted(ACTIVATIONS)}, got {_short(merged['hidden_act'])}",
        )
    return merged


def _token_id(config: Mapping[str, Any], keys: tuple[str, ...], default: int, source: Path) -> int:
    values = {key: config[key] for key in keys if config.get(key) is not None}
    if len(set(map(repr, values.values()))) > 1:
        raise CheckpointError(source, keys[0], f"disagreeing values {values}")
    value = next(iter(values.values()), default)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**63:
        raise CheckpointError(
            source, next(iter(values), keys[0]), f"expected an id, got {_short(value)}"
        )
    return value


def _flag(
    config: Mapping[str, Any], key: str, default: bool, source: Path, prefix: str = ""
) -> bool:
    value = config.get(key, default)
    if not isinstance(value, bool):
        raise CheckpointError(source, prefix + key, f"expected true or false, got {_short(value)}")
    return value


def _llava_spec(config: Mapping[str, Any], source: Path) -> _Spec:
    text = _text_kwargs(config, source, "LLaVA")
    vision = _vision_kwargs(config, source, "LLaVA", _CLIP_VISION_TYPES, _CLIP_VISION_DEFAULTS)
    layer = config.get("vision_feature_layer", -2)
    layers = layer if isinstance(layer, list) else [layer]
    if not layers or any(isinstance(v, bool) or not isinstance(v, int) for v in layers):
        raise CheckpointError(
            source,
            "vision_feature_layer",
            f"expected an int or a list of ints, got {_short(layer)}",
        )
    strategy = config.get("vision_feature_select_strategy", "default")
    if strategy not in FEATURE_STRATEGIES:
        raise CheckpointError(
            source,
            "vision_feature_select_strategy",
            f"expected one of {list(FEATURE_STRATEGIES)}, got {_short(strategy)}",
        )
    act = config.get("projector_hidden_act", "gelu")
    if act not in ACTIVATIONS:
        raise CheckpointError(
            source,
            "projector_hidden_act",
            f"expected one of {sorted(ACTIVATIONS)}, got {_short(act)}",
        )
    # transformers ties when either the top level or text_config asks for it.
    text_tied = _flag(config["text_config"], "tie_word_embeddings", False, source, "text_config.")
    text["tie_word_embeddings"] = _flag(config, "tie_word_embeddings", False, source) or text_tied
    return _Spec(
        kind="llava",
        text=text,
        vision=vision,
        image_token_id=_token_id(config, ("image_token_index", "image_token_id"), 32_000, source),
        options={
            "vision_feature_layer": layer,
            "vision_feature_select_strategy": strategy,
            "projector_hidden_act": act,
            "projector_bias": _flag(config, "multimodal_projector_bias", True, source),
        },
    )


def _idefics3_spec(config: Mapping[str, Any], source: Path) -> _Spec:
    text = _text_kwargs(config, source, "Idefics3")
    vision = _vision_kwargs(
        config, source, "Idefics3", _IDEFICS3_VISION_TYPES, _IDEFICS3_VISION_DEFAULTS
    )
    scale = config.get("scale_factor", 2)
    if isinstance(scale, bool) or not isinstance(scale, int) or not 0 < scale < 2**16:
        raise CheckpointError(
            source, "scale_factor", f"expected a positive integer, got {_short(scale)}"
        )
    # transformers (5.x) ties on the top-level flag only.
    text["tie_word_embeddings"] = _flag(config, "tie_word_embeddings", False, source)
    return _Spec(
        kind="idefics3",
        text=text,
        vision=vision,
        image_token_id=_token_id(config, ("image_token_id",), 128_257, source),
        options={"scale_factor": scale},
    )


def _read_spec(path: Path, kinds: tuple[str, ...]) -> tuple[_Spec, Path]:
    file = path / CONFIG_NAME
    config = read_hf_config(file)
    model_type = config.get("model_type")
    allowed = {"llava": LLAVA_MODEL_TYPES, "idefics3": IDEFICS3_MODEL_TYPES}
    expected = [t for kind in kinds for t in allowed[kind]]
    if model_type not in expected:
        hint = " (a plain Llama: use load_hf_llama)" if model_type in (None, "llama") else ""
        raise CheckpointError(
            file, "model_type", f"expected one of {expected}, got {_short(model_type)}{hint}"
        )
    if model_type in LLAVA_MODEL_TYPES:
        return _llava_spec(config, file), file
    return _idefics3_spec(config, file), file


@dataclass(frozen=True)
class VlmImageLayout:
    """What preprocessing needs to know of a vision-language model: its ``kind``
    (``"llava"`` or ``"idefics3"``), the placeholder id of image rows, the rows one image
    (LLaVA) or one tile (Idefics3) gives, and the side of the square images its tower takes."""

    kind: str
    image_token_id: int
    tokens_per_image: int
    image_size: int


def read_hf_vlm_layout(path: str | bytes | os.PathLike) -> VlmImageLayout:
    """The :class:`VlmImageLayout` a LLaVA or Idefics3 directory's ``config.json`` describes,
    without reading the weights.

    Raises:
        TypeError, ValueError: ``path`` is not a path.
        CheckpointError: as :func:`load_hf_vlm` for ``config.json``.
    """
    path = as_path(path, "path")
    spec, config_file = _read_spec(path, ("llava", "idefics3"))
    # Arithmetic only: nothing is built, so no config can make this slow.
    size, patch = spec.vision["image_size"], spec.vision["patch_size"]
    if patch == 0 or size == 0 or size % patch:
        raise CheckpointError(
            config_file,
            "vision_config.image_size",
            f"expected a positive multiple of patch_size={patch}, got {size}",
        )
    side = size // patch
    if spec.kind == "llava":
        full = spec.options["vision_feature_select_strategy"] == "full"
        tokens = side * side + int(full)
    else:
        scale = spec.options["scale_factor"]
        if side % scale:
            raise CheckpointError(
                config_file,
                "scale_factor",
                f"expected a divisor of the patch grid's side {side}, got {scale}",
            )
        tokens = (side // scale) ** 2
    return VlmImageLayout(spec.kind, spec.image_token_id, tokens, size)


# ---------------------------------------------------------------------- loading


def load_hf_llava(
    path: str | bytes | os.PathLike,
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    max_seq_len: int | None = None,
) -> EarlyFusion:
    """Build the LLaVA model a Hugging Face ``LlavaForConditionalGeneration`` directory
    describes, with its weights, as an ``EarlyFusion``.

    Everything is checked from ``config.json`` and the weights' headers before anything is
    allocated: the config's values (keys ``text_config`` and ``vision_config`` leave out take
    ``transformers``' defaults, as configs written by transformers 4.x omit them), that the
    layer counts are backed by weights, every name, shape and dtype, and that the files hold
    the bytes the weights claim. The model is then allocated once, on ``device``, and filled.

    Args:
        path: a directory with ``config.json`` and ``model.safetensors``,
            ``model.safetensors.index.json`` + shards, or ``pytorch_model.bin`` (+ index), the
            latter read with ``torch.load(weights_only=True)``.
        dtype: parameter dtype (float16, bfloat16, float32 or float64). None: as stored.
        device: where the model lives.
        max_seq_len: override ``text_config.max_position_embeddings``.

    Returns:
        ``EarlyFusion(decoder, {"image": LlavaImageEncoder}, {"image": image_token_index})``,
        in training mode as freshly built modules are (call ``.eval()`` for inference).

    Raises:
        TypeError, ValueError: an argument of the wrong type or value (``path``, ``dtype``,
            ``device``, ``max_seq_len``).
        CheckpointError: naming the file and key: another ``model_type`` (e.g. a plain Llama,
            or Idefics3); a missing or malformed ``text_config`` or ``vision_config``; a vision
            tower other than CLIP; values no model can be built from (e.g. ``image_size`` not a
            multiple of ``patch_size``, ``vision_feature_layer`` out of range); more layers than
            the weights hold; a missing, unexpected or duplicated key (two layouts mixed); a
            shape that differs from the config's; weights not stored as float16, bfloat16,
            float32 or float64; mixed stored dtypes with ``dtype=None``; values beyond the range
            of ``dtype``; a tied ``lm_head`` that differs from the embedding; and every file
            problem :class:`~fusion.checkpoint.CheckpointFiles` reports.
    """
    return _load(path, ("llava",), dtype, device, max_seq_len)


def load_hf_idefics3(
    path: str | bytes | os.PathLike,
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    max_seq_len: int | None = None,
) -> EarlyFusion:
    """Build the Idefics3 / SmolVLM model a Hugging Face ``Idefics3ForConditionalGeneration``
    or ``SmolVLMForConditionalGeneration`` directory describes, with its weights.

    As :func:`load_hf_llava` (same arguments, checks and errors), for ``model_type``
    ``"idefics3"`` or ``"smolvlm"``; the vision tower must be an Idefics3 / SmolVLM one.

    Returns:
        ``EarlyFusion(decoder, {"image": Idefics3ImageEncoder}, {"image": image_token_id})``.
    """
    return _load(path, ("idefics3",), dtype, device, max_seq_len)


def load_hf_vlm(
    path: str | bytes | os.PathLike,
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    max_seq_len: int | None = None,
) -> EarlyFusion:
    """:func:`load_hf_llava` or :func:`load_hf_idefics3`, whichever ``model_type`` names (same
    arguments and errors)."""
    return _load(path, ("llava", "idefics3"), dtype, device, max_seq_len)


def _check_load_args(
    path: object, dtype: object, device: object, max_seq_len: object
) -> tuple[Path, torch.device]:
    path = as_path(path, "path")
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype: expected a torch.dtype or None, got {type(dtype).__name__}")
    if dtype is not None and dtype not in _LOADABLE_DTYPES:
        raise ValueError(f"dtype: expected float16, bfloat16, float32 or float64, got {dtype}")
    if not isinstance(device, str | torch.device):
        raise TypeError(f"device: expected a str or torch.device, got {type(device).__name__}")
    try:
        parsed = torch.device(device)
        torch.empty(0, device=parsed)
    except (RuntimeError, AssertionError) as error:  # unknown, or not built / not present
        raise ValueError(f"device: {device!r} is not available: {error}") from None
    if parsed.type == "meta":
        raise ValueError("device: expected a device that holds data, got meta")
    if max_seq_len is not None and check_positive_int(max_seq_len, "max_seq_len") >= 2**31:
        raise ValueError(f"max_seq_len: expected less than 2**31, got {max_seq_len}")
    return path, parsed


def _load(
    path: object,
    kinds: tuple[str, ...],
    dtype: torch.dtype | None,
    device: object,
    max_seq_len: int | None,
) -> EarlyFusion:
    path, device = _check_load_args(path, dtype, device, max_seq_len)
    spec, config_file = _read_spec(path, kinds)
    checkpoint = CheckpointFiles(path)
    sources = _map_keys(checkpoint, spec.kind)
    _check_layer_counts(spec, sources, config_file)
    if max_seq_len is not None:
        spec.text["max_seq_len"] = max_seq_len
    try:
        with torch.device("meta"):
            model = spec.build()
    except (ValueError, TypeError) as error:
        raise CheckpointError(
            config_file, None, f"describes no {spec.kind} model: {error}"
        ) from error
    expected = {key: tuple(t.shape) for key, t in model.state_dict().items()}
    tied = model.decoder.output is None
    _check_entries(checkpoint, sources, expected, tied)
    _check_sizes(checkpoint, sources, spec, config_file, max_seq_len)
    if dtype is None:
        stored = {checkpoint.entries[key].dtype for key in sources.values()}
        if len(stored) != 1:
            dtypes = sorted(map(str, stored))
            raise CheckpointError(
                path, None, f"weights stored in several dtypes {dtypes}: pass dtype"
            )
        dtype = stored.pop()

    model = model.to(dtype).to_empty(device=device)  # uninitialised until filled below
    for module in model.modules():
        if isinstance(module, RotaryPositionalEmbeddings):
            module.reset_parameters()  # the rotary table, in float32, on ``device``
    _check_all_filled(model, set(sources))
    heads = {
        "q_proj": spec.text["num_heads"],
        "k_proj": spec.text["num_kv_heads"],
    }
    targets = model.state_dict()
    with torch.no_grad():
        for key, hf_key in sources.items():
            if key == "decoder.output.weight" and tied:
                continue
            tensor = checkpoint.load(hf_key)
            _check_fits(tensor, dtype, checkpoint.entries[hf_key].file, hf_key)
            proj = key.rsplit(".", 2)[-2] if key.startswith("decoder.layers.") else None
            if proj in heads:
                tensor = rotate_half_to_interleaved(tensor, heads[proj])
            targets[key].copy_(tensor)
        if tied and "decoder.output.weight" in sources:
            _check_tied_copy(checkpoint, sources["decoder.output.weight"], model)
    return model


def _our_key(kind: str, part: str, rest: str) -> str:
    """This library's key for a checkpoint key split into (part, rest)."""
    if part == "lm_head":
        return "decoder.output.weight"
    if part == "text":
        try:
            return "decoder." + hf_key_to_fusion("model." + rest)
        except KeyError:
            return f"decoder.<unknown>.{rest}"
    if part == "vision":
        tower = "vision_tower" if kind == "llava" else "vision_model"
        return f"encoders.image.{tower}.{rest}"
    connector = "multi_modal_projector" if kind == "llava" else "connector"
    return f"encoders.image.{connector}.{rest}"


def _map_keys(checkpoint: CheckpointFiles, kind: str) -> dict[str, str]:
    """Our key -> the checkpoint's key, refusing keys of neither layout and duplicates."""
    layouts = _LLAVA_LAYOUTS if kind == "llava" else _IDEFICS3_LAYOUTS
    sources: dict[str, str] = {}
    for hf_key, entry in checkpoint.entries.items():
        for part, pattern in layouts:  # noqa: B007 (the matching part is used below)
            match = pattern.fullmatch(hf_key)
            if match:
                break
        else:
            raise CheckpointError(entry.file, hf_key, f"unexpected key for a {kind} model")
        rest = match.group(1)
        if _DERIVED.fullmatch(rest):
            continue
        key = _our_key(kind, part, rest)
        if key in sources:
            raise CheckpointError(
                entry.file,
                hf_key,
                f"the same weight as {sources[key]!r}: the checkpoint mixes two key layouts",
            )
        sources[key] = hf_key
    return sources


_TEXT_LAYER = re.compile(r"decoder\.layers\.(\d{1,9})\.")
_VISION_LAYER = re.compile(r"encoders\.image\.\w+\.encoder\.layers\.(\d{1,9})\.")


def _check_layer_counts(spec: _Spec, sources: Mapping[str, str], config_file: Path) -> None:
    """Before building anything: the config's layer counts must be backed by weights (a config
    claiming millions of layers would otherwise be built, if only on the meta device)."""
    for pattern, claimed, key in (
        (_TEXT_LAYER, spec.text["num_layers"], "text_config.num_hidden_layers"),
        (_VISION_LAYER, spec.vision["num_hidden_layers"], "vision_config.num_hidden_layers"),
    ):
        held = {m.group(1) for k in sources if (m := pattern.match(k))}
        if claimed > len(held):
            raise CheckpointError(
                config_file,
                key,
                f"{claimed}, but the checkpoint holds weights for {len(held)} layers",
            )


def _check_entries(
    checkpoint: CheckpointFiles,
    sources: Mapping[str, str],
    expected: Mapping[str, tuple[int, ...]],
    tied: bool,
) -> None:
    for key, hf_key in sources.items():
        entry = checkpoint.entries[hf_key]
        if key == "decoder.output.weight" and tied:
            shape = expected["decoder.tok_embeddings.weight"]
        elif key not in expected:
            raise CheckpointError(entry.file, hf_key, "unexpected key for a model with this config")
        else:
            shape = expected[key]
        if entry.shape != shape:
            raise CheckpointError(
                entry.file,
                hf_key,
                f"shape {list(entry.shape)} differs from {list(shape)} that config.json implies",
            )
        if entry.dtype not in _LOADABLE_DTYPES:
            raise CheckpointError(
                entry.file,
                hf_key,
                f"stored as {entry.dtype}: expected float16, bfloat16, float32 or float64 "
                "(quantized, float8 or integer weights are not supported)",
            )
    for key in expected:
        if key not in sources:
            raise CheckpointError(checkpoint.path, _hf_name(key), "missing from the checkpoint")


def _hf_name(key: str) -> str:
    """A readable name of the checkpoint key that would hold our ``key``."""
    if key == "decoder.output.weight":
        return "lm_head.weight"
    if key.startswith("decoder."):
        return f"text model: {key.removeprefix('decoder.')}"
    return key.removeprefix("encoders.image.")


def _check_sizes(
    checkpoint: CheckpointFiles,
    sources: Mapping[str, str],
    spec: _Spec,
    config_file: Path,
    max_seq_len: int | None,
) -> None:
    """Refuse what would allocate more than the files back: tensors sharing storage, and a
    rotary table larger than the weights."""
    entries = [checkpoint.entries[hf_key] for hf_key in sources.values()]
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
        if max_seq_len is not None:
            raise ValueError(f"max_seq_len: {message}")
        raise CheckpointError(
            config_file,
            "text_config.max_position_embeddings",
            f"{message}; pass max_seq_len to load fewer",
        )


def _check_fits(tensor: torch.Tensor, dtype: torch.dtype, file: Path, key: str) -> None:
    """Refuse values that ``dtype`` cannot hold (they would become inf)."""
    limit = torch.finfo(dtype).max
    if tensor.numel() == 0 or limit >= torch.finfo(tensor.dtype).max:
        return
    low, high = torch.aminmax(tensor)
    largest = max(-low.item(), high.item())
    if largest > limit:
        raise CheckpointError(
            file,
            key,
            f"holds {largest:g}, beyond the range of {dtype} (max {limit:g}): load it with a "
            "wider dtype",
        )


def _check_all_filled(model: EarlyFusion, loaded: set[str]) -> None:
    """Guard against a module gaining state that neither the checkpoint nor a rebuild fills."""
    rebuilt = {
        f"{name}.cache"
        for name, module in model.named_modules(remove_duplicate=False)
        if isinstance(module, RotaryPositionalEmbeddings)
    }
    names = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    names |= {name for name, _ in model.named_buffers(remove_duplicate=False)}
    unfilled = sorted(names - loaded - rebuilt - {"decoder.output.weight"})
    if unfilled:
        raise RuntimeError(f"hf_vlm: no value for {unfilled}; the loader needs updating")


def _check_tied_copy(checkpoint: CheckpointFiles, hf_key: str, model: EarlyFusion) -> None:
    embedding = model.decoder.tok_embeddings.weight
    if not torch.equal(checkpoint.load(hf_key).to(embedding), embedding):
        raise CheckpointError(
            checkpoint.entries[hf_key].file,
            hf_key,
            "config.json ties the output to the embedding (tie_word_embeddings), but this "
            "differs from the embedding",
        )


# ---------------------------------------------------------------------- saving


def hf_config_from_llava(model: EarlyFusion) -> dict[str, Any]:
    """The Hugging Face ``LlavaForConditionalGeneration`` config describing ``model``.

    Raises:
        TypeError: ``model`` is not an ``EarlyFusion``.
        ValueError: ``model`` is not a LLaVA as :func:`fusion.models.llava` builds it (named:
            other encoders, a modified tower or decoder, an image id outside the vocabulary).
    """
    encoder = _image_encoder(model, LlavaImageEncoder, "LlavaImageEncoder")
    tower: ClipVisionTransformer = encoder.vision_tower
    projector = encoder.multi_modal_projector
    text = _text_config(model)
    config = {
        "architectures": ["LlavaForConditionalGeneration"],
        "model_type": "llava",
        "image_token_index": model.encoder_tokens["image"],
        "image_seq_length": encoder.tokens_per_image,
        "projector_hidden_act": projector.act.name,
        "multimodal_projector_bias": projector.linear_1.bias is not None,
        "vision_feature_layer": encoder.vision_feature_layer,
        "vision_feature_select_strategy": encoder.vision_feature_select_strategy,
        "tie_word_embeddings": text["tie_word_embeddings"],
        "text_config": text,
        "vision_config": {"model_type": "clip_vision_model", **_tower_config(tower)},
        "torch_dtype": text["torch_dtype"],
    }
    _check_rebuilds(model, _llava_spec(config, Path(CONFIG_NAME)))
    return config


def hf_config_from_idefics3(model: EarlyFusion) -> dict[str, Any]:
    """The Hugging Face ``Idefics3ForConditionalGeneration`` config describing ``model``.

    Raises:
        TypeError: ``model`` is not an ``EarlyFusion``.
        ValueError: ``model`` is not an Idefics3 as :func:`fusion.models.idefics3` builds it
            (named: other encoders, a modified tower or decoder, an image id outside the
            vocabulary).
    """
    encoder = _image_encoder(model, Idefics3ImageEncoder, "Idefics3ImageEncoder")
    tower: SiglipVisionTransformer = encoder.vision_model
    if tower.embeddings.position_scheme != "bucketed":
        raise ValueError(
            "model: Idefics3 assigns bucketed positions; its vision tower has "
            f"position_scheme={tower.embeddings.position_scheme!r}"
        )
    text = _text_config(model)
    config = {
        "architectures": ["Idefics3ForConditionalGeneration"],
        "model_type": "idefics3",
        "image_token_id": model.encoder_tokens["image"],
        "scale_factor": encoder.connector.scale_factor,
        "tie_word_embeddings": text["tie_word_embeddings"],
        "text_config": text,
        "vision_config": {"model_type": "idefics3_vision", **_tower_config(tower)},
        "torch_dtype": text["torch_dtype"],
    }
    _check_rebuilds(model, _idefics3_spec(config, Path(CONFIG_NAME)))
    return config


def _image_encoder(model: object, cls: type, name: str) -> Any:
    if not isinstance(model, EarlyFusion):
        raise TypeError(f"model: expected an EarlyFusion, got {type(model).__name__}")
    if set(model.encoders) != {"image"} or not isinstance(model.encoders["image"], cls):
        got = {k: type(v).__name__ for k, v in model.encoders.items()}
        raise ValueError(f"model: expected one encoder, 'image', a {name}; got {got}")
    image_id, vocab = model.encoder_tokens["image"], model.decoder.vocab_size
    if not 0 <= image_id < vocab:
        raise ValueError(
            f"model: the image placeholder id {image_id} lies outside the vocabulary [0, "
            f"{vocab}); Hugging Face models embed it, so it must lie inside"
        )
    return model.encoders["image"]


def _text_config(model: EarlyFusion) -> dict[str, Any]:
    text = hf_config_from_decoder(model.decoder)
    text.pop("architectures", None)
    return text


def _tower_config(tower: ClipVisionTransformer | SiglipVisionTransformer) -> dict[str, Any]:
    layers = [cast(VisionEncoderLayer, layer) for layer in tower.encoder.layers]
    return {
        "hidden_size": tower.hidden_size,
        "intermediate_size": layers[0].mlp.fc1.out_features if layers else 1,
        "num_hidden_layers": len(layers),
        "num_attention_heads": layers[0].self_attn.num_heads if layers else 1,
        "num_channels": tower.num_channels,
        "image_size": tower.image_size,
        "patch_size": tower.patch_size,
        "hidden_act": tower.hidden_act,
        "layer_norm_eps": tower.layer_norm_eps,
    }


def _check_rebuilds(model: EarlyFusion, spec: _Spec) -> None:
    """The config written must rebuild ``model`` exactly: same names, shapes and sub-layer
    settings (so a modified model is refused rather than saved wrongly)."""
    with torch.device("meta"):
        rebuilt = spec.build()
    ours = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    theirs = {k: tuple(v.shape) for k, v in rebuilt.state_dict().items()}
    if ours != theirs:
        differing = sorted(set(ours) ^ set(theirs)) or sorted(
            k for k in ours if ours[k] != theirs[k]
        )
        raise ValueError(
            f"model: not a {spec.kind} model as the builder makes it; differing parameters: "
            f"{differing[:5]}"
        )
    for mine, built in zip(model.modules(), rebuilt.modules(), strict=True):
        if type(mine) is not type(built) or _settings(mine) != _settings(built):
            raise ValueError(
                f"model: a {type(mine).__name__} differs from what its config describes "
                f"({_settings(mine)} vs {_settings(built)})"
            )


def _settings(module: torch.nn.Module) -> tuple:
    """The settings of a module that its parameters' shapes do not show."""
    return tuple(
        getattr(module, name)
        for name in ("eps", "name", "num_heads", "position_scheme", "scale_factor")
        if isinstance(getattr(module, name, None), int | float | str)
    )


def save_hf_llava(
    model: EarlyFusion,
    directory: str | bytes | os.PathLike,
    *,
    max_shard_size: int | None = None,
    overwrite: bool = False,
) -> list[Path]:
    """Write a LLaVA ``model`` as a Hugging Face directory: ``config.json`` and safetensors.

    ``transformers.LlavaForConditionalGeneration.from_pretrained(directory)`` loads it, and
    :func:`load_hf_llava` gives back the same parameters bit for bit. Keys are written in the
    Hub layout (``language_model.model.*``, ``vision_tower.vision_model.*``,
    ``multi_modal_projector.*``). Written crash-safely as
    :func:`~fusion.checkpoint.save_state_dict` describes, ``config.json`` renamed in last.

    Args:
        model: as :func:`load_hf_llava` or :func:`fusion.models.llava` makes it.
        directory: created if needed.
        max_shard_size: bytes per safetensors shard (then with an index); None: one file.
        overwrite: replace a checkpoint already in ``directory``.

    Returns:
        the files written.

    Raises:
        TypeError: ``model`` not an ``EarlyFusion``; ``directory``, ``max_shard_size`` or
            ``overwrite`` of the wrong type.
        ValueError: ``model`` not a LLaVA (see :func:`hf_config_from_llava`), tensors without
            data (meta device), ``max_shard_size`` not positive.
        CheckpointError: ``directory`` already holds a checkpoint or ``config.json`` and
            ``overwrite`` is False; it is a file.
        OSError: the file system failed (a checkpoint being replaced is then left as it was).
    """
    config = hf_config_from_llava(model)
    encoder = cast(LlavaImageEncoder, model.encoders["image"])

    def key(part: str, rest: str) -> str:
        return {
            "text": f"language_model.{rest}",
            "lm_head": "language_model.lm_head.weight",
            "vision": f"vision_tower.vision_model.{rest}",
            "projector": f"multi_modal_projector.{rest}",
        }[part]

    parts = {"vision": encoder.vision_tower, "projector": encoder.multi_modal_projector}
    return _save(model, config, parts, key, directory, max_shard_size, overwrite)


def save_hf_idefics3(
    model: EarlyFusion,
    directory: str | bytes | os.PathLike,
    *,
    max_shard_size: int | None = None,
    overwrite: bool = False,
) -> list[Path]:
    """Write an Idefics3 / SmolVLM ``model`` as a Hugging Face directory (``model_type``
    ``"idefics3"``), in the layout ``Idefics3ForConditionalGeneration`` and
    ``SmolVLMForConditionalGeneration`` load (``model.text_model.*``, ``model.vision_model.*``,
    ``model.connector.*``, ``lm_head.weight``). As :func:`save_hf_llava` otherwise (arguments,
    round trip and errors; see :func:`hf_config_from_idefics3`)."""
    config = hf_config_from_idefics3(model)
    encoder = cast(Idefics3ImageEncoder, model.encoders["image"])

    def key(part: str, rest: str) -> str:
        return {
            "text": rest.replace("model.", "model.text_model.", 1),
            "lm_head": "lm_head.weight",
            "vision": f"model.vision_model.{rest}",
            "projector": f"model.connector.{rest}",
        }[part]

    parts = {"vision": encoder.vision_model, "projector": encoder.connector}
    return _save(model, config, parts, key, directory, max_shard_size, overwrite)


def _save(
    model: EarlyFusion,
    config: dict[str, Any],
    parts: Mapping[str, torch.nn.Module],
    key: Callable[[str, str], str],
    directory: object,
    max_shard_size: int | None,
    overwrite: bool,
) -> list[Path]:
    directory = as_path(directory, "directory")
    check_save_options(max_shard_size, overwrite)
    try:
        text = json.dumps(config, indent=2, allow_nan=False) + "\n"
    except ValueError as error:
        raise ValueError(f"model: its config cannot be written as JSON: {error}") from None
    attn = cast(TransformerSelfAttentionLayer, model.decoder.layers[0]).attn
    state: dict[str, torch.Tensor] = {}
    decoder = fusion_to_hf(
        model.decoder.state_dict(), num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads
    )
    for hf_key, tensor in decoder.items():
        state[key("lm_head" if hf_key == "lm_head.weight" else "text", hf_key)] = tensor
    for part, module in parts.items():
        for name, tensor in module.state_dict().items():
            state[key(part, name)] = tensor
    tensors = prepare_tensors(state, "model", safetensors=True)
    if os.path.lexists(directory / CONFIG_NAME) and not overwrite:
        raise CheckpointError(directory / CONFIG_NAME, None, "exists; pass overwrite=True")
    return write_checkpoint(
        tensors,
        directory,
        max_shard_size=max_shard_size,
        overwrite=overwrite,
        extra_files={CONFIG_NAME: text},
    )
