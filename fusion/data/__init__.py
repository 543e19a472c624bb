"""Fine-tuning data: conversations from JSON Lines, the model's chat template rendered in a
sandbox, samples with assistant-only labels, and packed or padded batches.

    from fusion.data import (
        ConversationEncoder, collate_packed, encode_conversations, pack_samples,
        read_conversations,
    )
    from fusion import masked_token_loss

    conversations = read_conversations("train.jsonl").conversations   # whole file checked
    encoder = ConversationEncoder.from_directory(model_dir)
    data = encode_conversations(encoder, conversations, max_seq_len=2048)
    for row_group in ...:                                            # rows of pack_samples
        batch = collate_packed(row_group, pad_id=pad_id)
        logits = model(**batch.model_inputs())
        loss_sum, count = masked_token_loss(logits, batch.labels)
"""

from fusion.data.chat_template import (
    ChatTemplate,
    ChatTemplateError,
    RenderedChat,
    load_chat_template,
    load_special_tokens,
)
from fusion.data.conversations import (
    IMAGE_MARKER,
    Conversation,
    ConversationFile,
    DataError,
    parse_conversation,
    read_conversations,
)
from fusion.data.packing import Batch, collate_packed, collate_padded, pack, pack_samples
from fusion.data.samples import (
    IGNORE_INDEX,
    ConversationEncoder,
    EncodedData,
    Sample,
    encode_conversations,
    fit_sample,
)

__all__ = [
    "IGNORE_INDEX",
    "IMAGE_MARKER",
    "Batch",
    "ChatTemplate",
    "ChatTemplateError",
    "Conversation",
    "ConversationEncoder",
    "ConversationFile",
    "DataError",
    "EncodedData",
    "RenderedChat",
    "Sample",
    "collate_packed",
    "collate_padded",
    "encode_conversations",
    "fit_sample",
    "load_chat_template",
    "load_special_tokens",
    "pack",
    "pack_samples",
    "parse_conversation",
    "read_conversations",
]
