"""Model builders, kept apart from the modules they assemble."""

from fusion.models.llama3_2 import llama3_2, llama3_2_1b, llama3_2_3b, scale_hidden_dim_for_mlp

__all__ = ["llama3_2", "llama3_2_1b", "llama3_2_3b", "scale_hidden_dim_for_mlp"]
