"""Micro-batches of a plan (fusion.data.loader): every step's samples trained once over the
processes and micro-batches, fillers where a process would idle or miss images, the same
batches in the same order with any number of workers (and the training RNG untouched), and a
micro-batch that cannot be made, or a worker that dies, as a LoaderError."""

import os
import signal
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fusion.data import (
    IGNORE_INDEX,
    Collate,
    ImageRef,
    LoaderError,
    MicroBatches,
    Sample,
    StepBatches,
    fill,
    ignored,
    image_filler,
)
from fusion.training.steps import plan_in_order

PAD = 0


def sample(length: int, *, image: bool = False, tag: int = 1) -> Sample:
    tokens = torch.full((length,), tag, dtype=torch.int64)
    labels = tokens.clone()
    labels[-1] = IGNORE_INDEX
    images = (ImageRef(f"img{tag}.png", 2, 2, 1),) if image else ()
    return Sample(tokens, labels, torch.empty(0), f"data.jsonl:{tag}", images=images)


class PixelMaker:
    """Stands in for a ConversationEncoder: each image's pixels are its sample's tag;
    ``broken`` names the image files that can no longer be read."""

    def __init__(self, broken: tuple[str, ...] = ()) -> None:
        self.broken = broken

    def load_pixels(self, samples):
        out = []
        for s in samples:
            if s.pixels_loaded:
                out.append(s)
                continue
            if s.images[0].path in self.broken:
                raise ValueError(f"{s.source}: image {s.images[0].path!r}: no such file")
            pixels = torch.full((1, 3, 2, 2), float(s.tokens[0]))
            out.append(replace(s, pixel_values=pixels))
        return out


def test_fill_adds_fillers_without_targets():
    text, short_image, long_image = sample(3), sample(2, image=True), sample(5, image=True, tag=2)
    # A process with no image among processes with images gets the shortest image sample.
    got = fill([[text], [long_image, short_image]], 0)
    assert got[0] is text and got[1].has_images and len(got[1]) == 2
    assert got[1].num_targets == 0 and short_image.num_targets > 0
    # An empty group gets the shortest sample, then an image one: every process runs the same
    # modules.
    got = fill([[], [text, long_image]], 0)
    assert [len(s) for s in got] == [3, 5] and all(s.num_targets == 0 for s in got)
    # DDP with a trained image encoder: a micro-batch without images gets the filler.
    filler = image_filler([text, long_image, short_image])
    assert filler is not None and len(filler) == 2 and filler.num_targets == 0
    assert fill([[text]], 0, filler) == [text, filler]
    assert image_filler([text]) is None
    # One process skips an empty group; every process skips an empty micro-batch.
    assert fill([[]], 0) is None and fill([[], []], 1) is None
    assert fill([[text], []], 1)[0].num_targets == 0


def test_fill_gives_every_process_each_media_kind_of_the_micro_batch():
    """A video runs the vision tower once more (the shared "video" entry): a process without
    videos beside one with them gets the shortest video sample, and one without images the
    shortest image sample, both without targets."""
    image, long_clip = sample(2, image=True), with_video(sample(6, tag=3))
    clip = with_video(sample(4, tag=4))
    first = fill([[long_clip, clip], [image]], 0)
    assert first[:2] == [long_clip, clip] and first[2].has_images and not first[2].num_targets
    second = fill([[long_clip, clip], [image]], 1)
    assert second[0] is image and second[1].has_videos and len(second[1]) == 4
    assert second[1].num_targets == 0 and clip.num_targets > 0
    assert image_filler([sample(3), clip]).has_videos  # DDP's filler: a video will do


def with_video(base: Sample) -> Sample:
    """``base`` showing one video of grid (2, 2, 2), its patches given."""
    return replace(
        base,
        pixel_values_videos=torch.zeros(8, 4),
        video_grid_thw=torch.tensor([[2, 2, 2]]),
        second_per_grid_ts=torch.tensor([0.5]),
    )


@settings(max_examples=25)
@given(
    lengths=st.lists(st.integers(2, 12), min_size=1, max_size=16),
    micro_batches=st.integers(1, 3),
    world=st.integers(1, 3),
)
def test_every_step_s_samples_are_trained_once_over_processes_and_micro_batches(
    lengths, micro_batches, world
):
    samples = [sample(n, tag=i + 1) for i, n in enumerate(lengths)]
    steps = [s.samples for s in plan_in_order(lengths, batch_tokens=24)]
    collate = Collate(PAD, max_seq_len=24)
    seen: dict[int, list[int]] = {}
    for rank in range(world):
        batches = StepBatches(
            samples, steps, collate, micro_batches=micro_batches, world_size=world, rank=rank
        )
        assert len(batches) == len(steps) * micro_batches
        for index in range(len(batches)):
            item = batches[index]
            assert (item.step, item.index) == divmod(index, micro_batches)
            if item.batch is None:
                assert item.tokens == 0
                continue
            # Real samples: those with targets (tags are their indices + 1).
            real = item.batch.tokens[item.batch.labels != IGNORE_INDEX].unique().tolist()
            seen.setdefault(item.step, []).extend(tag - 1 for tag in real)
            assert item.tokens == sum(lengths[tag - 1] for tag in real)
    assert {step: sorted(found) for step, found in seen.items()} == {
        step: sorted(indices) for step, indices in enumerate(steps)
    }


def image_batches(broken: tuple[str, ...] = (), **kwargs) -> StepBatches:
    samples = [sample(3 + i % 4, image=i % 3 != 0, tag=i + 1) for i in range(12)]
    steps = [tuple(range(i, i + 3)) for i in range(0, 12, 3)]
    collate = Collate(PAD, max_seq_len=16, encoder=PixelMaker(broken))  # type: ignore[arg-type]
    return StepBatches(samples, steps, collate, micro_batches=2, **kwargs)


def taken(batches: StepBatches, **kwargs) -> list[tuple[int, int, list, list]]:
    with MicroBatches(batches, **kwargs) as stream:
        out = []
        for item in stream:
            batch = item.batch
            assert batch is not None
            pixels = batch.encoder_input.get("image", {}).get("pixel_values", torch.empty(0))
            out.append((item.step, item.index, batch.tokens.tolist(), pixels.flatten().tolist()))
        return out


@pytest.mark.parametrize("packing", [True, False])
def test_workers_give_the_same_batches_in_order_and_leave_the_rng_alone(packing):
    batches = image_batches(world_size=2, rank=1)
    batches = StepBatches(
        batches.samples,
        batches.steps,
        replace(batches.collate, packing=packing),
        micro_batches=2,
        world_size=2,
        rank=1,
    )
    state = torch.get_rng_state()
    in_process = taken(batches)
    assert torch.equal(torch.get_rng_state(), state)  # the loader draws its own seed
    assert [(step, k) for step, k, _, _ in in_process] == [(s, k) for s in range(4) for k in (0, 1)]
    assert taken(batches, num_workers=2) == in_process
    assert torch.equal(torch.get_rng_state(), state)
    assert taken(batches, num_workers=3, start=3) == in_process[3:]  # a resumed run's


def test_a_micro_batch_that_cannot_be_made_is_a_loader_error_in_its_turn():
    """img5.png (in micro-batch 1 of step 1) is broken: the micro-batches before it come,
    then one line naming it; with workers too (they made it ahead)."""
    batches = image_batches(broken=("img5.png",))
    assert batches[3].error == "data.jsonl:5: image 'img5.png': no such file"
    for workers in (0, 2):
        got = []
        with pytest.raises(LoaderError, match=r"^data.jsonl:5: image 'img5.png'") as caught:
            with MicroBatches(batches, num_workers=workers) as stream:
                got.extend(stream)
        assert not caught.value.died and [(i.step, i.index) for i in got] == [
            (0, 0),
            (0, 1),
            (1, 0),
        ]
        assert "\n" not in str(caught.value)


def test_a_killed_worker_is_a_loader_error():
    batches = image_batches()
    real_item = StepBatches.__getitem__

    def dies_on_item_5(self, index):
        if torch.utils.data.get_worker_info() is not None and index == 5:
            os.kill(os.getpid(), signal.SIGKILL)
        return real_item(self, index)

    StepBatches.__getitem__ = dies_on_item_5  # type: ignore[method-assign]
    try:
        got = []
        with pytest.raises(LoaderError, match="a data loader worker process died") as caught:
            with MicroBatches(batches, num_workers=2) as stream:
                got.extend(item.step * 2 + item.index for item in stream)
    finally:
        StepBatches.__getitem__ = real_item  # type: ignore[method-assign]
    # In order up to the dead worker's: its last one may be lost with it (a killed process's
    # queue is not flushed).
    assert caught.value.died and got == list(range(len(got))) and 3 <= len(got) <= 5
    assert "\n" not in str(caught.value)


def test_bad_arguments_are_refused_by_name():
    batches = image_batches()
    with pytest.raises(ValueError, match=r"start: expected an integer in \[0, 8\], got 9"):
        MicroBatches(batches, start=9)
    with pytest.raises(ValueError, match="num_workers: expected an integer >= 0, got -1"):
        MicroBatches(batches, num_workers=-1)
    with pytest.raises(ValueError, match=r"rank: expected an integer in \[0, 2\), got 2"):
        image_batches(world_size=2, rank=2)
    with pytest.raises(IndexError, match="index"):
        batches[8]
    with pytest.raises(RuntimeError, match="inside its `with` block"):
        next(MicroBatches(batches))


def test_evaluation_s_plan_keeps_the_order_within_the_budget():
    steps = plan_in_order([3, 4, 2, 9, 1, 1], batch_tokens=8)
    assert [s.samples for s in steps] == [(0, 1), (2,), (3,), (4, 5)]  # 9 alone: too long
    assert plan_in_order([], batch_tokens=8) == []
    assert ignored(sample(4)).num_targets == 0
