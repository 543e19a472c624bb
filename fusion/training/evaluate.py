"""Held-out evaluation: greedy captions with :func:`fusion.generate` and exact-match accuracy."""

import torch

from fusion.data import CaptionTokenizer, ShapesSplit, max_caption_words, prompt_tokens
from fusion.early_fusion import EarlyFusion
from fusion.generation import generate
from fusion.training.model import image_input


@torch.no_grad()
def greedy_captions(
    model: EarlyFusion,
    split: ShapesSplit,
    tokenizer: CaptionTokenizer,
    *,
    tokens_per_image: int,
    batch_size: int,
) -> list[str]:
    """One greedy caption per image of ``split``, in order.

    Each batch's prompts are ``<image> * tokens_per_image, describe:``; the encoder runs once at
    prefill, then :func:`fusion.generate` (``temperature=0``: argmax) decodes with the KV cache
    until ``<eos>`` or the longest caption plus ``<eos>``. Generated text is decoded up to the
    first ``<eos>``; anything malformed stays in the text, so it cannot match by accident.
    """
    device = model.decoder.tok_embeddings.weight.device
    captions = []
    for start in range(0, len(split), batch_size):
        images = split.images[start : start + batch_size].to(device).float() / 255
        prompts = prompt_tokens(tokenizer, images.size(0), tokens_per_image).to(device)
        out = generate(
            model,
            prompts,
            encoder_input=image_input(images),
            max_new_tokens=max_caption_words() + 1,
            temperature=0.0,
            stop_tokens=(tokenizer.eos_id,),
            pad_id=tokenizer.pad_id,
        )
        new = out[:, prompts.size(1) :].tolist()
        captions += [tokenizer.decode(ids) for ids in new]
    return captions


def exact_match(predictions: list[str], references: list[str]) -> float:
    """Fraction of ``predictions`` equal to their reference, word for word.

    Raises:
        ValueError: the lists differ in length or are empty.
    """
    if len(predictions) != len(references) or not references:
        raise ValueError(
            f"predictions: expected as many as the {len(references)} references (at least one), "
            f"got {len(predictions)}"
        )
    return sum(p == r for p, r in zip(predictions, references, strict=True)) / len(references)
