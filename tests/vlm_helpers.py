"""Tiny random ``transformers`` vision-language models, a character tokenizer and images, built
in the tests (nothing downloaded), shared by the LLaVA / Idefics3 tests."""

import string
from pathlib import Path

import numpy as np
import torch

TEXT_VOCAB = 128
PAD, BOS, EOS = 0, 1, 2
SPECIALS = [
    "<pad>",
    "<s>",
    "</s>",
    "<unk>",
    "<image>",
    "<fake_token_around_image>",
    "<global-img>",
    "<end_of_utterance>",
    *(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)),
]
IMAGE_ID = SPECIALS.index("<image>")  # inside the vocabulary, as Hugging Face models need
CHARS = string.ascii_letters + string.digits + " .,:;!?'\n"

TEXT_CONFIG = {
    "vocab_size": TEXT_VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rope_theta": 500_000.0,
    "rms_norm_eps": 1e-5,
    "bos_token_id": BOS,
    "eos_token_id": EOS,
    "pad_token_id": PAD,
}
CLIP_CONFIG = {
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 2,
    "image_size": 16,
    "patch_size": 4,
}
IDEFICS3_VISION_CONFIG = {
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "image_size": 16,
    "patch_size": 2,
}
LLAVA_TOKENS = 16  # (16 / 4) ** 2 patches, class token dropped
IDEFICS3_TOKENS = 16  # (16 / 2) ** 2 patches, 2 x 2 pixel shuffle


def randomize(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Weights drawn so that layout mistakes show: N(0, 0.1) everywhere, norm scales from
    [0.5, 1.5] (initialised to ones otherwise), biases nonzero."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                param.copy_(torch.rand(param.shape, generator=generator) + 0.5)
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    return model.eval()


def tiny_hf_llava(seed: int = 0, *, tied: bool = False, **config):
    """A random ``LlavaForConditionalGeneration`` (CLIP 16 x 16 images, 4 x 4 patches, 16 rows
    per image), in eval mode; ``config`` overrides ``LlavaConfig`` fields."""
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    settings = {
        "vision_config": {"model_type": "clip_vision_model", **CLIP_CONFIG},
        "text_config": {"model_type": "llama", **TEXT_CONFIG, "tie_word_embeddings": tied},
        "image_token_index": IMAGE_ID,
        "tie_word_embeddings": tied,
        **config,
    }
    model = LlavaForConditionalGeneration(LlavaConfig(**settings))
    return randomize(model, seed)


def tiny_hf_idefics3(seed: int = 0, *, smolvlm: bool = False, tied: bool = False, **config):
    """A random ``Idefics3ForConditionalGeneration`` (or ``SmolVLMForConditionalGeneration``):
    16 x 16 tiles, 2 x 2 patches, 2 x 2 pixel shuffle, 16 rows per tile."""
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        SmolVLMConfig,
        SmolVLMForConditionalGeneration,
    )

    config_cls, model_cls = (
        (SmolVLMConfig, SmolVLMForConditionalGeneration)
        if smolvlm
        else (Idefics3Config, Idefics3ForConditionalGeneration)
    )
    settings = {
        "vision_config": IDEFICS3_VISION_CONFIG,
        "text_config": {"model_type": "llama", **TEXT_CONFIG, "tie_word_embeddings": tied},
        "image_token_id": IMAGE_ID,
        "scale_factor": 2,
        "tie_word_embeddings": tied,
        **config,
    }
    model = model_cls(config_cls(**settings))
    return randomize(model, seed)


def tiny_hf_processor(kind: str, tokenizer, chat_template: str | None = None):
    """The transformers processor of a tiny ``"llava"`` or Idefics3-family model (16-pixel
    images, no tiling) around ``tokenizer``."""
    if kind == "llava":
        from transformers import CLIPImageProcessor, LlavaProcessor

        return LlavaProcessor(
            image_processor=CLIPImageProcessor(size={"shortest_edge": 16}, crop_size=16),
            tokenizer=tokenizer,
            patch_size=4,
            vision_feature_select_strategy="default",
            num_additional_image_tokens=1,
            chat_template=chat_template,
        )
    from transformers import Idefics3ImageProcessor, Idefics3Processor

    return Idefics3Processor(
        image_processor=Idefics3ImageProcessor(
            size={"longest_edge": 16},
            max_image_size={"longest_edge": 16},
            do_image_splitting=False,
        ),
        tokenizer=tokenizer,
        image_seq_len=IDEFICS3_TOKENS,
        chat_template=chat_template,
    )


def char_tokenizer():
    """A ``tokenizers.Tokenizer``: one token per character of :data:`CHARS`, the special tokens
    of LLaVA and Idefics3 prompts as added tokens, ``<s>`` prepended."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, processors

    vocab = {token: i for i, token in enumerate([*SPECIALS, *CHARS])}
    assert len(vocab) <= TEXT_VOCAB
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.add_special_tokens(SPECIALS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", BOS)]
    )
    return tokenizer


def hf_tokenizer(tokenizer):
    """The same tokenizer as ``transformers`` wraps it."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
    )


def make_image(height: int, width: int, seed: int = 0, channels: int = 3) -> np.ndarray:
    """uint8 [height, width, channels] (channels-last, as Pillow takes it): smooth gradients
    and noise, so that resizing errors show."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack(
        [(x * 255 / max(width - 1, 1)), (y * 255 / max(height - 1, 1)), ((x + y) * 7) % 256], -1
    )
    noisy = base[..., :channels] * 0.7 + rng.integers(0, 77, (height, width, 1))
    if channels == 4:
        noisy = np.concatenate([base, rng.integers(0, 256, (height, width, 1))], -1)
    return np.clip(noisy, 0, 255).astype(np.uint8)


def as_tensor(array: np.ndarray) -> torch.Tensor:
    """[h, w, c] uint8 array -> [c, h, w] uint8 tensor."""
    return torch.from_numpy(np.array(array)).permute(2, 0, 1).contiguous()


# Qwen2-VL / Qwen2.5-VL: a character tokenizer with Qwen's special tokens, for tiny models of
# 160 tokens (<|endoftext|> pads, <|im_end|> ends, the vision tokens are 150 to 153).
QWEN_VOCAB = 160
QWEN_SPECIAL_IDS = {
    "<|endoftext|>": 0,
    "<|im_start|>": 1,
    "<|im_end|>": 2,
    "<unk>": 3,
    "<|vision_start|>": 150,
    "<|vision_end|>": 151,
    "<|image_pad|>": 152,
    "<|video_pad|>": 153,
}
QWEN_IMAGE_MARKER = "<|vision_start|><|image_pad|><|vision_end|>"


def qwen_char_tokenizer():
    """A ``tokenizers.Tokenizer``: one token per character of :data:`CHARS` (ids from 4), Qwen's
    special tokens as added tokens at :data:`QWEN_SPECIAL_IDS`; nothing prepended, as Qwen's
    tokenizers prepend nothing."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    vocab = dict(QWEN_SPECIAL_IDS) | {c: 4 + i for i, c in enumerate(CHARS)}
    assert max(vocab.values()) < QWEN_VOCAB and len(set(vocab.values())) == len(vocab)
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.add_special_tokens([t for t in QWEN_SPECIAL_IDS if t != "<unk>"])
    return tokenizer


def qwen_hf_tokenizer(tokenizer):
    """The same tokenizer as ``transformers`` wraps it."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token="<unk>",
        pad_token="<|endoftext|>",
        eos_token="<|im_end|>",
    )


def without_torchvision_video(monkeypatch) -> None:
    """Let ``transformers`` build Qwen2-VL's processors without torchvision: their video
    processor needs it, images do not use it (it is loaded as None and its class check
    skipped)."""
    from transformers.models.auto.video_processing_auto import AutoVideoProcessor
    from transformers.processing_utils import ProcessorMixin

    monkeypatch.setattr(ProcessorMixin, "check_argument_for_proper_class", lambda *a: None)
    monkeypatch.setattr(AutoVideoProcessor, "from_pretrained", classmethod(lambda *a, **k: None))


def trl_features():
    """The ``datasets.Features`` of TRL's vision data sets: ``messages`` (role, content parts of
    type and text) and ``images`` embedded as ``datasets.Image``."""
    import datasets

    part = {"type": datasets.Value("string"), "text": datasets.Value("string")}
    message = {"role": datasets.Value("string"), "content": datasets.List(part)}
    return datasets.Features(
        {"messages": datasets.List(message), "images": datasets.List(datasets.Image())}
    )


# A chat template in the characters of the tests' tokenizer: "role:" headers, images where
# the content puts them, "<end_of_utterance>" and a newline closing every turn.
TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}:"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>{% else %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
END_OF_TURN = "<end_of_utterance>"


def write_model(kind: str, directory: Path, seed: int = 0) -> Path:
    """A tiny random model of ``kind`` saved by transformers with its tokenizer, processor
    and :data:`TEMPLATE`."""
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = hf_tokenizer(char_tokenizer())
    if kind == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        model = randomize(LlamaForCausalLM(LlamaConfig(**TEXT_CONFIG)), seed)
        model.save_pretrained(directory)
        tokenizer.chat_template = TEMPLATE
        tokenizer.save_pretrained(directory)
        return directory
    if kind == "llava":
        model = tiny_hf_llava(seed)
    else:
        model = tiny_hf_idefics3(seed, smolvlm=kind == "smolvlm")
    processor = tiny_hf_processor(kind, tokenizer, TEMPLATE)
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    return directory
