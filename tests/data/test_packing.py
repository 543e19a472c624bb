"""Packing: first-fit rows, block-causal batches, and the property that a packed (or padded)
batch gives every sample the logits, loss and gradients it gets alone, with every attention
that runs on CPU: the dense mask, per-sample SDPA and (forward only there) FlexAttention."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from fusion import EarlyFusion, masked_token_loss, register_fusion_module
from fusion.data import (
    IGNORE_INDEX,
    Batch,
    Sample,
    collate_packed,
    collate_padded,
    pack,
    pack_samples,
)
from fusion.decoder import PackedSegments
from helpers import EMBED_DIM, IMAGE_ID, VOCAB, build_tiny_decoder, recording_pin_memory

ROWS_PER_IMAGE = 4  # a 2 x 2 image, one row per pixel
PAD = 0


class PixelEncoder(nn.Module):
    """pixel_values [n, 3, 2, 2] -> rows [n, 4, EMBED_DIM]."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Linear(3, 8)
        self.proj = register_fusion_module(nn.Linear(8, EMBED_DIM))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.tanh(self.backbone(pixel_values.flatten(2).transpose(1, 2))))


def tiny_model() -> EarlyFusion:
    decoder = build_tiny_decoder(tie_word_embeddings=False, seed=3)
    torch.manual_seed(4)
    return EarlyFusion(decoder, {"image": PixelEncoder()}, {"image": IMAGE_ID})


@st.composite
def samples(draw, max_samples: int = 5) -> list[Sample]:
    """Random samples: a prompt of text and 0-2 images, then an answer (the targets)."""
    out = []
    for index in range(draw(st.integers(1, max_samples))):
        images = draw(st.integers(0, 2))
        prompt: list[int] = []
        for _ in range(images):
            prompt += draw(st.lists(st.integers(4, VOCAB - 1), max_size=3))
            prompt += [IMAGE_ID] * ROWS_PER_IMAGE
        prompt += draw(st.lists(st.integers(4, VOCAB - 1), min_size=1, max_size=4))
        answer = draw(st.lists(st.integers(4, VOCAB - 1), min_size=1, max_size=10))
        tokens = torch.tensor(prompt + answer)
        labels = torch.full_like(tokens, IGNORE_INDEX)
        labels[len(prompt) - 1 : -1] = tokens[len(prompt) :]
        generator = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
        pixels = torch.randn(images, 3, 2, 2, generator=generator)
        out.append(Sample(tokens, labels, pixels, source=f"sample {index}"))
    return out


def check_row_layout(rows: list[list[int]], lengths: list[int], max_seq_len: int) -> None:
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
    for r, row in enumerate(rows):
        assert row == sorted(row)
        assert sum(lengths[i] for i in row) <= max_seq_len
        # First fit: no sample fits a row before its own, as filled when it came.
        for i in row:
            for earlier in rows[:r]:
                used = sum(lengths[j] for j in earlier if j < i)
                assert used + lengths[i] > max_seq_len


@settings(max_examples=100, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 40), max_size=60),
    extra=st.integers(0, 30),
)
def test_pack_is_first_fit(lengths, extra):
    max_seq_len = max(lengths, default=1) + extra
    rows = pack(lengths, max_seq_len)
    check_row_layout(rows, lengths, max_seq_len)
    assert rows == pack(lengths, max_seq_len)  # deterministic


def test_pack_examples_and_errors():
    assert pack([3, 3, 2, 4, 1], 5) == [[0, 2], [1, 4], [3]]
    assert pack([], 8) == []
    with pytest.raises(
        ValueError, match=r"lengths\[1\]: expected an integer in \[1, max_seq_len=4\], got 5"
    ):
        pack([2, 5], 4)
    with pytest.raises(ValueError, match=r"lengths\[0\].*got 0"):
        pack([0], 4)
    with pytest.raises(ValueError, match="max_seq_len: expected a positive integer, got 0"):
        pack([1], 0)


def test_collate_packed_layout():
    a = Sample(torch.tensor([5, 6, 7]), torch.tensor([-100, 7, -100]), torch.empty(0, 3, 2, 2))
    pixels = torch.randn(1, 3, 2, 2)
    b = Sample(torch.tensor([IMAGE_ID] * 4 + [8, 9]), torch.tensor([-100] * 4 + [9, -100]), pixels)
    batch = collate_packed([[a, b], [a]], pad_id=PAD, seq_len=10)
    assert batch.tokens.tolist() == [
        [5, 6, 7, IMAGE_ID, IMAGE_ID, IMAGE_ID, IMAGE_ID, 8, 9, PAD],
        [5, 6, 7] + [PAD] * 7,
    ]
    assert batch.input_pos.tolist() == [
        [0, 1, 2, 0, 1, 2, 3, 4, 5, 0],
        [0, 1, 2, 0, 1, 2, 3, 4, 5, 6],
    ]
    assert batch.labels[0].tolist() == [-100, 7, -100, -100, -100, -100, -100, 9, -100, -100]
    segments = batch.mask
    assert isinstance(segments, PackedSegments) and segments.backend == "auto"
    assert segments.lengths == ((3, 6, 1), (3, 7)) and segments.padding == (1, 7)
    expected = torch.zeros(10, 10, dtype=torch.bool)
    expected[:3, :3] = True
    expected[3:9, 3:9] = True
    expected[9, 9] = True
    dense = collate_packed([[a, b], [a]], pad_id=PAD, seq_len=10, attention="mask").mask
    assert torch.equal(dense[0], expected.tril()) and torch.equal(segments.dense_mask(), dense)
    assert dense.shape == (2, 10, 10) and dense.diagonal(dim1=1, dim2=2).all()
    flex = collate_packed([[a, b], [a]], pad_id=PAD, seq_len=10, attention="flex").mask
    assert flex.backend == "flex" and flex.lengths == segments.lengths
    assert torch.equal(batch.encoder_input["image"]["pixel_values"], pixels)
    assert (batch.num_tokens, batch.num_targets, batch.num_samples) == (12, 3, 3)
    assert batch.padding_fraction == pytest.approx(1 - 12 / 20)

    padded = collate_padded([a, b], pad_id=PAD)
    assert padded.mask is None and padded.input_pos is None
    assert padded.tokens.tolist()[0] == [5, 6, 7, PAD, PAD, PAD]
    assert set(padded.model_inputs()) == {"tokens", "mask", "input_pos", "encoder_input"}
    assert collate_padded([a], pad_id=PAD).encoder_input == {}


def test_collate_errors():
    a = Sample(torch.tensor([5, 6, 7]), torch.tensor([-100, 7, -100]), torch.empty(0))
    with pytest.raises(ValueError, match=r"rows\[0\]: 6 tokens, more than seq_len=5"):
        collate_packed([[a, a]], pad_id=PAD, seq_len=5)
    with pytest.raises(ValueError, match="rows: expected at least one row"):
        collate_packed([], pad_id=PAD)
    with pytest.raises(ValueError, match=r"rows\[1\]: expected at least one sample"):
        collate_packed([[a], []], pad_id=PAD)
    with pytest.raises(ValueError, match="pad_id: expected an integer >= 0, got -1"):
        collate_padded([a], pad_id=-1)
    b = Sample(a.tokens, a.labels, torch.zeros(1, 3, 2, 2))
    c = Sample(a.tokens, a.labels, torch.zeros(1, 3, 4, 4))
    with pytest.raises(ValueError, match="pixel values of different shapes"):
        collate_padded([b, c], pad_id=PAD)
    with pytest.raises(ValueError, match=r"attention: expected one of \('auto', 'sdpa'.*'dense'"):
        collate_packed([[a]], pad_id=PAD, attention="dense")


def test_sample_checks():
    ids = torch.tensor([5, 6])
    with pytest.raises(
        ValueError, match=r"tokens: expected integer ids \[n\], n >= 1, got shape \[0\]"
    ):
        Sample(ids[:0], ids[:0], torch.empty(0))
    with pytest.raises(ValueError, match=r"tokens: expected integer ids.*dtype torch.float32"):
        Sample(ids.float(), ids, torch.empty(0))
    with pytest.raises(ValueError, match=r"labels: expected integers of the tokens' shape \[2\]"):
        Sample(ids, ids[:1], torch.empty(0))
    with pytest.raises(ValueError, match="pixel_values: expected a floating tensor, got shape"):
        Sample(ids, ids, torch.zeros(1, 3, 2, 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="pixel_values: expected a floating tensor, got list"):
        Sample(ids, ids, [])


def test_batch_to():
    a = Sample(torch.tensor([5, 6]), torch.tensor([6, -100]), torch.zeros(1, 3, 2, 2))
    batch = collate_packed([[a]], pad_id=PAD).to("meta", pixel_dtype=torch.bfloat16)
    assert isinstance(batch, Batch) and batch.tokens.device.type == "meta"
    assert batch.encoder_input["image"]["pixel_values"].dtype == torch.bfloat16
    assert batch.mask.device.type == "meta" and batch.num_tokens == 2
    assert batch.mask.lengths == ((2,),)
    dense = collate_packed([[a]], pad_id=PAD, attention="mask").to("meta")
    assert dense.mask.device.type == "meta" and dense.mask.dtype == torch.bool


def test_batch_pin_memory_pins_every_tensor():
    a = Sample(torch.tensor([5, 6]), torch.tensor([6, -100]), torch.zeros(1, 3, 2, 2))
    batch = collate_packed([[a, a], [a]], pad_id=PAD)
    with recording_pin_memory() as pinned:
        out = batch.pin_memory()
    pixels = batch.encoder_input["image"]["pixel_values"]
    expected = [batch.tokens, batch.labels, batch.mask.segment_ids, batch.mask.cu_seqlens]
    expected += [batch.input_pos, pixels]
    assert {id(t) for t in pinned} == {id(t) for t in expected}
    assert isinstance(out.mask, PackedSegments) and out.mask.lengths == batch.mask.lengths
    assert torch.equal(out.encoder_input["image"]["pixel_values"], pixels)


def test_a_packed_batch_holds_no_square_tensor():
    """O(b * s) memory: no [b, s, s] mask in the batch (it was 1 GiB at 8 x 8192 before)."""
    samples = [
        Sample(torch.full((n,), 5), torch.full((n,), -100), torch.empty(0)) for n in (300, 700)
    ]
    batch = collate_packed([samples, samples[:1]], pad_id=PAD, seq_len=1024)
    tensors = [batch.tokens, batch.labels, batch.input_pos]
    tensors += [batch.mask.segment_ids, batch.mask.cu_seqlens]
    assert max(t.numel() for t in tensors) == 2 * 1024
    assert all(t.dim() <= 2 for t in tensors)


def grad(param: torch.Tensor) -> torch.Tensor:
    """The gradient, zeros where none flowed (the encoder without images)."""
    return torch.zeros_like(param) if param.grad is None else param.grad


def alone(model: EarlyFusion, sample: Sample) -> torch.Tensor:
    encoder_input = (
        {"image": {"pixel_values": sample.pixel_values}} if len(sample.pixel_values) else None
    )
    return model(sample.tokens[None], encoder_input=encoder_input)[0]


@pytest.mark.parametrize("attention", ["mask", "sdpa"])
@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(batch_samples=samples(), extra=st.integers(0, 12), packed=st.booleans())
def test_packed_batch_equals_samples_alone(one_thread, attention, batch_samples, extra, packed):
    """Every sample's logits and summed loss in the batch equal those it gets alone, and the
    batch loss's gradients are the sum of the samples' (fp32, 1e-5): with the dense mask and
    with per-sample SDPA (the CPU default)."""
    check_batch_equals_alone(batch_samples, extra, packed, attention)


@settings(
    max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(batch_samples=samples(), extra=st.integers(0, 12))
def test_packed_batch_equals_samples_alone_with_flex_attention(one_thread, batch_samples, extra):
    """The same with compiled FlexAttention, logits and loss only: on CPU it has no backward
    (torch 2.13). Few examples: each new shape compiles."""
    with torch.no_grad():
        check_batch_equals_alone(batch_samples, extra, True, "flex", gradients=False)


def check_batch_equals_alone(
    batch_samples: list[Sample],
    extra: int,
    packed: bool,
    attention: str,
    gradients: bool = True,
) -> None:
    model = tiny_model()
    max_seq_len = max(len(s) for s in batch_samples) + extra
    if packed:
        rows = pack_samples(batch_samples, max_seq_len)
        batch = collate_packed(rows, pad_id=PAD, seq_len=max_seq_len, attention=attention)
        placed = [sample for row in rows for sample in row]
        starts = [
            (r, sum(len(s) for s in row[:k])) for r, row in enumerate(rows) for k in range(len(row))
        ]
    else:
        batch = collate_padded(batch_samples, pad_id=PAD)
        placed = batch_samples
        starts = [(r, 0) for r in range(len(batch_samples))]

    logits = model(**batch.model_inputs())
    assert bool(logits.isfinite().all())  # padding's too
    loss_sum, count = masked_token_loss(logits, batch.labels)
    assert int(count) == batch.num_targets == sum(s.num_targets for s in batch_samples)
    if gradients:
        loss_sum.backward()
    batch_grads = {name: grad(p).clone() for name, p in model.named_parameters()}
    model.zero_grad()

    total = torch.zeros(())
    for sample, (row, start) in zip(placed, starts, strict=True):
        own = alone(model, sample)
        mine = logits[row, start : start + len(sample)]
        torch.testing.assert_close(mine, own, atol=1e-5, rtol=0)
        own_sum, own_count = masked_token_loss(own[None], sample.labels[None])
        if gradients:
            own_sum.backward()
        total = total + own_sum.detach()
        assert int(own_count) == sample.num_targets
    torch.testing.assert_close(loss_sum.detach(), total, atol=1e-5, rtol=1e-6)
    for name, param in model.named_parameters() if gradients else ():
        torch.testing.assert_close(batch_grads[name], grad(param), atol=1e-5, rtol=1e-5, msg=name)
