"""Tiny model directories with processors, tokenizers and the chat templates their families
ship (shortened), written by transformers in the tests; images and conversation files."""

import json

import pytest
from PIL import Image

from vlm_helpers import (
    CLIP_CONFIG,
    IDEFICS3_TOKENS,
    IDEFICS3_VISION_CONFIG,
    IMAGE_ID,
    TEXT_CONFIG,
    char_tokenizer,
    hf_tokenizer,
    make_image,
)

# llava-hf/llava-1.5's template, with the {% generation %} tags transformers' docs add.
LLAVA_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] != 'system' %}{{ message['role'].upper() + ': ' }}{% endif %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\\n' }}{% endfor %}"
    "{% if message['role'] == 'assistant' %}{% generation %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ content['text'] }}{% endfor %}{{ eos_token }}{% endgeneration %}{{ ' ' }}"
    "{% else %}{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ content['text'] + ' ' }}{% endfor %}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)
# HuggingFaceM4/Idefics3-8B-Llama3's ("<|begin_of_text|>" is this tokenizer's "<s>").
IDEFICS3_TEMPLATE = (
    "<s>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}"
    "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
# HuggingFaceTB/SmolVLM-Instruct's: the same turns after "<|im_start|>" (not BOS here).
SMOLVLM_TEMPLATE = IDEFICS3_TEMPLATE.replace("<s>", "<|im_start|>", 1)
# meta-llama/Llama-3.2-1B-Instruct's, without tools and dates.
LLAMA_TEMPLATE = (
    "{% for message in messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}"
)
EXTRA_SPECIALS = ["<|im_start|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


def tokenizer():
    """The character tokenizer of ``vlm_helpers`` plus the chat tokens of the templates."""
    tok = char_tokenizer()
    tok.add_special_tokens(EXTRA_SPECIALS)
    return tok


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    """``{family: (directory, transformers processor or tokenizer)}`` for ``llava``,
    ``idefics3``, ``smolvlm`` and ``llama`` (tokenizer only)."""
    from transformers import (
        CLIPImageProcessor,
        Idefics3Config,
        Idefics3ImageProcessor,
        Idefics3Processor,
        LlavaConfig,
        LlavaProcessor,
        SmolVLMConfig,
        SmolVLMImageProcessor,
    )

    dirs = {}
    directory = tmp_path_factory.mktemp("llava")
    LlavaConfig(
        vision_config={"model_type": "clip_vision_model", **CLIP_CONFIG},
        text_config={"model_type": "llama", **TEXT_CONFIG},
        image_token_index=IMAGE_ID,
    ).save_pretrained(directory)  # encoding reads the config only: no weights
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessor(size={"shortest_edge": 16}, crop_size=16),
        tokenizer=hf_tokenizer(tokenizer()),
        patch_size=4,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=LLAVA_TEMPLATE,
    )
    processor.save_pretrained(directory)
    dirs["llava"] = (directory, processor)

    for family, config_cls, template in (
        ("idefics3", Idefics3Config, IDEFICS3_TEMPLATE),
        ("smolvlm", SmolVLMConfig, SMOLVLM_TEMPLATE),
    ):
        directory = tmp_path_factory.mktemp(family)
        config_cls(
            vision_config=IDEFICS3_VISION_CONFIG,
            text_config={"model_type": "llama", **TEXT_CONFIG},
            image_token_id=IMAGE_ID,
            scale_factor=2,
        ).save_pretrained(directory)
        # SmolVLMProcessor needs torchvision (its video processor) and num2words, which the
        # test environment lacks: SmolVLM's image processor goes into Idefics3's processor,
        # which expands images the same way.
        image_cls = SmolVLMImageProcessor if family == "smolvlm" else Idefics3ImageProcessor
        processor = Idefics3Processor(
            image_processor=image_cls(
                size={"longest_edge": 48}, max_image_size={"longest_edge": 16}
            ),
            tokenizer=hf_tokenizer(tokenizer()),
            image_seq_len=IDEFICS3_TOKENS,
            chat_template=template,
        )
        processor.save_pretrained(directory)
        dirs[family] = (directory, processor)

    directory = tmp_path_factory.mktemp("llama")
    (directory / "config.json").write_text(
        json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]})
    )
    hf = hf_tokenizer(tokenizer())
    hf.chat_template = LLAMA_TEMPLATE
    hf.save_pretrained(directory)
    dirs["llama"] = (directory, hf)
    return dirs


@pytest.fixture
def write_images():
    """``write_images(directory, sizes)``: PNG files ``img{i}.png`` of the given (height,
    width) in ``directory``; returns their names."""

    def write(directory, sizes):
        names = []
        for i, (h, w) in enumerate(sizes):
            name = f"img{i}.png"
            Image.fromarray(make_image(h, w, i)).save(directory / name)
            names.append(name)
        return names

    return write


@pytest.fixture
def write_jsonl():
    """``write_jsonl(path, records)``: one JSON object (or raw string) per line."""

    def write(path, records):
        lines = [r if isinstance(r, str) else json.dumps(r) for r in records]
        path.write_text("\n".join(lines) + "\n")
        return path

    return write


@pytest.fixture
def one_thread():
    """Tiny models run faster on one thread than on two shared, busy cores."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
