"""Packing with M-RoPE (Qwen2-VL, Qwen2.5-VL, Qwen3-VL with DeepStack, Qwen3.5 with its Gated
DeltaNet layers, which refuse a dense block-causal mask): over random sets of
samples (text only, one image, several images of random sizes, several answered turns), every
sample's logits and loss in a packed or padded batch equal the sample run alone, and the
batch's gradients the sum of the samples' (fp32, 1e-5), with the dense mask, per-sample SDPA
and (logits and loss: no backward on CPU) FlexAttention. Planted bugs of the kinds other tools
shipped make the property fail, and Hypothesis shrinks each to a minimal batch: 1-D positions
for an M-RoPE model, positions that restart only in the text row, DeepStack rows added one
position off or into the wrong sample."""

from collections.abc import Callable
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, find, given, settings
from hypothesis import strategies as st

import fusion.hooks
from fusion import EarlyFusion, masked_token_loss
from fusion.data import IGNORE_INDEX, Sample, collate_packed, collate_padded, pack_samples
from fusion.hooks import add_at_placeholders
from fusion.models import qwen2_vl
from fusion.positions import mrope_positions
from qwen3_helpers import tiny_qwen3_5, tiny_qwen3_vl
from qwen_helpers import (
    IMAGE_PAD,
    MERGE,
    PAD,
    VISION_CONFIGS,
    VISION_END,
    VISION_START,
)
from qwen_helpers import PATCH_WIDTH as QWEN2_PATCH_WIDTH

TEXT = {
    "vocab_size": 160,
    "num_layers": 2,
    "num_heads": 4,
    "num_kv_heads": 2,
    "embed_dim": 32,
    "max_seq_len": 512,
    "intermediate_dim": 64,
    "rope_base": 100.0,  # fast rotations: position mistakes show at once
    "scale_factor": None,
    "tie_word_embeddings": False,
    "qkv_bias": True,
    "mrope_section": [2, 1, 1],
}
SETTINGS = settings(
    max_examples=20,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
# A bug turns a property into a counterexample found, then shrunk, within these examples.
BUG_SETTINGS = settings(SETTINGS, max_examples=100, database=None)
PATCH_WIDTHS = {
    "qwen2_vl": QWEN2_PATCH_WIDTH,
    "qwen2_5_vl": QWEN2_PATCH_WIDTH,
    "qwen3_vl": 1536,
    "qwen3_5": 1536,
}


def tiny_model(model_type: str = "qwen2_5_vl") -> EarlyFusion:
    if model_type == "qwen3_vl":
        return tiny_qwen3_vl()
    if model_type == "qwen3_5":
        return tiny_qwen3_5()
    torch.manual_seed(0)
    model = qwen2_vl(
        text=TEXT,
        vision=VISION_CONFIGS[model_type],
        image_token_id=IMAGE_PAD,
        model_type=model_type,
    )
    with torch.no_grad():  # O(1) weights, so that every position mistake moves the logits
        for param in model.parameters():
            param.normal_(0, 0.2)
    return model


@st.composite
def qwen_samples(draw, patch_width: int = QWEN2_PATCH_WIDTH, max_samples: int = 4) -> list[Sample]:
    """Random conversations: turns of a prompt with 0-2 images of random grids, then an answer
    (the targets), 1-2 turns; patches of ``patch_width``."""
    out = []
    for index in range(draw(st.integers(1, max_samples))):
        tokens: list[int] = []
        targets: list[bool] = []
        grids: list[tuple[int, int, int]] = []
        for _ in range(draw(st.integers(1, 2))):
            for _ in range(draw(st.integers(0, 2))):
                h, w = (MERGE * draw(st.integers(1, 4)) for _ in range(2))
                grids.append((1, h, w))
                text = draw(st.lists(st.integers(3, 140), max_size=2))
                image = [VISION_START] + [IMAGE_PAD] * (h * w // MERGE**2) + [VISION_END]
                tokens += text + image
                targets += [False] * (len(text) + len(image))
            prompt = draw(st.lists(st.integers(3, 140), min_size=1, max_size=3))
            answer = draw(st.lists(st.integers(3, 140), min_size=1, max_size=4))
            tokens += prompt + answer
            targets += [False] * len(prompt) + [True] * len(answer)
        ids = torch.tensor(tokens)
        # labels[t] = tokens[t + 1] where that token is a target
        labels = torch.where(torch.tensor(targets), ids, IGNORE_INDEX).roll(-1)
        labels[-1] = IGNORE_INDEX
        patches = sum(t * h * w for t, h, w in grids)
        generator = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
        pixels = torch.randn(patches, patch_width, generator=generator) if grids else torch.empty(0)
        grid = torch.tensor(grids, dtype=torch.int64).view(-1, 3)
        out.append(Sample(ids, labels, pixels, f"sample {index}", image_grid_thw=grid))
    return out


Positions = Callable[[EarlyFusion, dict], torch.Tensor | None]


def fusion_positions(model: EarlyFusion, inputs: dict) -> torch.Tensor | None:
    """The library's way: 1-D positions in, M-RoPE derived inside the model."""
    return inputs["input_pos"]


def one_d_positions(model: EarlyFusion, inputs: dict) -> torch.Tensor | None:
    """Planted bug: the packed row's 1-D positions as all three rows (no M-RoPE)."""
    positions = inputs["input_pos"]
    if positions is None:
        positions = torch.arange(inputs["tokens"].size(1)).expand_as(inputs["tokens"])
    return positions.expand(3, *inputs["tokens"].shape)


def restart_text_row_only(model: EarlyFusion, inputs: dict) -> torch.Tensor | None:
    """Planted bug: text positions restart at every sample, but the images' 3-D positions are
    computed over the whole packed row as if it were one sample.

    (Positions that never restart at all would be harmless here: within a sample they are
    off by one constant, which rotary attention, seeing only differences inside the sample's
    block, cannot tell. What breaks isolation is text and images disagreeing.)"""
    tokens = inputs["tokens"]
    grids = inputs.get("encoder_input", {}).get("image", {}).get("image_grid_thw")
    right, _ = mrope_positions(tokens, inputs["input_pos"], IMAGE_PAD, grids, MERGE)
    whole, _ = mrope_positions(tokens, None, IMAGE_PAD, grids, MERGE)
    return torch.where(tokens == IMAGE_PAD, whole, right)


def alone(model: EarlyFusion, sample: Sample, positions: Positions) -> torch.Tensor:
    tokens = sample.tokens[None]
    encoder_input = {}
    if len(sample.image_grid_thw):
        encoder_input = {
            "image": {"pixel_values": sample.pixel_values, "image_grid_thw": sample.image_grid_thw}
        }
    if len(sample.video_grid_thw):
        encoder_input["video"] = {
            "pixel_values_videos": sample.pixel_values_videos,
            "video_grid_thw": sample.video_grid_thw,
            "second_per_grid_ts": sample.second_per_grid_ts,
        }
    inputs = {"tokens": tokens, "input_pos": None, "encoder_input": encoder_input}
    return model(tokens, encoder_input=encoder_input, input_pos=positions(model, inputs))[0]


def row_length(samples: list[Sample], share: float) -> int:
    """From the longest sample (``share`` 0: one sample per row, mostly) to all of them in one
    row (``share`` 1)."""
    longest, total = max(len(s) for s in samples), sum(len(s) for s in samples)
    return longest + round(share * (total - longest))


def check_batch_equals_alone(
    model: EarlyFusion,
    samples: list[Sample],
    share: float,
    packed: bool,
    positions: Positions,
    attention: str = "auto",
    gradients: bool = True,
    grad_tol: float = 1e-5,
) -> None:
    model.zero_grad()  # an example that failed half-way left its gradients
    max_seq_len = row_length(samples, share)
    if packed:
        rows = pack_samples(samples, max_seq_len)
        batch = collate_packed(rows, pad_id=PAD, seq_len=max_seq_len, attention=attention)
        placed = [sample for row in rows for sample in row]
        starts = [
            (r, sum(len(s) for s in row[:k])) for r, row in enumerate(rows) for k in range(len(row))
        ]
    else:
        batch = collate_padded(samples, pad_id=PAD)
        placed, starts = list(samples), [(r, 0) for r in range(len(samples))]
    inputs = batch.model_inputs()
    inputs["input_pos"] = positions(model, inputs)
    logits = model(**inputs)
    assert bool(logits.isfinite().all())  # padding's too
    loss_sum, _ = masked_token_loss(logits, batch.labels)
    if gradients:
        loss_sum.backward()
    batch_grads = {
        name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None
    }
    model.zero_grad()

    total = torch.zeros(())
    for sample, (row, start) in zip(placed, starts, strict=True):
        own = alone(model, sample, positions)
        torch.testing.assert_close(logits[row, start : start + len(sample)], own, atol=1e-5, rtol=0)
        own_sum, _ = masked_token_loss(own[None], sample.labels[None])
        if gradients:
            own_sum.backward()
        total = total + own_sum.detach()
    torch.testing.assert_close(loss_sum.detach(), total, atol=1e-5, rtol=1e-6)
    for name, param in model.named_parameters() if gradients else ():
        if param.grad is not None or name in batch_grads:
            theirs = torch.zeros_like(param) if param.grad is None else param.grad
            # Relative to the tensor's scale: fp32 sums in another order (a batch of rows)
            # differ by about that much from the samples' own.
            scale = max(1.0, float(theirs.abs().max()))
            torch.testing.assert_close(
                batch_grads.get(name, torch.zeros_like(param)),
                theirs,
                atol=grad_tol * scale,
                rtol=grad_tol,
                msg=name,
            )
    model.zero_grad()


MODEL_TYPES = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5"]
# Qwen3.5's chunked delta rule (a triangular solve per chunk) rounds its fp32 gradients to
# about 3e-5 of their scale, batched or alone alike; in float64 they agree to 1e-15
# (tests/models/test_qwen3_5.py checks them there at 1e-5).
GRAD_TOL = {"qwen3_5": 1e-4}


@pytest.fixture(scope="module", params=MODEL_TYPES)
def model_type(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def model(model_type) -> EarlyFusion:
    return tiny_model(model_type)


@pytest.mark.parametrize("attention", ["mask", "sdpa"])
@SETTINGS
@given(data=st.data(), share=st.floats(0, 1), packed=st.booleans())
def test_packed_and_padded_batches_equal_samples_alone(
    one_thread, model_type, model, attention, data, share, packed
):
    samples = data.draw(qwen_samples(PATCH_WIDTHS[model_type]))
    if model_type == "qwen3_5" and packed and attention == "mask":
        max_seq_len = row_length(samples, share)
        rows = pack_samples(samples, max_seq_len)
        if any(len(row) > 1 or sum(map(len, row)) < max_seq_len for row in rows):
            # Not plain causal: the DeltaNet's state would run across the samples of a dense
            # block-causal mask (or take a padded row's samples for padding).
            with pytest.raises(ValueError, match=r"mask: .*PackedSegments"):
                check_batch_equals_alone(model, samples, share, packed, fusion_positions, attention)
            return
    check_batch_equals_alone(
        model,
        samples,
        share,
        packed,
        fusion_positions,
        attention,
        grad_tol=GRAD_TOL.get(model_type, 1e-5),
    )


@settings(SETTINGS, max_examples=3)
@given(data=st.data(), share=st.floats(0, 1))
def test_packed_batches_with_flex_attention_equal_samples_alone(
    one_thread, model_type, model, data, share
):
    """Logits and loss only (CPU FlexAttention has no backward); few examples, each new shape
    compiles."""
    samples = data.draw(qwen_samples(PATCH_WIDTHS[model_type]))
    with torch.no_grad():
        check_batch_equals_alone(
            model, samples, share, True, fusion_positions, "flex", gradients=False
        )


def packed_differs(
    model: EarlyFusion,
    samples: list[Sample],
    share: float,
    positions: Positions = fusion_positions,
    placement: Callable | None = None,
    collate: Callable = collate_packed,
) -> bool:
    """Whether some sample's logits in the packed batch, run with a planted bug (its
    ``positions``, ``placement`` in place of the DeepStack rows' placement, or ``collate`` in
    place of :func:`collate_packed`), differ from its logits alone as the model computes them
    (transformers' logits, tested apart)."""
    max_seq_len = row_length(samples, share)
    rows = pack_samples(samples, max_seq_len)
    inputs = collate(rows, pad_id=PAD, seq_len=max_seq_len).model_inputs()
    with torch.no_grad():
        expected = [[alone(model, sample, fusion_positions) for sample in row] for row in rows]
        inputs["input_pos"] = positions(model, inputs)
        right = fusion.hooks.add_at_placeholders
        with mock.patch.object(fusion.hooks, "add_at_placeholders", placement or right):
            logits = model(**inputs)
    for r, row in enumerate(rows):
        start = 0
        for sample, own in zip(row, expected[r], strict=True):
            if not torch.allclose(logits[r, start : start + len(sample)], own, atol=1e-5):
                return True
            start += len(sample)
    return False


def shrunk_counterexample(model: EarlyFusion, patch_width: int, **bug: Callable):
    """The smallest (samples, share) that the planted bug breaks, as Hypothesis shrinks it."""
    return find(
        st.tuples(qwen_samples(patch_width, max_samples=3), st.floats(0, 1)),
        lambda example: packed_differs(model, *example, **bug),
        settings=BUG_SETTINGS,
    )


def images_per_sample(samples: list[Sample]) -> list[int]:
    return [len(s.image_grid_thw) for s in samples]


def image_after_another_sample(samples: list[Sample], share: float) -> bool:
    """Whether a packed row holds an image in a sample that is not the row's first."""
    rows = pack_samples(samples, row_length(samples, share))
    return any(len(sample.image_grid_thw) for row in rows for sample in row[1:])


@pytest.mark.parametrize("bug", [one_d_positions, restart_text_row_only], ids=lambda f: f.__name__)
def test_planted_position_bugs_are_caught_and_shrunk(one_thread, bug):
    samples, share = shrunk_counterexample(tiny_model(), QWEN2_PATCH_WIDTH, positions=bug)
    if bug is one_d_positions:  # wrong for any image, even in a sample alone in its row
        assert images_per_sample(samples) == [1]
    else:  # wrong only for an image after another sample in its row
        assert len(samples) <= 3 and image_after_another_sample(samples, share)


def one_position_off(hidden, tokens, placeholder_id, rows):
    """Planted DeepStack bug: each row added at the token after its placeholder."""
    after = torch.roll(tokens, 1, dims=1)
    after[:, 0] = -1
    return add_at_placeholders(hidden, after, placeholder_id, rows)


def into_the_wrong_sample(hidden, tokens, placeholder_id, rows):
    """Planted DeepStack bug: placeholders counted per batch row instead of across the batch,
    so the images of a second row take the first row's rows."""
    is_placeholder = tokens == placeholder_id
    rank = (is_placeholder.cumsum(1) - 1).clamp(min=0, max=rows.size(0) - 1)
    return hidden + torch.where(is_placeholder[..., None], rows.to(hidden.dtype)[rank], 0)


@pytest.mark.parametrize("bug", [one_position_off, into_the_wrong_sample], ids=lambda f: f.__name__)
def test_planted_deepstack_bugs_are_caught_and_shrunk(one_thread, bug):
    samples, share = shrunk_counterexample(tiny_model("qwen3_vl"), 1536, placement=bug)
    if bug is one_position_off:
        assert images_per_sample(samples) == [1]
    else:  # images in two rows: the later row's take the earlier row's rows
        rows = pack_samples(samples, row_length(samples, share))
        with_images = [any(len(s.image_grid_thw) for s in row) for row in rows]
        assert len(samples) <= 3 and sum(with_images) == 2


def test_collate_concatenates_grids_and_keeps_them_on_the_cpu():
    def sample(grids: list[tuple[int, int, int]]) -> Sample:
        rows = sum(t * h * w for t, h, w in grids) // MERGE**2
        ids = torch.tensor([5] + [IMAGE_PAD] * rows + [6, 7])
        labels = torch.full_like(ids, IGNORE_INDEX)
        labels[-2] = 7
        patches = torch.randn(sum(t * h * w for t, h, w in grids), QWEN2_PATCH_WIDTH)
        grid = torch.tensor(grids, dtype=torch.int64).view(-1, 3)
        return Sample(ids, labels, patches if grids else torch.empty(0), image_grid_thw=grid)

    a, b, c = sample([(1, 2, 4)]), sample([]), sample([(1, 4, 4), (1, 2, 2)])
    batch = collate_packed([[a, b], [c]], pad_id=PAD)
    image = batch.encoder_input["image"]
    assert image["image_grid_thw"].tolist() == [[1, 2, 4], [1, 4, 4], [1, 2, 2]]
    assert torch.equal(image["pixel_values"], torch.cat([a.pixel_values, c.pixel_values]))
    moved = batch.to("meta", pixel_dtype=torch.bfloat16)
    assert moved.encoder_input["image"]["pixel_values"].device.type == "meta"
    assert moved.encoder_input["image"]["image_grid_thw"] is image["image_grid_thw"]
    with pytest.raises(ValueError, match=r"image_grid_thw: expected int64 \[n_images, 3\]"):
        Sample(
            a.tokens, a.labels, a.pixel_values, image_grid_thw=torch.ones(1, 2, dtype=torch.int64)
        )
