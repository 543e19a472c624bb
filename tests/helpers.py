"""Small models and data shared by the tests."""

import torch

from fusion.decoder import TransformerDecoder
from fusion.models import llama3_2

VOCAB = 64
EMBED_DIM = 32


def build_tiny_decoder(tie_word_embeddings: bool = True, seed: int = 0) -> TransformerDecoder:
    """A 2-layer GQA Llama small enough for unit tests (4 query heads, 2 KV heads, width 32)."""
    torch.manual_seed(seed)
    return llama3_2(
        vocab_size=VOCAB,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        embed_dim=EMBED_DIM,
        max_seq_len=64,
        intermediate_dim=64,
        tie_word_embeddings=tie_word_embeddings,
    )
