"""Qwen2-VL and Qwen2.5-VL loaded from directories ``transformers`` wrote: logits equal
transformers' own classes (fp32, 1e-4) with images of odd sizes (and far off with flat
positions), left padding and packed rows, M-RoPE positions derived as ``get_rope_index``
derives them (text-only logits, save, export and peft: the family suite, ``tests/families``)."""

import json

import pytest
import torch

from fusion import EarlyFusion
from fusion.checkpoint import load_hf_vlm
from fusion.checkpoint.hf_vlm import hf_model_kind
from fusion.positions import mrope_positions
from qwen_helpers import (
    IMAGE_PAD,
    MERGE,
    MODEL_TYPES,
    PAD,
    hf_logits,
    image_prompt,
    left_pad,
    left_padded_mask,
    mm_token_type_ids,
    our_logits,
    packed_row,
    tiny_hf_qwen,
)

ONE_IMAGE = ([(1, 6, 10)], [3, 5])
TWO_IMAGES = ([(1, 4, 4), (1, 10, 6)], [2, 3, 4])  # odd: h != w, several windows in 10 x 6
TEXT_ONLY = ([], [9])


@pytest.fixture(scope="module", params=MODEL_TYPES)
def pair(request, tmp_path_factory) -> tuple[torch.nn.Module, EarlyFusion]:
    hf = tiny_hf_qwen(request.param)
    directory = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(directory)
    assert hf_model_kind(directory) == "qwen2_vl"
    return hf, load_hf_vlm(directory).eval()


@pytest.mark.parametrize("case", [ONE_IMAGE, TWO_IMAGES], ids=["one", "two"])
def test_logits_match_transformers(pair, case):
    hf, model = pair
    ids, pixels, grid = image_prompt(*case)
    theirs = hf_logits(hf, ids, pixels, grid)
    assert (our_logits(model, ids, pixels, grid) - theirs).abs().max() <= 1e-4
    if len(grid):  # the images and their positions matter: far off without either
        flat = torch.arange(ids.size(1))
        assert (
            our_logits(model, ids, pixels, grid, input_pos=flat.expand(3, 1, -1)) - theirs
        ).abs().max() > 1e-3


def test_left_padded_batch_matches_transformers(pair):
    hf, model = pair
    samples = [image_prompt(*case, seed=i) for i, case in enumerate([TWO_IMAGES, ONE_IMAGE])]
    ids, attention = left_pad([s[0] for s in samples])
    pixels = torch.cat([s[1] for s in samples])
    grid = torch.cat([s[2] for s in samples])
    theirs = hf_logits(hf, ids, pixels, grid, attention)
    # fusion's left padding: pads at position 0, each sample from 0, pads attend to themselves
    positions, mask = left_padded_mask(attention)
    ours = our_logits(model, ids, pixels, grid, mask=mask, input_pos=positions)
    assert (ours - theirs)[attention.bool()].abs().max() <= 1e-4


def test_packed_row_gives_each_sample_its_own_logits(pair):
    _, model = pair
    samples = [
        image_prompt(*case, seed=i) for i, case in enumerate([ONE_IMAGE, TEXT_ONLY, TWO_IMAGES])
    ]
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


def test_positions_equal_get_rope_index(pair):
    hf, _ = pair
    samples = [image_prompt(*case, seed=i) for i, case in enumerate([TWO_IMAGES, ONE_IMAGE])]
    ids, attention = left_pad([s[0] for s in samples])
    grid = torch.cat([s[2] for s in samples])
    theirs, deltas = hf.model.get_rope_index(
        ids, mm_token_type_ids(ids), image_grid_thw=grid, attention_mask=attention
    )
    ours, offsets = mrope_positions(
        ids, (attention.cumsum(1) - 1).clamp(min=0), IMAGE_PAD, grid, MERGE
    )
    assert torch.equal(ours, theirs)
    assert torch.equal(offsets, deltas[:, 0])


def test_text_positions_are_bitwise_1d_rope(pair):
    _, model = pair
    ids, _, _ = image_prompt(*TEXT_ONLY)
    flat = torch.arange(ids.size(1))
    with torch.no_grad():
        derived = model(ids)
        one_d = model.decoder(ids, input_pos=flat)
        three = model.decoder(ids, input_pos=flat.expand(3, 1, -1))
    assert torch.equal(derived, one_d) and torch.equal(three, one_d)
    assert PAD not in ids[0].tolist()


def test_export_loads_in_transformers_with_equal_logits(pair, tmp_path):
    from transformers import AutoModelForImageTextToText

    from fusion.checkpoint import export_hf, load_state_dict

    hf, model = pair
    source = tmp_path / "source"
    hf.save_pretrained(source)
    export_hf(model, source, tmp_path / "out")
    assert set(load_state_dict(tmp_path / "out")) == set(load_state_dict(source))
    again = AutoModelForImageTextToText.from_pretrained(tmp_path / "out").eval()
    assert type(again) is type(hf)
    ids, pixels, grid = image_prompt(*TWO_IMAGES)
    assert (
        hf_logits(again, ids, pixels, grid) - our_logits(model, ids, pixels, grid)
    ).abs().max() <= 1e-4
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    # token ids the model does not hold, carried over from the source's config.json
    assert (config["vision_start_token_id"], config["vision_end_token_id"]) == (150, 151)
    assert config["text_config"]["pad_token_id"] == PAD
    reloaded = load_hf_vlm(tmp_path / "out").eval()
    assert all(
        torch.equal(a, b)
        for a, b in zip(reloaded.state_dict().values(), model.state_dict().values(), strict=True)
    )


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_in_memory_layout_and_flat_published_config(tmp_path, model_type):
    """transformers' in-memory key names (``model.visual.*``, ``model.language_model.*``) and
    a flat config.json as published on the Hub (``rope_scaling`` of type ``mrope``)."""
    from safetensors.torch import save_file

    hf = tiny_hf_qwen(model_type, seed=1)
    hf.save_pretrained(tmp_path / "hub")
    config = json.loads((tmp_path / "hub" / "config.json").read_text())
    text = config.pop("text_config")
    rope = text.pop("rope_parameters")
    flat = {k: v for k, v in text.items() if k != "model_type"} | {
        "rope_theta": rope["rope_theta"],
        "rope_scaling": {"type": "mrope", "mrope_section": rope["mrope_section"]},
    }
    (tmp_path / "flat").mkdir()
    (tmp_path / "flat" / "config.json").write_text(json.dumps(config | flat))
    state = {k: v.contiguous() for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    assert any(k.startswith("model.visual.") for k in state)
    save_file(
        state | {"lm_head.weight": hf.lm_head.weight.detach().clone()},
        tmp_path / "flat" / "model.safetensors",
    )
    model = load_hf_vlm(tmp_path / "flat").eval()
    ids, pixels, grid = image_prompt(*ONE_IMAGE)
    assert (
        our_logits(model, ids, pixels, grid) - hf_logits(hf, ids, pixels, grid)
    ).abs().max() <= 1e-4


def test_export_refuses_a_hostile_token_id_before_writing(pair, tmp_path):
    from fusion.checkpoint import CheckpointError, export_hf

    hf, model = pair
    hf.save_pretrained(tmp_path / "source")
    config = json.loads((tmp_path / "source" / "config.json").read_text())
    config["vision_start_token_id"] = 10**30
    (tmp_path / "source" / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"vision_start_token_id.*expected a token id"):
        export_hf(model, tmp_path / "source", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_grids_that_do_not_match_the_placeholders_are_refused(pair):
    _, model = pair
    ids, pixels, grid = image_prompt(*TWO_IMAGES)  # rows 4 and 15
    swapped = grid.flip(0)  # the same patches and rows in all, split 15 + 4
    with pytest.raises(ValueError, match="image placeholders do not match image_grid_thw"):
        our_logits(model, ids, pixels, swapped)
    with pytest.raises(ValueError, match=r"expected \d+ patches"):
        our_logits(model, ids, pixels[:-1], grid)
    more = torch.tensor([[1, 4, 4], [1, 10, 8]])  # 24 rows for 19 placeholders
    with pytest.raises(ValueError, match=r"placeholder count .* must equal the 24 packed rows"):
        our_logits(model, ids, torch.randn(16 + 80, pixels.size(1)), more)


def test_precomputed_rows_need_explicit_positions(pair):
    _, model = pair
    ids, pixels, grid = image_prompt(*ONE_IMAGE)
    rows = model.encode({"image": {"pixel_values": pixels, "image_grid_thw": grid}})
    with pytest.raises(ValueError, match=r"rows computed beforehand carry no image_grid_thw"):
        model(ids, encoder_input=rows)
    positions, _ = mrope_positions(ids, None, IMAGE_PAD, grid, MERGE)
    with torch.no_grad():
        reused = model(ids, encoder_input=rows, input_pos=positions)
    assert torch.equal(reused, our_logits(model, ids, pixels, grid))
