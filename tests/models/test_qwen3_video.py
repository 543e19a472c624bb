"""Qwen3-VL and Qwen3.5 take videos: each temporal patch's rows after its timestamp, in a
start / end pair of its own in place of the chat template's (as transformers 5.25's processor
writes them), placed as media of their own (t = 1); Qwen3-VL adds DeepStack rows at the video
placeholders too. Logits equal transformers' (fp32, 1e-4) with a video, a video and images, a
left-padded batch; positions equal ``get_rope_index``'s; packed rows equal each sample alone
(1e-5); greedy generation equals transformers' ``generate``."""

import pytest
import torch

from fusion import EarlyFusion, generate
from fusion.checkpoint import load_hf_vlm
from fusion.decoder import PackedSegments
from fusion.hooks import MRopeInput, MRopePositions
from qwen3_helpers import tiny_hf_qwen3, tiny_hf_qwen3_5
from qwen_helpers import (
    PAD,
    VIDEO_PAD,
    concat_media,
    hf_media_kwargs,
    left_pad,
    left_padded_mask,
    media_prompt,
    media_token_type_ids,
    our_media_input,
    packed_row,
)

VIDEO = ("video", (5, 3.0, 40, 60))  # odd frame counts and sizes
SHORT_VIDEO = ("video", (3, 7.5, 50, 36))
IMAGE = ("image", (1, 4, 6))
ONE_VIDEO = ([VIDEO], [3, 4])
VIDEO_AND_IMAGE = ([IMAGE, SHORT_VIDEO, IMAGE], [2, 3, 1, 2])


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=["qwen3_vl", "qwen3_5"])
def pair(request, tmp_path_factory) -> tuple[torch.nn.Module, EarlyFusion]:
    hf = tiny_hf_qwen3(seed=1) if request.param == "qwen3_vl" else tiny_hf_qwen3_5()
    directory = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(directory)
    return hf, load_hf_vlm(directory).eval()


def prompt(case, seed=0):
    return media_prompt(*case, seed=seed, qwen3=True)


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


@pytest.mark.parametrize("case", [ONE_VIDEO, VIDEO_AND_IMAGE], ids=["video", "images"])
def test_logits_match_transformers(pair, case):
    hf, model = pair
    ids, images, videos = prompt(case)
    assert videos["video_grid_thw"][:, 0].gt(1).all()  # several frames a video
    theirs = hf_logits(hf, ids, images, videos)
    assert (our_logits(model, ids, images, videos) - theirs).abs().max() <= 1e-4


class _DropVideoLayerRows:
    """A planted bug: the video's DeepStack rows dropped (only its main rows merged)."""

    def check(self, decoder, encoder_tokens):
        pass

    def before_decoder(self, decoder, tokens, placeholders, rows, encoder_input, input_pos, kw):
        rows["video"] = rows["video"][0]
        return input_pos


@pytest.mark.parametrize("bug", ["frames as one media", "no video deepstack rows"])
def test_planted_bugs_move_the_logits(pair, bug):
    """Each planted bug is refused (a video's frames as one media: its runs, split by the
    timestamps, do not match its grid) or moves the logits far past the tolerance."""
    hf, model = pair
    if bug == "no video deepstack rows" and len(model.hooks) == 1:
        pytest.skip("Qwen3.5's tower has no DeepStack")
    ids, images, videos = prompt(ONE_VIDEO)
    theirs = hf_logits(hf, ids, images, videos)
    hooks = model.hooks
    if bug == "frames as one media":
        unsplit = MRopePositions(["image", MRopeInput("video", "video_grid_thw")], 2)
        model.hooks = (unsplit, *hooks[1:])
    else:
        model.hooks = (hooks[0], _DropVideoLayerRows(), hooks[1])
    try:
        if bug == "frames as one media":
            with pytest.raises(ValueError, match="video placeholders do not match"):
                our_logits(model, ids, images, videos)
        else:
            assert (our_logits(model, ids, images, videos) - theirs).abs().max() > 1e-3
    finally:
        model.hooks = hooks


def test_positions_equal_get_rope_index(pair):
    hf, model = pair
    samples = [prompt(case, seed=i) for i, case in enumerate([VIDEO_AND_IMAGE, ONE_VIDEO])]
    ids, attention = left_pad([s[0] for s in samples])
    images = concat_media([s[1] for s in samples])
    videos = concat_media([s[2] for s in samples])
    theirs, _ = hf.model.get_rope_index(
        ids,
        media_token_type_ids(ids),
        image_grid_thw=images["image_grid_thw"],
        video_grid_thw=videos["video_grid_thw"],
        attention_mask=attention,
    )
    positions = (attention.cumsum(1) - 1).clamp(min=0)
    ours = model.hooks[0].before_decoder(
        model.decoder, ids, model.encoder_tokens, {}, our_media_input(images, videos),
        positions, {},
    )  # fmt: skip
    real = attention.bool()
    assert torch.equal(ours[:, real], theirs[:, real])


def test_left_padded_batch_matches_transformers(pair):
    hf, model = pair
    cases = [VIDEO_AND_IMAGE, ONE_VIDEO, ([IMAGE], [4, 2])]
    samples = [prompt(case, seed=i) for i, case in enumerate(cases)]
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
    cases = [ONE_VIDEO, VIDEO_AND_IMAGE, ([IMAGE], [2, 3])]
    samples = [prompt(case, seed=i) for i, case in enumerate(cases)]
    alone = [our_logits(model, *s)[0] for s in samples]
    ids = torch.cat([s[0] for s in samples], dim=1)
    lengths = [s[0].size(1) for s in samples]
    positions, mask = packed_row(lengths)
    if pair[0].config.model_type == "qwen3_5":  # Gated DeltaNet: each sample's state afresh
        mask = PackedSegments.from_lengths([lengths], sum(lengths))
    images = concat_media([s[1] for s in samples])
    videos = concat_media([s[2] for s in samples])
    packed = our_logits(model, ids, images, videos, mask=mask, input_pos=positions)[0]
    assert (packed - torch.cat(alone)).abs().max() <= 1e-5


def test_greedy_generation_equals_transformers(pair):
    hf, model = pair
    cases = [([IMAGE, VIDEO], [2, 1, 1]), ([SHORT_VIDEO], [3, 2])]
    samples = [prompt(case, seed=3 + i) for i, case in enumerate(cases)]
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


def test_videos_add_no_key(pair):
    _, model = pair
    assert set(model.encoders) == {"image"} and model.encoder_tokens["video"] == VIDEO_PAD
    plain = EarlyFusion(model.decoder, {"image": model.encoders["image"]}, {"image": 0})
    assert list(model.state_dict()) == list(plain.state_dict())


def test_positions_read_nothing_back_from_the_device(pair):
    """Sync-free: positions of tokens on the meta device (any read of a value fails there),
    the grids on the CPU as the processors give them (split per temporal patch there)."""
    _, model = pair
    ids, images, videos = prompt(VIDEO_AND_IMAGE)
    positions = model.hooks[0].before_decoder(
        model.decoder, ids.to("meta"), model.encoder_tokens, {},
        our_media_input(images, videos), None, {},
    )  # fmt: skip
    assert positions.device.type == "meta" and positions.shape == (3, *ids.shape)
