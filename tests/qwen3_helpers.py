"""Tiny random Qwen3-VL models that ``transformers`` builds in the tests (nothing downloaded):
a head_dim of its own, q/k norms, interleaved M-RoPE and two DeepStack layers; and model
directories as the Hub carries them."""

import json
from pathlib import Path

import torch

from qwen_helpers import EOS, IMAGE_PAD, PAD, VIDEO_PAD, VISION_END, VISION_START, VOCAB
from vlm_helpers import randomize

PATCH = 16
PATCH_WIDTH = 3 * 2 * PATCH * PATCH
TEXT_CONFIG = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,  # not hidden_size / heads
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-6,
    # 8 frequencies: rows t h w t h w t t, interleaved
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10_000.0,
        "mrope_section": [4, 2, 2],
        "mrope_interleaved": True,
    },
    "pad_token_id": PAD,
    "bos_token_id": None,
    "eos_token_id": EOS,
}
VISION_CONFIG = {
    "depth": 3,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_heads": 2,
    "out_hidden_size": 32,
    "patch_size": PATCH,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "num_position_embeddings": 16,  # a 4 x 4 table, resampled to every grid
    "deepstack_visual_indexes": [0, 2],
}


def tiny_hf_qwen3(seed: int = 0, *, tied: bool = False):
    """A random ``Qwen3VLForConditionalGeneration`` in fp32 eval mode."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    config = Qwen3VLConfig(
        text_config=dict(TEXT_CONFIG),
        vision_config=dict(VISION_CONFIG),
        image_token_id=IMAGE_PAD,
        video_token_id=VIDEO_PAD,
        vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(seed)
    return randomize(Qwen3VLForConditionalGeneration(config).to(torch.float32), seed)


# The same text stack as fusion.models.llama3_2 arguments, for models built without transformers.
FUSION_TEXT = {
    "vocab_size": VOCAB,
    "num_layers": 3,
    "num_heads": 4,
    "num_kv_heads": 2,
    "embed_dim": 32,
    "head_dim": 16,
    "max_seq_len": 512,
    "intermediate_dim": 64,
    "rope_base": 100.0,  # fast rotations: position mistakes show at once
    "scale_factor": None,
    "tie_word_embeddings": False,
    "qk_norm": True,
    "mrope_section": [4, 2, 2],
    "mrope_interleaved": True,
}


def tiny_qwen3_vl(seed: int = 0):
    """A random Qwen3-VL ``EarlyFusion`` from :func:`fusion.models.qwen3_vl` (its decoder is
    ``llama3_2(**FUSION_TEXT)`` drawn from the same seed), weights N(0, 0.2) so that every
    position or placement mistake moves the logits."""
    from fusion.models import qwen3_vl

    torch.manual_seed(seed)
    model = qwen3_vl(text=FUSION_TEXT, vision=VISION_CONFIG, image_token_id=IMAGE_PAD)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.2)
    return model.eval()


# Qwen3.5's text stack as fusion.models.qwen3_5_text arguments: Gated DeltaNet layers around
# one gated full-attention layer (kernel 4, two key heads shared by four value heads), rotary
# on half of each 16-wide head (rotary_dim 8: 4 frequencies, t h w t interleaved).
QWEN3_5_TEXT = {
    "vocab_size": VOCAB,
    "num_layers": 4,
    "num_heads": 4,
    "num_kv_heads": 2,
    "embed_dim": 32,
    "intermediate_dim": 64,
    "max_seq_len": 512,
    "head_dim": 16,
    "layer_types": ["linear_attention", "full_attention", "linear_attention", "linear_attention"],
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "linear_conv_kernel": 4,
    "rope_base": 100.0,  # fast rotations: position mistakes show at once
    "rotary_dim": 8,
    "mrope_section": [2, 1, 1],
}
# Qwen3.5's tower: Qwen3-VL's without DeepStack.
QWEN3_5_VISION = {k: v for k, v in VISION_CONFIG.items() if k != "deepstack_visual_indexes"}


def tiny_qwen3_5(seed: int = 0, **text):
    """A random Qwen3.5 ``EarlyFusion`` from :func:`fusion.models.qwen3_5` (``QWEN3_5_TEXT``
    with ``text`` overrides), weights N(0, 0.2) so that every position, boundary or padding
    mistake moves the logits (the DeltaNet's ``A_log`` too: decays of about exp(-1) per
    token, so a state carried across a boundary still shows)."""
    from fusion.models import qwen3_5

    torch.manual_seed(seed)
    model = qwen3_5(text=QWEN3_5_TEXT | text, vision=QWEN3_5_VISION, image_token_id=IMAGE_PAD)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.2)
    return model.eval()


# Qwen3-VL-Instruct's chat template as its Hub directories carry it (chat_template.json), less
# the tool-calling branches (tools, tool_calls, tool turns), which no test renders: no default
# system prompt, a first system message rendered before the loop, images marked
# "<|vision_start|><|image_pad|><|vision_end|>" as in Qwen2-VL's, "<|im_end|>\n" closing
# every turn, whitespace trimmed by the "-" of each tag.
QWEN3_CHAT_TEMPLATE = """\
{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].content is string %}
        {{- messages[0].content }}
    {%- else %}
        {%- for content in messages[0].content %}
            {%- if 'text' in content %}
                {{- content.text }}
            {%- endif %}
        {%- endfor %}
    {%- endif %}
    {{- '<|im_end|>\\n' }}
{%- endif %}
{%- set image_count = namespace(value=0) %}
{%- set video_count = namespace(value=0) %}
{%- for message in messages %}
    {%- if message.role == "user" %}
        {{- '<|im_start|>' + message.role + '\\n' }}
        {%- if message.content is string %}
            {{- message.content }}
        {%- else %}
            {%- for content in message.content %}
                {%- if content.type == 'image' or 'image' in content or 'image_url' in content %}
                    {%- set image_count.value = image_count.value + 1 %}
                    {%- if add_vision_id %}Picture {{ image_count.value }}: {% endif -%}
                    <|vision_start|><|image_pad|><|vision_end|>
                {%- elif content.type == 'video' or 'video' in content %}
                    {%- set video_count.value = video_count.value + 1 %}
                    {%- if add_vision_id %}Video {{ video_count.value }}: {% endif -%}
                    <|vision_start|><|video_pad|><|vision_end|>
                {%- elif 'text' in content %}
                    {{- content.text }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role + '\\n' }}
        {%- if message.content is string %}
            {{- message.content }}
        {%- else %}
            {%- for content_item in message.content %}
                {%- if 'text' in content_item %}
                    {{- content_item.text }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
# Qwen3.5's chat template as its Hub repositories carry it (chat_template.jinja; transformers
# 5.24 ships none), written here to its behaviour less what no test renders (tools, tool
# calls and tool turns; add_vision_id's Picture / Video numbers; the refusal of images in a
# system message): content as a string or a list of parts (an image or video part gives
# "<|vision_start|><|image_pad|><|vision_end|>" or its video form), every message's text
# trimmed, a first system message before the loop (refused elsewhere). An assistant turn
# after the last user message opens with "<think>\n{reasoning}\n</think>\n\n" (reasoning
# from reasoning_content, else what the content holds before "</think>", else empty);
# earlier turns drop their reasoning (the template rewrites history). The generation prompt
# opens a thinking block, "<think>\n", or closes an empty one under enable_thinking=false.
QWEN3_5_CHAT_TEMPLATE = """\
{%- macro text_of(content) %}
    {%- if content is string %}
        {{- content }}
    {%- elif content is iterable and content is not mapping %}
        {%- for part in content %}
            {%- if part.type == 'image' or 'image' in part or 'image_url' in part %}
                {{- '<|vision_start|><|image_pad|><|vision_end|>' }}
            {%- elif part.type == 'video' or 'video' in part %}
                {{- '<|vision_start|><|video_pad|><|vision_end|>' }}
            {%- elif 'text' in part %}
                {{- part.text }}
            {%- else %}
                {{- raise_exception('Unexpected item type in content.') }}
            {%- endif %}
        {%- endfor %}
    {%- elif content is not none and content is defined %}
        {{- raise_exception('Unexpected content type.') }}
    {%- endif %}
{%- endmacro %}
{%- if not messages %}
    {{- raise_exception('No messages provided.') }}
{%- endif %}
{%- if messages[0].role == 'system' %}
    {%- set content = text_of(messages[0].content)|trim %}
    {{- '<|im_start|>system\\n' + content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(last_query_index=-1) %}
{%- for message in messages %}
    {%- if message.role == 'user' %}
        {%- set ns.last_query_index = loop.index0 %}
    {%- endif %}
{%- endfor %}
{%- if ns.last_query_index < 0 %}
    {{- raise_exception('No user query found in messages.') }}
{%- endif %}
{%- for message in messages %}
    {%- set content = text_of(message.content)|trim %}
    {%- if message.role == 'system' %}
        {%- if not loop.first %}
            {{- raise_exception('System message must be at the beginning.') }}
        {%- endif %}
    {%- elif message.role == 'user' %}
        {{- '<|im_start|>user\\n' + content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set reasoning = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].rstrip('\\n') %}
            {%- set reasoning = reasoning.split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {{- '<|im_start|>assistant\\n<think>\\n' + reasoning|trim + '\\n</think>\\n\\n' }}
            {{- content }}
        {%- else %}
            {{- '<|im_start|>assistant\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- else %}
        {{- raise_exception('Unexpected message role.') }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- else %}
        {{- '<think>\\n' }}
    {%- endif %}
{%- endif %}
"""
# A small pixel range (sides are multiples of 32), so that images give a few to 20 rows.
QWEN3_PIXELS = {"shortest_edge": 32 * 32, "longest_edge": 32 * 32 * 20}
# preprocessor_config.json as Qwen3-VL's Hub directories hold it (the size form, mean and std
# 0.5, the fast processor's name), with QWEN3_PIXELS.
QWEN3_PREPROCESSOR = {
    "size": QWEN3_PIXELS,
    "patch_size": PATCH,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "processor_class": "Qwen3VLProcessor",
    "image_processor_type": "Qwen2VLImageProcessorFast",
}


def write_qwen3_dir(directory: Path, seed: int = 0, *, tied: bool = False) -> Path:
    """A tiny random Qwen3-VL directory as the Hub carries one: weights and ``config.json``
    by transformers' ``save_pretrained``, the tokenizer of
    :func:`vlm_helpers.qwen_char_tokenizer`, :data:`QWEN3_CHAT_TEMPLATE` in
    ``chat_template.json`` and :data:`QWEN3_PREPROCESSOR` in ``preprocessor_config.json``."""
    from vlm_helpers import qwen_char_tokenizer, qwen_hf_tokenizer

    directory.mkdir(parents=True, exist_ok=True)
    tiny_hf_qwen3(seed, tied=tied).save_pretrained(directory)
    qwen_hf_tokenizer(qwen_char_tokenizer()).save_pretrained(directory)
    template = {"chat_template": QWEN3_CHAT_TEMPLATE}
    (directory / "chat_template.json").write_text(json.dumps(template, indent=2))
    (directory / "preprocessor_config.json").write_text(json.dumps(QWEN3_PREPROCESSOR, indent=2))
    return directory


# transformers' Qwen3_5TextConfig of the tiny models: two Gated DeltaNet layers, one gated
# full-attention layer, then one more DeltaNet (kernel 4, two key heads shared by four value
# heads), rotary on a quarter of each 32-wide head.
QWEN3_5_HF_TEXT = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 4,
    "layer_types": [*["linear_attention"] * 2, "full_attention", "linear_attention"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "linear_conv_kernel_dim": 4,
    "max_position_embeddings": 1024,
    "pad_token_id": PAD,
    "eos_token_id": EOS,
}
QWEN3_5_HF_ROPE = {"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.25}


def randomize_qwen3_5(model, seed: int):
    """:func:`vlm_helpers.randomize`, less 1 on the text stack's norms: those are zero-centred
    (x * (1 + w)), so the effective scales are randomize's [0.5, 1.5] (the DeltaNet's gated
    output norm is a plain one)."""
    torch.manual_seed(seed)
    model = randomize(model.to(torch.float32), seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if (
                "norm" in name
                and "linear_attn.norm" not in name
                and not name.startswith("model.visual.")
            ):
                param.sub_(1.0)
    return model


def tiny_hf_qwen3_5(seed: int = 2, *, vocab: int = VOCAB, ids: dict | None = None):
    """A random ``Qwen3_5ForConditionalGeneration``: the text stack of
    :data:`QWEN3_5_HF_TEXT` with interleaved M-RoPE, and Qwen3-VL's tower without DeepStack;
    ``ids``: the special ids (image, video, vision start and end; default Qwen-VL's test ids).
    Seed 2: greedy decoding that does not settle on one token."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    rope = QWEN3_5_HF_ROPE | {"mrope_section": [2, 1, 1], "mrope_interleaved": True}
    text = QWEN3_5_HF_TEXT | {"vocab_size": vocab, "rope_parameters": rope}
    vision = {
        key: value for key, value in VISION_CONFIG.items() if key != "deepstack_visual_indexes"
    }
    ids = ids or {
        "image_token_id": IMAGE_PAD,
        "video_token_id": VIDEO_PAD,
        "vision_start_token_id": VISION_START,
        "vision_end_token_id": VISION_END,
    }
    config = Qwen3_5Config(text_config=text, vision_config=vision, **ids)
    return randomize_qwen3_5(Qwen3_5ForConditionalGeneration(config), seed)


def tiny_hf_qwen3_5_text(seed: int = 2, *, vocab: int = VOCAB, tied: bool = False):
    """A random ``Qwen3_5ForCausalLM`` (``qwen3_5_text``): the text stack of
    :data:`QWEN3_5_HF_TEXT`, with the rotary settings transformers writes for it (no M-RoPE
    section)."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    config = Qwen3_5TextConfig(
        **QWEN3_5_HF_TEXT,
        vocab_size=vocab,
        rope_parameters=dict(QWEN3_5_HF_ROPE),
        tie_word_embeddings=tied,
    )
    return randomize_qwen3_5(Qwen3_5ForCausalLM(config), seed)


# Qwen's special tokens after the 256 byte symbols of :func:`qwen3_5_byte_tokenizer`.
QWEN3_5_SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
QWEN3_5_SPECIAL_IDS = {token: 256 + i for i, token in enumerate(QWEN3_5_SPECIALS)}


def qwen3_5_byte_tokenizer():
    """A ``Qwen3_5Tokenizer`` of the 256 byte symbols (no merges) and Qwen's special tokens.

    transformers 5.24 loads a ``qwen3_5`` directory's tokenizer as ``Qwen3_5Tokenizer``
    whatever ``tokenizer_config.json`` names, rebuilding its pipeline (NFC, its split regex,
    byte-level) from the vocabulary alone: a test tokenizer must be one of that class, whose
    ``tokenizer.json`` then holds that pipeline, as the published ones do."""
    from transformers import Qwen3_5Tokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {symbol: i for i, symbol in enumerate(bytes_to_unicode().values())}
    tokenizer = Qwen3_5Tokenizer(vocab=vocab, merges=[])
    tokenizer.add_special_tokens({"additional_special_tokens": QWEN3_5_SPECIALS})
    ids = [tokenizer.convert_tokens_to_ids(t) for t in QWEN3_5_SPECIALS]
    assert ids == list(QWEN3_5_SPECIAL_IDS.values())
    return tokenizer


def write_qwen3_5_dir(directory: Path, seed: int = 0) -> Path:
    """A tiny random Qwen3.5 directory as the Hub carries one: weights and ``config.json`` by
    transformers' ``save_pretrained`` (a vocabulary of 320: the byte tokenizer's ids),
    :func:`qwen3_5_byte_tokenizer`, :data:`QWEN3_5_CHAT_TEMPLATE` in ``chat_template.jinja``
    and :data:`QWEN3_PREPROCESSOR` in ``preprocessor_config.json``."""
    directory.mkdir(parents=True, exist_ok=True)
    ids = {
        f"{name}_token_id": QWEN3_5_SPECIAL_IDS[f"<|{name}|>"]
        for name in ("image_pad", "video_pad", "vision_start", "vision_end")
    }
    ids["image_token_id"] = ids.pop("image_pad_token_id")
    ids["video_token_id"] = ids.pop("video_pad_token_id")
    tiny_hf_qwen3_5(seed, vocab=320, ids=ids).save_pretrained(directory)
    qwen3_5_byte_tokenizer().save_pretrained(directory)
    (directory / "chat_template.jinja").write_text(QWEN3_5_CHAT_TEMPLATE)
    (directory / "preprocessor_config.json").write_text(json.dumps(QWEN3_PREPROCESSOR, indent=2))
    return directory


def write_qwen3_5_text_dir(directory: Path, seed: int = 0) -> Path:
    """A tiny random text-only Qwen3.5 directory (``Qwen3_5ForCausalLM``, a vocabulary of 320:
    the byte tokenizer's ids) with :func:`qwen3_5_byte_tokenizer` and
    :data:`QWEN3_5_CHAT_TEMPLATE` in ``chat_template.jinja``."""
    directory.mkdir(parents=True, exist_ok=True)
    tiny_hf_qwen3_5_text(seed, vocab=320).save_pretrained(directory)
    qwen3_5_byte_tokenizer().save_pretrained(directory)
    (directory / "chat_template.jinja").write_text(QWEN3_5_CHAT_TEMPLATE)
    return directory


def with_config(source: Path, target: Path, edit) -> Path:
    """``target``: ``source``'s weights (linked) and its config.json edited by ``edit``."""
    target.mkdir()
    config = json.loads((source / "config.json").read_text())
    edit(config)
    (target / "config.json").write_text(json.dumps(config))
    for weights in source.glob("*.safetensors*"):
        (target / weights.name).symlink_to(weights)
    return target


def check_refused_unbuilt(directory: Path, key: str, message: str) -> None:
    """``load_hf_model(directory)`` raises a ``CheckpointError`` matching ``message`` that
    names ``directory``'s config.json and ``key``, before any module is built."""
    from unittest import mock

    import pytest

    from fusion.checkpoint import CheckpointError, load_hf_model

    with mock.patch.object(torch.nn.Module, "__init__", side_effect=AssertionError("built")):
        with pytest.raises(CheckpointError, match=message) as error:
            load_hf_model(directory)
    assert error.value.key == key
    assert error.value.file == directory / "config.json"
    assert key.rsplit(".", 1)[-1] in str(error.value)
