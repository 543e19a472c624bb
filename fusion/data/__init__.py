"""Fine-tuning data: conversations from JSON Lines or Hugging Face data sets (Parquet,
``save_to_disk`` directories: :mod:`fusion.data.hf_datasets`), the model's chat template
rendered in a sandbox, samples with assistant-only labels, and packed or padded batches.

    from fusion import masked_token_loss
    from fusion.data import (
        ConversationEncoder, collate_packed, encode_conversations, pack_samples,
        read_conversations,
    )

    read = read_conversations("train.jsonl")                 # the whole file checked
    read = read_conversations("train.parquet")               # or a data set, images embedded
    encoder = ConversationEncoder.from_directory(model_dir)  # template, tokenizer, processor
    data = encode_conversations(encoder, read.conversations, max_seq_len=2048)  # no pixels kept
    samples = encoder.load_pixels(data.samples[:32])         # one batch's pixels, made now
    rows = pack_samples(samples, max_seq_len=2048)           # greedy first fit
    batch = collate_packed(rows[:8], pad_id=pad_id)          # e.g. 8 rows a micro-batch
    loss_sum, count = masked_token_loss(model(**batch.model_inputs()), batch.labels)

Videos (models that take them: the Qwen families) are content items ``{"type": "video",
"video": "clip.mp4"}`` (or a list of frame files), or a data set's ``videos`` column: planned
from their containers when encoded (:class:`VideoRef`, nothing decoded), decoded and patched
per clip by ``load_pixels``, and batched as ``encoder_input["video"]``.

A run's micro-batches, made ahead in worker processes (:mod:`fusion.data.loader`):
``StepBatches(samples, steps, Collate(pad_id, max_seq_len, encoder=encoder), ...)`` and
``with MicroBatches(batches, num_workers=2, device=device) as stream: for item in stream``.
"""

from fusion.data.chat_template import (
    ChatTemplate,
    ChatTemplateError,
    RenderedChat,
    check_template_variables,
    load_chat_template,
    load_special_tokens,
)
from fusion.data.conversations import (
    IMAGE_MARKER,
    Conversation,
    ConversationFile,
    ConversationVideo,
    DataError,
    load_conversation_image,
    parse_conversation,
    read_conversations,
)
from fusion.data.encoded import EncodedData, encode_conversations, fit_sample
from fusion.data.hf_datasets import EmbeddedImage, read_hf_dataset
from fusion.data.loader import (
    Collate,
    LoaderError,
    MicroBatch,
    MicroBatches,
    StepBatches,
    fill,
    has_images,
    ignored,
    image_filler,
)
from fusion.data.packing import (
    ATTENTION_CHOICES,
    Batch,
    PackedSegments,
    collate_packed,
    collate_padded,
    pack,
    pack_samples,
)
from fusion.data.prepare import pad_token_id, read_encoded, skipped_summary
from fusion.data.sample import IGNORE_INDEX, ImageRef, Sample, VideoRef
from fusion.data.samples import ConversationEncoder

__all__ = [
    "ATTENTION_CHOICES",
    "IGNORE_INDEX",
    "IMAGE_MARKER",
    "Batch",
    "ChatTemplate",
    "ChatTemplateError",
    "Collate",
    "Conversation",
    "ConversationEncoder",
    "ConversationFile",
    "ConversationVideo",
    "DataError",
    "EmbeddedImage",
    "EncodedData",
    "ImageRef",
    "LoaderError",
    "MicroBatch",
    "MicroBatches",
    "PackedSegments",
    "RenderedChat",
    "Sample",
    "StepBatches",
    "VideoRef",
    "check_template_variables",
    "collate_packed",
    "collate_padded",
    "encode_conversations",
    "fill",
    "fit_sample",
    "has_images",
    "ignored",
    "image_filler",
    "load_chat_template",
    "load_conversation_image",
    "load_special_tokens",
    "pack",
    "pack_samples",
    "pad_token_id",
    "parse_conversation",
    "read_conversations",
    "read_encoded",
    "read_hf_dataset",
    "skipped_summary",
]
