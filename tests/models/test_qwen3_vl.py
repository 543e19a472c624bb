"""Qwen3-VL loaded from directories ``transformers`` wrote: logits equal
``Qwen3VLForConditionalGeneration``'s (fp32, 1e-4) with DeepStack rows added after the first
decoder layers (and far off without them), left padding and packed rows; exports that keep
the source's key names; the published config layout. Logits with and without images, greedy
generation, save and peft: the family suite, ``tests/families``."""

import pytest
import torch

from fusion import EarlyFusion
from fusion.checkpoint import export_hf, load_hf_vlm, load_state_dict
from fusion.checkpoint.hf_vlm import hf_model_kind
from fusion.positions import mrope_positions
from qwen3_helpers import PATCH_WIDTH, tiny_hf_qwen3
from qwen_helpers import (
    IMAGE_PAD,
    hf_logits,
    image_prompt,
    left_pad,
    left_padded_mask,
    our_logits,
    packed_row,
)

ONE_IMAGE = ([(1, 6, 10)], [3, 5])
TWO_IMAGES = ([(1, 4, 4), (1, 10, 6)], [2, 3, 4])
TEXT_ONLY = ([], [9])


def prompt(case, seed: int = 0):
    ids, _, grid = image_prompt(*case, seed=seed)
    patches = int(grid.prod(-1).sum())
    pixels = torch.randn(patches, PATCH_WIDTH, generator=torch.Generator().manual_seed(seed))
    return ids, pixels, grid


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[torch.nn.Module, EarlyFusion]:
    hf = tiny_hf_qwen3()
    directory = tmp_path_factory.mktemp("qwen3_vl")
    hf.save_pretrained(directory)
    assert hf_model_kind(directory) == "qwen3_vl"
    return hf, load_hf_vlm(directory).eval()


def test_deepstack_rows_matter(pair):
    """The tower's output passed back in (``EarlyFusion.encode``'s reuse) gives the same
    logits; without its DeepStack rows they are far off."""
    hf, model = pair
    ids, pixels, grid = prompt(TWO_IMAGES)
    theirs = hf_logits(hf, ids, pixels, grid)
    main, layer_rows = model.encoders["image"](pixels, grid)
    assert len(layer_rows) == 2
    positions, _ = mrope_positions(ids, None, IMAGE_PAD, grid, 2)
    with torch.no_grad():
        reused = model(ids, encoder_input={"image": (main, layer_rows)}, input_pos=positions)
        without = model(ids, encoder_input={"image": main}, input_pos=positions)
    assert (reused - theirs).abs().max() <= 1e-4
    assert (without - theirs).abs().max() > 1e-3


def test_left_padded_batch_matches_transformers(pair):
    hf, model = pair
    samples = [prompt(case, seed=i) for i, case in enumerate([TWO_IMAGES, ONE_IMAGE])]
    ids, attention = left_pad([s[0] for s in samples])
    pixels = torch.cat([s[1] for s in samples])
    grid = torch.cat([s[2] for s in samples])
    theirs = hf_logits(hf, ids, pixels, grid, attention)
    positions, mask = left_padded_mask(attention)
    ours = our_logits(model, ids, pixels, grid, mask=mask, input_pos=positions)
    assert (ours - theirs)[attention.bool()].abs().max() <= 1e-4


def test_packed_row_keeps_deepstack_rows_in_their_samples(pair):
    _, model = pair
    samples = [prompt(case, seed=i) for i, case in enumerate([ONE_IMAGE, TEXT_ONLY, TWO_IMAGES])]
    alone = [our_logits(model, *s)[0] for s in samples]
    ids = torch.cat([s[0] for s in samples], dim=1)
    positions, mask = packed_row([s[0].size(1) for s in samples])
    packed = our_logits(
        model,
        ids,
        torch.cat([s[1] for s in samples]),
        torch.cat([s[2] for s in samples]),
        mask=mask,
        input_pos=positions,
    )[0]
    assert (packed - torch.cat(alone)).abs().max() <= 1e-5


def test_export_keeps_keys_and_loads_in_transformers(pair, tmp_path):
    from transformers import AutoModelForImageTextToText

    hf, model = pair
    source = tmp_path / "source"
    hf.save_pretrained(source)
    export_hf(model, source, tmp_path / "out")
    assert set(load_state_dict(tmp_path / "out")) == set(load_state_dict(source))
    again = AutoModelForImageTextToText.from_pretrained(tmp_path / "out").eval()
    assert type(again) is type(hf)
    ids, pixels, grid = prompt(TWO_IMAGES)
    assert (
        hf_logits(again, ids, pixels, grid) - our_logits(model, ids, pixels, grid)
    ).abs().max() <= 1e-4


def test_published_config_layout(pair, tmp_path):
    """Qwen3-VL's config.json as published: ``rope_scaling`` and ``rope_theta`` inside
    ``text_config`` (``mrope_interleaved`` said or not: it always interleaves), the vision
    config's old ``model_type``; and a sharded checkpoint."""
    import json

    hf, model = pair
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    config = json.loads((tmp_path / "config.json").read_text())
    text = config["text_config"]
    rope = text.pop("rope_parameters")
    text["rope_theta"] = rope["rope_theta"]
    text["rope_scaling"] = {"rope_type": "default", "mrope_section": rope["mrope_section"]}
    config["vision_config"]["model_type"] = "qwen3_vl"
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = load_hf_vlm(tmp_path).eval()
    ids, pixels, grid = prompt(ONE_IMAGE)
    assert torch.equal(our_logits(loaded, ids, pixels, grid), our_logits(model, ids, pixels, grid))
