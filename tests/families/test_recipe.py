"""The fine-tuning recipe over every registered model type (the fixture table of
``fixtures.py``): on a whole tiny directory (weights, tokenizer, chat template, processor
settings), the first loss of ``python -m recipes.finetune`` packed equals it padded
(``--no-packing``), and both equal transformers' cross-entropy over the same samples' targets
(our encoded ids, pixels and grids fed to transformers' model, its own loss). What each family
adds (exports, LoRA targets, processors against transformers' own) stays in
``tests/recipes/finetune``."""

import json

import numpy as np
import pytest
import torch
from PIL import Image

from families.fixtures import FIXTURES
from fusion.data import IGNORE_INDEX, ConversationEncoder, read_conversations
from fusion.families import family_named
from recipes.finetune import main

ANSWERS = ("red fox", "blue cat", "old dog")
ARGS = ["--max-seq-len", "256", "--batch-tokens", "2048", "--warmup-steps", "1", "--lr", "1e-2"]
ARGS += ["--threads", "1", "--no-progress", "--train", "full", "--steps", "1"]


def write_data(directory, image_size) -> object:
    """Three conversations: the first two with an image each (for models that take images),
    the last a second user turn, so that packing puts samples of unequal kinds side by side."""
    records = []
    for i, answer in enumerate(ANSWERS):
        question: list[dict] = [{"type": "text", "text": f"What is {i}?"}]
        if image_size is not None and i < 2:
            pixels = np.random.default_rng(i).integers(0, 256, (*image_size, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(directory / f"img{i}.png")
            question.insert(0, {"type": "image", "path": f"img{i}.png"})
        messages = [
            {"role": "user", "content": question},
            {"role": "assistant", "content": [{"type": "text", "text": answer}]},
        ]
        if i == 2:
            messages += [
                {"role": "user", "content": [{"type": "text", "text": "And then?"}]},
                {"role": "assistant", "content": [{"type": "text", "text": "it ran"}]},
            ]
        records.append({"messages": messages})
    path = directory / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def transformers_loss(fixture, directory, data) -> float:
    """transformers' mean cross-entropy over our samples' targets."""
    hf = fixture.auto_class().from_pretrained(directory).eval()
    encoder = ConversationEncoder.from_directory(directory)
    total = count = 0.0
    for conversation in read_conversations(data).conversations:
        sample = encoder.encode_conversation(conversation)
        labels = torch.full_like(sample.tokens, IGNORE_INDEX)  # unshifted: transformers shifts
        labels[1:] = sample.labels[:-1]
        inputs = fixture.their_images(sample, hf.config)
        with torch.no_grad():
            loss = hf(input_ids=sample.tokens[None], labels=labels[None], **inputs).loss
        total += loss.item() * sample.num_targets
        count += sample.num_targets
    return total / count


def test_every_model_type_the_recipe_takes_has_a_directory_writer():
    for model_type, fixture in FIXTURES.items():
        family = family_named(fixture.family)
        takes_conversations = not family.encoder_types or family.processor is not None
        assert (fixture.recipe_dir is not None) == takes_conversations, model_type


@pytest.mark.parametrize("model_type", [t for t, f in FIXTURES.items() if f.recipe_dir])
def test_first_loss_packed_equals_padded_equals_transformers(model_type, tmp_path):
    fixture = FIXTURES[model_type]
    assert fixture.recipe_dir is not None
    directory = fixture.recipe_dir(tmp_path / "model")
    data = write_data(tmp_path, fixture.image_size)
    expected = transformers_loss(fixture, directory, data)
    for packing in ([], ["--no-packing"]):
        out = tmp_path / f"run{len(packing)}"
        argv = ["--model", str(directory), "--data", str(data), "--output-dir", str(out)]
        assert main([*argv, *ARGS, *packing]) == 0
        first = json.loads((out / "metrics.json").read_text())["losses"][0]
        assert first == pytest.approx(expected, rel=1e-5), packing
