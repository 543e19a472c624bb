"""LLaVA (``LlavaForConditionalGeneration``): a CLIP tower and an MLP projector fused into a
Llama decoder, :func:`fusion.models.llava`.

Checkpoints come in two layouts, one per file set (mixing them is refused):
``language_model.model.*`` + ``language_model.lm_head.weight`` (on disk before transformers
4.52, and on the Hub) or ``model.language_model.*`` + ``lm_head.weight`` (the in-memory
names); the tower under ``vision_tower.vision_model.*``, ``vision_tower.*`` or either with
``model.`` in front; ``(model.)multi_modal_projector.*``. The saver writes the Hub layout,
which every transformers version loads.
"""

from pathlib import Path
from typing import Any, cast

from torch import nn

from fusion._validation import is_int
from fusion.early_fusion import EarlyFusion
from fusion.encoders.vit_blocks import ACTIVATIONS
from fusion.families.base import (
    Family,
    ModelSpec,
    check_image_encoder,
    check_rebuilds,
    read_token_id,
)
from fusion.families.llama.config import hf_config_from_decoder
from fusion.families.llava.builders import (
    FEATURE_STRATEGIES,
    LlavaImageEncoder,
    llava,
    rows_per_image,
)
from fusion.families.vit_config import (
    VISION_DEFAULTS,
    VISION_LAYERS,
    read_text,
    read_vision,
    tower_config,
)
from fusion.hf.config import ConfigReader
from fusion.hf.layout import KeyLayout

_VISION_TYPES = ("clip_vision_model",)


class LlavaFamily(Family):
    name = "llava"
    what = "LLaVA"
    architectures = {"llava": "LlavaForConditionalGeneration"}
    layout = KeyLayout(
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
    )
    encoder_types = (LlavaImageEncoder,)
    vision_layers = VISION_LAYERS
    square_images = True
    processor = "llava"
    peft_encoder = (
        ("encoders.image.vision_tower.", "model.vision_tower."),
        ("encoders.image.multi_modal_projector.", "model.multi_modal_projector."),
    )
    vision_defaults = VISION_DEFAULTS | {
        "hidden_size": 768,
        "num_attention_heads": 12,
        "hidden_act": "quick_gelu",
        "layer_norm_eps": 1e-5,
    }

    def read(self, config: ConfigReader) -> ModelSpec:
        text = read_text(config, self.what)
        vision = read_vision(config, self.what, self.vision_defaults, _VISION_TYPES)
        # transformers ties LLaVA when either the top level or text_config asks for it.
        text["tie_word_embeddings"] |= config.flag("tie_word_embeddings")
        options = {
            "vision_feature_layer": config.get(
                "vision_feature_layer",
                -2,
                _is_layers,
                "an int or a list of ints",
            ),
            "vision_feature_select_strategy": config.choice(
                "vision_feature_select_strategy", "default", FEATURE_STRATEGIES
            ),
            "projector_hidden_act": config.choice("projector_hidden_act", "gelu", ACTIVATIONS),
            "projector_bias": config.flag("multimodal_projector_bias", True),
        }
        token_id = read_token_id(config, ("image_token_index", "image_token_id"), 32_000)
        return ModelSpec(self, "llava", text, vision, token_id, options)

    def build(self, spec: ModelSpec) -> nn.Module:
        return llava(
            text=spec.text,
            vision=spec.vision,
            image_token_id=cast(int, spec.image_token_id),
            **spec.options,
        )

    def rows_per_image(self, spec: ModelSpec, side: int, config_file: Path) -> int:
        return rows_per_image(side * side, spec.options["vision_feature_select_strategy"])

    def hf_config(self, model: nn.Module) -> dict[str, Any]:
        encoder, image_id = check_image_encoder(model, self)
        encoder = cast(LlavaImageEncoder, encoder)
        text = hf_config_from_decoder(cast(EarlyFusion, model).decoder)
        del text["architectures"]
        projector = encoder.multi_modal_projector
        config = {
            "architectures": [self.architectures["llava"]],
            "model_type": "llava",
            "image_token_index": image_id,
            "image_seq_length": encoder.tokens_per_image,
            "projector_hidden_act": projector.act.name,
            "multimodal_projector_bias": projector.linear_1.bias is not None,
            "vision_feature_layer": encoder.vision_feature_layer,
            "vision_feature_select_strategy": encoder.vision_feature_select_strategy,
            "tie_word_embeddings": text["tie_word_embeddings"],
            "text_config": text,
            "vision_config": {"model_type": _VISION_TYPES[0], **tower_config(encoder.vision_tower)},
            "torch_dtype": text["torch_dtype"],
        }
        check_rebuilds(model, config, self)
        return config


def _is_layers(value: object) -> bool:
    """One layer number, or a non-empty list of them."""
    return is_int(value) or (isinstance(value, list) and bool(value) and all(map(is_int, value)))


LLAVA = LlavaFamily()
