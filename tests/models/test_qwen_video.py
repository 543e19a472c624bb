"""Qwen2-VL and Qwen2.5-VL take videos: logits equal transformers' (fp32, 1e-4) with a video,
a video and an image in one prompt, and a left-padded batch, clips of odd frame counts and
rates (``second_per_grid_ts`` != 1, so that Qwen2.5-VL's scaled temporal row matters: the
row left unscaled moves the logits far past the tolerance); positions equal
``get_rope_index``'s; packed rows with video samples equal each sample alone (1e-5); greedy
generation equals transformers' ``generate``; the videos add no module, parameter or key."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fusion import EarlyFusion, generate
from fusion.checkpoint import load_hf_vlm
from fusion.hooks import MRopeInput, MRopePositions
from fusion.positions import MediaGrids, mrope_positions
from qwen_helpers import (
    IMAGE_PAD,
    MERGE,
    MODEL_TYPES,
    PAD,
    TOKENS_PER_SECOND,
    VIDEO_PAD,
    concat_media,
    hf_media_kwargs,
    left_pad,
    left_padded_mask,
    media_prompt,
    media_token_type_ids,
    our_media_input,
    packed_row,
    tiny_hf_qwen,
)

# (frames, fps, height, width): odd frame counts (the last frame repeated to the temporal
# patch) at rates giving second_per_grid_ts of 2/3, 4/15, 2/7 and 4/3 seconds. The slow one's
# temporal row passes the text after it (Qwen2.5-VL: by 13; Qwen2-VL: by 1).
VIDEO = ("video", (5, 3.0, 40, 60))
SLOW_VIDEO = ("video", (9, 1.5, 30, 40))
SHORT_VIDEO = ("video", (3, 7.5, 50, 36))
LONG_VIDEO = ("video", (7, 7.0, 36, 44))
IMAGE = ("image", (1, 6, 4))
ONE_VIDEO = ([VIDEO], [3, 4])
VIDEO_AND_IMAGE = ([IMAGE, LONG_VIDEO], [2, 3, 2])
VIDEO_IMAGE_VIDEO = ([SHORT_VIDEO, IMAGE, VIDEO], [1, 2, 2, 1])


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models run faster on one thread than on two shared, busy cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=MODEL_TYPES)
def pair(request, tmp_path_factory) -> tuple[torch.nn.Module, EarlyFusion]:
    hf = tiny_hf_qwen(request.param, seed=3)
    directory = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(directory)
    return hf, load_hf_vlm(directory).eval()


def hf_logits(hf, ids, images, videos, attention_mask=None) -> torch.Tensor:
    with torch.no_grad():
        return hf(
            input_ids=ids,
            attention_mask=attention_mask,
            mm_token_type_ids=media_token_type_ids(ids),
            **hf_media_kwargs(hf, images, videos),
        ).logits


def our_logits(model, ids, images, videos, **kwargs) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, encoder_input=our_media_input(images, videos), **kwargs)


@pytest.mark.parametrize(
    "case", [ONE_VIDEO, VIDEO_AND_IMAGE, VIDEO_IMAGE_VIDEO], ids=["video", "image", "three"]
)
def test_logits_match_transformers(pair, case):
    hf, model = pair
    ids, images, videos = media_prompt(*case)
    assert videos["second_per_grid_ts"].ne(1).all()
    theirs = hf_logits(hf, ids, images, videos)
    assert (our_logits(model, ids, images, videos) - theirs).abs().max() <= 1e-4


def test_the_temporal_row_scaled_matters(pair):
    """A planted bug, Qwen2.5-VL's temporal row left as the frame index (Qwen2-VL's), moves
    the logits far past the tolerance: the test above can fail."""
    hf, model = pair
    if hf.config.model_type != "qwen2_5_vl":
        pytest.skip("Qwen2-VL's temporal row is the frame index")
    ids, images, videos = media_prompt(*ONE_VIDEO)
    theirs = hf_logits(hf, ids, images, videos)
    hooks = model.hooks
    model.hooks = (MRopePositions(["image", MRopeInput("video", "video_grid_thw")], MERGE),)
    try:
        unscaled = our_logits(model, ids, images, videos)
    finally:
        model.hooks = hooks
    assert (unscaled - theirs).abs().max() > 1e-3


def test_positions_equal_get_rope_index(pair):
    hf, _ = pair
    cases = [VIDEO_AND_IMAGE, ([SLOW_VIDEO], [2, 0]), ONE_VIDEO]
    samples = [media_prompt(*case, seed=i) for i, case in enumerate(cases)]
    ids, attention = left_pad([s[0] for s in samples])
    images = concat_media([s[1] for s in samples])
    videos = concat_media([s[2] for s in samples])
    theirs, deltas = hf.model.get_rope_index(
        ids,
        media_token_type_ids(ids),
        image_grid_thw=images["image_grid_thw"],
        attention_mask=attention,
        **{k: v for k, v in hf_media_kwargs(hf, {}, videos).items() if k != "pixel_values_videos"},
    )
    scale = TOKENS_PER_SECOND if hf.config.model_type == "qwen2_5_vl" else None
    interval = None if scale is None else scale * videos["second_per_grid_ts"]
    ours, offsets = mrope_positions(
        ids,
        (attention.cumsum(1) - 1).clamp(min=0),
        IMAGE_PAD,
        images["image_grid_thw"],
        MERGE,
        media=[MediaGrids(VIDEO_PAD, videos["video_grid_thw"], interval, "video_grid_thw")],
    )
    assert torch.equal(ours, theirs)
    # Decoding goes on from each prompt's last position, as transformers' generate does;
    # get_rope_index's rope_deltas (one past the largest position) say so too, except where
    # the slow video's temporal row passes the text after it.
    lengths = attention.sum(1)
    assert torch.equal(offsets, theirs[0, :, -1] + 1 - lengths)
    passes = theirs.amax((0, 2)) > theirs[0, :, -1]
    assert passes.tolist() == [False, True, False]
    assert torch.equal(offsets[~passes], deltas[~passes, 0])


def test_left_padded_batch_matches_transformers(pair):
    hf, model = pair
    cases = [VIDEO_IMAGE_VIDEO, ONE_VIDEO, ([IMAGE], [4, 2])]
    samples = [media_prompt(*case, seed=i) for i, case in enumerate(cases)]
    ids, attention = left_pad([s[0] for s in samples])
    images = concat_media([s[1] for s in samples])
    videos = concat_media([s[2] for s in samples])
    theirs = hf_logits(hf, ids, images, videos, attention_mask=attention)
    positions, mask = left_padded_mask(attention)
    ours = our_logits(model, ids, images, videos, mask=mask, input_pos=positions)
    real = attention.bool()
    assert (ours[real] - theirs[real]).abs().max() <= 1e-4


def test_packed_row_equals_each_sample_alone(pair):
    _, model = pair
    cases = [ONE_VIDEO, VIDEO_AND_IMAGE, ([IMAGE], [2, 3]), VIDEO_IMAGE_VIDEO]
    samples = [media_prompt(*case, seed=i) for i, case in enumerate(cases)]
    alone = [our_logits(model, *s)[0] for s in samples]
    ids = torch.cat([s[0] for s in samples], dim=1)
    positions, mask = packed_row([s[0].size(1) for s in samples])
    images = concat_media([s[1] for s in samples])
    videos = concat_media([s[2] for s in samples])
    packed = our_logits(model, ids, images, videos, mask=mask, input_pos=positions)[0]
    assert (packed - torch.cat(alone)).abs().max() <= 1e-5


# Seeds whose tiny models answer these prompts with varied tokens.
GENERATION_SEEDS = {"qwen2_vl": 1, "qwen2_5_vl": 0}


def test_greedy_generation_equals_transformers(pair, tmp_path):
    """A left-padded batch, one prompt ending right after a video whose temporal row passes
    the text, so that decoding continues from one past the sample's largest position (the
    offsets themselves are pinned by the positions test; greedy tokens of a tiny model move
    with them only now and then)."""
    model_type = pair[0].config.model_type
    hf = tiny_hf_qwen(model_type, seed=GENERATION_SEEDS[model_type])
    hf.save_pretrained(tmp_path)
    model = load_hf_vlm(tmp_path).eval()
    cases = [([IMAGE, SLOW_VIDEO], [2, 1, 0]), ([SHORT_VIDEO], [3, 1])]
    samples = [media_prompt(*case, seed=7 + i) for i, case in enumerate(cases)]
    ids, attention = left_pad([s[0] for s in samples])
    images = concat_media([s[1] for s in samples])
    videos = concat_media([s[2] for s in samples])
    new = 6
    with torch.no_grad():
        theirs = hf.generate(
            input_ids=ids,
            attention_mask=attention,
            mm_token_type_ids=media_token_type_ids(ids),
            **hf_media_kwargs(hf, images, videos),
            max_new_tokens=new,
            do_sample=False,
            pad_token_id=PAD,
            eos_token_id=None,
        )[:, ids.size(1) :]
    ours = generate(
        model,
        ids,
        encoder_input=our_media_input(images, videos),
        max_new_tokens=new,
        temperature=0,
        pad_id=PAD,
    )[:, ids.size(1) :]
    assert any(len(set(row)) > 2 for row in theirs.tolist())  # a lively model
    assert torch.equal(ours, theirs)


def test_videos_add_no_module_parameter_or_key(pair):
    """The video entry shares the image tower by name: the model's modules, parameters and
    state-dict keys (under any prefix) are those of the same parts fused without videos,
    before and after a video ran."""
    _, model = pair
    assert set(model.encoders) == {"image"} and model.encoder_tokens["video"] == VIDEO_PAD
    assert model.shared_encoders["video"].encoder == "image"
    plain = EarlyFusion(
        model.decoder,
        {"image": model.encoders["image"]},
        {"image": IMAGE_PAD},
        hooks=[MRopePositions("image", MERGE)],
    )
    keys = list(plain.state_dict())
    assert list(model.state_dict()) == keys
    assert [n for n, _ in model.named_modules()] == [n for n, _ in plain.named_modules()]
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in plain.named_parameters()]
    our_logits(model, *media_prompt(*ONE_VIDEO))
    wrapped = torch.nn.ModuleDict({"outer": model})
    assert list(wrapped.state_dict()) == [f"outer.{k}" for k in keys]


def test_video_input_mistakes_are_refused_by_name(pair):
    _, model = pair
    ids, images, videos = media_prompt(*VIDEO_IMAGE_VIDEO)  # two videos of other sizes
    # The grids of the two videos in the wrong order: as many patches (the tower takes them),
    # runs that do not match.
    swapped = {**videos, "video_grid_thw": videos["video_grid_thw"].flip(0)}
    with pytest.raises(ValueError, match="video placeholders do not match video_grid_thw"):
        our_logits(model, ids, images, swapped)
    fewer = {**videos, "video_grid_thw": videos["video_grid_thw"][:1]}
    with pytest.raises(ValueError, match=r"encoder_input\['video'\].*image_grid_thw"):
        our_logits(model, ids, images, fewer)  # the tower's refusal, named as the entry's
    if model.hooks[0].inputs[1].tokens_per_second is not None:  # Qwen2.5-VL reads them
        seconds = {**videos, "second_per_grid_ts": torch.tensor([0.5, 0.5, 0.5])}
        with pytest.raises(ValueError, match=r"second_per_grid_ts.*expected one number per"):
            our_logits(model, ids, images, seconds)
    renamed = {**videos, "pixel_values": videos["pixel_values_videos"]}
    with pytest.raises(ValueError, match=r"encoder_input\['video'\]: unknown keys"):
        our_logits(model, ids, images, renamed)


def test_saved_model_keeps_its_video_settings(pair, tmp_path):
    """``save_hf_model`` writes the ``<|video_pad|>`` id and Qwen2.5-VL's
    ``tokens_per_second`` (here not transformers' default): transformers loads the directory
    with the same video logits."""
    import json

    from transformers import AutoModelForImageTextToText

    from fusion.checkpoint import save_hf_model

    hf, model = pair
    save_hf_model(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["video_token_id"] == VIDEO_PAD
    if hf.config.model_type == "qwen2_5_vl":
        assert config["vision_config"]["tokens_per_second"] == TOKENS_PER_SECOND
    again = AutoModelForImageTextToText.from_pretrained(tmp_path).eval()
    ids, images, videos = media_prompt(*ONE_VIDEO)
    assert (
        hf_logits(again, ids, images, videos) - our_logits(model, ids, images, videos)
    ).abs().max() <= 1e-4


def test_tower_rows_equal_get_video_features(pair):
    """Grids with t > 1 through the tower: attention within each frame (and Qwen2.5-VL's
    windows), rotary angles repeated per frame, as transformers' tower computes them."""
    hf, model = pair
    _, _, videos = media_prompt(*VIDEO_IMAGE_VIDEO)
    with torch.no_grad():
        theirs = torch.cat(
            hf.model.get_video_features(
                videos["pixel_values_videos"], videos["video_grid_thw"]
            ).pooler_output
        )
        ours = model.encode({"video": videos})["video"]
    assert (ours - theirs).abs().max() <= 1e-5


@st.composite
def media_batches(draw):
    """Left-padded rows of text, images and videos interleaved at random, grids of 1 to 4
    temporal patches, seconds per patch among rates that round both ways in float32."""
    rows, grids = [], {"image": [], "video": []}
    seconds = []
    for _ in range(draw(st.integers(1, 3))):
        pieces = [torch.full((draw(st.integers(1, 3)),), 5)]
        for _ in range(draw(st.integers(0, 3))):
            kind = draw(st.sampled_from(["image", "video"]))
            t = 1 if kind == "image" else draw(st.integers(1, 4))
            h, w = draw(st.sampled_from([2, 4, 6])), draw(st.sampled_from([2, 4, 6]))
            grids[kind].append((t, h, w))
            if kind == "video":
                seconds.append(draw(st.sampled_from([2 / 3, 1 / 3, 4 / 15, 2 / 7, 0.5, 4 / 3])))
            pad = IMAGE_PAD if kind == "image" else VIDEO_PAD
            pieces.append(torch.tensor([7, *[pad] * (t * h * w // MERGE**2), 8]))
            pieces.append(torch.full((draw(st.integers(0, 2)),), 5))
        rows.append(torch.cat(pieces)[None])
    ids, attention = left_pad(rows)
    as_tensor = {k: torch.tensor(v, dtype=torch.long).view(-1, 3) for k, v in grids.items()}
    return ids, attention, as_tensor, torch.tensor(seconds, dtype=torch.float32)


@pytest.fixture(scope="module")
def hf_qwen25():
    return tiny_hf_qwen("qwen2_5_vl")


@given(batch=media_batches())
def test_positions_equal_get_rope_index_for_any_interleaving(hf_qwen25, batch):
    ids, attention, grids, seconds = batch
    videos = {"video_grid_thw": grids["video"], "second_per_grid_ts": seconds}
    if not len(grids["video"]):
        videos = {}
    images = {"image_grid_thw": grids["image"]} if len(grids["image"]) else {}
    if not videos and not images:
        return
    theirs, _ = hf_qwen25.model.get_rope_index(
        ids, media_token_type_ids(ids), attention_mask=attention, **images, **videos
    )
    interval = TOKENS_PER_SECOND * seconds if videos else None
    ours, offsets = mrope_positions(
        ids,
        (attention.cumsum(1) - 1).clamp(min=0),
        IMAGE_PAD,
        images.get("image_grid_thw"),
        MERGE,
        media=[MediaGrids(VIDEO_PAD, videos.get("video_grid_thw"), interval, "video_grid_thw")],
    )
    real = attention.bool()
    assert torch.equal(ours[:, real], theirs[:, real])
    assert torch.equal(offsets, theirs[0, :, -1] + 1 - attention.sum(1))


def test_positions_read_nothing_back_from_the_device(pair):
    """Sync-free: the hook derives the positions of tokens on the meta device (where any
    read of a value, ``.item()``, ``.tolist()``, ``nonzero`` or a boolean index, fails) from
    the grids and seconds on the CPU, as the processors give them."""
    _, model = pair
    ids, images, videos = media_prompt(*VIDEO_IMAGE_VIDEO)
    hook = model.hooks[0]
    positions = hook.before_decoder(
        model.decoder, ids.to("meta"), model.encoder_tokens, {},
        our_media_input(images, videos), None, {},
    )  # fmt: skip
    assert positions.device.type == "meta" and positions.shape == (3, *ids.shape)
