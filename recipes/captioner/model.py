"""The captioning model: the recipe's small vision encoder fused early into a Llama decoder;
its optimizer and its greedy captions."""

from collections.abc import Iterable

import torch
from torch import nn

from fusion import EarlyFusion, TransformerDecoder, generate
from fusion.models import llama3_2
from fusion.training import adamw_warmup_cosine
from recipes.captioner.batching import prompt_tokens, sequence_length
from recipes.captioner.config import TrainConfig
from recipes.captioner.shapes import caption_words, max_caption_words
from recipes.captioner.tokenizer import CaptionTokenizer
from recipes.captioner.vision import VisionEncoder

ENCODER_NAME = "image"


def build_tokenizer() -> CaptionTokenizer:
    return CaptionTokenizer(caption_words())


def tokens_per_image(config: TrainConfig) -> int:
    return (config.image_size // config.patch_size) ** 2  # one per patch


def build_decoder(config: TrainConfig) -> TransformerDecoder:
    """The text decoder alone, exactly as inside :func:`build_model`; plain RoPE (short rows)."""
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
    """A trainable ``EarlyFusion`` of a ``VisionEncoder`` and a decoder, from the global RNG."""
    decoder = build_decoder(config)
    encoder = VisionEncoder(
        image_size=config.image_size,
        patch_size=config.patch_size,
        dim=config.encoder_dim,
        num_layers=config.encoder_layers,
        num_heads=config.encoder_heads,
        out_dim=config.decoder_dim,
    )
    # Tied embeddings at std d ** -0.5 (not nn.Embedding's 1) keep the first logits O(1), and
    # positions at std 0.5 show the patches' places from the first step: this small model
    # learns in hundreds rather than thousands of steps.
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


def build_optimizer(
    params: Iterable[nn.Parameter], config: TrainConfig
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """The job's AdamW and schedule (:func:`fusion.training.adamw_warmup_cosine`)."""
    return adamw_warmup_cosine(
        params, lr=config.lr, weight_decay=config.weight_decay, warmup=config.warmup_steps,
        total=config.steps,
    )  # fmt: skip


def image_input(images: torch.Tensor) -> dict[str, dict[str, torch.Tensor]]:
    return {ENCODER_NAME: {"images": images}}


@torch.no_grad()
def greedy_captions(model: EarlyFusion, images: torch.Tensor, batch_size: int) -> list[str]:
    """One greedy caption per image of ``images`` (uint8 [n, 3, h, w]), ``batch_size`` at a
    time; anything malformed stays in the text, so it cannot match by accident."""
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
