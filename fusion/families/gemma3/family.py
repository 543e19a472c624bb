"""Gemma 3: text only (``gemma3_text``, ``Gemma3ForCausalLM``: Gemma 3 270M and 1B), a
:func:`fusion.models.gemma3_text` decoder; and the vision models (``gemma3``,
``Gemma3ForConditionalGeneration``: 4B to 27B), a :func:`fusion.models.gemma3`
``EarlyFusion`` whose images attend to themselves both ways.

``config.json`` is read as transformers 5.24 reads it: the layers by ``layer_types`` (else a
full-attention layer every ``sliding_window_pattern`` layers, 6), the rotary bases from
``rope_parameters`` (``{"sliding_attention": {...}, "full_attention": {...}}``, as 5.24
writes it) or the published form (``rope_theta`` for the full-attention layers,
``rope_local_base_freq`` for the sliding ones, ``rope_scaling`` the full-attention layers'
scaling, ``"linear"`` in Gemma 3 4B to 27B), keys left out taking ``Gemma3TextConfig``'s
defaults. Settings transformers reads but this library does not model are refused by name
rather than ignored: ``use_bidirectional_attention`` (EmbeddingGemma) and
``attn_logit_softcapping``, which transformers 5.24's Gemma 3 attention never applies (every
published Gemma 3 config sets it null).

Checkpoints: transformers' names (``model.layers.N.*``, a Llama's, the norms renamed:
``input_layernorm`` -> ``sa_norm``, ``post_attention_layernorm`` -> ``sa_scale``,
``pre_feedforward_layernorm`` -> ``mlp_norm``, ``post_feedforward_layernorm`` ->
``mlp_scale``); the query and key rows load as they are stored (the decoder rotates in
Hugging Face's rotate-half layout).

The vision models' ``config.json`` holds the text settings under ``text_config``
(``gemma3_text``, read as above, except that ``final_logit_softcapping`` is refused:
``Gemma3ForConditionalGeneration`` never applies it) and SigLIP's under ``vision_config``
(the head's weights, which transformers builds when ``vision_use_head`` and never runs, are
skipped), ``mm_tokens_per_image`` (a square whose side
divides the tower's patches per side) and ``image_token_index``. Checkpoints: the Hub's
layout (``language_model.model.*``, ``vision_tower.vision_model.*``,
``multi_modal_projector.*``), which the saver writes; transformers 5.24's saved one (the same
with ``vision_tower.*``) and in-memory one (``model.language_model.*``,
``model.vision_tower.vision_model.*``, ``model.multi_modal_projector.*``). Each image's
placeholders attend to each other both ways (:class:`fusion.hooks.ImageBlocks`, from where
the rows are merged: no ``token_type_ids``). No preprocessing yet: pixel values and the
image text (``<start_of_image>``, the placeholders, ``<end_of_image>``) come from
transformers' processor.
"""

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

from torch import nn

from fusion.decoder import (
    ScaledEmbedding,
    TransformerDecoder,
    TransformerSelfAttentionLayer,
)
from fusion.early_fusion import EarlyFusion
from fusion.families.base import (
    Family,
    ModelSpec,
    check_image_encoder,
    check_rebuilds,
    read_token_id,
)
from fusion.families.gemma3.builders import (
    LAYER_TYPES,
    Gemma3ImageEncoder,
    default_layer_types,
    gemma3,
    gemma3_text,
)
from fusion.families.llama.config import DECODER_SIZES, read_sizes
from fusion.families.vit_config import VISION_LAYERS, read_vision, tower_config
from fusion.hf.config import ConfigReader
from fusion.hf.errors import short_repr
from fusion.hf.layout import KeyLayout

MODEL_TYPE = "gemma3_text"
ARCHITECTURE = "Gemma3ForCausalLM"

# transformers' Gemma3TextConfig defaults, for keys a config leaves out.
_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_208,
    "max_position_embeddings": 131_072,
    "head_dim": 256,
    "rms_norm_eps": 1e-6,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "attention_dropout": 0.0,
    "tie_word_embeddings": True,
}
_REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
# Ids a config may hold, each refused outside the vocabulary (a tokenizer's pad or end id
# that the embedding has no row for). transformers' defaults: pad 0, eos 1, bos 2.
_TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id")
_ACTIVATION = "gelu_pytorch_tanh"
# (this library's name, transformers') of the layer norms that a Llama names otherwise.
_NORMS = (
    ("sa_scale.scale", "post_attention_layernorm.weight"),
    ("mlp_norm.scale", "pre_feedforward_layernorm.weight"),
    ("mlp_scale.scale", "post_feedforward_layernorm.weight"),
)
_ROPE_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}


def gemma3_text_kwargs(config: ConfigReader) -> dict[str, Any]:
    """The :func:`fusion.models.gemma3_text` arguments of a ``gemma3_text`` config, every
    value checked before anything is built.

    Raises:
        CheckpointError: naming the file and key.
    """
    text = ConfigReader({**_DEFAULTS, **config.values}, config.source, config.prefix)
    values = text.values
    for key in _REQUIRED:
        if key not in values:
            raise text.fail(key, "missing; a Gemma 3 config needs it")
    for key, expected in (
        ("attention_bias", False),
        ("use_bidirectional_attention", False),
        ("hidden_activation", _ACTIVATION),
        ("hidden_act", _ACTIVATION),
    ):
        if values.get(key) not in (None, expected):
            raise text.fail(key, f"expected {expected!r}, got {short_repr(values[key])}")
    if values.get("attn_logit_softcapping") is not None:
        raise text.fail(
            "attn_logit_softcapping",
            f"expected null, got {short_repr(values['attn_logit_softcapping'])}: transformers' "
            "Gemma 3 never applies it, so no model here could match it",
        )
    sizes = read_sizes(text, DECODER_SIZES)
    kwargs: dict[str, Any] = {DECODER_SIZES[key]: value for key, value in sizes.items()}
    if sizes["num_attention_heads"] % sizes["num_key_value_heads"]:
        raise text.fail(
            "num_key_value_heads",
            f"expected a divisor of num_attention_heads={sizes['num_attention_heads']}",
        )
    if sizes["head_dim"] % 2:
        raise text.fail(
            "head_dim", f"expected an even number (rotary pairs), got {sizes['head_dim']}"
        )
    vocab, positions = sizes["vocab_size"], sizes["max_position_embeddings"]
    for key in _TOKEN_IDS:
        ids = values.get(key)
        if ids is not None and not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab
            for i in (ids if isinstance(ids, list) else [ids])
        ):
            raise text.fail(key, f"expected ids in [0, vocab_size={vocab}), got {short_repr(ids)}")
    kinds = _layer_types(text, kwargs["num_layers"])
    kwargs["layer_types"] = kinds
    window = values.get("sliding_window")
    if window is not None or "sliding_attention" in kinds:
        if not isinstance(window, int) or isinstance(window, bool) or not 0 < window <= positions:
            raise text.fail(
                "sliding_window",
                f"expected an integer in [1, max_position_embeddings={positions}], got "
                f"{short_repr(window)}",
            )
    kwargs["sliding_window"] = window
    kwargs |= _rope_kwargs(text)
    kwargs["query_pre_attn_scalar"] = text.number("query_pre_attn_scalar", None, 0.0)
    softcap = values.get("final_logit_softcapping")
    kwargs["final_logit_softcap"] = (
        None if softcap is None else text.number("final_logit_softcapping", None, 0.0)
    )
    kwargs["norm_eps"] = text.number("rms_norm_eps", None, 0.0, high=1.0)
    kwargs["attn_dropout"] = text.number("attention_dropout", None, 0.0, closed=True, high=1.0)
    kwargs["tie_word_embeddings"] = text.flag("tie_word_embeddings")
    return kwargs


def _layer_types(text: ConfigReader, num_layers: int) -> list[str]:
    if text.values.get("layer_types") is None:
        return default_layer_types(num_layers, text.integer("sliding_window_pattern", 6))
    return text.get(
        "layer_types",
        None,
        lambda v: isinstance(v, list) and len(v) == num_layers and all(t in LAYER_TYPES for t in v),
        f"a list of {num_layers} entries (num_hidden_layers), each one of {list(LAYER_TYPES)}",
    )


def _rope_kwargs(text: ConfigReader) -> dict[str, Any]:
    """The rotary bases and the full-attention layers' linear factor, from
    ``rope_parameters`` per layer type and the published keys beside it, merged as
    transformers merges them (``rope_parameters``' values first)."""
    values = text.values
    per_type = text.get(
        "rope_parameters",
        None,
        lambda v: v is None or (isinstance(v, Mapping) and set(v) <= set(LAYER_TYPES)),
        f"null or an object of {list(LAYER_TYPES)}",
    )
    legacy = {"full_attention": "rope_theta", "sliding_attention": "rope_local_base_freq"}
    kwargs: dict[str, Any] = {}
    for kind, argument in (
        ("full_attention", "rope_base"),
        ("sliding_attention", "rope_local_base"),
    ):
        given = (per_type or {}).get(kind)
        key = f"rope_parameters.{kind}"
        if given is not None and not isinstance(given, Mapping):
            raise text.fail(key, f"expected an object, got {short_repr(given)}")
        found = dict(given or {})
        if kind == "full_attention":
            scaling = text.get(
                "rope_scaling", None, lambda v: v is None or isinstance(v, Mapping), "an object"
            )
            if scaling:
                found, key = found | dict(scaling), "rope_scaling"
        theta = values.get(legacy[kind], _ROPE_THETA[kind])
        rope = ConfigReader({"rope_theta": theta} | found, text.source, f"{text.prefix}{key}.")
        rope_type = rope.values.get("rope_type", rope.values.get("type", "default"))
        allowed = ("default", "linear") if kind == "full_attention" else ("default",)
        if rope_type not in allowed:
            raise rope.fail(
                "rope_type", f"expected one of {list(allowed)}, got {short_repr(rope_type)}"
            )
        kwargs[argument] = rope.number("rope_theta", None, 0.0)
        if rope_type == "linear":
            kwargs["rope_linear_factor"] = rope.number("factor", None, 0.0)
    return kwargs


def hf_text_config(decoder: TransformerDecoder) -> dict[str, Any]:
    """The ``config.json`` transformers reads for a :func:`~fusion.models.gemma3_text`
    decoder (checked to rebuild it by the caller)."""
    layers = [cast(TransformerSelfAttentionLayer, layer) for layer in decoder.layers]
    attentions = decoder.attentions()
    sliding = [a for a in attentions if a.sliding_window is not None]
    full = [a for a in attentions if a.sliding_window is None]
    attention = attentions[0]
    scale = cast(float, attention.attn_scale)
    scalar = round(scale**-2, 6)  # 256 ** -0.5 -> 256.0, as the config said
    global_rope = (full or attentions)[0].pos_embeddings
    local_rope = (sliding or attentions)[0].pos_embeddings
    full_rope: dict[str, Any] = {"rope_type": "default", "rope_theta": global_rope.base}
    if global_rope.linear_factor is not None:
        full_rope |= {"rope_type": "linear", "factor": global_rope.linear_factor}
    return {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "vocab_size": decoder.vocab_size,
        "hidden_size": decoder.embed_dim,
        "intermediate_size": layers[0].mlp.w1.out_features,
        "num_hidden_layers": len(layers),
        "num_attention_heads": attention.num_heads,
        "num_key_value_heads": attention.num_kv_heads,
        "head_dim": attention.head_dim,
        "hidden_activation": _ACTIVATION,
        "max_position_embeddings": decoder.max_seq_len,
        "rms_norm_eps": decoder.norm.eps,
        "attention_bias": False,
        "attention_dropout": attention.attn_dropout,
        "query_pre_attn_scalar": int(scalar) if scalar.is_integer() else scalar,
        "sliding_window": sliding[0].sliding_window if sliding else None,
        "layer_types": [
            "full_attention" if a.sliding_window is None else "sliding_attention"
            for a in attentions
        ],
        "rope_parameters": {
            "full_attention": full_rope,
            "sliding_attention": {"rope_type": "default", "rope_theta": local_rope.base},
        },
        "final_logit_softcapping": decoder.final_logit_softcap,
        "attn_logit_softcapping": None,
        "use_bidirectional_attention": False,
        "tie_word_embeddings": decoder.output is None,
        "torch_dtype": str(decoder.tok_embeddings.weight.dtype).removeprefix("torch."),
    }


class Gemma3TextFamily(Family):
    name = "gemma3_text"
    what = "Gemma 3 text"
    architectures = {MODEL_TYPE: ARCHITECTURE}
    layout = KeyLayout(permute_rope=False, renamed=_NORMS)
    peft_text = "model."

    def read(self, config: ConfigReader) -> ModelSpec:
        return ModelSpec(self, MODEL_TYPE, gemma3_text_kwargs(config), text_prefix="")

    def build(self, spec: ModelSpec) -> nn.Module:
        return gemma3_text(**spec.text)

    def hf_config(self, model: nn.Module) -> dict[str, Any]:
        if not self.owns(model):
            raise ValueError("model: not a Gemma 3 decoder as gemma3_text builds it")
        config = hf_text_config(cast(TransformerDecoder, model))
        check_rebuilds(model, config, self)
        return config

    def owns(self, decoder: nn.Module) -> bool:
        # Its embedding scales its rows: a Llama's never does.
        return isinstance(decoder, TransformerDecoder) and isinstance(
            decoder.tok_embeddings, ScaledEmbedding
        )


GEMMA3_TEXT = Gemma3TextFamily()


VISION_MODEL_TYPE = "gemma3"
VISION_ARCHITECTURE = "Gemma3ForConditionalGeneration"
# transformers' SiglipVisionConfig defaults, then Gemma3Config's, for keys a config leaves out.
_VISION_DEFAULTS: dict[str, Any] = {
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_channels": 3,
    "image_size": 224,
    "patch_size": 16,
    "hidden_act": "gelu_pytorch_tanh",
    "layer_norm_eps": 1e-6,
}
_IMAGE_TOKEN_ID = 262_144
_TOKENS_PER_IMAGE = 256


class Gemma3Family(Family):
    name = "gemma3"
    what = "Gemma 3"
    architectures = {VISION_MODEL_TYPE: VISION_ARCHITECTURE}
    layout = KeyLayout(
        decoder="decoder.",
        read=(
            (r"(?:language_model\.)?lm_head\.", "decoder.lm_head."),
            (r"model\.language_model\.|language_model\.model\.", "decoder.model."),
            (r"(?:model\.)?vision_tower\.(?:vision_model\.)?", "encoders.image.vision_tower."),
            (
                r"(?:model\.)?multi_modal_projector\.mm_soft_emb_norm\.weight$",
                "encoders.image.projector.norm.scale",
            ),
            (
                r"(?:model\.)?multi_modal_projector\.mm_input_projection_weight$",
                "encoders.image.projector.projection",
            ),
        ),
        write=(  # the Hub's layout, which every transformers version since 4.50 loads
            ("decoder.model.", "language_model.model."),
            ("decoder.", "language_model."),
            ("encoders.image.vision_tower.", "vision_tower.vision_model."),
            (
                "encoders.image.projector.norm.scale",
                "multi_modal_projector.mm_soft_emb_norm.weight",
            ),
            (
                "encoders.image.projector.projection",
                "multi_modal_projector.mm_input_projection_weight",
            ),
        ),
        ignored=r"(?:model\.)?vision_tower\.(?:vision_model\.)?head\.",
        permute_rope=False,
        renamed=_NORMS,
    )
    encoder_types = (Gemma3ImageEncoder,)
    vision_layers = VISION_LAYERS
    peft_encoder = (("encoders.image.vision_tower.", "model.vision_tower.vision_model."),)
    square_images = True
    processor = "gemma3"

    def rows_per_image(self, spec: ModelSpec, side: int, config_file: Path) -> int:
        return spec.options["tokens_per_image"]  # checked by read against the tower's side

    def read(self, config: ConfigReader) -> ModelSpec:
        text_config = config.section("text_config", self.what)
        if text_config.values.get("model_type", MODEL_TYPE) != MODEL_TYPE:
            raise text_config.fail(
                "model_type",
                f"expected {MODEL_TYPE!r}, got {short_repr(text_config.values['model_type'])}",
            )
        text = gemma3_text_kwargs(text_config)
        if text["final_logit_softcap"] is not None:
            raise text_config.fail(
                "final_logit_softcapping",
                f"expected null, got {text['final_logit_softcap']:g}: transformers' "
                "Gemma3ForConditionalGeneration never applies it (Gemma3ForCausalLM does), so "
                "no model here could match it",
            )
        text["tie_word_embeddings"] = config.flag(
            "tie_word_embeddings", text["tie_word_embeddings"]
        )
        vision = read_vision(config, self.what, _VISION_DEFAULTS, ("siglip_vision_model",))
        size, patch = vision["image_size"], vision["patch_size"]
        if patch == 0 or size % patch:
            raise config.fail(
                "vision_config.image_size",
                f"expected a positive multiple of patch_size={patch}, got {size}",
            )
        tokens = config.integer("mm_tokens_per_image", _TOKENS_PER_IMAGE)
        side = size // patch
        if math.isqrt(tokens) ** 2 != tokens or side % math.isqrt(tokens):
            raise config.fail(
                "mm_tokens_per_image",
                f"expected a square whose side divides the tower's {side} patches per side "
                f"(image_size / patch_size), got {tokens}",
            )
        token_id = read_token_id(config, ("image_token_index", "image_token_id"), _IMAGE_TOKEN_ID)
        if token_id >= text["vocab_size"]:
            raise config.fail(
                "image_token_index",
                f"expected an id in [0, text_config.vocab_size={text['vocab_size']}), got "
                f"{token_id}",
            )
        options = {"tokens_per_image": tokens}
        return ModelSpec(self, VISION_MODEL_TYPE, text, vision, token_id, options)

    def build(self, spec: ModelSpec) -> nn.Module:
        return gemma3(
            text=spec.text,
            vision=spec.vision,
            image_token_id=cast(int, spec.image_token_id),
            **spec.options,
        )

    def hf_config(self, model: nn.Module) -> dict[str, Any]:
        encoder, image_id = check_image_encoder(model, self)
        encoder = cast(Gemma3ImageEncoder, encoder)
        decoder = cast(EarlyFusion, model).decoder
        if not GEMMA3_TEXT.owns(decoder):
            raise ValueError("model: its decoder is not a Gemma 3 one as gemma3_text builds it")
        text = hf_text_config(decoder)
        del text["architectures"]
        config = {
            "architectures": [VISION_ARCHITECTURE],
            "model_type": VISION_MODEL_TYPE,
            "image_token_index": image_id,
            "mm_tokens_per_image": encoder.tokens_per_image,
            "tie_word_embeddings": text["tie_word_embeddings"],
            "text_config": text,
            "vision_config": {
                "model_type": "siglip_vision_model",
                **tower_config(encoder.vision_tower),
                "vision_use_head": False,
            },
            "torch_dtype": text["torch_dtype"],
        }
        check_rebuilds(model, config, self)
        return config


GEMMA3 = Gemma3Family()
