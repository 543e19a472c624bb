"""A training run's data made ready before the first step: a whole file read, checked and
encoded (:func:`read_encoded`), what was skipped or cut in one line (:func:`skipped_summary`),
and the id that pads its batches for the model's vocabulary (:func:`pad_token_id`).

    encoder = ConversationEncoder.from_directory(model_dir)
    data = read_encoded(encoder, "train.jsonl", max_seq_len=2048, skip_bad=True)
    collate = Collate(pad_token_id(encoder, vocab_size, model_dir), 2048, encoder=encoder)
"""

import dataclasses
import os
from pathlib import Path

from fusion._validation import check_int
from fusion.data.conversations import read_conversations
from fusion.data.encoded import EncodedData, encode_conversations
from fusion.data.samples import ConversationEncoder
from fusion.hf.errors import CheckpointError
from fusion.hf.files import read_json

# Where fusion.data.load_special_tokens reads special tokens from, in its order.
_SPECIAL_TOKEN_FILES = ("tokenizer_config.json", "special_tokens_map.json")


def read_encoded(
    encoder: ConversationEncoder,
    path: str | os.PathLike,
    *,
    max_seq_len: int,
    truncate: bool = False,
    skip_bad: bool = False,
) -> EncodedData:
    """Every conversation of ``path`` read (:func:`fusion.data.read_conversations`: JSON
    Lines, or a Hugging Face data set: a Parquet file, a directory of them, a ``save_to_disk``
    directory), then encoded and fitted to ``max_seq_len``
    (:func:`fusion.data.encode_conversations`), all before any training. With ``skip_bad``,
    ``skipped`` holds the errors of both, reading's first.

    Raises:
        DataError: naming the file, line (or row) and problem (unless ``skip_bad``), or a
            file with no usable conversation.
        ImportError: a data set without the ``data`` extra installed.
        ValueError: ``max_seq_len`` not an integer >= 2.
    """
    read = read_conversations(path, skip_bad=skip_bad)
    encoded = encode_conversations(
        encoder, read.conversations, max_seq_len=max_seq_len, truncate=truncate, skip_bad=skip_bad
    )
    return dataclasses.replace(encoded, skipped=[*read.skipped, *encoded.skipped])


def skipped_summary(data: EncodedData) -> str | None:
    """``data``'s samples, skipped conversations (and the first one's error) and truncated
    ones in one line, for a log; None when none was skipped or truncated."""
    if not data.skipped and not data.truncated:
        return None
    first = f" (first skipped: {data.skipped[0]})" if data.skipped else ""
    return (
        f"{len(data.samples)} conversations; skipped {len(data.skipped)} bad ones, truncated "
        f"{data.truncated}{first}"
    )


def pad_token_id(
    encoder: ConversationEncoder, vocab_size: int, directory: str | os.PathLike
) -> int:
    """The id that pads batches for a model of ``vocab_size`` embeddings: ``encoder``'s pad
    token (else its EOS token, else 0). Padding is never attended to by a real token nor a
    target, so any id of the vocabulary ``[0, vocab_size)`` does; ``directory`` is the model
    directory ``encoder`` comes from, named in the error.

    Raises:
        ValueError: ``vocab_size`` not a positive integer; the token's id (``tokenizer.json``'s)
            outside the vocabulary, which no embedding can take: naming the file and key it
            comes from (the EOS token is not taken instead: a pad token that does not fit is a
            broken directory).
    """
    check_int(vocab_size, "vocab_size", low=1)
    tokens = encoder.template.special_tokens
    for key in ("pad_token", "eos_token"):
        if key in tokens and (found := encoder.tokenizer.token_to_id(tokens[key])) is not None:
            if not 0 <= found < vocab_size:
                raise ValueError(
                    f"{_special_token_source(directory, key)} {key} {tokens[key]!r} is id "
                    f"{found} in tokenizer.json, outside the model's vocabulary [0, "
                    f"{vocab_size}) (config.json vocab_size): no embedding row pads with it; set "
                    f"{key} to a token of the vocabulary"
                )
            return int(found)
    return 0


def _special_token_source(directory: str | os.PathLike, key: str) -> str:
    """The file :func:`fusion.data.load_special_tokens` took special token ``key`` from."""
    for name in _SPECIAL_TOKEN_FILES:
        file = Path(directory) / name
        try:
            if file.exists() and key in read_json(file, name):
                return name
        except (CheckpointError, OSError, TypeError):
            continue
    return "the tokenizer's"
