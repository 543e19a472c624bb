"""Qwen3.5 (dense): Qwen3-VL's vision tower without DeepStack, fused into a hybrid text stack
of Gated DeltaNet and gated full-attention layers with interleaved M-RoPE
(:func:`fusion.models.qwen3_5`).

``config.json`` is read as transformers 5.24 writes and reads it: the text settings under
``text_config`` (``qwen3_5_text``), rotary settings in ``rope_parameters`` (or the legacy
``rope_scaling`` with ``rope_theta`` beside it), ``layer_types`` or else a full-attention layer
every ``full_attention_interval`` (4) layers. The mixture-of-experts variants
(``qwen3_5_moe``) are another model type, refused; expert settings in a dense config are
refused too, rather than ignored.

Checkpoints: transformers' in-memory names (``model.language_model.*``, ``model.visual.*``),
what the Hub's Qwen3.5 repositories hold and what transformers saves; the multi-token
prediction head (``mtp.*``) is not part of the model and is skipped on load with a warning.
The full-attention rows load as they are stored (the decoder rotates in Hugging Face's
rotate-half layout).
"""

from collections.abc import Mapping
from typing import Any, cast

from torch import nn

from fusion.decoder import (
    GatedDeltaNet,
    TransformerDecoder,
    TransformerSelfAttentionLayer,
)
from fusion.early_fusion import EarlyFusion
from fusion.encoders.qwen_vision import Qwen35VisionTransformer
from fusion.families.base import (
    Family,
    ModelSpec,
    check_image_encoder,
    check_rebuilds,
    read_token_id,
)
from fusion.families.llama.config import DECODER_SIZES, read_sizes
from fusion.families.qwen3_5.builders import LAYER_TYPES, default_layer_types, qwen3_5, qwen3_5_text
from fusion.families.qwen_vl.family import (
    QWEN3_VL_SETTINGS,
    VISION_DEFAULTS,
    add_video_settings,
    qwen_vision_kwargs,
)
from fusion.families.qwen_vl.images import QWEN2_VL_VIDEO_MARKER
from fusion.hf.config import ConfigReader
from fusion.hf.errors import short_repr
from fusion.hf.layout import KeyLayout

MODEL_TYPE = "qwen3_5"
ARCHITECTURE = "Qwen3_5ForConditionalGeneration"
# transformers' Qwen3_5Config ids; the image processor is Qwen2-VL's with Qwen3-VL's patch
# sizes and (for a directory without a preprocessor_config.json) Qwen3-VL's published
# settings, which Qwen3.5's repositories repeat.
_IDS = {
    "image_token_id": 248_056,
    "video_token_id": 248_057,
    "vision_start_token_id": 248_053,
    "vision_end_token_id": 248_054,
}
_PROCESSOR = {
    **_IDS,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "settings": QWEN3_VL_SETTINGS,
    "settings_name": "Qwen3-VL's published settings",
    "video_processor": "Qwen3VLVideoProcessor",  # transformers' AutoVideoProcessor's
}

# transformers' Qwen3_5TextConfig defaults, for keys a config leaves out.
_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 248_320,
    "max_position_embeddings": 32_768,
    "rms_norm_eps": 1e-6,
    "head_dim": 256,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "attention_dropout": 0.0,
}
_REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
# The sizes read as integers, config key -> the builder's argument.
_SIZES = {
    **DECODER_SIZES,
    "linear_num_key_heads": "linear_num_key_heads",
    "linear_num_value_heads": "linear_num_value_heads",
    "linear_key_head_dim": "linear_key_head_dim",
    "linear_value_head_dim": "linear_value_head_dim",
}
# A depthwise kernel this wide is no published config's (4); wider is a corrupt one.
_MAX_CONV_KERNEL = 256
# Mixture-of-experts settings: Qwen3.5-MoE's, never a dense model's.
_MOE_KEYS = (
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "decoder_sparse_step",
    "mlp_only_layers",
)
_VISION_DEFAULTS = {
    k: v for k, v in VISION_DEFAULTS["qwen3_vl"].items() if k != "deepstack_visual_indexes"
}


def qwen3_5_text_kwargs(text: ConfigReader, *, mrope: bool = True) -> dict[str, Any]:
    """The :func:`fusion.models.qwen3_5_text` arguments of Qwen3.5's text settings (a
    ``qwen3_5`` config's ``text_config``, or a ``qwen3_5_text`` config itself, over
    transformers' defaults), every value checked before anything is built.

    ``mrope``: read ``mrope_section`` for interleaved M-RoPE; False: plain 1-D RoPE, as
    ``Qwen3_5ForCausalLM`` rotates (its t, h and w rows being the same text positions, any
    ``mrope_section`` there changes nothing, and is not read).

    Raises:
        CheckpointError: naming the file and key.
    """
    values = text.values
    if values.get("model_type", "qwen3_5_text") != "qwen3_5_text":
        raise text.fail(
            "model_type", f"expected 'qwen3_5_text', got {short_repr(values['model_type'])}"
        )
    for key in _REQUIRED:
        if key not in values:
            raise text.fail(key, "missing; a Qwen3.5 config needs it")
    for key in _MOE_KEYS:
        if values.get(key) is not None:
            raise text.fail(
                key,
                "a mixture-of-experts setting in a dense Qwen3.5 config (qwen3_5_moe is "
                "unsupported)",
            )
    for key, expected in (("attention_bias", False), ("hidden_act", "silu")):
        if values.get(key, expected) != expected:
            raise text.fail(key, f"expected {expected!r}, got {short_repr(values[key])}")
    sizes = read_sizes(text, _SIZES)
    kwargs: dict[str, Any] = {_SIZES[key]: value for key, value in sizes.items()}
    for heads, groups in (
        ("num_attention_heads", "num_key_value_heads"),
        ("linear_num_value_heads", "linear_num_key_heads"),
    ):
        if sizes[heads] % sizes[groups]:
            raise text.fail(groups, f"expected a divisor of {heads}={sizes[heads]}")
    kwargs["linear_conv_kernel"] = text.integer("linear_conv_kernel_dim")
    if kwargs["linear_conv_kernel"] > _MAX_CONV_KERNEL:
        raise text.fail(
            "linear_conv_kernel_dim",
            f"expected at most {_MAX_CONV_KERNEL}, got {kwargs['linear_conv_kernel']}",
        )
    kwargs["layer_types"] = _layer_types(text, kwargs["num_layers"])
    kwargs |= _rope_kwargs(text, kwargs["head_dim"], mrope)
    kwargs["norm_eps"] = text.number("rms_norm_eps", None, 0.0)
    kwargs["attn_dropout"] = text.number("attention_dropout", None, 0.0, closed=True, high=1.0)
    kwargs["tie_word_embeddings"] = text.flag("tie_word_embeddings")
    return kwargs


def _layer_types(text: ConfigReader, num_layers: int) -> list[str]:
    if text.values.get("layer_types") is None:
        interval = text.integer("full_attention_interval", 4)
        return default_layer_types(num_layers, interval)
    return text.get(
        "layer_types",
        None,
        lambda v: isinstance(v, list) and len(v) == num_layers and all(t in LAYER_TYPES for t in v),
        f"a list of {num_layers} entries (num_hidden_layers), each one of {list(LAYER_TYPES)}",
    )


def _rope_kwargs(text: ConfigReader, head_dim: int, mrope: bool) -> dict[str, Any]:
    values = text.values
    rope_key = "rope_parameters" if values.get("rope_parameters") else "rope_scaling"
    rope_values = text.get(
        rope_key, None, lambda v: v is None or isinstance(v, Mapping), "an object or null"
    )
    rope = ConfigReader(
        {"rope_theta": values.get("rope_theta", 10_000.0)} | dict(rope_values or {}),
        text.source,
        f"{text.prefix}{rope_key}.",
    )
    rope_type = rope.values.get("rope_type", rope.values.get("type", "default"))
    if rope_type not in ("default", "mrope"):
        raise rope.fail("rope_type", f"expected 'default', got {short_repr(rope_type)}")
    factor = rope.number("partial_rotary_factor", 0.25, 0.0, high=1.0)
    rotary_dim = int(head_dim * factor)
    if rotary_dim < 2 or rotary_dim % 2:
        raise rope.fail(
            "partial_rotary_factor",
            f"{factor:g} of head_dim={head_dim} gives {rotary_dim} rotary channels; expected a "
            "positive even number",
        )
    section = None
    if mrope:
        section = rope.get(
            "mrope_section",
            [11, 11, 10],
            lambda v: (
                isinstance(v, list)
                and len(v) == 3
                and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in v)
                and sum(v) == rotary_dim // 2
            ),
            f"three non-negative integers summing to the rotary channels / 2 = {rotary_dim // 2}",
        )
    return {
        "rope_base": rope.number("rope_theta", None, 0.0),
        "rotary_dim": rotary_dim,
        "mrope_section": section,
    }


def hf_text_config(decoder: TransformerDecoder) -> dict[str, Any]:
    """The ``text_config`` transformers reads for a :func:`~fusion.models.qwen3_5_text`
    decoder (checked to rebuild it by the caller)."""
    attention = decoder.attentions()[0]
    mixers = decoder.recurrent_mixers()
    rope = attention.pos_embeddings
    layer = cast(TransformerSelfAttentionLayer, decoder.layers[0])
    config: dict[str, Any] = {
        "model_type": "qwen3_5_text",
        "vocab_size": decoder.vocab_size,
        "hidden_size": decoder.embed_dim,
        "intermediate_size": layer.mlp.w1.out_features,
        "num_hidden_layers": len(decoder.layers),
        "num_attention_heads": attention.num_heads,
        "num_key_value_heads": attention.num_kv_heads,
        "head_dim": attention.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": decoder.max_seq_len,
        "rms_norm_eps": decoder.norm.eps,
        "attention_bias": False,
        "attention_dropout": attention.attn_dropout,
        "tie_word_embeddings": decoder.output is None,
        "layer_types": [
            "linear_attention" if isinstance(layer.attn, GatedDeltaNet) else "full_attention"
            for layer in decoder.layers
        ],
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": rope.base,
            "partial_rotary_factor": rope.dim / attention.head_dim,
        },
    }
    if rope.mrope_section is not None:
        config["rope_parameters"] |= {
            "mrope_section": list(rope.mrope_section),
            "mrope_interleaved": True,
        }
    if mixers:
        mixer = mixers[0]
        config |= {
            "linear_num_key_heads": mixer.num_key_heads,
            "linear_num_value_heads": mixer.num_value_heads,
            "linear_key_head_dim": mixer.key_head_dim,
            "linear_value_head_dim": mixer.value_head_dim,
            "linear_conv_kernel_dim": mixer.conv_kernel,
        }
    return config


class Qwen35Family(Family):
    name = "qwen3_5"
    what = "Qwen3.5"
    architectures = {MODEL_TYPE: ARCHITECTURE}
    layout = KeyLayout(
        decoder="decoder.",
        read=(
            (r"lm_head\.", "decoder.lm_head."),
            (r"model\.language_model\.", "decoder.model."),
            (r"model\.visual\.", "encoders.image."),
        ),
        write=(
            ("decoder.model.", "model.language_model."),
            ("decoder.", ""),
            ("encoders.image.", "model.visual."),
        ),
        ignored=r"mtp\.",
        permute_rope=False,
    )
    encoder_types = (Qwen35VisionTransformer,)
    vision_layers = (r"encoders\.image\.blocks\.(\d{1,9})\.", "depth")
    peft_encoder = (("encoders.image.", "model.visual."),)
    processor = "qwen2_vl"
    video_marker = QWEN2_VL_VIDEO_MARKER
    processor_defaults = {MODEL_TYPE: _PROCESSOR}
    refused_model_types = {
        "qwen3_5_moe": "Qwen3.5's mixture-of-experts models are not supported (the dense "
        "qwen3_5 models are)"
    }

    def read(self, config: ConfigReader) -> ModelSpec:
        text_config = config.section("text_config", "Qwen3.5", _TEXT_DEFAULTS)
        text = qwen3_5_text_kwargs(text_config)
        text["tie_word_embeddings"] |= config.flag("tie_word_embeddings")
        vision_config: dict[str, Any] = dict(config.values.get("vision_config") or {})
        if vision_config.get("deepstack_visual_indexes"):
            raise config.fail(
                "vision_config.deepstack_visual_indexes",
                "expected none: Qwen3.5's tower has no DeepStack",
            )
        vision = qwen_vision_kwargs(
            ConfigReader(
                {
                    **config.values,
                    "vision_config": {**vision_config, "deepstack_visual_indexes": []},
                },
                config.source,
            ),
            "qwen3_vl",
        )
        del vision["deepstack_visual_indexes"]
        token_id = read_token_id(config, ("image_token_id",), _IDS["image_token_id"])
        video_id = read_token_id(config, ("video_token_id",), _IDS["video_token_id"])
        options = {"video_token_id": video_id}
        return ModelSpec(self, MODEL_TYPE, text, vision, token_id, options, text_config.prefix)

    def build(self, spec: ModelSpec) -> nn.Module:
        return qwen3_5(
            text=spec.text,
            vision=spec.vision,
            image_token_id=cast(int, spec.image_token_id),
            **spec.options,
        )

    def hf_config(self, model: nn.Module) -> dict[str, Any]:
        encoder, image_id = check_image_encoder(model, self)
        decoder = cast(EarlyFusion, model).decoder
        text = hf_text_config(decoder)
        vision = {key: getattr(encoder, key) for key in _VISION_DEFAULTS}
        vision["rope_parameters"] = {"rope_type": "axial", "rope_theta": encoder.rope_theta}
        dtype = next(iter(decoder.parameters())).dtype
        config = {
            "architectures": [ARCHITECTURE],
            "model_type": MODEL_TYPE,
            "image_token_id": image_id,
            "tie_word_embeddings": text["tie_word_embeddings"],
            "text_config": text,
            "vision_config": {"model_type": "qwen3_5_vision", **vision},
            "torch_dtype": str(dtype).removeprefix("torch."),
        }
        add_video_settings(config, cast(EarlyFusion, model), MODEL_TYPE)
        check_rebuilds(model, config, self)
        return config


QWEN3_5 = Qwen35Family()


class Qwen35TextFamily(Family):
    """Qwen3.5's text stack alone: ``Qwen3_5ForCausalLM`` directories (``qwen3_5_text``, the
    text settings at the top of ``config.json``, weights under ``model.`` and ``lm_head``)
    <-> a bare :func:`~fusion.models.qwen3_5_text` decoder with plain 1-D RoPE, as
    transformers' text model rotates (text positions on every M-RoPE row)."""

    name = "qwen3_5_text"
    what = "Qwen3.5 (text only)"
    architectures = {"qwen3_5_text": "Qwen3_5ForCausalLM"}
    layout = KeyLayout(ignored=r"mtp\.", permute_rope=False)
    peft_text = "model."
    refused_model_types = {
        "qwen3_5_moe_text": "Qwen3.5's mixture-of-experts models are not supported (the dense "
        "qwen3_5_text models are)"
    }

    def owns(self, decoder: nn.Module) -> bool:
        # Gated DeltaNet layers, or gated full attention: no other family's decoder has
        # either (Gemma 3's has zero-centred norms too).
        return isinstance(decoder, TransformerDecoder) and (
            bool(decoder.recurrent_mixers())
            or any(attention.output_gate for attention in decoder.attentions())
        )

    def read(self, config: ConfigReader) -> ModelSpec:
        text = ConfigReader(
            {**_TEXT_DEFAULTS, **config.values}, config.source, config.prefix, error=config.error
        )
        kwargs = qwen3_5_text_kwargs(text, mrope=False)
        return ModelSpec(self, "qwen3_5_text", kwargs, text_prefix=config.prefix)

    def build(self, spec: ModelSpec) -> nn.Module:
        return qwen3_5_text(**spec.text)

    def hf_config(self, model: nn.Module) -> dict[str, Any]:
        if not isinstance(model, TransformerDecoder):
            raise TypeError(f"model: expected a TransformerDecoder, got {type(model).__name__}")
        config = {"architectures": ["Qwen3_5ForCausalLM"], **hf_text_config(model)}
        config["torch_dtype"] = str(model.tok_embeddings.weight.dtype).removeprefix("torch.")
        check_rebuilds(model, config, self)
        return config

    def transformers_module(self, model_type: str) -> str:
        return "transformers.models.qwen3_5.modeling_qwen3_5"


QWEN3_5_TEXT = Qwen35TextFamily()
