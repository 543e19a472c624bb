"""The captioning model: the recipe's small vision encoder fused early into a Llama decoder,
and its greedy captions."""

import torch
from torch import nn

from fusion import EarlyFusion, TransformerDecoder, generate
from fusion.models import llama3_2
from recipes.captioner.batching import prompt_tokens, sequence_length
from recipes.captioner.config import TrainConfig
from recipes.captioner.shapes import caption_words, max_caption_words
from recipes.captioner.tokenizer import CaptionTokenizer
from recipes.captioner.vision import VisionEncoder

ENCODER_NAME = "image"


def build_tokenizer() -> CaptionTokenizer:
    """The word-level tokenizer of the shapes captions."""
    return CaptionTokenizer(caption_words())


def tokens_per_image(config: TrainConfig) -> int:
    """Image placeholders per image: one per patch."""
    return (config.image_size // config.patch_size) ** 2


def build_decoder(config: TrainConfig) -> TransformerDecoder:
    """The text decoder alone, exactly as inside :func:`build_model` (same keys and shapes):
    the caption tokenizer's vocabulary (the image id outside it), the training sequence length,
    plain RoPE (no llama3 scaling: the sequences are short)."""
    return llama3_2(
        vocab_size=build_tokenizer().vocab_size,
        num_layers=config.decoder_layers,
        num_heads=config.decoder_heads,
        num_kv_heads=config.decoder_kv_heads,
        embed_dim=config.decoder_dim,
        max_seq_len=sequence_length(tokens_per_image(config)),
        intermediate_dim=config.decoder_mlp_dim,
        rope_base=10_000,
        scale_factor=None,
    )


def build_model(config: TrainConfig) -> EarlyFusion:
    """A trainable ``EarlyFusion`` of a :class:`~recipes.captioner.vision.VisionEncoder` and a
    decoder, initialised from the current global RNG state (seed it first). The token embeddings
    (tied to the output projection) start at std ``decoder_dim ** -0.5`` instead of
    ``nn.Embedding``'s 1, so initial logits are O(1) rather than O(sqrt(d)); the encoder's
    position embeddings start at std 0.5 so patches' places are visible from the first step.
    Both make this small model learn in hundreds rather than thousands of steps.
    """
    decoder = build_decoder(config)
    encoder = VisionEncoder(
        image_size=config.image_size,
        patch_size=config.patch_size,
        dim=config.encoder_dim,
        num_layers=config.encoder_layers,
        num_heads=config.encoder_heads,
        out_dim=config.decoder_dim,
    )
    nn.init.normal_(decoder.tok_embeddings.weight, std=config.decoder_dim**-0.5)
    nn.init.normal_(encoder.patch_embedding.pos_embedding, std=0.5)
    return EarlyFusion(
        decoder,
        {ENCODER_NAME: encoder},
        {ENCODER_NAME: build_tokenizer().image_id},
        decoder_trainable=True,
        encoders_trainable=True,
        fusion_trainable=True,
    )


def image_input(images: torch.Tensor) -> dict[str, dict[str, torch.Tensor]]:
    """``encoder_input`` for a batch of images [n, 3, h, w]."""
    return {ENCODER_NAME: {"images": images}}


@torch.no_grad()
def greedy_captions(model: EarlyFusion, images: torch.Tensor, batch_size: int) -> list[str]:
    """One greedy caption per image of ``images`` (uint8 [n, 3, h, w]), in order, ``batch_size``
    at a time: :func:`fusion.generate` (argmax, KV cache) after ``<image> * tokens_per_image,
    describe:`` up to ``<eos>`` or the longest caption, decoded up to the first ``<eos>``
    (anything malformed stays in the text, so it cannot match by accident)."""
    tokenizer, device = build_tokenizer(), model.decoder.tok_embeddings.weight.device
    encoder = model.encoders[ENCODER_NAME]
    assert isinstance(encoder, VisionEncoder)
    captions = []
    for start in range(0, images.size(0), batch_size):
        pixels = images[start : start + batch_size].to(device).float() / 255
        prompts = prompt_tokens(tokenizer, pixels.size(0), encoder.tokens_per_image).to(device)
        out = generate(
            model, prompts, encoder_input=image_input(pixels), temperature=0.0,
            max_new_tokens=max_caption_words() + 1, stop_tokens=(tokenizer.eos_id,),
            pad_id=tokenizer.pad_id,
        )  # fmt: skip
        captions += [tokenizer.decode(ids) for ids in out[:, prompts.size(1) :].tolist()]
    return captions
