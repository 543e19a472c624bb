"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL: a Qwen vision tower fused into a Qwen2 or Qwen3 text
decoder with M-RoPE (:func:`fusion.models.qwen2_vl`, :func:`fusion.models.qwen3_vl`), and
Qwen3-VL's DeepStack rows.

``config.json`` is read as transformers 5.24 reads it: the text model's settings under
``text_config`` (what ``save_pretrained`` writes, and Qwen3-VL's published configs) or at the
top level (Qwen2-VL's and Qwen2.5-VL's published configs), rotary settings as
``rope_parameters`` or the legacy ``rope_scaling`` (of type ``mrope``) with ``rope_theta``
beside it, keys left out taking the configs' defaults, and the output tied when the top level
or ``text_config`` says so. Qwen3-VL interleaves its M-RoPE sections whatever
``mrope_interleaved`` says, as transformers does.

Checkpoints: the Hub's Qwen2(.5)-VL names (``model.*``, ``visual.*``) and transformers'
in-memory ones (``model.language_model.*``, ``model.visual.*``) are both read; Qwen2(.5)-VL is
saved in the first (what transformers 5.24 saves too), Qwen3-VL in the second.
"""

from collections.abc import Mapping
from typing import Any, cast

from torch import nn

from fusion.early_fusion import EarlyFusion
from fusion.encoders.qwen_vision import (
    Qwen2VisionTransformer,
    Qwen3VisionTransformer,
    Qwen25VisionTransformer,
)
from fusion.families.base import (
    Family,
    ModelSpec,
    check_image_encoder,
    check_rebuilds,
    read_token_id,
)
from fusion.families.llama.config import hf_config_from_decoder, llama_kwargs
from fusion.families.qwen_vl.builders import TOKENS_PER_SECOND, qwen2_vl, qwen3_vl
from fusion.families.qwen_vl.images import QWEN2_VL_VIDEO_MARKER
from fusion.hf.config import ConfigReader
from fusion.hf.errors import short_repr
from fusion.hf.layout import KeyLayout
from fusion.hooks import MRopePositions

MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")
QWEN3_MODEL_TYPES = ("qwen3_vl",)


# What differs between the families' text configs: transformers' defaults that differ from a
# Llama's, and the text stack's parts.
_TEXT: dict[str, dict[str, Any]] = {
    "qwen2_vl": {
        "defaults": {
            "max_position_embeddings": 32768,
            "rms_norm_eps": 1e-5,
            "num_key_value_heads": 8,
        },
        "theta": 1_000_000.0,
        "section": [16, 24, 24],
        "stack": {"qkv_bias": True},
    },
    "qwen3_vl": {
        "defaults": {
            "max_position_embeddings": 128000,
            "rms_norm_eps": 1e-6,
            "head_dim": 128,
            "attention_bias": False,
        },
        "theta": 500_000.0,
        "section": [24, 20, 20],
        "stack": {"qk_norm": True, "mrope_interleaved": True},
    },
}
_TEXT["qwen2_5_vl"] = _TEXT["qwen2_vl"]

VISION_DEFAULTS: Mapping[str, Mapping[str, Any]] = {
    "qwen2_vl": {
        "depth": 32,
        "embed_dim": 1280,
        "hidden_size": 3584,
        "hidden_act": "quick_gelu",
        "mlp_ratio": 4,
        "num_heads": 16,
        "in_channels": 3,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    },
    "qwen2_5_vl": {
        "depth": 32,
        "hidden_size": 3584,
        "hidden_act": "silu",
        "intermediate_size": 3420,
        "num_heads": 16,
        "in_channels": 3,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "window_size": 112,
        "out_hidden_size": 3584,
        "fullatt_block_indexes": [7, 15, 23, 31],
    },
    "qwen3_vl": {
        "depth": 27,
        "hidden_size": 1152,
        "hidden_act": "gelu_pytorch_tanh",
        "intermediate_size": 4304,
        "num_heads": 16,
        "in_channels": 3,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "out_hidden_size": 3584,
        "num_position_embeddings": 2304,
        "deepstack_visual_indexes": [8, 16, 24],
    },
}
_VISION_ACTIVATIONS = ("quick_gelu", "gelu", "silu", "gelu_pytorch_tanh")
# Keys of each tower that are not sizes.
_VISION_OTHER = ("hidden_act", "fullatt_block_indexes", "deepstack_visual_indexes")


def qwen_text_kwargs(config: ConfigReader, model_type: str) -> tuple[dict[str, Any], str]:
    """The :func:`fusion.models.llama3_2` arguments of the text model, and where its keys are
    (``"text_config."`` or ``""``) for errors."""
    family = _TEXT[model_type]
    nested = "text_config" in config.values
    text = config.section("text_config", "Qwen-VL") if nested else config
    values = {**family["defaults"], **text.values, "model_type": "llama"}
    if values.get("use_sliding_window"):
        raise text.fail("use_sliding_window", "expected false (sliding-window layers unsupported)")
    rope_key = "rope_parameters" if values.get("rope_parameters") else "rope_scaling"
    rope = dict(
        text.get(rope_key, {}, lambda v: v is None or isinstance(v, Mapping), "an object or null")
        or {}
    )
    rope_type = rope.pop("rope_type", rope.pop("type", "default"))
    if rope_type not in ("default", "mrope"):
        raise text.fail(
            rope_key, f"rope type {short_repr(rope_type)} unsupported: expected mrope or default"
        )
    section = rope.pop("mrope_section", family["section"])
    rope.pop("mrope_interleaved", None)  # Qwen3-VL interleaves, Qwen2(.5)-VL never
    if "rope_theta" not in values and "rope_theta" not in rope:
        rope["rope_theta"] = family["theta"]
    kwargs = llama_kwargs(
        ConfigReader(values | {rope_key: rope}, text.source, text.prefix),
        own_head_dim=model_type in QWEN3_MODEL_TYPES,
    )
    if not isinstance(section, list):  # its values: checked by the rotary embedding
        half = kwargs.get("head_dim", kwargs["embed_dim"] // kwargs["num_heads"]) // 2
        raise text.fail(
            f"{rope_key}.mrope_section",
            f"expected three non-negative integers summing to head_dim / 2 = {half}, got "
            f"{short_repr(section)}",
        )
    tied = config.flag("tie_word_embeddings") or (nested and text.flag("tie_word_embeddings"))
    kwargs |= {"mrope_section": section, "tie_word_embeddings": tied, **family["stack"]}
    return kwargs, text.prefix


def qwen_vision_kwargs(config: ConfigReader, model_type: str) -> dict[str, Any]:
    """The tower's arguments, every size an integer in [1, 2**31) (bounded here, before
    anything is built; how they fit together is the tower's to check)."""
    vision = config.section("vision_config", "Qwen-VL", VISION_DEFAULTS[model_type])
    kwargs: dict[str, Any] = {
        key: vision.integer(key) for key in VISION_DEFAULTS[model_type] if key not in _VISION_OTHER
    }
    kwargs["hidden_act"] = vision.choice("hidden_act", None, _VISION_ACTIVATIONS)
    rope = vision.get(
        "rope_parameters", None, lambda v: v is None or isinstance(v, Mapping), "an object or null"
    )
    rope_reader = ConfigReader(rope or {}, vision.source, f"{vision.prefix}rope_parameters.")
    kwargs["rope_theta"] = rope_reader.number("rope_theta", 10_000.0, 1.0)
    for key in ("fullatt_block_indexes", "deepstack_visual_indexes"):  # checked by the tower
        if key in VISION_DEFAULTS[model_type]:
            kwargs[key] = vision.get(key, None, lambda v: isinstance(v, list), "a list")
    return kwargs


def read_tokens_per_second(config: ConfigReader) -> float:
    """Qwen2.5-VL's ``vision_config.tokens_per_second`` (transformers' default where absent),
    as written (an integer stays one)."""
    vision = config.section("vision_config", "Qwen-VL", {"tokens_per_second": TOKENS_PER_SECOND})
    value = vision.get(
        "tokens_per_second",
        None,
        lambda v: isinstance(v, int | float) and not isinstance(v, bool) and 0 < v < 2**31,
        "a positive number",
    )
    return cast(float, value)


def add_video_settings(config: dict[str, Any], model: EarlyFusion, model_type: str) -> None:
    """Write into ``config`` (``config.json``'s) what it says of a Qwen-VL model's videos:
    the ``<|video_pad|>`` id (nothing without a video entry) and, for Qwen2.5-VL,
    ``vision_config.tokens_per_second`` (the M-RoPE hook's)."""
    if "video" not in model.shared_encoders:
        return
    config["video_token_id"] = model.encoder_tokens["video"]
    if model_type == "qwen2_5_vl":
        hook = next(h for h in model.hooks if isinstance(h, MRopePositions))
        video = next(i for i in hook.inputs if i.encoder == "video")
        config["vision_config"]["tokens_per_second"] = video.tokens_per_second


ARCHITECTURES = {
    "qwen2_vl": "Qwen2VLForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "qwen3_vl": "Qwen3VLForConditionalGeneration",
}


def hf_config_from_qwen(
    llama: Mapping[str, Any], rope: Any, tower: Any, image_token_id: int, model_type: str
) -> dict[str, Any]:
    """The ``config.json`` transformers 5.24's ``save_pretrained`` writes (nested
    ``text_config``, ``rope_parameters``), from the decoder's config ``llama`` (as
    :func:`~fusion.families.llama.config.hf_config_from_decoder` writes it with ``qwen=True``),
    its rotary embeddings ``rope`` and the vision ``tower``'s settings."""
    text_keys = (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "hidden_act",
        "max_position_embeddings",
        "rms_norm_eps",
        "attention_dropout",
        "tie_word_embeddings",
    )
    rope_parameters = {
        "rope_type": "default",
        "rope_theta": llama["rope_theta"],
        "mrope_section": list(rope.mrope_section),
    }
    text_config = {key: llama[key] for key in text_keys} | {
        "model_type": f"{model_type}_text",
        "rope_parameters": rope_parameters,
    }
    if model_type in QWEN3_MODEL_TYPES:
        rope_parameters["mrope_interleaved"] = True
        text_config |= {"head_dim": llama["head_dim"], "attention_bias": False}
    else:
        text_config["use_sliding_window"] = False
    vision = {key: getattr(tower, key) for key in VISION_DEFAULTS[model_type]}
    for key in ("fullatt_block_indexes", "deepstack_visual_indexes"):
        if key in vision:
            vision[key] = list(vision[key])
    vision["rope_parameters"] = {"rope_type": "axial", "rope_theta": tower.rope_theta}
    return {
        "architectures": [ARCHITECTURES[model_type]],
        "model_type": model_type,
        "image_token_id": image_token_id,
        "tie_word_embeddings": llama["tie_word_embeddings"],
        "text_config": text_config,
        "vision_config": {"model_type": f"{model_type}_vision", **vision},
        "torch_dtype": llama["torch_dtype"],
    }


# Both layouts Qwen-VL checkpoints come in: the Hub's Qwen2(.5)-VL names and transformers'
# in-memory ones.
_READ = (
    (r"lm_head\.", "decoder.lm_head."),
    (r"model\.language_model\.", "decoder.model."),
    (r"(?:model\.)?visual\.", "encoders.image."),
    (r"model\.", "decoder.model."),
)
_TOWER_MODEL_TYPES: dict[type[nn.Module], str] = {
    Qwen2VisionTransformer: "qwen2_vl",
    Qwen25VisionTransformer: "qwen2_5_vl",
    Qwen3VisionTransformer: "qwen3_vl",
}


# What a Qwen directory that leaves them out has (transformers' Qwen2VLConfig,
# Qwen2_5_VLConfig and Qwen3VLConfig, and their vision configs' patch sizes), and the image
# processor settings it gets without a preprocessor_config.json: transformers'
# Qwen2VLImageProcessor defaults for Qwen2(.5)-VL, the published ones for Qwen3-VL (size 65536
# to 16777216 pixels, mean and std 0.5).
QWEN_IDS = {
    "image_token_id": 151_655,
    "video_token_id": 151_656,
    "vision_start_token_id": 151_652,
    "vision_end_token_id": 151_653,
}
QWEN3_VL_SETTINGS: dict[str, Any] = {
    "min_pixels": 256 * 256,
    "max_pixels": 4096 * 4096,
    "image_mean": (0.5, 0.5, 0.5),
    "image_std": (0.5, 0.5, 0.5),
}
_QWEN2_PROCESSOR = {
    **QWEN_IDS,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "settings": {},
    "settings_name": "transformers' Qwen2-VL defaults",
    # transformers' video processor of the model type (AutoVideoProcessor's mapping)
    "video_processor": "Qwen2VLVideoProcessor",
}
_QWEN3_PROCESSOR = _QWEN2_PROCESSOR | {
    "patch_size": 16,
    "settings": QWEN3_VL_SETTINGS,
    "settings_name": "Qwen3-VL's published settings",
    "video_processor": "Qwen3VLVideoProcessor",
}


class QwenVLFamily(Family):
    """What Qwen2-VL and Qwen2.5-VL (one family: the same text stack, two towers) and
    Qwen3-VL share; the two instances differ in their model types, towers and saved layout."""

    vision_layers = (r"encoders\.image\.blocks\.(\d{1,9})\.", "depth")
    peft_encoder = (("encoders.image.", "model.visual."),)
    processor = "qwen2_vl"  # transformers gives all three Qwen2VLImageProcessor
    video_marker = QWEN2_VL_VIDEO_MARKER

    def read(self, config: ConfigReader) -> ModelSpec:
        model_type = config.values["model_type"]
        text, prefix = qwen_text_kwargs(config, model_type)
        vision = qwen_vision_kwargs(config, model_type)
        token_id = read_token_id(config, ("image_token_id",), QWEN_IDS["image_token_id"])
        video_id = read_token_id(config, ("video_token_id",), QWEN_IDS["video_token_id"])
        options: dict[str, Any] = {"video_token_id": video_id}
        if self is QWEN2_VL:
            options["model_type"] = model_type
        if model_type == "qwen2_5_vl":
            options["tokens_per_second"] = read_tokens_per_second(config)
        return ModelSpec(self, model_type, text, vision, token_id, options, prefix)

    def build(self, spec: ModelSpec) -> nn.Module:
        builder = qwen2_vl if self is QWEN2_VL else qwen3_vl
        return builder(
            text=spec.text,
            vision=spec.vision,
            image_token_id=cast(int, spec.image_token_id),
            **spec.options,
        )

    def model_type_of(self, model: nn.Module) -> str:
        return _TOWER_MODEL_TYPES[type(cast(EarlyFusion, model).encoders["image"])]

    def hf_config(self, model: nn.Module) -> dict[str, Any]:
        encoder, image_id = check_image_encoder(model, self)
        decoder = cast(EarlyFusion, model).decoder
        text = hf_config_from_decoder(decoder, qwen=True)
        del text["architectures"]
        rope = decoder.attentions()[0].pos_embeddings
        model_type = _TOWER_MODEL_TYPES[type(encoder)]
        config = hf_config_from_qwen(text, rope, encoder, image_id, model_type)
        add_video_settings(config, cast(EarlyFusion, model), model_type)
        check_rebuilds(model, config, self)
        return config


class Qwen2VLFamily(QwenVLFamily):
    name = "qwen2_vl"
    what = "Qwen2-VL"
    architectures = {
        "qwen2_vl": ARCHITECTURES["qwen2_vl"],
        "qwen2_5_vl": ARCHITECTURES["qwen2_5_vl"],
    }
    # The Hub's layout (also what transformers 5.24 saves) and the in-memory one.
    layout = KeyLayout(
        decoder="decoder.", read=_READ, write=(("decoder.", ""), ("encoders.image.", "visual."))
    )
    encoder_types = (Qwen2VisionTransformer, Qwen25VisionTransformer)
    processor_defaults = {"qwen2_vl": _QWEN2_PROCESSOR, "qwen2_5_vl": _QWEN2_PROCESSOR}


class Qwen3VLFamily(QwenVLFamily):
    name = "qwen3_vl"
    what = "Qwen3-VL"
    architectures = {"qwen3_vl": ARCHITECTURES["qwen3_vl"]}
    # transformers 5.24 and the Hub: the in-memory names (the Hub's layout is read too).
    layout = KeyLayout(
        decoder="decoder.",
        read=_READ,
        write=(
            ("decoder.model.", "model.language_model."),
            ("decoder.", ""),
            ("encoders.image.", "model.visual."),
        ),
    )
    encoder_types = (Qwen3VisionTransformer,)
    processor_defaults = {"qwen3_vl": _QWEN3_PROCESSOR}


QWEN2_VL = Qwen2VLFamily()
QWEN3_VL = Qwen3VLFamily()
