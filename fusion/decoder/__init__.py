"""Decoder pieces: one concept per file, assembled by the builders in ``fusion.models``."""

from fusion.decoder.attention import MultiHeadAttention
from fusion.decoder.delta_rule import (
    SampleRegions,
    causal_conv,
    chunk_gated_delta_rule,
    conv_step,
    gated_delta_step,
    recurrent_gated_delta_rule,
)
from fusion.decoder.delta_rule_fla import delta_rule_backend
from fusion.decoder.embedding import ScaledEmbedding
from fusion.decoder.feed_forward import FeedForward
from fusion.decoder.few_rows import FewRowsLinear
from fusion.decoder.gated_deltanet import DeltaNetState, GatedDeltaNet
from fusion.decoder.kv_cache import KVCache, SlidingWindowKVCache
from fusion.decoder.packed import PACKED_BACKENDS, PackedSegments
from fusion.decoder.rms_norm import GatedRMSNorm, RMSNorm, ZeroCenteredRMSNorm
from fusion.decoder.rope import RotaryPositionalEmbeddings
from fusion.decoder.transformer import TransformerDecoder
from fusion.decoder.transformer_layer import TransformerSelfAttentionLayer

__all__ = [
    "PACKED_BACKENDS",
    "DeltaNetState",
    "FeedForward",
    "FewRowsLinear",
    "GatedDeltaNet",
    "GatedRMSNorm",
    "KVCache",
    "MultiHeadAttention",
    "PackedSegments",
    "RMSNorm",
    "RotaryPositionalEmbeddings",
    "SampleRegions",
    "ScaledEmbedding",
    "SlidingWindowKVCache",
    "TransformerDecoder",
    "TransformerSelfAttentionLayer",
    "ZeroCenteredRMSNorm",
    "causal_conv",
    "chunk_gated_delta_rule",
    "conv_step",
    "delta_rule_backend",
    "gated_delta_step",
    "recurrent_gated_delta_rule",
]
