"""Merging encoder rows into text embeddings: layouts, the public merge and its implementations."""

from fusion.merge.layouts import EncoderRows, Packed, Padded
from fusion.merge.merge import IMPLEMENTATIONS, default_impl, embedding_table, merge_embeddings

__all__ = [
    "IMPLEMENTATIONS",
    "EncoderRows",
    "Packed",
    "Padded",
    "default_impl",
    "embedding_table",
    "merge_embeddings",
]
