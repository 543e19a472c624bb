"""Greedy captions with :func:`fusion.generate`, and exact-match accuracy."""

import torch

from fusion import EarlyFusion, generate
from recipes.captioner.batching import prompt_tokens
from recipes.captioner.model import image_input
from recipes.captioner.shapes import max_caption_words
from recipes.captioner.tokenizer import CaptionTokenizer


@torch.no_grad()
def greedy_captions(
    model: EarlyFusion,
    images: torch.Tensor,
    tokenizer: CaptionTokenizer,
    *,
    tokens_per_image: int,
    batch_size: int,
) -> list[str]:
    """One greedy caption per image of ``images`` (uint8 [n, 3, h, w], as the dataset renders
    them), in order.

    Each batch's prompts are ``<image> * tokens_per_image, describe:``; the encoder runs once at
    prefill, then :func:`fusion.generate` (``temperature=0``: argmax) decodes with the KV cache
    until ``<eos>`` or the longest caption plus ``<eos>``. Generated text is decoded up to the
    first ``<eos>``; anything malformed stays in the text, so it cannot match by accident.
    """
    device = model.decoder.tok_embeddings.weight.device
    captions = []
    for start in range(0, images.size(0), batch_size):
        pixels = images[start : start + batch_size].to(device).float() / 255
        prompts = prompt_tokens(tokenizer, pixels.size(0), tokens_per_image).to(device)
        out = generate(
            model,
            prompts,
            encoder_input=image_input(pixels),
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
