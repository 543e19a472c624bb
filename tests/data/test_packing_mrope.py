"""Packing with M-RoPE (Qwen2-VL, Qwen2.5-VL): over random sets of samples (text only, one
image, several images of random sizes, several answered turns), every sample's logits and loss
in a packed or padded batch equal the sample run alone, and the batch's gradients the sum of
the samples' (fp32, 1e-5). Planted bugs of the kinds other tools shipped (1-D positions for an
M-RoPE model, positions that restart only in the text row) make the property fail."""

from collections.abc import Callable

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fusion import EarlyFusion, masked_token_loss
from fusion.data import IGNORE_INDEX, Sample, collate_packed, collate_padded, pack_samples
from fusion.models import qwen2_vl
from fusion.positions import mrope_positions
from qwen_helpers import (
    IMAGE_PAD,
    MERGE,
    PAD,
    PATCH_WIDTH,
    VISION_CONFIGS,
    VISION_END,
    VISION_START,
)

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
# A bug turns a property into a counterexample found within these many examples.
BUG_SETTINGS = settings(SETTINGS, max_examples=40, print_blob=False, report_multiple_bugs=False)


def tiny_model(model_type: str = "qwen2_5_vl") -> EarlyFusion:
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
def qwen_samples(draw, max_samples: int = 4) -> list[Sample]:
    """Random conversations: turns of a prompt with 0-2 images of random grids, then an answer
    (the targets), 1-2 turns."""
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
        pixels = torch.randn(patches, PATCH_WIDTH, generator=generator) if grids else torch.empty(0)
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
    inputs = {"tokens": tokens, "input_pos": None, "encoder_input": encoder_input}
    return model(tokens, encoder_input=encoder_input, input_pos=positions(model, inputs))[0]


def row_length(samples: list[Sample], share: float) -> int:
    """From the longest sample (``share`` 0: one sample per row, mostly) to all of them in one
    row (``share`` 1)."""
    longest, total = max(len(s) for s in samples), sum(len(s) for s in samples)
    return longest + round(share * (total - longest))


def check_batch_equals_alone(
    model: EarlyFusion, samples: list[Sample], share: float, packed: bool, positions: Positions
) -> None:
    max_seq_len = row_length(samples, share)
    if packed:
        rows = pack_samples(samples, max_seq_len)
        batch = collate_packed(rows, pad_id=PAD, seq_len=max_seq_len)
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
    loss_sum, _ = masked_token_loss(logits, batch.labels)
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
        own_sum.backward()
        total = total + own_sum.detach()
    torch.testing.assert_close(loss_sum.detach(), total, atol=1e-5, rtol=1e-6)
    for name, param in model.named_parameters():
        if param.grad is not None or name in batch_grads:
            theirs = torch.zeros_like(param) if param.grad is None else param.grad
            torch.testing.assert_close(
                batch_grads.get(name, torch.zeros_like(param)),
                theirs,
                atol=1e-5,
                rtol=1e-5,
                msg=name,
            )
    model.zero_grad()


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def model(request) -> EarlyFusion:
    return tiny_model(request.param)


@SETTINGS
@given(samples=qwen_samples(), share=st.floats(0, 1), packed=st.booleans())
def test_packed_and_padded_batches_equal_samples_alone(one_thread, model, samples, share, packed):
    check_batch_equals_alone(model, samples, share, packed, fusion_positions)


@pytest.mark.parametrize("bug", [one_d_positions, restart_text_row_only], ids=lambda f: f.__name__)
def test_planted_position_bugs_are_caught(one_thread, bug):
    """The property is not vacuous: each bug class gives a counterexample. (A planted bug
    that the single-sample reference shares must still break packing isolation.)"""
    model = tiny_model()

    @BUG_SETTINGS
    @given(samples=qwen_samples(), share=st.floats(0, 1))
    def packed_property(samples, share):
        # The reference is each sample alone as the model computes it (transformers'
        # logits, tested apart), against what the buggy packing gives it.
        max_seq_len = row_length(samples, share)
        rows = pack_samples(samples, max_seq_len)
        batch = collate_packed(rows, pad_id=PAD, seq_len=max_seq_len)
        inputs = batch.model_inputs()
        inputs["input_pos"] = bug(model, inputs)
        with torch.no_grad():
            logits = model(**inputs)
            for r, row in enumerate(rows):
                start = 0
                for sample in row:
                    own = alone(model, sample, fusion_positions)
                    mine = logits[r, start : start + len(sample)]
                    torch.testing.assert_close(mine, own, atol=1e-5, rtol=0)
                    start += len(sample)

    with pytest.raises(AssertionError):
        packed_property()


def test_collate_concatenates_grids_and_keeps_them_on_the_cpu():
    def sample(grids: list[tuple[int, int, int]]) -> Sample:
        rows = sum(t * h * w for t, h, w in grids) // MERGE**2
        ids = torch.tensor([5] + [IMAGE_PAD] * rows + [6, 7])
        labels = torch.full_like(ids, IGNORE_INDEX)
        labels[-2] = 7
        patches = torch.randn(sum(t * h * w for t, h, w in grids), PATCH_WIDTH)
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
