"""Tiny random Qwen2-VL and Qwen2.5-VL models that ``transformers`` builds in the tests
(nothing downloaded), and prompts with images of odd sizes, shared by the Qwen tests."""

import json
from pathlib import Path

import torch

from vlm_helpers import randomize

VOCAB = 160
PAD, EOS = 0, 2
VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = 150, 151, 152, 153
PATCH, MERGE, TEMPORAL = 14, 2, 2
PATCH_WIDTH = 3 * TEMPORAL * PATCH * PATCH  # one flattened patch

TEXT_CONFIG = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-6,
    # head_dim 8: 4 frequencies, split over (t, h, w)
    "rope_parameters": {"rope_type": "default", "rope_theta": 10_000.0, "mrope_section": [2, 1, 1]},
    "pad_token_id": PAD,
    "bos_token_id": None,
    "eos_token_id": EOS,
}
VISION_CONFIGS = {
    "qwen2_vl": {
        "depth": 2,
        "embed_dim": 16,
        "hidden_size": 32,
        "mlp_ratio": 2,
        "num_heads": 2,
        "patch_size": PATCH,
        "spatial_merge_size": MERGE,
        "temporal_patch_size": TEMPORAL,
    },
    # window 56 pixels = 2 x 2 merged patches: images of more than 4 x 4 patches have several
    # windows; block 1 attends over the whole image, blocks 0 and 2 within windows.
    "qwen2_5_vl": {
        "depth": 3,
        "hidden_size": 16,
        "intermediate_size": 24,
        "num_heads": 2,
        "out_hidden_size": 32,
        "patch_size": PATCH,
        "spatial_merge_size": MERGE,
        "temporal_patch_size": TEMPORAL,
        "window_size": 56,
        "fullatt_block_indexes": [1],
    },
}
MODEL_TYPES = tuple(VISION_CONFIGS)
# Qwen2.5-VL's temporal positions per second of video: not transformers' default 4, so that
# it must be read from config.json.
TOKENS_PER_SECOND = 3


def tiny_hf_qwen(model_type: str = "qwen2_5_vl", seed: int = 0, *, tied: bool = False):
    """A random ``Qwen2VLForConditionalGeneration`` or ``Qwen2_5_VLForConditionalGeneration``
    in fp32 eval mode (SDPA attention), weights from :func:`vlm_helpers.randomize`."""
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
    )

    config_class, model_class = {
        "qwen2_vl": (Qwen2VLConfig, Qwen2VLForConditionalGeneration),
        "qwen2_5_vl": (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration),
    }[model_type]
    config = config_class(
        text_config=dict(TEXT_CONFIG),
        vision_config=dict(VISION_CONFIGS[model_type])
        | ({"tokens_per_second": TOKENS_PER_SECOND} if model_type == "qwen2_5_vl" else {}),
        image_token_id=IMAGE_PAD,
        video_token_id=VIDEO_PAD,
        vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(seed)
    model = model_class(config).to(torch.float32)
    return randomize(model, seed)


def image_prompt(
    grids: list[tuple[int, int, int]],
    text_lengths: list[int],
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One sample: text runs of ``text_lengths`` (one more than images) around images of patch
    ``grids`` (t, h, w), each image as ``<|vision_start|>`` + placeholders +
    ``<|vision_end|>``. Returns (ids [1, s], pixel_values [n_patches, PATCH_WIDTH],
    image_grid_thw [n, 3])."""
    assert len(text_lengths) == len(grids) + 1
    generator = torch.Generator().manual_seed(seed)
    pieces = []
    for i, length in enumerate(text_lengths):
        pieces.append(torch.randint(3, 140, (length,), generator=generator))
        if i < len(grids):
            t, h, w = grids[i]
            rows = t * h * w // MERGE**2
            pieces.append(torch.tensor([VISION_START, *[IMAGE_PAD] * rows, VISION_END]))
    patches = sum(t * h * w for t, h, w in grids)
    pixels = torch.randn(patches, PATCH_WIDTH, generator=generator)
    grid = torch.tensor(grids, dtype=torch.long).view(-1, 3)
    return torch.cat(pieces)[None], pixels, grid


def mm_token_type_ids(ids: torch.Tensor) -> torch.Tensor:
    """What the processor emits for transformers' M-RoPE: 1 at image placeholders."""
    return (ids == IMAGE_PAD).to(torch.int32)


def left_pad(samples: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Ids [1, s_i] left-padded into [b, max s] with PAD; and the attention mask."""
    length = max(s.size(1) for s in samples)
    ids = torch.full((len(samples), length), PAD)
    mask = torch.zeros(len(samples), length, dtype=torch.long)
    for i, sample in enumerate(samples):
        ids[i, length - sample.size(1) :] = sample[0]
        mask[i, length - sample.size(1) :] = 1
    return ids, mask


# Qwen2-VL's and Qwen2.5-VL's chat template, as their Hub directories carry it
# (chat_template.json): a default system prompt, "<|vision_start|><|image_pad|><|vision_end|>"
# for each image item, "<|im_end|>\n" closing every turn.
QWEN_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# A small pixel range, so that images give a few to 20 rows (and Qwen2.5-VL several windows).
QWEN_PIXELS = {"min_pixels": 28 * 28, "max_pixels": 28 * 28 * 20}


def hf_logits(hf, ids, pixels, grid, attention_mask=None) -> torch.Tensor:
    """transformers' logits on image prompts (``mm_token_type_ids`` as its processor gives
    them, without which it falls back to 1-D positions)."""
    images = {"pixel_values": pixels, "image_grid_thw": grid} if len(grid) else {}
    with torch.no_grad():
        return hf(
            input_ids=ids,
            attention_mask=attention_mask,
            mm_token_type_ids=mm_token_type_ids(ids),
            **images,
        ).logits


def our_logits(model, ids, pixels, grid, **kwargs) -> torch.Tensor:
    """An ``EarlyFusion`` Qwen model's logits on the same inputs."""
    images = {"image": {"pixel_values": pixels, "image_grid_thw": grid}} if len(grid) else {}
    with torch.no_grad():
        return model(ids, encoder_input=images, **kwargs)


def left_padded_mask(attention: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fusion's left padding for an attention mask [b, s]: positions (pads at 0, each sample
    from 0) and the [b, s, s] mask (causal over real tokens, each pad seeing itself)."""
    length = attention.size(1)
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    mask = causal & (attention.bool()[:, None, :] | torch.eye(length, dtype=torch.bool))
    return (attention.cumsum(1) - 1).clamp(min=0), mask


def packed_row(lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """One packed row of samples of ``lengths``: positions [1, s] restarting at each sample
    and the block-causal mask [1, s, s]."""
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    sample_of = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    causal = torch.ones(len(sample_of), len(sample_of), dtype=torch.bool).tril()
    return positions, (causal & (sample_of[:, None] == sample_of[None, :]))[None]


def write_qwen_dir(
    directory: Path, model_type: str = "qwen2_5_vl", seed: int = 0, *, tied: bool = False
) -> Path:
    """A tiny random Qwen2-VL or Qwen2.5-VL directory as the Hub carries one: weights and
    ``config.json`` by transformers' ``save_pretrained``, the tokenizer of
    :func:`vlm_helpers.qwen_char_tokenizer`, :data:`QWEN_CHAT_TEMPLATE` in
    ``chat_template.json`` and a ``preprocessor_config.json`` with the legacy ``min_pixels`` /
    ``max_pixels`` keys (:data:`QWEN_PIXELS`)."""
    from vlm_helpers import qwen_char_tokenizer, qwen_hf_tokenizer

    directory.mkdir(parents=True, exist_ok=True)
    tiny_hf_qwen(model_type, seed, tied=tied).save_pretrained(directory)
    qwen_hf_tokenizer(qwen_char_tokenizer()).save_pretrained(directory)
    template = {"chat_template": QWEN_CHAT_TEMPLATE}
    (directory / "chat_template.json").write_text(json.dumps(template, indent=2))
    processor = {"qwen2_vl": "Qwen2VLProcessor", "qwen2_5_vl": "Qwen2_5_VLProcessor"}[model_type]
    settings = {
        **QWEN_PIXELS,
        "patch_size": PATCH,
        "temporal_patch_size": TEMPORAL,
        "merge_size": MERGE,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": processor,
    }
    (directory / "preprocessor_config.json").write_text(json.dumps(settings, indent=2))
    return directory


# What the fine-tuning tests compare with: transformers' processor, model and loss.


def hf_processor(directory):
    """transformers' ``AutoProcessor`` of ``directory`` (without torchvision)."""
    import warnings

    import pytest
    from transformers import AutoProcessor

    from vlm_helpers import without_torchvision_video

    with pytest.MonkeyPatch.context() as patch, warnings.catch_warnings():
        without_torchvision_video(patch)
        warnings.simplefilter("ignore")
        return AutoProcessor.from_pretrained(directory)


def hf_model(directory):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(directory).eval()


def hf_inputs(processor, messages, **kwargs):
    """transformers' ``apply_chat_template`` ids, patches, grids (images read from the
    paths)."""
    return processor.apply_chat_template(
        messages, tokenize=True, return_dict=True, return_tensors="pt", **kwargs
    )


def fusion_inputs(directory, messages, images, *, add_generation_prompt: bool = False):
    """Our tokens and encoder input for ``messages`` with the directory's template."""
    from fusion.data import ChatTemplate
    from fusion.preprocessing import load_image, prepare_inputs

    prompt = ChatTemplate.from_directory(directory).render(
        messages, add_generation_prompt=add_generation_prompt
    )
    inputs = prepare_inputs(directory, prompt, [load_image(path) for path in images])
    return inputs.tokens(PAD), inputs.encoder_input()


def transformers_first_loss(hf, processor, directory, data, *, thinking: bool = False) -> float:
    """transformers' mean cross-entropy over the assistant tokens of ``data``'s
    conversations, checking on the way that our samples hold transformers' ids, patches and
    grids, and that their targets are each answer and its ``<|im_end|>``, nothing else;
    ``thinking``: a template that opens a thinking block for the answers after the last user
    message (Qwen3.5's, the generation prompt ending in ``<think>\n``), whose targets then
    begin with the empty block's end ``\n</think>\n\n``."""
    from fusion.data import IGNORE_INDEX, ConversationEncoder, read_conversations

    encoder = ConversationEncoder.from_directory(directory)
    total = targets = 0.0
    for conversation in read_conversations(data).conversations:
        sample = encoder.encode_conversation(conversation)
        inputs = hf_inputs(processor, conversation.messages)
        assert inputs["input_ids"][0].tolist() == sample.tokens.tolist()
        if conversation.images:
            assert torch.equal(inputs["pixel_values"], sample.pixel_values)
            assert torch.equal(inputs["image_grid_thw"], sample.image_grid_thw)
        roles = [m["role"] for m in conversation.messages]
        last_query = len(roles) - 1 - roles[::-1].index("user")
        answers = [
            ("\n</think>\n\n" if thinking and i > last_query else "")
            + (m["content"] if isinstance(m["content"], str) else m["content"][0]["text"])
            for i, m in enumerate(conversation.messages)
            if m["role"] == "assistant"
        ]
        end = encoder.tokenizer.token_to_id("<|im_end|>")
        expected_targets = [
            t
            for a in answers
            for t in [*encoder.tokenizer.encode(a, add_special_tokens=False).ids, end]
        ]
        assert sample.labels[sample.labels != IGNORE_INDEX].tolist() == expected_targets
        labels = torch.full_like(sample.tokens, IGNORE_INDEX)  # unshifted: transformers shifts
        labels[1:] = sample.labels[:-1]
        with torch.no_grad():
            loss = hf(**inputs, labels=labels[None]).loss
        total += loss.item() * sample.num_targets
        targets += sample.num_targets
    return total / targets


# Videos: clips drawn here (odd frame counts and rates), patched by fusion's video processor
# (bitwise transformers' own, tests/preprocessing/test_qwen2_vl_video.py), so that both
# models see the same pixels without torchvision.
VIDEO_PIXELS = {"min_pixels": 28 * 28 * 4, "max_pixels": 28 * 28 * 6}
VIDEO3_PIXELS = {"min_pixels": 32 * 32 * 4, "max_pixels": 32 * 32 * 6}


def media_prompt(
    parts: list[tuple[str, tuple]], text_lengths: list[int], seed: int = 0, *, qwen3: bool = False
):
    """One sample: text runs of ``text_lengths`` (one more than ``parts``) around images
    (``("image", (t, h, w))``, random patches) and videos (``("video", (frames, fps, height,
    width))``: drawn frames through :class:`Qwen2VLVideoProcessor`, or with ``qwen3``
    :class:`Qwen3VLVideoProcessor`), each as ``<|vision_start|>`` + placeholders +
    ``<|vision_end|>``; a Qwen3-VL video's as transformers 5.25 writes them, each temporal
    patch's run after a timestamp (three random tokens here) and in a start / end pair of its
    own (the chat template's pair replaced). Returns (ids [1, s], image input, video input) in
    transformers' names: ``pixel_values`` and ``image_grid_thw``; ``pixel_values_videos``,
    ``video_grid_thw`` and float32 ``second_per_grid_ts``."""
    from video_helpers import drawn_frames

    from fusion.families.qwen_vl.video import Qwen2VLVideoProcessor, Qwen3VLVideoProcessor
    from fusion.preprocessing import load_video

    assert len(text_lengths) == len(parts) + 1
    generator = torch.Generator().manual_seed(seed)
    if qwen3:
        processor = Qwen3VLVideoProcessor(**VIDEO3_PIXELS)
        patch_width = 3 * TEMPORAL * 16 * 16
    else:
        processor = Qwen2VLVideoProcessor(**VIDEO_PIXELS)
        patch_width = PATCH_WIDTH
    pieces, image_grids, clips = [], [], []
    for i, length in enumerate(text_lengths):
        pieces.append(torch.randint(3, 140, (length,), generator=generator))
        if i == len(parts):
            break
        kind, spec = parts[i]
        if kind == "image":
            image_grids.append(spec)
            rows = spec[0] * spec[1] * spec[2] // MERGE**2
            pieces.append(torch.tensor([VISION_START, *[IMAGE_PAD] * rows, VISION_END]))
            continue
        frames, fps, height, width = spec
        clip = load_video(drawn_frames(frames, height, width, seed=seed + i), fps=fps)
        clips.append(clip)
        t, h, w = processor.grid(frames, height, width)
        if not qwen3:
            rows = t * h * w // MERGE**2
            pieces.append(torch.tensor([VISION_START, *[VIDEO_PAD] * rows, VISION_END]))
            continue
        for _ in range(t):
            pieces.append(torch.randint(3, 140, (3,), generator=generator))
            pieces.append(torch.tensor([VISION_START, *[VIDEO_PAD] * (h * w // MERGE**2)]))
            pieces.append(torch.tensor([VISION_END]))
    patches = sum(t * h * w for t, h, w in image_grids)
    images = {
        "pixel_values": torch.randn(patches, patch_width, generator=generator),
        "image_grid_thw": torch.tensor(image_grids, dtype=torch.long).view(-1, 3),
    }
    videos = {}
    if clips:
        patched = processor(clips)
        videos = {
            "pixel_values_videos": patched.pixel_values_videos,
            "video_grid_thw": patched.video_grid_thw,
            "second_per_grid_ts": torch.tensor(patched.second_per_grid_ts),
        }
    return torch.cat(pieces)[None], images if image_grids else {}, videos


def media_token_type_ids(ids: torch.Tensor) -> torch.Tensor:
    """transformers' ``mm_token_type_ids``: 1 at image placeholders, 2 at video ones."""
    return (ids == IMAGE_PAD).to(torch.int32) + 2 * (ids == VIDEO_PAD).to(torch.int32)


def hf_media_kwargs(hf, images: dict, videos: dict) -> dict:
    """transformers' keyword arguments for ``images`` and ``videos`` (only Qwen2.5-VL takes
    ``second_per_grid_ts``)."""
    kwargs = {**images, **videos}
    if hf.config.model_type != "qwen2_5_vl":
        kwargs.pop("second_per_grid_ts", None)
    return kwargs


def our_media_input(images: dict, videos: dict) -> dict:
    """The same inputs as an ``EarlyFusion`` Qwen model's ``encoder_input``."""
    return {
        **({"image": images} if images else {}),
        **({"video": videos} if videos else {}),
    }


def concat_media(inputs: list[dict]) -> dict:
    """Several samples' image (or video) inputs as one batch's: each key concatenated."""
    present = [x for x in inputs if x]
    return {k: torch.cat([x[k] for x in present]) for k in present[0]} if present else {}
