"""Tiny random Gemma 3 models written by transformers' own classes, and what the Gemma 3 tests
share."""

import json
import string
from collections.abc import Callable
from pathlib import Path

import torch

from vlm_helpers import randomize

VOCAB = 96
WINDOW = 5  # shorter than the test sequences: the sliding layers' window matters
# Sliding, full, sliding, sliding: both kinds, the first layer not a full one.
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]
TEXT_CONFIG = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": len(LAYER_TYPES),
    "layer_types": LAYER_TYPES,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "query_pre_attn_scalar": 24,  # not head_dim: the scale matters
    "sliding_window": WINDOW,
    "max_position_embeddings": 256,
    "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1_000_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    },
    "final_logit_softcapping": 8.0,
    "pad_token_id": 0,
    "bos_token_id": 2,
    "eos_token_id": 1,
}


def tiny_hf_gemma3_text(seed: int = 0, *, attn_implementation: str = "eager", **config):
    """A random ``Gemma3ForCausalLM`` of :data:`TEXT_CONFIG` (``config`` overrides it), tied,
    fp32, in eval mode. The norms' effective scales ``1 + w`` drawn from [0.5, 1.5]."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    settings = {**TEXT_CONFIG, **config, "attn_implementation": attn_implementation}
    torch.manual_seed(seed)
    model = randomize(Gemma3ForCausalLM(Gemma3TextConfig(**settings)), seed)
    with torch.no_grad():  # randomize draws norms from [0.5, 1.5]; Gemma's are 1 + w
        for name, param in model.named_parameters():
            if "norm" in name:
                param.sub_(1.0)
    return model


# The vision model: special ids at the top of the vocabulary, a 32 x 32 SigLIP of 4 x 4 patches
# (an 8 x 8 grid) pooled to 16 rows, longer than the window (so the window's clamp matters).
BOI, EOI, IMAGE = VOCAB - 3, VOCAB - 2, VOCAB - 1
IMAGE_ROWS = 16
IMAGE_SIZE = 32
VISION_CONFIG = {
    "model_type": "siglip_vision_model",
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "image_size": IMAGE_SIZE,
    "patch_size": 4,
    "layer_norm_eps": 1e-6,
    "vision_use_head": False,
}


def tiny_hf_gemma3(seed: int = 0, *, attn_implementation: str = "eager"):
    """A random ``Gemma3ForConditionalGeneration``: :data:`TEXT_CONFIG`'s text stack, a tiny
    SigLIP tower, :data:`IMAGE_ROWS` rows per image; fp32, eval mode, the zero-centred norms'
    effective scales from [0.5, 1.5]."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    # no final_logit_softcapping: Gemma3ForConditionalGeneration never applies it
    text = {**TEXT_CONFIG, "model_type": "gemma3_text", "final_logit_softcapping": None}
    config = Gemma3Config(
        text_config=text,
        vision_config=VISION_CONFIG,
        mm_tokens_per_image=IMAGE_ROWS,
        boi_token_index=BOI,
        eoi_token_index=EOI,
        image_token_index=IMAGE,
        attn_implementation=attn_implementation,
    )
    torch.manual_seed(seed)
    model = randomize(Gemma3ForConditionalGeneration(config), seed)
    with torch.no_grad():  # the text stack's and the projector's norms are 1 + w
        for name, param in model.named_parameters():
            if "norm" in name and "vision_tower" not in name:
                param.sub_(1.0)
    return model


def image_text(images: int) -> list[int]:
    """The ids the processor writes for ``images`` images: each ``<start_of_image>``, its
    rows of placeholders and ``<end_of_image>`` (the blank lines around them left out)."""
    return [BOI, *[IMAGE] * IMAGE_ROWS, EOI] * images


def max_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def with_config(source: Path, target: Path, edit: Callable[[dict], None]) -> Path:
    """``target``: ``source``'s weights (linked) and its config.json edited by ``edit``."""
    target.mkdir()
    config = json.loads((source / "config.json").read_text())
    edit(config)
    (target / "config.json").write_text(json.dumps(config))
    for weights in source.glob("*.safetensors*"):
        (target / weights.name).symlink_to(weights)
    return target


# ---------------------------------------------------------------------- whole directories

# Gemma 3's chat template as its directories carry it: <bos>, a system message folded into the
# first user turn, turns as <start_of_turn>{user|model}\n...<end_of_turn>\n, images as
# <start_of_image>, roles that do not alternate refused by raise_exception.
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- if messages[0]['content'] is string -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}"
    "{%- endif -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = '' -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- if message['role'] == 'assistant' -%}{%- set role = 'model' -%}"
    "{%- else -%}{%- set role = message['role'] -%}{%- endif -%}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}"
    "{%- if message['content'] is string -%}{{ message['content'] | trim }}"
    "{%- elif message['content'] is iterable -%}"
    "{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' -%}{{ '<start_of_image>' }}"
    "{%- elif item['type'] == 'text' -%}{{ item['text'] | trim }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- else -%}{{ raise_exception('Invalid content type') }}{%- endif -%}"
    "{{ '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)
# The tokenizer's special tokens at their ids (pad, eos, bos as TEXT_CONFIG says; the image
# markers at the top of the vocabulary, as the vision model's ids), one id per character of
# TOKENIZER_CHARS between them.
TOKENIZER_SPECIALS = {
    "<pad>": 0,
    "<eos>": 1,
    "<bos>": 2,
    "<start_of_turn>": 3,
    "<end_of_turn>": 4,
    "<start_of_image>": BOI,
    "<end_of_image>": EOI,
    "<image_soft_token>": IMAGE,
}
TOKENIZER_CHARS = string.ascii_letters + string.digits + " .,:;!?'\n"


def gemma3_tokenizer():
    """transformers' fast tokenizer over a character vocabulary of :data:`VOCAB` ids with
    Gemma 3's special tokens (:data:`TOKENIZER_SPECIALS`) and image markers, and
    :data:`GEMMA3_CHAT_TEMPLATE`."""
    from tokenizers import AddedToken, Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = iter(TOKENIZER_CHARS)
    vocab = {}
    for i in range(VOCAB):
        token = next((t for t, j in TOKENIZER_SPECIALS.items() if j == i), None)
        vocab[token if token is not None else next(chars, f"<unused{i}>")] = i
    assert set(TOKENIZER_CHARS) <= set(vocab)
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in TOKENIZER_SPECIALS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        chat_template=GEMMA3_CHAT_TEMPLATE,
        extra_special_tokens={
            "boi_token": "<start_of_image>",
            "eoi_token": "<end_of_image>",
            "image_token": "<image_soft_token>",
        },
    )


def write_gemma3_text_dir(directory: Path, seed: int = 0) -> Path:
    """A tiny random Gemma 3 1B-style directory (``Gemma3ForCausalLM``) with
    :func:`gemma3_tokenizer` and its chat template."""
    directory.mkdir(parents=True, exist_ok=True)
    tiny_hf_gemma3_text(seed).save_pretrained(directory)
    gemma3_tokenizer().save_pretrained(directory)
    return directory


def pan_and_scan_settings() -> dict:
    """Pan-and-scan on, with crops of the small test images. ``Gemma3Processor`` applies its
    own defaults (off; crops of at least 256 pixels) over its image processor's saved settings:
    only settings passed to its call take effect there."""
    return {
        "do_pan_and_scan": True,
        "pan_and_scan_min_crop_size": 8,
        "pan_and_scan_max_num_crops": 4,
        "pan_and_scan_min_ratio_to_activate": 1.2,
    }


def hf_gemma3_processor(*, pan_and_scan: bool = False):
    """transformers' ``Gemma3Processor`` of the tiny vision model: its Pillow image processor
    at the tower's :data:`IMAGE_SIZE`, :func:`gemma3_tokenizer`, :data:`IMAGE_ROWS` rows per
    image."""
    from transformers import Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    image_processor = Gemma3ImageProcessorPil(
        size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        **(pan_and_scan_settings() if pan_and_scan else {}),
    )
    return Gemma3Processor(
        image_processor,
        gemma3_tokenizer(),
        chat_template=GEMMA3_CHAT_TEMPLATE,
        image_seq_length=IMAGE_ROWS,
    )


def write_gemma3_dir(directory: Path, seed: int = 0, *, pan_and_scan: bool = False) -> Path:
    """A tiny random Gemma 3 vision directory as transformers saves one: the model, and
    :func:`hf_gemma3_processor`'s tokenizer, chat template and processor settings."""
    directory.mkdir(parents=True, exist_ok=True)
    tiny_hf_gemma3(seed).save_pretrained(directory)
    hf_gemma3_processor(pan_and_scan=pan_and_scan).save_pretrained(directory)
    return directory
