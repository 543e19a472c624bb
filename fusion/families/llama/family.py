"""Llama: text-only ``LlamaForCausalLM`` directories <-> a :func:`fusion.models.llama3_2`
decoder (a bare ``TransformerDecoder``, or an ``EarlyFusion`` without encoders for peft)."""

from typing import Any, cast

from torch import nn

from fusion.decoder import TransformerDecoder
from fusion.families.base import Family, ModelSpec
from fusion.families.llama.builders import llama3_2
from fusion.families.llama.config import hf_config_from_decoder, llama_kwargs
from fusion.hf.config import ConfigReader
from fusion.hf.layout import KeyLayout


class LlamaFamily(Family):
    name = "llama"
    what = "Llama"
    architectures = {"llama": "LlamaForCausalLM"}
    layout = KeyLayout()
    peft_text = "model."

    def read(self, config: ConfigReader) -> ModelSpec:
        return ModelSpec(self, "llama", llama_kwargs(config), text_prefix="")

    def build(self, spec: ModelSpec) -> nn.Module:
        return llama3_2(**spec.text)

    def hf_config(self, model: nn.Module) -> dict[str, Any]:
        return hf_config_from_decoder(cast(TransformerDecoder, model))


LLAMA = LlamaFamily()
