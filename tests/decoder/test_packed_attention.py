"""Packed rows without a dense mask: ``PackedSegments`` (layout, checks, moves, memory) and the
attention backends over it (each sample as alone, padding finite, the block mask, the
backend rules, the decoder's checks, compilation without recompiles across layouts)."""

import subprocess
import sys
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import fusion.decoder.packed_attention as pa
from fusion.decoder import PackedSegments
from fusion.decoder.packed_attention import (
    document_block_mask,
    packed_attention,
    prepare,
    resolve_backend,
)
from helpers import VOCAB, build_tiny_decoder, recording_pin_memory

CPU = torch.device("cpu")


@st.composite
def layouts(draw, max_rows: int = 3, max_seq_len: int = 300) -> tuple[list[list[int]], int]:
    """Rows of sample lengths and a row length they fit in (some rows padded, some full)."""
    seq_len = draw(st.integers(1, max_seq_len))
    rows = []
    for _ in range(draw(st.integers(1, max_rows))):
        row, left = [], seq_len
        while left and (not row or draw(st.booleans())):
            n = draw(st.integers(1, left))
            row.append(n)
            left -= n
        rows.append(row)
    return rows, seq_len


def positions(segments: PackedSegments) -> torch.Tensor:
    """Positions [b, s] restarting at every segment."""
    rows = [torch.cat([torch.arange(n) for n in row]) for row in segments.lengths]
    return torch.stack(rows)


def qkv(b: int, s: int, heads: int = 4, kv_heads: int = 2, head_dim: int = 8, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s, heads, head_dim, generator=generator)
    k, v = (torch.randn(b, s, kv_heads, head_dim, generator=generator) for _ in range(2))
    return q, k, v


def dense_attention(q, k, v, mask: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """The baseline: SDPA with the [b, 1, s, s] mask, back to [b, s, h, hd]."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask[:, None],
        enable_gqa=True, scale=scale,
    )  # fmt: skip
    return out.transpose(1, 2)


# ---------------------------------------------------------------------- PackedSegments


def test_from_lengths_layout():
    segments = PackedSegments.from_lengths([[3, 6], [3, 2, 5], [10]], 10)
    assert segments.lengths == ((3, 6, 1), (3, 2, 5), (10,))
    assert segments.padding == (1, 0, 0)
    assert (segments.batch_size, segments.seq_len, segments.backend) == (3, 10, "auto")
    assert segments.segment_ids.tolist() == [
        [0, 0, 0, 1, 1, 1, 1, 1, 1, -1],
        [0, 0, 0, 1, 1, 2, 2, 2, 2, 2],
        [0] * 10,
    ]
    assert segments.cu_seqlens.tolist() == [0, 3, 9, 10, 13, 15, 20, 30]
    assert segments.cu_seqlens.dtype == segments.segment_ids.dtype == torch.int32
    assert segments.max_length == 10  # 10 -> 16, at most seq_len
    assert PackedSegments.from_lengths([[3, 2]], 8).max_length == 4  # 3 -> 4
    expected = torch.zeros(10, 10, dtype=torch.bool)
    expected[:3, :3] = expected[3:9, 3:9] = True
    expected[9, 9] = True  # padding attends to itself
    dense = segments.dense_mask()
    assert dense.shape == (3, 10, 10) and torch.equal(dense[0], expected.tril())
    assert torch.equal(dense[2], torch.ones(10, 10, dtype=torch.bool).tril())


def test_from_lengths_errors():
    with pytest.raises(ValueError, match="seq_len: expected a positive integer, got 0"):
        PackedSegments.from_lengths([[1]], 0)
    with pytest.raises(ValueError, match="lengths: expected a list of rows"):
        PackedSegments.from_lengths([], 4)
    with pytest.raises(ValueError, match=r"lengths\[1\]: expected a non-empty list"):
        PackedSegments.from_lengths([[1], []], 4)
    with pytest.raises(ValueError, match=r"lengths\[0\]: expected positive integers, got 0"):
        PackedSegments.from_lengths([[2, 0]], 4)
    with pytest.raises(ValueError, match=r"lengths\[0\]: 5 tokens, more than seq_len=4"):
        PackedSegments.from_lengths([[2, 3]], 4)
    with pytest.raises(ValueError, match="backend: expected one of"):
        PackedSegments.from_lengths([[2]], 4, backend="math")


def test_constructor_checks_its_parts():
    good = PackedSegments.from_lengths([[2, 1], [4]], 4)
    fields = {
        "lengths": good.lengths,
        "padding": good.padding,
        "segment_ids": good.segment_ids,
        "cu_seqlens": good.cu_seqlens,
        "max_length": good.max_length,
    }
    bad = [
        ({"lengths": ((2, 1, 1), (3,))}, r"lengths\[1\]: expected segments summing to seq_len=4"),
        ({"padding": (2, 0)}, r"padding\[0\]: expected 0 or the row's last segment"),
        ({"padding": (1,)}, "padding: expected a tuple of 2 lengths"),
        ({"segment_ids": good.segment_ids.long()}, r"segment_ids: expected int32 \[2, 4\]"),
        ({"cu_seqlens": good.cu_seqlens[:-1]}, r"cu_seqlens: expected int32 \[5\]"),
        ({"max_length": 3}, "max_length: expected 4"),
        ({"lengths": ((3, 1), (0, 4))}, r"lengths\[1\]: expected a non-empty tuple of positive"),
    ]
    for change, message in bad:
        with pytest.raises(ValueError, match=message):
            PackedSegments(**{**fields, **change})


def test_to_and_pin_memory_move_the_tensors_and_keep_the_lengths():
    segments = prepare(PackedSegments.from_lengths([[2, 1], [4]], 4, backend="flex"), torch.float)
    assert segments.block_mask is not None
    moved = segments.to("meta", non_blocking=True)
    assert moved.segment_ids.device.type == moved.cu_seqlens.device.type == "meta"
    assert moved.device.type == "meta" and moved.block_mask is None  # made per device
    assert (moved.lengths, moved.padding, moved.backend) == (
        segments.lengths,
        segments.padding,
        "flex",
    )
    with recording_pin_memory() as pinned:
        out = segments.pin_memory()
    assert pinned[0] is segments.segment_ids and pinned[1] is segments.cu_seqlens
    assert torch.equal(out.segment_ids, segments.segment_ids) and out.lengths == segments.lengths


def test_a_window_limits_the_dense_mask_to_the_latest_keys_of_the_sample():
    segments = PackedSegments.from_lengths([[6, 3], [9]], 10).with_window(4)
    ids = segments.segment_ids.tolist()
    expected = torch.tensor(
        [
            [
                [ids[r][i] == ids[r][j] and 0 <= i - j < 4  # padding: -1, its own segment
                 for j in range(10)]
                for i in range(10)
            ]
            for r in range(2)
        ]
    )  # fmt: skip
    assert torch.equal(segments.dense_mask(), expected)
    assert segments.with_window(None).window is None
    with pytest.raises(ValueError, match="window: expected a positive integer"):
        segments.with_window(0)


def test_memory_is_linear_in_the_row_length():
    s = 2048
    segments = PackedSegments.from_lengths([[700, 900], [2048]], s)
    tensors = [segments.segment_ids, segments.cu_seqlens]
    assert sum(t.numel() for t in tensors) <= 2 * s + 8
    block_mask = document_block_mask(segments.segment_ids)
    blocks = (s // pa.FLEX_BLOCK) ** 2
    assert block_mask.kv_indices.numel() == 2 * blocks  # (s / 128)^2 per row, not s^2


# ---------------------------------------------------------------------- backends


@settings(max_examples=15, deadline=None)
@given(layout=layouts(), window=st.none() | st.integers(1, 300))
def test_block_mask_equals_flex_create_block_mask(layout, window):
    """Document-causal, and within a sliding window when there is one (the blocks outside it
    skipped, those inside it whole)."""
    from torch.nn.attention.flex_attention import create_block_mask

    rows, seq_len = layout
    ids = PackedSegments.from_lengths(rows, seq_len).segment_ids

    def document_causal(b, h, q, k):
        allowed = (ids[b, q] == ids[b, k]) & (q >= k) & (ids[b, q] >= 0)
        return allowed if window is None else allowed & (q - k < window)

    expected = create_block_mask(document_causal, len(rows), None, seq_len, seq_len, device="cpu")
    actual = document_block_mask(ids, window)
    assert torch.equal(actual.to_dense(), expected.to_dense())
    assert torch.equal(actual.full_kv_num_blocks, expected.full_kv_num_blocks)
    assert torch.equal(actual.kv_num_blocks, expected.kv_num_blocks)


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
@settings(max_examples=10, deadline=None)
@given(layout=layouts(max_seq_len=160), seed=st.integers(0, 2**16))
def test_each_sample_attends_as_with_the_dense_mask(backend, layout, seed):
    """At every sample position the backend's output equals SDPA with the dense mask (and so
    the sample alone); padding positions are finite (zeros for these two backends)."""
    rows, seq_len = layout
    segments = PackedSegments.from_lengths(rows, seq_len, backend=backend)
    q, k, v = qkv(len(rows), seq_len, seed=seed)
    with torch.no_grad():  # CPU FlexAttention has no backward (torch 2.13)
        out = packed_attention(q, k, v, prepare(segments, q.dtype), enable_gqa=True)
    expected = dense_attention(q, k, v, segments.dense_mask())
    real = segments.segment_ids >= 0
    torch.testing.assert_close(out[real], expected[real], atol=1e-5, rtol=1e-5)
    assert out.shape == q.shape and bool(out.isfinite().all())
    assert not bool(out[~real].any())


@settings(max_examples=10, deadline=None)
@given(
    layout=layouts(max_seq_len=160),
    seed=st.integers(0, 2**16),
    window=st.integers(1, 40),
    scale=st.none() | st.floats(0.05, 1.0),
)
def test_per_sample_sdpa_within_a_window_equals_the_dense_mask(layout, seed, window, scale):
    rows, seq_len = layout
    segments = PackedSegments.from_lengths(rows, seq_len, backend="sdpa").with_window(window)
    q, k, v = qkv(len(rows), seq_len, seed=seed)
    out = packed_attention(q, k, v, segments, enable_gqa=True, scale=scale)
    expected = dense_attention(q, k, v, segments.dense_mask(), scale=scale)
    real = segments.segment_ids >= 0
    torch.testing.assert_close(out[real], expected[real], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("rows", "seq_len", "window"),
    [([[200, 60]], 300, 130), ([[5, 140], [145]], 150, 3)],  # whole blocks in the window, none
)
def test_flex_within_a_window_equals_the_dense_mask(rows, seq_len, window):
    """The block mask and its ``mask_mod`` with a window, run by eager FlexAttention (the
    compiled CPU kernels take minutes per window; the block mask alone is checked against
    ``create_block_mask`` above)."""
    from torch.nn.attention.flex_attention import flex_attention

    segments = PackedSegments.from_lengths(rows, seq_len, backend="flex").with_window(window)
    q, k, v = qkv(len(rows), seq_len)
    with mock.patch.object(pa, "_compiled_flex", flex_attention), torch.no_grad():
        out = packed_attention(q, k, v, prepare(segments, q.dtype), enable_gqa=True, scale=0.3)
    expected = dense_attention(q, k, v, segments.dense_mask(), scale=0.3)
    real = segments.segment_ids >= 0
    torch.testing.assert_close(out[real], expected[real], atol=1e-5, rtol=1e-5)


def test_per_sample_sdpa_gradients_equal_the_dense_masks():
    segments = PackedSegments.from_lengths([[5, 9, 2], [16], [3]], 16, backend="sdpa")
    q, k, v = (t.requires_grad_() for t in qkv(3, 16))
    grad = torch.randn(3, 16, 4, 8) * (segments.segment_ids >= 0)[..., None, None]
    out = packed_attention(q, k, v, segments, enable_gqa=True)
    mine = torch.autograd.grad(out, (q, k, v), grad)
    dense = dense_attention(q, k, v, segments.dense_mask())
    theirs = torch.autograd.grad(dense, (q, k, v), grad)
    for a, b in zip(mine, theirs, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_backend_rules():
    cuda = torch.device("cuda", 0)
    assert resolve_backend("auto", CPU, torch.float32) == "sdpa"
    assert resolve_backend("auto", CPU, torch.bfloat16, dropout=True) == "sdpa"
    assert resolve_backend("auto", cuda, torch.float32) == "flex"  # varlen: no fp32
    with mock.patch.object(pa, "_flash_capable", return_value=True):
        assert resolve_backend("auto", cuda, torch.bfloat16) == "varlen"
        assert resolve_backend("auto", cuda, torch.bfloat16, dropout=True) == "sdpa"
    with mock.patch.object(pa, "_flash_capable", return_value=False):
        assert resolve_backend("auto", cuda, torch.bfloat16) == "flex"  # before Ampere
    assert resolve_backend("flex", CPU, torch.float32) == "flex"
    with pytest.raises(ValueError, match="mask: the 'varlen' backend needs"):
        resolve_backend("varlen", CPU, torch.bfloat16)
    with pytest.raises(ValueError, match="mask: the 'flex' backend has no attention dropout"):
        resolve_backend("flex", CPU, torch.float32, dropout=True)


def test_eager_per_sample_attention_never_imports_dynamo():
    code = (
        "import sys, torch; from fusion.decoder import PackedSegments; "
        "from fusion.decoder.packed_attention import packed_attention, prepare; "
        "s = prepare(PackedSegments.from_lengths([[2, 3]], 6), torch.float32); "
        "q = torch.randn(1, 6, 2, 4); packed_attention(q, q, q, s).sum().item(); "
        "print(s.backend, 'torch._dynamo' in sys.modules)"
    )
    assert subprocess.check_output([sys.executable, "-c", code], text=True).split() == [
        "sdpa",
        "False",
    ]


# ---------------------------------------------------------------------- the decoder


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_decoder_with_segments_equals_the_dense_mask(backend):
    decoder = build_tiny_decoder()
    segments = PackedSegments.from_lengths([[4, 6], [3, 3, 3]], 12, backend=backend)
    tokens = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    pos = positions(segments)
    with torch.no_grad():
        expected = decoder(tokens, mask=segments.dense_mask(), input_pos=pos)
        actual = decoder(tokens, mask=segments, input_pos=pos)
    real = segments.segment_ids >= 0
    torch.testing.assert_close(actual[real], expected[real], atol=1e-5, rtol=1e-5)
    assert bool(actual.isfinite().all())


def test_decoder_checks_segments():
    decoder = build_tiny_decoder()
    tokens = torch.zeros(2, 8, dtype=torch.long)
    with pytest.raises(ValueError, match="mask: expected packed segments of 2 rows of 8 "):
        decoder(tokens, mask=PackedSegments.from_lengths([[8]], 8))
    with pytest.raises(ValueError, match="got 2 rows of 9"):
        decoder(tokens, mask=PackedSegments.from_lengths([[8], [9]], 9))
    with pytest.raises(ValueError, match="mask: expected device cpu, got meta"):
        decoder(tokens, mask=PackedSegments.from_lengths([[8], [8]], 8).to("meta"))
    with pytest.raises(ValueError, match="mask: the 'varlen' backend needs"):
        decoder(tokens, mask=PackedSegments.from_lengths([[8], [8]], 8, backend="varlen"))
    decoder.setup_caches(2, torch.float32, decoder_max_seq_len=16)
    with pytest.raises(ValueError, match="mask: packed segments are for forwards without a KV"):
        decoder(tokens, mask=PackedSegments.from_lengths([[8], [8]], 8))
    with decoder.caches_disabled():
        decoder(tokens, mask=PackedSegments.from_lengths([[8], [8]], 8))
    assert decoder.kv_caches()[0].size == 0  # nothing was written


def test_attention_dropout_takes_per_sample_sdpa_or_is_refused():
    from fusion.models import llama3_2

    decoder = llama3_2(VOCAB, num_layers=1, num_heads=2, num_kv_heads=1, embed_dim=16,
                       max_seq_len=16, attn_dropout=0.5)  # fmt: skip
    tokens = torch.zeros(1, 8, dtype=torch.long)
    decoder(tokens, mask=PackedSegments.from_lengths([[3, 5]], 8))  # auto: sdpa, with dropout
    with pytest.raises(ValueError, match="'flex' backend has no attention dropout"):
        decoder(tokens, mask=PackedSegments.from_lengths([[3, 5]], 8, backend="flex"))
    decoder.eval()  # no dropout in eval: flex is fine
    with torch.no_grad():
        decoder(tokens, mask=PackedSegments.from_lengths([[3, 5]], 8, backend="flex"))


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_compiled_layers_do_not_recompile_across_layouts(backend):
    """Regional compilation (each layer compiled): new layouts of the same row length reuse
    the graphs (per-sample SDPA is a graph break; flex reads device tensors only)."""
    decoder = build_tiny_decoder()
    graphs = []

    def count(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    for layer in decoder.layers:
        layer.compile(backend=count)
    grad = backend == "sdpa"  # CPU FlexAttention has no backward
    outputs = []
    for rows in ([[3, 6], [16]], [[5, 5, 5], [1, 2, 3, 4]], [[16], [8, 8]], [[2] * 8, [15]]):
        segments = PackedSegments.from_lengths(rows, 16, backend=backend)
        tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(2))
        with torch.set_grad_enabled(grad):
            out = decoder(tokens, mask=segments, input_pos=positions(segments))
            if grad:
                out.sum().backward()
        outputs.append((out.detach(), segments, tokens))
        if len(outputs) == 1:
            first = len(graphs)
    assert first > 0 and len(graphs) == first
    eager_decoder = build_tiny_decoder()  # the same weights, not compiled
    with torch.no_grad():
        for out, segments, tokens in outputs:
            eager = eager_decoder(tokens, mask=segments, input_pos=positions(segments))
            torch.testing.assert_close(out, eager, atol=1e-5, rtol=1e-5)
