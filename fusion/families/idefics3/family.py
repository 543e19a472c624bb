"""Idefics3 and SmolVLM (``Idefics3ForConditionalGeneration``,
``SmolVLMForConditionalGeneration``): a SigLIP tower and a pixel-shuffle connector fused into
a Llama decoder, :func:`fusion.models.idefics3`.

Checkpoints: ``model.text_model.*``, ``model.vision_model.*``, ``model.connector.*``,
``lm_head.weight``, or the same without ``model.`` (a bare ``Idefics3Model``); the saver
writes the first, which both classes load.
"""

from pathlib import Path
from typing import Any, cast

from torch import nn

from fusion.early_fusion import EarlyFusion
from fusion.families.base import (
    Family,
    ModelSpec,
    check_image_encoder,
    check_rebuilds,
    read_token_id,
)
from fusion.families.idefics3.builders import Idefics3ImageEncoder, idefics3
from fusion.families.llama.config import hf_config_from_decoder
from fusion.families.vit_config import (
    VISION_DEFAULTS,
    VISION_LAYERS,
    read_text,
    read_vision,
    tower_config,
)
from fusion.hf.config import ConfigReader
from fusion.hf.errors import CheckpointError
from fusion.hf.layout import KeyLayout

_VISION_TYPES = ("idefics3_vision", "smolvlm_vision")


class Idefics3Family(Family):
    name = "idefics3"
    what = "Idefics3"
    architectures = {
        "idefics3": "Idefics3ForConditionalGeneration",
        "smolvlm": "SmolVLMForConditionalGeneration",
    }
    layout = KeyLayout(
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
    )
    encoder_types = (Idefics3ImageEncoder,)
    vision_layers = VISION_LAYERS
    square_images = True
    processor = "idefics3"
    peft_text = "model.text_model."
    peft_encoder = (("encoders.image.", "model."),)
    vision_defaults = VISION_DEFAULTS | {
        "hidden_size": 1152,
        "num_attention_heads": 16,
        "hidden_act": "gelu_pytorch_tanh",
        "layer_norm_eps": 1e-6,
    }

    def read(self, config: ConfigReader) -> ModelSpec:
        text = read_text(config, self.what)
        vision = read_vision(config, self.what, self.vision_defaults, _VISION_TYPES)
        text["tie_word_embeddings"] = config.flag("tie_word_embeddings")  # as transformers 5.x
        token_id = read_token_id(config, ("image_token_id",), 128_257)
        options = {"scale_factor": config.integer("scale_factor", 2)}
        return ModelSpec(self, config.values["model_type"], text, vision, token_id, options)

    def build(self, spec: ModelSpec) -> nn.Module:
        return idefics3(
            text=spec.text,
            vision=spec.vision,
            image_token_id=cast(int, spec.image_token_id),
            **spec.options,
        )

    def rows_per_image(self, spec: ModelSpec, side: int, config_file: Path) -> int:
        scale = spec.options["scale_factor"]
        if side % scale:
            raise CheckpointError(
                config_file,
                "scale_factor",
                f"expected a divisor of the patch grid's side {side}, got {scale}",
            )
        return (side // scale) ** 2

    def hf_config(self, model: nn.Module) -> dict[str, Any]:
        encoder, image_id = check_image_encoder(model, self)
        encoder = cast(Idefics3ImageEncoder, encoder)
        text = hf_config_from_decoder(cast(EarlyFusion, model).decoder)
        del text["architectures"]
        tower = encoder.vision_model
        if tower.embeddings.position_scheme != "bucketed":
            raise ValueError(
                "model: Idefics3 assigns bucketed positions; its vision tower has "
                f"position_scheme={tower.embeddings.position_scheme!r}"
            )
        config = {
            "architectures": [self.architectures["idefics3"]],
            "model_type": "idefics3",
            "image_token_id": image_id,
            "scale_factor": encoder.connector.scale_factor,
            "tie_word_embeddings": text["tie_word_embeddings"],
            "text_config": text,
            "vision_config": {"model_type": _VISION_TYPES[0], **tower_config(tower)},
            "torch_dtype": text["torch_dtype"],
        }
        check_rebuilds(model, config, self)
        return config


IDEFICS3 = Idefics3Family()
