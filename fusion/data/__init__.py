"""The captioned shapes dataset: rendering, tokenizer and batching for the training job."""

from fusion.data.batching import (
    IGNORE_INDEX,
    CaptionBatch,
    CaptionDataset,
    EpochSampler,
    encode_captions,
    prompt_length,
    prompt_tokens,
    sequence_length,
)
from fusion.data.shapes import ShapesSplit, caption_words, make_splits, max_caption_words
from fusion.data.tokenizer import CaptionTokenizer

__all__ = [
    "IGNORE_INDEX",
    "CaptionBatch",
    "CaptionDataset",
    "CaptionTokenizer",
    "EpochSampler",
    "ShapesSplit",
    "caption_words",
    "encode_captions",
    "make_splits",
    "max_caption_words",
    "prompt_length",
    "prompt_tokens",
    "sequence_length",
]
