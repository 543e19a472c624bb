"""Training sequences and batches: ``<image> * T, describe:, caption words, <eos>, <pad>...``,
all of one length, read without their last token and trained to predict them without their
first; only targets that are caption words or ``<eos>`` count in the loss."""

from dataclasses import dataclass

import torch

from fusion.data import IGNORE_INDEX
from recipes.captioner.shapes import ShapesSplit, max_caption_words
from recipes.captioner.tokenizer import CaptionTokenizer


def sequence_length(tokens_per_image: int) -> int:
    """Length of a model input: the prompt, the longest caption and ``<eos>``, less one."""
    return tokens_per_image + 1 + max_caption_words()


def prompt_tokens(tokenizer: CaptionTokenizer, n: int, tokens_per_image: int) -> torch.Tensor:
    """``n`` prompts ``<image> * tokens_per_image, describe:`` as ids [n, tokens_per_image + 1]."""
    prompt = [tokenizer.image_id] * tokens_per_image + [tokenizer.prompt_id]
    return torch.tensor([prompt] * n, dtype=torch.long)


def encode_captions(
    tokenizer: CaptionTokenizer, captions: list[str], tokens_per_image: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Model inputs and labels of ``captions``, int64 [n, sequence_length(tokens_per_image)]
    each (labels ``IGNORE_INDEX`` where no target counts). A caption longer than the data
    set's longest, or with unknown words, is a ``ValueError``."""
    prompt = prompt_tokens(tokenizer, 1, tokens_per_image)[0].tolist()
    full = sequence_length(tokens_per_image) + 1
    tokens, labels = [], []
    for text in captions:
        target = [*tokenizer.encode(text), tokenizer.eos_id]
        if len(prompt) + len(target) > full:
            raise ValueError(
                f"captions: expected at most {max_caption_words()} words, got {text!r}"
            )
        pad = [tokenizer.pad_id] * (full - len(prompt) - len(target))
        sequence = prompt + target + pad
        tokens.append(sequence[:-1])
        # labels[j] is the target read at input position j, i.e. sequence[j + 1].
        labels.append([IGNORE_INDEX] * (len(prompt) - 1) + target + [IGNORE_INDEX] * len(pad))
    return torch.tensor(tokens, dtype=torch.long), torch.tensor(labels, dtype=torch.long)


@dataclass(frozen=True)
class CaptionBatch:
    """``tokens``, ``labels`` int64 [b, s] and ``images`` float32 [b, 3, h, w] in [0, 1]."""

    tokens: torch.Tensor
    labels: torch.Tensor
    images: torch.Tensor
    num_targets: int


class CaptionDataset:
    """A split encoded once for training (:func:`encode_captions`)."""

    def __init__(self, split: ShapesSplit, tokenizer: CaptionTokenizer, tokens_per_image: int):
        self.split = split
        self.tokens, self.labels = encode_captions(tokenizer, split.captions, tokens_per_image)
        self.targets_per_sample = (self.labels != IGNORE_INDEX).sum(1)

    def __len__(self) -> int:
        return len(self.split)

    def batch(self, indices: torch.Tensor, device: str | torch.device = "cpu") -> CaptionBatch:
        """The samples at ``indices`` [b] (int64), in that order, on ``device``."""
        tokens, labels, pixels = (
            t[indices].to(device, non_blocking=True)
            for t in (self.tokens, self.labels, self.split.images)
        )
        return CaptionBatch(tokens, labels, pixels.float() / 255, self.count_targets(indices))

    def count_targets(self, indices: torch.Tensor) -> int:
        """Number of loss targets in the samples at ``indices``, counted on the host."""
        return int(self.targets_per_sample[indices].sum())
