"""Encoded conversations fitted to a sequence length (:func:`fit_sample`, truncated or
refused) and a whole file encoded, every sample checked (:func:`encode_conversations`,
:class:`EncodedData`)."""

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from fusion._validation import check_int
from fusion.data.conversations import Conversation, DataError
from fusion.data.sample import IGNORE_INDEX, Sample
from fusion.data.samples import ConversationEncoder


def fit_sample(
    sample: Sample,
    max_seq_len: int,
    *,
    truncate: bool = False,
    placeholder_ids: Sequence[int] = (),
) -> Sample:
    """``sample`` if it holds at most ``max_seq_len`` tokens; else, with ``truncate``, its
    first ``max_seq_len`` tokens (the answer's end cut, ``truncated=True``). A cut must keep
    every placeholder (``placeholder_ids``): its image's rows could not be placed otherwise.

    Raises:
        ValueError: too long without ``truncate``; with it, a cut that would drop
            placeholders (their images' rows could not be placed) or leave no target.
    """
    check_int(max_seq_len, "max_seq_len", low=2)
    length = len(sample)
    if length <= max_seq_len:
        return sample
    if not truncate:
        raise ValueError(
            f"{length} tokens, longer than max_seq_len={max_seq_len} (truncate cuts the answer's "
            "end)"
        )
    kept_labels = sample.labels[:max_seq_len].clone()
    kept_labels[-1] = IGNORE_INDEX  # its target was cut
    cut = sample.tokens[max_seq_len:]
    if placeholder_ids and bool(torch.isin(cut, torch.tensor(list(placeholder_ids))).any()):
        raise ValueError(
            f"{length} tokens, and cutting at max_seq_len={max_seq_len} would cut image "
            "placeholders: the prompt and images alone are too long"
        )
    if not bool((kept_labels != IGNORE_INDEX).any()):
        raise ValueError(
            f"{length} tokens, and cutting at max_seq_len={max_seq_len} leaves no answer token"
        )
    return replace(sample, tokens=sample.tokens[:max_seq_len], labels=kept_labels, truncated=True)


@dataclass(frozen=True)
class EncodedData:
    """What :func:`encode_conversations` made.

    Attributes:
        samples: the samples, in file order.
        skipped: errors of the conversations skipped (``skip_bad=True``).
        truncated: how many samples were cut (``truncate=True``).
    """

    samples: list[Sample]
    skipped: list[DataError] = field(default_factory=list)
    truncated: int = 0


def encode_conversations(
    encoder: ConversationEncoder,
    conversations: Sequence[Conversation],
    *,
    max_seq_len: int,
    truncate: bool = False,
    skip_bad: bool = False,
) -> EncodedData:
    """Encode every conversation and fit it to ``max_seq_len`` (:func:`fit_sample`), before
    any training: the first failure is a :class:`DataError` naming the file, line and
    problem, or with ``skip_bad`` the conversation is skipped and its error kept.

    Every image is decoded once here to check it, but no pixels are kept: the samples hold
    :class:`ImageRef` (path, size, tiles) and :meth:`ConversationEncoder.load_pixels` makes
    a batch's pixels when it is collated (:meth:`ConversationEncoder.check_conversation`).

    Raises:
        ValueError: ``max_seq_len`` not an integer >= 2 (before any conversation).
        DataError: a conversation that cannot be encoded or fitted (unless ``skip_bad``), or
            no sample left.
    """
    check_int(max_seq_len, "max_seq_len", low=2)
    samples, skipped, truncated = [], [], 0
    for conversation in conversations:
        try:
            sample = encoder.check_conversation(conversation)
            sample = fit_sample(
                sample, max_seq_len, truncate=truncate, placeholder_ids=encoder.placeholder_ids
            )
        except ValueError as error:
            bad = error if isinstance(error, DataError) else conversation.error(str(error))
            if not skip_bad:
                raise bad from None
            skipped.append(bad)
            continue
        truncated += sample.truncated
        samples.append(sample)
    if not samples and conversations:
        raise DataError(
            conversations[0].file, None, f"no usable conversation (first: {skipped[0]})"
        )
    return EncodedData(samples, skipped, truncated)
