"""Llama (and the text stacks of the Llama/Qwen2/Qwen3 kind): the builder of every
family's text decoder (:mod:`.builders`), the ``config.json`` mapping of its sizes both ways
(:mod:`.config`), and the family of text-only Llama directories (:mod:`.family`)."""

from fusion.families.llama.builders import (
    llama3_2,
    llama3_2_1b,
    llama3_2_3b,
    scale_hidden_dim_for_mlp,
)
from fusion.families.llama.family import LLAMA, LlamaFamily

__all__ = [
    "LLAMA",
    "LlamaFamily",
    "llama3_2",
    "llama3_2_1b",
    "llama3_2_3b",
    "scale_hidden_dim_for_mlp",
]
