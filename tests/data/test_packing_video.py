"""Packing with videos (Qwen2.5-VL, whose temporal row is scaled by each video's seconds per
temporal patch, and Qwen3-VL, whose videos' frames are media of their own after their
timestamps): over random sets of samples mixing text, images and videos in one conversation
and one packed row, every sample's logits and loss in a packed or padded batch equal the
sample run alone, and the batch's gradients the sum of the samples' (fp32). Planted bugs in
how a batch carries its videos make the property fail, and Hypothesis shrinks each to a
minimal batch: the seconds per temporal patch lost (the temporal row not scaled as the
sample's), a video's patches landing in another sample."""

import pytest
import torch
from data.test_packing_mrope import (
    SETTINGS,
    TEXT,
    check_batch_equals_alone,
    fusion_positions,
    packed_differs,
)
from hypothesis import find, given, settings
from hypothesis import strategies as st

from fusion import EarlyFusion
from fusion.data import IGNORE_INDEX, Batch, Sample, collate_packed
from fusion.data.packing import HOST_INPUTS
from fusion.models import qwen2_vl, qwen3_vl
from qwen3_helpers import FUSION_TEXT
from qwen3_helpers import VISION_CONFIG as QWEN3_VISION
from qwen_helpers import (
    IMAGE_PAD,
    MERGE,
    PAD,
    VIDEO_PAD,
    VISION_CONFIGS,
    VISION_END,
    VISION_START,
)
from qwen_helpers import PATCH_WIDTH as QWEN2_PATCH_WIDTH

MODEL_TYPES = ["qwen2_5_vl", "qwen3_vl"]
PATCH_WIDTHS = {"qwen2_5_vl": QWEN2_PATCH_WIDTH, "qwen3_vl": 3 * 2 * 16 * 16}
TOKENS_PER_SECOND = 3  # Qwen2.5-VL's temporal positions per second (transformers: 4)
# Seconds per temporal patch (2 frames over the sampled frame rate): 1 first, the value a
# lost input defaults to, so that shrinking keeps another only where it matters.
SECONDS = [1.0, 0.5, 2 / 3, 0.25]
BUG_SETTINGS = settings(SETTINGS, max_examples=100, database=None)


def tiny_video_model(model_type: str) -> EarlyFusion:
    """A random Qwen2.5-VL or Qwen3-VL model with its ``"video"`` entry, weights N(0, 0.2)."""
    torch.manual_seed(0)
    if model_type == "qwen3_vl":
        model = qwen3_vl(
            text=FUSION_TEXT,
            vision=QWEN3_VISION,
            image_token_id=IMAGE_PAD,
            video_token_id=VIDEO_PAD,
        )
    else:
        model = qwen2_vl(
            text=TEXT,
            vision=VISION_CONFIGS[model_type],
            image_token_id=IMAGE_PAD,
            model_type=model_type,
            video_token_id=VIDEO_PAD,
            tokens_per_second=TOKENS_PER_SECOND,
        )
    with torch.no_grad():  # O(1) weights, so that every position mistake moves the logits
        for param in model.parameters():
            param.normal_(0, 0.2)
    return model.eval()


def video_tokens(draw, grid: tuple[int, int, int], qwen3: bool) -> list[int]:
    """A video's ids as the processors write them: Qwen2-VL's one run of ``t * h * w / 4``
    placeholders in the template's start / end pair; Qwen3-VL's, per temporal patch, a
    timestamp (three text tokens here), then that frame's run in a start / end pair of its
    own (in place of the template's)."""
    t, h, w = grid
    if not qwen3:
        return [VISION_START, *[VIDEO_PAD] * (t * h * w // MERGE**2), VISION_END]
    ids: list[int] = []
    for _ in range(t):
        ids += draw(st.lists(st.integers(3, 140), min_size=3, max_size=3))
        ids += [VISION_START, *[VIDEO_PAD] * (h * w // MERGE**2), VISION_END]
    return ids


@st.composite
def media_samples(draw, model_type: str, max_samples: int = 4) -> list[Sample]:
    """Random conversations: turns of a prompt with 0-2 media (images or videos of random
    grids and seconds, in any order), then an answer (the targets), 1-2 turns."""
    qwen3, width = model_type == "qwen3_vl", PATCH_WIDTHS[model_type]
    out = []
    for index in range(draw(st.integers(1, max_samples))):
        tokens: list[int] = []
        targets: list[bool] = []
        images: list[tuple[int, int, int]] = []
        videos: list[tuple[int, int, int]] = []
        seconds: list[float] = []
        for _ in range(draw(st.integers(1, 2))):
            for _ in range(draw(st.integers(0, 2))):
                kind = draw(st.sampled_from(["video", "image"]))
                h, w = (MERGE * draw(st.integers(1, 3)) for _ in range(2))
                text = draw(st.lists(st.integers(3, 140), max_size=2))
                if kind == "image":
                    images.append((1, h, w))
                    media = [VISION_START, *[IMAGE_PAD] * (h * w // MERGE**2), VISION_END]
                else:
                    grid = (draw(st.integers(1, 3)), h, w)
                    videos.append(grid)
                    seconds.append(draw(st.sampled_from(SECONDS)))
                    media = video_tokens(draw, grid, qwen3)
                tokens += text + media
                targets += [False] * (len(text) + len(media))
            prompt = draw(st.lists(st.integers(3, 140), min_size=1, max_size=3))
            answer = draw(st.lists(st.integers(3, 140), min_size=1, max_size=4))
            tokens += prompt + answer
            targets += [False] * len(prompt) + [True] * len(answer)
        ids = torch.tensor(tokens)
        labels = torch.where(torch.tensor(targets), ids, IGNORE_INDEX).roll(-1)
        labels[-1] = IGNORE_INDEX
        generator = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
        out.append(
            Sample(
                ids,
                labels,
                _patches(images, width, generator),
                f"sample {index}",
                image_grid_thw=torch.tensor(images, dtype=torch.int64).view(-1, 3),
                pixel_values_videos=_patches(videos, width, generator),
                video_grid_thw=torch.tensor(videos, dtype=torch.int64).view(-1, 3),
                second_per_grid_ts=torch.tensor(seconds, dtype=torch.float32),
            )
        )
    return out


def _patches(grids: list[tuple[int, int, int]], width: int, generator) -> torch.Tensor:
    count = sum(t * h * w for t, h, w in grids)
    return torch.randn(count, width, generator=generator) if grids else torch.empty(0)


@pytest.fixture(scope="module", params=MODEL_TYPES)
def model_type(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def model(model_type) -> EarlyFusion:
    return tiny_video_model(model_type)


@pytest.mark.parametrize("attention", ["mask", "sdpa"])
@settings(SETTINGS, max_examples=12)
@given(data=st.data(), share=st.floats(0, 1), packed=st.booleans())
def test_packed_and_padded_batches_with_videos_equal_samples_alone(
    one_thread, model_type, model, attention, data, share, packed
):
    samples = data.draw(media_samples(model_type))
    check_batch_equals_alone(model, samples, share, packed, fusion_positions, attention)


def test_collate_puts_a_rows_videos_in_order_and_keeps_grids_and_seconds_on_the_cpu():
    """A sample with an image then a video, and one with a video then an image, in one row:
    the batch's video entry holds both samples' videos in order, its image entry their
    images."""
    samples = [
        _sample(["image", "video"], seconds=[0.5], seed=1),
        _sample(["video", "image"], seconds=[2 / 3], seed=2),
    ]
    batch = collate_packed([samples], pad_id=PAD)
    video = batch.encoder_input["video"]
    assert video["video_grid_thw"].tolist() == [[2, 2, 4], [2, 2, 4]]
    assert video["second_per_grid_ts"].tolist() == pytest.approx([0.5, 2 / 3])
    assert batch.encoder_input["image"]["image_grid_thw"].tolist() == [[1, 2, 4], [1, 2, 4]]
    assert torch.equal(
        video["pixel_values_videos"], torch.cat([s.pixel_values_videos for s in samples])
    )
    moved = batch.to("meta", pixel_dtype=torch.bfloat16)
    for key in HOST_INPUTS[1:]:  # the video's grids and seconds stay on the CPU, uncast
        assert moved.encoder_input["video"][key] is video[key]
    assert moved.encoder_input["video"]["pixel_values_videos"].dtype == torch.bfloat16


def _sample(kinds: list[str], seconds: list[float], seed: int) -> Sample:
    """Qwen2-VL's ids for media of grid (2, 2, 4) (videos) or (1, 2, 4) (images)."""
    generator = torch.Generator().manual_seed(seed)
    ids, images, videos = [5], [], []
    for kind in kinds:
        pad, grid = (VIDEO_PAD, (2, 2, 4)) if kind == "video" else (IMAGE_PAD, (1, 2, 4))
        (videos if kind == "video" else images).append(grid)
        ids += [VISION_START, *[pad] * (grid[0] * 2), VISION_END]
    ids += [6, 7]
    tokens = torch.tensor(ids)
    labels = torch.full_like(tokens, IGNORE_INDEX)
    labels[-2] = 7
    return Sample(
        tokens,
        labels,
        torch.randn(8 * len(images), QWEN2_PATCH_WIDTH, generator=generator),
        image_grid_thw=torch.tensor(images, dtype=torch.int64).view(-1, 3),
        pixel_values_videos=torch.randn(16 * len(videos), QWEN2_PATCH_WIDTH, generator=generator),
        video_grid_thw=torch.tensor(videos, dtype=torch.int64).view(-1, 3),
        second_per_grid_ts=torch.tensor(seconds),
    )


# Planted bugs in what a packed batch carries for its videos.


def seconds_lost(rows, **kwargs) -> Batch:
    """Planted bug: the batch's video input without ``second_per_grid_ts`` (a collate that
    forgets it), so every video's temporal row steps by transformers' default of 1 second
    per temporal patch instead of its own."""
    batch = collate_packed(rows, **kwargs)
    video = batch.encoder_input.get("video")
    if video is not None:
        video.pop("second_per_grid_ts")
    return batch


def patches_in_another_sample(rows, **kwargs) -> Batch:
    """Planted bug: each sample's video patches handed to the next sample with videos (the
    last's to the first), the grids left in place: a video's rows land in another sample."""
    batch = collate_packed(rows, **kwargs)
    video = batch.encoder_input.get("video")
    owners = [s for row in rows for s in row if len(s.video_grid_thw)]
    if video is not None and len(owners) > 1:
        blocks = [s.pixel_values_videos for s in owners]
        video["pixel_values_videos"] = torch.cat(blocks[-1:] + blocks[:-1])
    return batch


def test_planted_video_bugs_are_caught_and_shrunk(one_thread):
    model = tiny_video_model("qwen2_5_vl")

    def shrunk(bug):
        return find(
            st.tuples(media_samples("qwen2_5_vl", max_samples=3), st.floats(0, 1)),
            lambda example: packed_differs(model, *example, collate=bug),
            settings=BUG_SETTINGS,
        )

    # Wrong for a video of two temporal patches or more whose seconds are not 1, even alone.
    samples, _ = shrunk(seconds_lost)
    videos = [grid for s in samples for grid in s.video_grid_thw.tolist()]
    seconds = [x for s in samples for x in s.second_per_grid_ts.tolist()]
    assert len(videos) == 1 and videos[0][0] >= 2 and seconds != [1.0]
    # Wrong only with two samples showing videos (in one row or two).
    samples, _ = shrunk(patches_in_another_sample)
    assert len(samples) <= 3 and sum(1 for s in samples if len(s.video_grid_thw)) == 2
