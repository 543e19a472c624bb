"""Hugging Face LLaVA and Idefics3 / SmolVLM directories <-> ready ``EarlyFusion`` models.

A loaded model is ``EarlyFusion(decoder, {"image": encoder}, {"image": image_token_id})``: the
decoder is this library's ``llama3_2`` built from ``text_config`` (its weights relabelled as
:mod:`fusion.checkpoint.keys` describes), the encoder is
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

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from fusion.checkpoint.errors import CheckpointError, as_path, short_repr
from fusion.checkpoint.hf_config import (
    CONFIG_NAME,
    ConfigReader,
    hf_config_from_decoder,
    llama_kwargs,
    read_hf_config,
)
from fusion.checkpoint.hf_llama import HfSpec, KeyLayout, load_hf, load_hf_llama, save_hf
from fusion.checkpoint.hf_qwen_vl import (
    MODEL_TYPES as QWEN2_VL_MODEL_TYPES,
)
from fusion.checkpoint.hf_qwen_vl import (
    QWEN3_MODEL_TYPES,
    hf_config_from_qwen,
    qwen_text_kwargs,
    qwen_vision_kwargs,
)
from fusion.decoder import TransformerDecoder
from fusion.early_fusion import EarlyFusion
from fusion.encoders.clip import ClipVisionTransformer
from fusion.encoders.qwen_vision import (
    Qwen2VisionTransformer,
    Qwen3VisionTransformer,
    Qwen25VisionTransformer,
)
from fusion.encoders.siglip import SiglipVisionTransformer
from fusion.encoders.vit_blocks import ACTIVATIONS, VisionEncoderLayer
from fusion.models.idefics3 import Idefics3ImageEncoder, idefics3
from fusion.models.llava import FEATURE_STRATEGIES, LlavaImageEncoder, llava
from fusion.models.qwen2_vl import VISION_TOWERS, qwen2_vl
from fusion.models.qwen3_vl import qwen3_vl

LLAVA_MODEL_TYPES = ("llava",)
# Bounds on what a config.json may ask preprocessing for (published towers: 224 to 512 pixels,
# at most a few thousand patches).
MAX_VISION_IMAGE_SIZE = 4096
MAX_VISION_PATCHES = 1 << 16
IDEFICS3_MODEL_TYPES = ("idefics3", "smolvlm")

# transformers' defaults for keys a sub-config leaves out (configs written by transformers 4.x
# omit those equal to the defaults, e.g. llava-1.5's text_config has no hidden_size).
_LLAMA_DEFAULTS = {
    "vocab_size": 32_000,
    "hidden_size": 4096,
    "intermediate_size": 11_008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
}
_VISION_DEFAULTS = {
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_channels": 3,
    "image_size": 224,
    "patch_size": 32,
}
_VISION_INTS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_channels",
    "image_size",
    "patch_size",
)


@dataclass(frozen=True)
class _Kind:
    """What differs between the vision-language models read here."""

    what: str  # named in errors
    architecture: str  # the transformers class, for the savers' config.json
    model_types: tuple[str, ...]
    vision_types: tuple[str, ...]  # vision_config.model_type
    vision_defaults: Mapping[str, Any]
    layout: KeyLayout
    encoder: type[nn.Module] | tuple[type[nn.Module], ...]
    builder: Callable[..., EarlyFusion]
    # our keys of a vision layer, its index in group 1; the vision config's layer count key
    vision_layers: tuple[str, str] = (
        r"encoders\.image\.\w+\.encoder\.layers\.(\d{1,9})\.",
        "num_hidden_layers",
    )


# Both layouts Qwen-VL checkpoints come in: the Hub's Qwen2(.5)-VL names (``model.*``,
# ``visual.*``) and transformers' in-memory ones (``model.language_model.*``, ``model.visual.*``).
_QWEN_READ = (
    (r"lm_head\.", "decoder.lm_head."),
    (r"model\.language_model\.", "decoder.model."),
    (r"(?:model\.)?visual\.", "encoders.image."),
    (r"model\.", "decoder.model."),
)
_KINDS = {
    "llava": _Kind(
        "LLaVA",
        "LlavaForConditionalGeneration",
        LLAVA_MODEL_TYPES,
        ("clip_vision_model",),
        _VISION_DEFAULTS
        | {"hidden_size": 768, "num_attention_heads": 12, "hidden_act": "quick_gelu"}
        | {"layer_norm_eps": 1e-5},
        KeyLayout(
            decoder="decoder.",
            read=(
                (r"(?:language_model\.)?lm_head\.", "decoder.lm_head."),
                (r"language_model\.model\.|model\.language_model\.", "decoder.model."),
                (r"(?:model\.)?vision_tower\.(?:vision_model\.)?", "encoders.image.vision_tower."),
                (r"(?:model\.)?multi_modal_projector\.", "encoders.image.multi_modal_projector."),
            ),
            write=(
                ("decoder.", "language_model."),
                ("encoders.image.vision_tower.", "vision_tower.vision_model."),
                ("encoders.image.", ""),
            ),
        ),
        LlavaImageEncoder,
        llava,
    ),
    "idefics3": _Kind(
        "Idefics3",
        "Idefics3ForConditionalGeneration",
        IDEFICS3_MODEL_TYPES,
        ("idefics3_vision", "smolvlm_vision"),
        _VISION_DEFAULTS
        | {"hidden_size": 1152, "num_attention_heads": 16, "hidden_act": "gelu_pytorch_tanh"}
        | {"layer_norm_eps": 1e-6},
        KeyLayout(
            decoder="decoder.",
            read=(
                (r"lm_head\.", "decoder.lm_head."),
                (r"(?:model\.)?text_model\.", "decoder.model."),
                (r"(?:model\.)?(?=vision_model\.|connector\.)", "encoders.image."),
            ),
            write=(
                ("decoder.model.", "model.text_model."),
                ("decoder.", ""),
                ("encoders.image.", "model."),
            ),
        ),
        Idefics3ImageEncoder,
        idefics3,
    ),
    "qwen2_vl": _Kind(
        "Qwen2-VL",
        "Qwen2_5_VLForConditionalGeneration",
        QWEN2_VL_MODEL_TYPES,
        (),
        {},
        # The Hub's layout (also what transformers 5.24 saves) and the in-memory one.
        KeyLayout(
            decoder="decoder.",
            read=_QWEN_READ,
            write=(("decoder.", ""), ("encoders.image.", "visual.")),
        ),
        (Qwen2VisionTransformer, Qwen25VisionTransformer),
        qwen2_vl,
        (r"encoders\.image\.blocks\.(\d{1,9})\.", "depth"),
    ),
    "qwen3_vl": _Kind(
        "Qwen3-VL",
        "Qwen3VLForConditionalGeneration",
        QWEN3_MODEL_TYPES,
        (),
        {},
        # transformers 5.24 and the Hub: the in-memory names (the Hub's layout is read too).
        KeyLayout(
            decoder="decoder.",
            read=_QWEN_READ,
            write=(
                ("decoder.model.", "model.language_model."),
                ("decoder.", ""),
                ("encoders.image.", "model.visual."),
            ),
        ),
        Qwen3VisionTransformer,
        qwen3_vl,
        (r"encoders\.image\.blocks\.(\d{1,9})\.", "depth"),
    ),
}
QWEN_KINDS = ("qwen2_vl", "qwen3_vl")
_TOWER_MODEL_TYPES: dict[type, str] = {tower: name for name, tower in VISION_TOWERS.items()} | {
    Qwen3VisionTransformer: "qwen3_vl"
}


@dataclass
class _Vlm:
    """What a config describes, in this library's terms."""

    kind: str  # a key of _KINDS
    text: dict[str, Any]  # llama3_2 keyword arguments
    vision: dict[str, Any]  # vision tower keyword arguments
    image_token_id: int
    options: dict[str, Any]  # builder keyword arguments
    text_prefix: str = "text_config."  # where config.json keeps the text settings

    def build(self) -> EarlyFusion:
        builder = _KINDS[self.kind].builder
        return builder(
            text=self.text, vision=self.vision, image_token_id=self.image_token_id, **self.options
        )

    def hf_spec(self, config_file: Path) -> HfSpec:
        info = _KINDS[self.kind]
        pattern, depth = info.vision_layers
        layers = {
            f"{self.text_prefix}num_hidden_layers": (
                r"decoder\.layers\.(\d{1,9})\.",
                self.text["num_layers"],
            ),
            f"vision_config.{depth}": (pattern, self.vision[depth]),
        }
        return HfSpec(
            self.kind, config_file, self.text, self.build, info.layout, self.text_prefix, layers
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
    return _kind(read_hf_config(file), file, ("llama", *_KINDS))


def _kind(config: Mapping[str, Any], file: Path, kinds: tuple[str, ...]) -> str:
    """The one of ``kinds`` whose model types hold the config's ``model_type``."""
    model_type = config.get("model_type")
    types = {"llama": ("llama",)} | {kind: info.model_types for kind, info in _KINDS.items()}
    for kind in kinds:
        if ("llama" if model_type is None else model_type) in types[kind]:
            return kind
    expected = [t for kind in kinds for t in types[kind]]
    hint = " (a plain Llama: use load_hf_llama)" if model_type in (None, "llama") else ""
    raise CheckpointError(
        file, "model_type", f"expected one of {expected}, got {short_repr(model_type)}{hint}"
    )


def _read_spec(file: Path, kinds: tuple[str, ...]) -> _Vlm:
    config = read_hf_config(file)
    return _spec(ConfigReader(config, file), _kind(config, file, kinds))


def _spec(config: ConfigReader, kind: str) -> _Vlm:
    """The model ``config`` describes, every value checked."""
    info = _KINDS[kind]
    if kind in QWEN_KINDS:
        model_type = config.values["model_type"]
        qwen_text, prefix = qwen_text_kwargs(config, model_type)
        qwen_vision = qwen_vision_kwargs(config, model_type)
        token_id = _token_id(config, ("image_token_id",), 151_655)
        options = {"model_type": model_type} if kind == "qwen2_vl" else {}
        return _Vlm(kind, qwen_text, qwen_vision, token_id, options, prefix)
    text = llama_kwargs(config.section("text_config", info.what, _LLAMA_DEFAULTS))
    vision_config = config.section("vision_config", info.what, info.vision_defaults)
    vision_config.choice("model_type", info.vision_types[0], info.vision_types)
    vision: dict[str, Any] = {key: vision_config.integer(key, low=0) for key in _VISION_INTS}
    vision["layer_norm_eps"] = vision_config.number("layer_norm_eps", None, 0.0, high=1.0)
    vision["hidden_act"] = vision_config.choice("hidden_act", None, ACTIVATIONS)
    if kind == "idefics3":
        text["tie_word_embeddings"] = config.flag("tie_word_embeddings")  # as transformers 5.x
        token_id = _token_id(config, ("image_token_id",), 128_257)
        return _Vlm(
            kind, text, vision, token_id, {"scale_factor": config.integer("scale_factor", 2)}
        )
    # transformers ties LLaVA when either the top level or text_config asks for it.
    text["tie_word_embeddings"] |= config.flag("tie_word_embeddings")
    options = {
        "vision_feature_layer": config.get(
            "vision_feature_layer",
            -2,
            lambda v: _is_layer(v) or (isinstance(v, list) and bool(v) and all(map(_is_layer, v))),
            "an int or a list of ints",
        ),
        "vision_feature_select_strategy": config.choice(
            "vision_feature_select_strategy", "default", FEATURE_STRATEGIES
        ),
        "projector_hidden_act": config.choice("projector_hidden_act", "gelu", ACTIVATIONS),
        "projector_bias": config.flag("multimodal_projector_bias", True),
    }
    token_id = _token_id(config, ("image_token_index", "image_token_id"), 32_000)
    return _Vlm(kind, text, vision, token_id, options)


def _is_layer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _token_id(config: ConfigReader, keys: tuple[str, ...], default: int) -> int:
    values = {key: config.values[key] for key in keys if config.values.get(key) is not None}
    if len(set(map(repr, values.values()))) > 1:
        raise config.fail(keys[0], f"disagreeing values {values}")
    key, value = next(iter(values.items()), (keys[0], default))
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**63:
        raise config.fail(key, f"expected an id, got {short_repr(value)}")
    return value


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
        CheckpointError: as :func:`load_hf_vlm` for ``config.json``; and naming the key, a
            ``vision_config.image_size`` above :data:`MAX_VISION_IMAGE_SIZE` or not a multiple
            of ``patch_size``, more than :data:`MAX_VISION_PATCHES` patches, a
            ``scale_factor`` that does not divide the patch grid.
    """
    config_file = as_path(path, "path") / CONFIG_NAME
    spec = _read_spec(config_file, tuple(_KINDS))
    # Arithmetic only: nothing is built, so no config can make this slow; every size bounded
    # before preprocessing allocates images, tiles or rows from it.
    size, patch = spec.vision["image_size"], spec.vision["patch_size"]
    if not 0 < size <= MAX_VISION_IMAGE_SIZE:
        raise CheckpointError(
            config_file,
            "vision_config.image_size",
            f"expected a positive integer <= {MAX_VISION_IMAGE_SIZE}, got {size}",
        )
    if patch == 0 or size % patch:
        raise CheckpointError(
            config_file,
            "vision_config.image_size",
            f"expected a positive multiple of patch_size={patch}, got {size}",
        )
    side = size // patch
    if side * side > MAX_VISION_PATCHES:
        raise CheckpointError(
            config_file,
            "vision_config.patch_size",
            f"{patch} cuts {size} x {size} images into {side * side} patches, more than "
            f"{MAX_VISION_PATCHES}",
        )
    if spec.kind == "llava":
        full = spec.options["vision_feature_select_strategy"] == "full"
        return VlmImageLayout(spec.kind, spec.image_token_id, side * side + int(full), size)
    scale = spec.options["scale_factor"]
    if side % scale:
        raise CheckpointError(
            config_file,
            "scale_factor",
            f"expected a divisor of the patch grid's side {side}, got {scale}",
        )
    return VlmImageLayout(spec.kind, spec.image_token_id, (side // scale) ** 2, size)


# ---------------------------------------------------------------------- loading


def load_hf_llava(
    path: str | bytes | os.PathLike,
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    max_seq_len: int | None = None,
) -> EarlyFusion:
    """Build the LLaVA model a Hugging Face ``LlavaForConditionalGeneration`` directory
    describes, with its weights, as :func:`~fusion.checkpoint.load_hf_llama` builds a decoder:
    the same arguments (``max_seq_len`` overrides ``text_config.max_position_embeddings``), and
    everything checked from ``config.json`` and the weights' headers before the model is
    allocated, once. Keys ``text_config`` and ``vision_config`` leave out take
    ``transformers``' defaults, as configs written by transformers 4.x omit them.

    Returns:
        ``EarlyFusion(decoder, {"image": LlavaImageEncoder}, {"image": image_token_index})``,
        in training mode as freshly built modules are (call ``.eval()`` for inference).

    Raises:
        TypeError, ValueError, CheckpointError: as :func:`~fusion.checkpoint.load_hf_llama`;
            and a ``CheckpointError`` naming the file and key for another ``model_type`` (e.g.
            a plain Llama, or Idefics3), a missing or malformed ``text_config`` or
            ``vision_config``, a vision tower other than CLIP, values no model can be built
            from (e.g. ``vision_feature_layer`` out of range), or two key layouts mixed.
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
    return _load(path, tuple(_KINDS), dtype, device, max_seq_len)


def load_hf_model(
    path: str | bytes | os.PathLike,
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    max_seq_len: int | None = None,
) -> EarlyFusion | TransformerDecoder:
    """:func:`load_hf_vlm`, or :func:`~fusion.checkpoint.load_hf_llama` for a text-only Llama,
    whichever ``config.json`` describes (:func:`hf_model_kind`; same arguments and errors)."""
    load = load_hf_llama if hf_model_kind(path) == "llama" else load_hf_vlm
    return load(path, dtype=dtype, device=device, max_seq_len=max_seq_len)


def _load(
    path: str | bytes | os.PathLike,
    kinds: tuple[str, ...],
    dtype: torch.dtype | None,
    device: str | torch.device,
    max_seq_len: int | None,
) -> EarlyFusion:
    def read_spec(config_file: Path) -> HfSpec:
        return _read_spec(config_file, kinds).hf_spec(config_file)

    model = load_hf(path, read_spec, dtype=dtype, device=device, max_seq_len=max_seq_len)
    return cast(EarlyFusion, model)


# ---------------------------------------------------------------------- saving


def hf_config_from_llava(model: EarlyFusion) -> dict[str, Any]:
    """The Hugging Face ``LlavaForConditionalGeneration`` config describing ``model``.

    Raises:
        TypeError: ``model`` is not an ``EarlyFusion``.
        ValueError: ``model`` is not a LLaVA as :func:`fusion.models.llava` builds it (named:
            other encoders, a modified tower or decoder, an image id outside the vocabulary).
    """
    return _hf_config(model, "llava")


def hf_config_from_idefics3(model: EarlyFusion) -> dict[str, Any]:
    """The Hugging Face ``Idefics3ForConditionalGeneration`` config describing ``model``; as
    :func:`hf_config_from_llava` for a model :func:`fusion.models.idefics3` builds."""
    return _hf_config(model, "idefics3")


def _hf_config(model: object, kind: str) -> dict[str, Any]:
    info = _KINDS[kind]
    if not isinstance(model, EarlyFusion):
        raise TypeError(f"model: expected an EarlyFusion, got {type(model).__name__}")
    encoder = model.encoders["image"] if set(model.encoders) == {"image"} else None
    if not isinstance(encoder, info.encoder):
        got = {k: type(v).__name__ for k, v in model.encoders.items()}
        classes = info.encoder if isinstance(info.encoder, tuple) else (info.encoder,)
        expected = " or ".join(c.__name__ for c in classes)
        raise ValueError(f"model: expected one encoder, 'image', a {expected}; got {got}")
    image_id, vocab = model.encoder_tokens["image"], model.decoder.vocab_size
    if not 0 <= image_id < vocab:
        raise ValueError(
            f"model: the image placeholder id {image_id} lies outside the vocabulary [0, "
            f"{vocab}); Hugging Face models embed it, so it must lie inside"
        )
    text = hf_config_from_decoder(model.decoder, qwen=kind in QWEN_KINDS)
    del text["architectures"]
    if kind in QWEN_KINDS:
        rope = model.decoder.attentions()[0].pos_embeddings
        model_type = _TOWER_MODEL_TYPES[type(encoder)]
        config = hf_config_from_qwen(text, rope, encoder, image_id, model_type)
        _check_rebuilds(model, _spec(ConfigReader(config, Path(CONFIG_NAME)), kind))
        return config
    if isinstance(encoder, LlavaImageEncoder):
        tower: ClipVisionTransformer | SiglipVisionTransformer = encoder.vision_tower
        projector = encoder.multi_modal_projector
        options = {
            "image_token_index": image_id,
            "image_seq_length": encoder.tokens_per_image,
            "projector_hidden_act": projector.act.name,
            "multimodal_projector_bias": projector.linear_1.bias is not None,
            "vision_feature_layer": encoder.vision_feature_layer,
            "vision_feature_select_strategy": encoder.vision_feature_select_strategy,
        }
    else:
        encoder = cast(Idefics3ImageEncoder, encoder)
        tower = encoder.vision_model
        if tower.embeddings.position_scheme != "bucketed":
            raise ValueError(
                "model: Idefics3 assigns bucketed positions; its vision tower has "
                f"position_scheme={tower.embeddings.position_scheme!r}"
            )
        options = {"image_token_id": image_id, "scale_factor": encoder.connector.scale_factor}
    config = {
        "architectures": [info.architecture],
        "model_type": kind,
        **options,
        "tie_word_embeddings": text["tie_word_embeddings"],
        "text_config": text,
        "vision_config": {"model_type": info.vision_types[0], **_tower_config(tower)},
        "torch_dtype": text["torch_dtype"],
    }
    _check_rebuilds(model, _spec(ConfigReader(config, Path(CONFIG_NAME)), kind))
    return config


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


def _check_rebuilds(model: EarlyFusion, spec: _Vlm) -> None:
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
    mine, built = list(model.modules()), list(rebuilt.modules())
    if len(mine) != len(built):
        raise ValueError(
            f"model: not a {spec.kind} model as the builder makes it: {len(mine)} modules, "
            f"expected {len(built)}"
        )
    for a, b in zip(mine, built, strict=True):
        if type(a) is not type(b) or _settings(a) != _settings(b):
            raise ValueError(
                f"model: a {type(a).__name__} differs from what its config describes "
                f"({_settings(a)} vs {_settings(b)})"
            )


def _settings(module: nn.Module) -> tuple:
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
    return _save(model, "llava", directory, max_shard_size, overwrite)


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
    return _save(model, "idefics3", directory, max_shard_size, overwrite)


def save_hf_qwen2_vl(
    model: EarlyFusion,
    directory: str | bytes | os.PathLike,
    *,
    max_shard_size: int | None = None,
    overwrite: bool = False,
) -> list[Path]:
    """Write a Qwen2-VL or Qwen2.5-VL ``model`` as a Hugging Face directory, in the layout the
    Hub's checkpoints and transformers 5.24's ``save_pretrained`` write (``model.*``,
    ``visual.*``, ``lm_head.weight``) with a nested ``text_config``; loaded by
    ``Qwen2VLForConditionalGeneration`` / ``Qwen2_5_VLForConditionalGeneration``. As
    :func:`save_hf_llava` otherwise (arguments, round trip and errors)."""
    return _save(model, "qwen2_vl", directory, max_shard_size, overwrite)


def save_hf_qwen3_vl(
    model: EarlyFusion,
    directory: str | bytes | os.PathLike,
    *,
    max_shard_size: int | None = None,
    overwrite: bool = False,
) -> list[Path]:
    """Write a Qwen3-VL ``model`` as a Hugging Face directory, in the layout transformers 5.24
    and the Hub use (``model.language_model.*``, ``model.visual.*``, ``lm_head.weight``);
    loaded by ``Qwen3VLForConditionalGeneration``. As :func:`save_hf_llava` otherwise."""
    return _save(model, "qwen3_vl", directory, max_shard_size, overwrite)


def _save(
    model: EarlyFusion,
    kind: str,
    directory: str | bytes | os.PathLike,
    max_shard_size: int | None,
    overwrite: bool,
) -> list[Path]:
    config = _hf_config(model, kind)
    return save_hf(
        model.state_dict(),
        config,
        _KINDS[kind].layout,
        directory,
        max_shard_size=max_shard_size,
        overwrite=overwrite,
        argument="model",
    )
