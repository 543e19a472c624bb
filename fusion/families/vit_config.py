"""The ``text_config`` and ``vision_config`` of the families built on a Llama text model and
a CLIP-style vision tower (LLaVA's CLIP, Idefics3's SigLIP), both ways."""

from collections.abc import Mapping
from typing import Any, cast

from fusion.encoders.clip import ClipVisionTransformer
from fusion.encoders.siglip import SiglipVisionTransformer
from fusion.encoders.vit_blocks import ACTIVATIONS, VisionEncoderLayer
from fusion.families.llama.config import llama_kwargs
from fusion.hf.config import ConfigReader

# transformers' defaults for keys a sub-config leaves out (configs written by transformers 4.x
# omit those equal to the defaults, e.g. llava-1.5's text_config has no hidden_size).
LLAMA_DEFAULTS = {
    "vocab_size": 32_000,
    "hidden_size": 4096,
    "intermediate_size": 11_008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
}
VISION_DEFAULTS = {
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
# Our keys of a vision layer (its index in group 1) and the vision config's layer count key.
VISION_LAYERS = (r"encoders\.image\.\w+\.encoder\.layers\.(\d{1,9})\.", "num_hidden_layers")


def read_text(config: ConfigReader, what: str) -> dict[str, Any]:
    """The text model's :func:`fusion.models.llama3_2` arguments from ``text_config``."""
    return llama_kwargs(config.section("text_config", what, LLAMA_DEFAULTS))


def read_vision(
    config: ConfigReader, what: str, defaults: Mapping[str, Any], types: tuple[str, ...]
) -> dict[str, Any]:
    """The tower's arguments from ``vision_config`` (its ``model_type`` one of ``types``)."""
    vision_config = config.section("vision_config", what, defaults)
    vision_config.choice("model_type", types[0], types)
    vision: dict[str, Any] = {key: vision_config.integer(key, low=0) for key in _VISION_INTS}
    vision["layer_norm_eps"] = vision_config.number("layer_norm_eps", None, 0.0, high=1.0)
    vision["hidden_act"] = vision_config.choice("hidden_act", None, ACTIVATIONS)
    return vision


def tower_config(tower: ClipVisionTransformer | SiglipVisionTransformer) -> dict[str, Any]:
    """The ``vision_config`` sizes describing ``tower``."""
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
