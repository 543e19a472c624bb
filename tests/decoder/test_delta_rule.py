"""The gated delta rule over packed rows: the chunked kernel against the token-by-token
recurrence and transformers' kernel (forward and backward), resets, decoding steps, and the
packing property of ``SampleRegions.gather -> conv -> silu -> kernel -> scatter`` (each sample
as if alone), with planted bugs that the property check must catch."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from fusion.decoder import (
    PackedSegments,
    SampleRegions,
    causal_conv,
    chunk_gated_delta_rule,
    conv_step,
    gated_delta_step,
    recurrent_gated_delta_rule,
)

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

TOL = {"atol": 1e-5, "rtol": 1e-5}


def inputs(b, s, k_heads, heads, dk, dv, *, seed=0, dtype=torch.float32, requires_grad=False):
    """q, k [b, s, hk, dk], v [b, s, h, dv], g (<= 0) and beta (in (0, 1)) [b, s, h]."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(b, s, k_heads, dk, generator=gen) for _ in range(2))
    v = torch.randn(b, s, heads, dv, generator=gen)
    g = -F.softplus(torch.randn(b, s, heads, generator=gen))
    beta = torch.rand(b, s, heads, generator=gen)
    out = [x.to(dtype) for x in (q, k, v, g, beta)]
    return [x.requires_grad_(requires_grad) for x in out]


def hf_chunk(q, k, v, g, beta, *, chunk_size, initial_state=None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return hf.torch_chunk_gated_delta_rule(
            q,
            k,
            v,
            g,
            beta,
            chunk_size=chunk_size,
            initial_state=initial_state,
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )


def grads(outputs, tensors, seed=1):
    """Gradients of a random linear function of ``outputs`` (out, final state)."""
    gen = torch.Generator().manual_seed(seed)
    loss = sum((o * torch.randn(o.shape, generator=gen, dtype=o.dtype)).sum() for o in outputs)
    return torch.autograd.grad(loss, tensors)


@st.composite
def length_and_chunk(draw):
    """A chunk size and a length shorter than a chunk, exactly one, one more, or several."""
    chunk = draw(st.sampled_from([1, 2, 3, 4, 8, 16]))
    kind = draw(st.sampled_from(["short", "exact", "plus_one", "several"]))
    if kind == "short":
        s = draw(st.integers(1, max(chunk - 1, 1)))
    elif kind == "exact":
        s = chunk
    elif kind == "plus_one":
        s = chunk + 1
    else:
        s = draw(st.integers(2 * chunk, 4 * chunk + 3))
    return s, chunk


# The kernels --------------------------------------------------------------------------------


@given(
    length_and_chunk(),
    st.integers(1, 2),  # batch
    st.sampled_from([(1, 1), (1, 2), (2, 2)]),  # (query/key heads, value heads)
    # dk >= 2: at dk = 1 the L2 norm is k's sign, whose gradient eps / |k|^3 puts every float32
    # implementation (ours, the recurrence, transformers') ~2e-5 from the float64 one.
    st.integers(2, 6),  # dk
    st.integers(1, 5),  # dv
    st.booleans(),  # with an initial state
    st.integers(0, 2**16),
)
def test_chunk_matches_recurrent_and_transformers(sc, b, heads, dk, dv, with_state, seed):
    (s, chunk), (hk, h) = sc, heads
    tensors = inputs(b, s, hk, h, dk, dv, seed=seed, requires_grad=True)
    gen = torch.Generator().manual_seed(seed + 1)
    state = torch.randn(b, h, dk, dv, generator=gen).requires_grad_() if with_state else None
    leaves = [*tensors, state] if with_state else tensors

    ours = chunk_gated_delta_rule(
        *tensors, chunk_size=chunk, initial_state=state, output_final_state=True
    )
    start = state if with_state else torch.zeros(b, h, dk, dv)
    plain = recurrent_gated_delta_rule(*tensors, start)
    theirs = hf_chunk(*tensors, chunk_size=chunk, initial_state=state)

    assert ours[0].shape == (b, s, h, dv) and ours[0].dtype == torch.float32
    assert ours[1] is not None and ours[1].shape == (b, h, dk, dv)
    for other in (plain, theirs):
        for x, y in zip(ours, other, strict=True):
            torch.testing.assert_close(x, y, **TOL)
    ours_grads = grads(ours, leaves)
    for other in (plain, theirs):
        for x, y in zip(ours_grads, grads(other, leaves), strict=True):
            torch.testing.assert_close(x, y, **TOL)


def test_float64_matches_recurrent_tightly():
    tensors = inputs(2, 23, 1, 2, 4, 3, dtype=torch.float64, requires_grad=True)
    out, state = chunk_gated_delta_rule(*tensors, chunk_size=8, output_final_state=True)
    ref_out, ref_state = recurrent_gated_delta_rule(
        *tensors, torch.zeros(2, 2, 4, 3, dtype=torch.float64)
    )
    assert out.dtype == state.dtype == torch.float64
    torch.testing.assert_close(out, ref_out, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(state, ref_state, atol=1e-12, rtol=1e-12)
    for x, y in zip(
        grads((out, state), tensors), grads((ref_out, ref_state), tensors), strict=True
    ):
        torch.testing.assert_close(x, y, atol=1e-12, rtol=1e-12)


def test_bfloat16_is_close_to_float32():
    tensors = inputs(2, 40, 2, 2, 8, 8)
    out32, state32 = chunk_gated_delta_rule(*tensors, chunk_size=16, output_final_state=True)
    low = [x.bfloat16() for x in tensors[:3]] + tensors[3:]  # g in float32, as Qwen3.5 has it
    out16, state16 = chunk_gated_delta_rule(*low, chunk_size=16, output_final_state=True)
    assert out16.dtype == torch.bfloat16 and state16.dtype == torch.float32
    torch.testing.assert_close(out16.float(), out32, atol=5e-2, rtol=5e-2)
    torch.testing.assert_close(state16, state32, atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("split", [1, 7, 8, 13])
def test_recurrent_steps_and_chunked_prefill_continue_the_chunked_kernel(split):
    """Token-by-token decoding from the chunked kernel's state, and a prefill in two chunked
    calls (the second from the first's final state), equal one chunked call."""
    b, s, h, dk, dv = 2, 20, 2, 4, 3
    tensors = inputs(b, s, 1, h, dk, dv, seed=3)
    out, final = chunk_gated_delta_rule(*tensors, chunk_size=8, output_final_state=True)

    first, state = chunk_gated_delta_rule(
        *(x[:, :split] for x in tensors), chunk_size=8, output_final_state=True
    )
    second, state2 = chunk_gated_delta_rule(
        *(x[:, split:] for x in tensors),
        chunk_size=8,
        initial_state=state,
        output_final_state=True,
    )
    torch.testing.assert_close(torch.cat([first, second], dim=1), out, **TOL)
    torch.testing.assert_close(state2, final, **TOL)

    steps = []
    for t in range(split, s):
        step, state = recurrent_gated_delta_rule(*(x[:, t : t + 1] for x in tensors), state)
        steps.append(step)
    torch.testing.assert_close(torch.cat(steps, dim=1), out[:, split:], **TOL)
    torch.testing.assert_close(state, final, **TOL)


def test_resets_zero_the_state_at_their_chunk():
    """A reset before chunk c gives chunks c.. the outputs of a sequence starting at c (here
    with an initial state, which a reset at chunk 0 discards too)."""
    b, s, chunk = 2, 24, 8
    tensors = inputs(b, s, 1, 2, 4, 3, seed=5)
    initial = torch.randn(b, 2, 4, 3)
    resets = torch.tensor([[False, True, False], [True, False, True]])
    out, final = chunk_gated_delta_rule(
        *tensors,
        chunk_size=chunk,
        resets=resets,
        initial_state=initial,
        output_final_state=True,
    )
    for r, (a, z) in enumerate([(0, 8), (8, 24), (0, 16), (16, 24)]):
        row = r // 2
        piece = [x[row : row + 1, a:z] for x in tensors]
        start = initial[row : row + 1] if a == 0 and not resets[row, 0] else None
        ref, ref_final = chunk_gated_delta_rule(
            *piece, chunk_size=chunk, initial_state=start, output_final_state=True
        )
        torch.testing.assert_close(out[row : row + 1, a:z], ref, **TOL)
        if z == s:
            torch.testing.assert_close(final[row : row + 1], ref_final, **TOL)


def test_empty_sequence_is_handled():
    """s == 0: no outputs, and the final state is the initial state (or zeros)."""
    tensors = inputs(2, 0, 1, 2, 4, 3)
    initial = torch.randn(2, 2, 4, 3)
    for kernel in (
        lambda: chunk_gated_delta_rule(*tensors, initial_state=initial, output_final_state=True),
        lambda: recurrent_gated_delta_rule(*tensors, initial),
    ):
        out, state = kernel()
        assert out.shape == (2, 0, 2, 3)
        torch.testing.assert_close(state, initial)
    out, state = chunk_gated_delta_rule(*tensors, output_final_state=True)
    assert not state.any()


@pytest.mark.parametrize(
    ("dtype", "state_dtype"),
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.float32),
        (torch.float64, torch.float32),
    ],
)
def test_the_decoding_step_updates_the_state_in_place_as_the_recurrence(dtype, state_dtype):
    """``gated_delta_step`` on one token: the recurrence's output and state, the state written
    in place (computed on a copy when it is not in the compute dtype)."""
    tensors = inputs(2, 1, 2, 4, 8, 6, seed=9, dtype=dtype)
    state = torch.randn(2, 4, 8, 6, generator=torch.Generator().manual_seed(4)).to(state_dtype)
    ref_out, ref_state = recurrent_gated_delta_rule(*tensors, state)
    written = state.clone()
    out = gated_delta_step(*tensors, written)
    assert out.shape == (2, 1, 4, 6) and out.dtype == dtype
    tol = TOL if dtype != torch.bfloat16 else {"atol": 1e-2, "rtol": 1e-2}
    torch.testing.assert_close(out, ref_out, **tol)
    torch.testing.assert_close(written, ref_state.to(state_dtype), **TOL)
    with pytest.raises(ValueError, match="one token"):
        gated_delta_step(*inputs(2, 2, 2, 4, 8, 6), written)


def test_kernels_run_on_meta():
    tensors = [x.to("meta") for x in inputs(2, 37, 1, 2, 4, 3)]
    out, state = chunk_gated_delta_rule(*tensors, chunk_size=8, output_final_state=True)
    assert out.device.type == "meta" and out.shape == (2, 37, 2, 3) and state.shape == (2, 2, 4, 3)
    step, state = recurrent_gated_delta_rule(*(x[:, :1] for x in tensors), state)
    assert step.shape == (2, 1, 2, 3) and state.device.type == "meta"


def _refusal_cases():
    q, k, v, g, beta = inputs(2, 10, 1, 2, 4, 3)
    ok = {"q": q, "k": k, "v": v, "g": g, "beta": beta}
    cases = [
        ({"chunk_size": 0}, "chunk_size"),
        ({"chunk_size": 2.0}, "chunk_size"),
        ({"q": q[..., :0], "k": k[..., :0]}, "q: expected"),
        ({"k": k[:, :9]}, "k: expected"),
        ({"k": k.double()}, "k: expected"),
        ({"v": v[:, :9]}, "v: expected"),
        ({"q": q.expand(2, 10, 2, 4), "k": k.expand(2, 10, 2, 4), "v": v[:, :, :1]}, "v: exp"),
        ({"v": v.double()}, "v: expected"),
        ({"g": g[:, :, :1]}, "g: expected"),
        ({"beta": beta.to(torch.int64)}, "beta: expected a floating"),
        ({"resets": torch.zeros(2, 3, dtype=torch.bool)}, "resets: expected bool \\[2, 2\\]"),
        ({"resets": torch.zeros(2, 2)}, "resets"),
        ({"initial_state": torch.zeros(2, 2, 3, 4)}, "initial_state: expected"),
    ]
    return ok, cases


@pytest.mark.parametrize("case", range(len(_refusal_cases()[1])))
def test_kernel_refuses_bad_arguments(case):
    ok, cases = _refusal_cases()
    change, message = cases[case]
    args = {**ok, "chunk_size": 8, **change}
    tensors = [args.pop(name) for name in ("q", "k", "v", "g", "beta")]
    with pytest.raises(ValueError, match=message):
        chunk_gated_delta_rule(*tensors, **args)


def test_recurrent_refuses_a_bad_state():
    tensors = inputs(2, 3, 1, 2, 4, 3)
    with pytest.raises(ValueError, match=r"state: expected a floating-point \[2, 2, 4, 3\]"):
        recurrent_gated_delta_rule(*tensors, torch.zeros(2, 2, 3, 4))


# The conv -----------------------------------------------------------------------------------


def make_conv(channels: int, kernel: int, *, bias: bool = False, seed: int = 0) -> nn.Conv1d:
    """A causal depthwise conv as Qwen3.5's Gated DeltaNet has it, with random weights."""
    conv = nn.Conv1d(channels, channels, kernel, groups=channels, padding=kernel - 1, bias=bias)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in conv.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    return conv


@pytest.mark.parametrize("kernel", [1, 2, 4])
@pytest.mark.parametrize("bias", [False, True])
def test_causal_conv_matches_transformers_and_conv_step_matches_it(kernel, bias):
    conv = make_conv(6, kernel, bias=bias)
    x = torch.randn(2, 11, 6)
    out = causal_conv(conv, x)
    theirs = hf.causal_conv1d_fn(x.transpose(1, 2), conv.weight.squeeze(1), conv.bias)
    torch.testing.assert_close(out, theirs.transpose(1, 2), **TOL)

    state, steps = torch.zeros(2, 6, kernel - 1), []
    for t in range(11):
        step, state = conv_step(conv, x[:, t : t + 1], state)
        steps.append(step)
    torch.testing.assert_close(torch.cat(steps, dim=1), out, **TOL)
    torch.testing.assert_close(state, x[:, 11 - (kernel - 1) :].transpose(1, 2))


def test_conv_helpers_call_the_module():
    """A forward hook on the conv sees every call: the helpers never read its weight."""
    conv, calls = make_conv(4, 3), []
    conv.register_forward_hook(lambda *args: calls.append(1))
    causal_conv(conv, torch.randn(1, 5, 4))
    conv_step(conv, torch.randn(1, 1, 4), torch.zeros(1, 4, 2))
    assert len(calls) == 2


def test_conv_helpers_refuse_bad_arguments():
    conv = make_conv(4, 3)
    with pytest.raises(ValueError, match="conv: expected stride 1, dilation 1 and zero padding 2"):
        causal_conv(nn.Conv1d(4, 4, 3, groups=4), torch.randn(1, 5, 4))
    with pytest.raises(ValueError, match=r"conv: expected an nn\.Conv1d"):
        causal_conv(nn.Linear(4, 4), torch.randn(1, 5, 4))
    with pytest.raises(ValueError, match=r"x: expected \[b, s, 4\]"):
        causal_conv(conv, torch.randn(1, 5, 3))
    with pytest.raises(ValueError, match=r"x: expected one token \[b, 1, 4\]"):
        conv_step(conv, torch.randn(1, 2, 4), torch.zeros(1, 4, 2))
    with pytest.raises(ValueError, match=r"conv_state: expected \[1, 4, 2\]"):
        conv_step(conv, torch.randn(1, 1, 4), torch.zeros(1, 4, 3))


# SampleRegions ------------------------------------------------------------------------------


def test_regions_layout():
    segments = PackedSegments.from_lengths([[3, 5], [9]], 10)  # paddings 2 and 1
    regions = SampleRegions.from_segments(segments, chunk_size=4, kernel=3)
    # Row 0: [2 zeros, 3 tokens, 3 zeros | 2 zeros, 5 tokens, 1 zero]; row 1: 2 + 9 + 1.
    assert regions.relaid_len == 16 and regions.n_chunks == 4
    assert regions.starts == ((2, 10), (2,))
    valid = torch.zeros(2, 16, dtype=torch.bool)
    valid[0, 2:5] = valid[0, 10:15] = valid[1, 2:11] = True
    assert torch.equal(regions.valid, valid)
    assert regions.resets.tolist() == [[True, False, True, False], [True, False, False, False]]

    x = torch.arange(1.0, 21.0).reshape(2, 10)
    relaid = regions.gather(x)
    assert relaid[0, 2:5].tolist() == [1, 2, 3] and relaid[0, 10:15].tolist() == [4, 5, 6, 7, 8]
    assert relaid[1, 2:11].tolist() == list(range(11, 20)) and not relaid[~valid].any()
    back = regions.scatter(relaid)
    assert torch.equal(back, torch.where(segments.segment_ids >= 0, x, 0.0))
    # The same regions from the host lengths directly.
    again = SampleRegions(segments.lengths, segments.padding, chunk_size=4, kernel=3)
    assert torch.equal(again.gather(x), relaid)


def test_regions_gather_and_scatter_are_differentiable():
    regions = SampleRegions(((3, 4, 1),), (1,), chunk_size=4, kernel=2)
    x = torch.randn(1, 8, 2, dtype=torch.float64, requires_grad=True)
    y = torch.randn(1, regions.relaid_len, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(regions.gather, (x,))
    assert torch.autograd.gradcheck(regions.scatter, (y,))


def test_regions_refuse_bad_arguments():
    with pytest.raises(ValueError, match="chunk_size: expected a positive integer, got 0"):
        SampleRegions(((3,),), (0,), chunk_size=0, kernel=4)
    with pytest.raises(ValueError, match="kernel: expected a positive integer, got 0"):
        SampleRegions(((3,),), (0,), chunk_size=4, kernel=0)
    with pytest.raises(ValueError, match="padding"):
        SampleRegions(((3, 2),), (1,), chunk_size=4, kernel=4)
    with pytest.raises(ValueError, match="at least one sample"):
        SampleRegions(((3,),), (3,), chunk_size=4, kernel=4)
    regions = SampleRegions(((3, 2),), (2,), chunk_size=4, kernel=4)
    with pytest.raises(ValueError, match=r"x: expected a tensor \[1, 5, \.\.\.\]"):
        regions.gather(torch.zeros(1, 4, 2))
    with pytest.raises(ValueError, match=r"y: expected a tensor \[1, 8, \.\.\.\]"):
        regions.scatter(torch.zeros(1, 5, 2))


# The packing property -----------------------------------------------------------------------

HEADS, DK, DV = 2, 3, 2
CHANNELS = 2 * HEADS * DK + HEADS * DV


def split_qkv(mixed: torch.Tensor):
    q, k, v = mixed.split([HEADS * DK, HEADS * DK, HEADS * DV], dim=-1)
    b, s = mixed.shape[:2]
    return q.reshape(b, s, HEADS, DK), k.reshape(b, s, HEADS, DK), v.reshape(b, s, HEADS, DV)


def packed_forward(conv, x, g, beta, regions, *, resets=True, gap_garbage=None):
    """The Gated DeltaNet's mixing over packed rows: x [b, s, c], g and beta [b, s, h] (g and
    beta gathered too, so the gaps are identity steps) -> [b, s, h, dv]."""
    relaid = regions.gather(x)
    if gap_garbage is not None:  # planted bug (c): the gaps not zeroed before the conv
        relaid = torch.where(regions.valid[..., None], relaid, gap_garbage)
    q, k, v = split_qkv(F.silu(causal_conv(conv, relaid)))
    out, _ = chunk_gated_delta_rule(
        q,
        k,
        v,
        regions.gather(g),
        regions.gather(beta),
        chunk_size=regions.chunk_size,
        resets=regions.resets if resets else None,
    )
    return regions.scatter(out)


def alone_forward(conv, x, g, beta, chunk_size):
    """One sample [1, n, ...] through the conv and the kernel on its own."""
    q, k, v = split_qkv(F.silu(causal_conv(conv, x)))
    return chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=chunk_size)[0]


def check_packing(out, conv, x, g, beta, lengths, chunk_size):
    """The property: each sample's outputs equal that sample's alone, padding's are zeros.
    Raises AssertionError otherwise."""
    for r, row in enumerate(lengths):
        at = 0
        for n in row:
            piece = (t[r : r + 1, at : at + n] for t in (x, g, beta))
            ref = alone_forward(conv, *piece, chunk_size)
            torch.testing.assert_close(out[r : r + 1, at : at + n], ref, **TOL)
            at += n
        assert not out[r, at:].any(), f"row {r}: padding outputs are not zero"


def packed_data(lengths, seq_len, seed=0, garbage=float("nan")):
    """x [b, s, c], g and beta [b, s, h], with ``garbage`` at the padding positions."""
    b = len(lengths)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, seq_len, CHANNELS, generator=gen)
    g = -F.softplus(torch.randn(b, seq_len, HEADS, generator=gen))
    beta = torch.rand(b, seq_len, HEADS, generator=gen)
    for r, row in enumerate(lengths):
        for t in (x, g, beta):
            t[r, sum(row) :] = garbage
    return x, g, beta


@st.composite
def packed_rows(draw):
    """Chunk size, kernel, rows of 1-4 sample lengths (shorter than the kernel, than a chunk,
    filling a region exactly, up to ~150) and a row length (trailing padding or none)."""
    chunk = draw(st.sampled_from([4, 8, 16, 64]))
    kernel = draw(st.sampled_from([2, 3, 4]))
    length = st.one_of(
        st.integers(1, kernel - 1),
        st.integers(1, chunk - 1),
        st.just(chunk),
        st.just(chunk - kernel + 1 if chunk >= kernel else chunk),  # fills its region
        st.integers(1, 150),
    )
    rows = draw(st.lists(st.lists(length, min_size=1, max_size=4), min_size=1, max_size=3))
    seq_len = max(sum(row) for row in rows) + draw(st.sampled_from([0, 0, 1, 5]))
    return chunk, kernel, rows, seq_len


@given(packed_rows(), st.booleans(), st.integers(0, 2**16))
def test_each_packed_sample_is_computed_as_alone(layout, bias, seed):
    chunk, kernel, rows, seq_len = layout
    segments = PackedSegments.from_lengths(rows, seq_len)
    regions = SampleRegions.from_segments(segments, chunk_size=chunk, kernel=kernel)
    conv = make_conv(CHANNELS, kernel, bias=bias, seed=seed)
    x, g, beta = packed_data(rows, seq_len, seed=seed)
    with torch.no_grad():
        out = packed_forward(conv, x, g, beta, regions)
        check_packing(out, conv, x, g, beta, rows, chunk)


def test_packed_gradients_are_the_sum_of_the_samples():
    rows, seq_len, chunk, kernel = [[13, 6], [20]], 22, 8, 4
    regions = SampleRegions.from_segments(
        PackedSegments.from_lengths(rows, seq_len), chunk_size=chunk, kernel=kernel
    )
    conv = make_conv(CHANNELS, kernel, bias=True)
    x, g, beta = (t.requires_grad_() for t in packed_data(rows, seq_len, garbage=0.0))
    weight = torch.randn(2, seq_len, HEADS, DV)
    leaves = [x, g, beta, *conv.parameters()]

    packed = grads_of((packed_forward(conv, x, g, beta, regions) * weight).sum(), leaves)
    loss = 0.0
    for r, row in enumerate(rows):
        at = 0
        for n in row:
            piece = (t[r : r + 1, at : at + n] for t in (x, g, beta))
            out = alone_forward(conv, *piece, chunk)
            loss = loss + (out * weight[r : r + 1, at : at + n]).sum()
            at += n
    for got, expected in zip(packed, grads_of(loss, leaves), strict=True):
        torch.testing.assert_close(got, expected, **TOL)


def grads_of(loss, leaves):
    return torch.autograd.grad(loss, leaves)


# Planted bugs: each is caught by the property check above -----------------------------------

# Row 0's first sample fills its region exactly when the gaps are one short (2 zeros + 14
# tokens = 2 chunks of 8), so the next sample's conv reaches one token into it; row 1 is padded.
PLANTED_ROWS, PLANTED_LEN, PLANTED_CHUNK, PLANTED_KERNEL = [[14, 6, 9], [3, 20]], 30, 8, 4


def planted_case(kernel_for_regions=PLANTED_KERNEL, lengths=None):
    rows = PLANTED_ROWS if lengths is None else lengths
    segments = PackedSegments.from_lengths(rows, PLANTED_LEN)
    regions = SampleRegions.from_segments(
        segments, chunk_size=PLANTED_CHUNK, kernel=kernel_for_regions
    )
    conv = make_conv(CHANNELS, PLANTED_KERNEL)
    return regions, conv, packed_data(PLANTED_ROWS, PLANTED_LEN, seed=7)


def check_planted(out, conv, data):
    check_packing(out, conv, *data, PLANTED_ROWS, PLANTED_CHUNK)


@torch.no_grad()
def test_the_planted_case_holds_without_a_bug():
    regions, conv, data = planted_case()
    check_planted(packed_forward(conv, *data, regions), conv, data)


@torch.no_grad()
def test_planted_state_carried_across_a_boundary_is_caught():
    regions, conv, data = planted_case()
    with pytest.raises(AssertionError):
        check_planted(packed_forward(conv, *data, regions, resets=False), conv, data)


@torch.no_grad()
def test_planted_conv_reaching_into_the_previous_sample_is_caught():
    regions, conv, data = planted_case(kernel_for_regions=PLANTED_KERNEL - 1)  # gaps of k - 2
    assert regions.starts[0][1] - regions.starts[0][0] - 14 == PLANTED_KERNEL - 2
    with pytest.raises(AssertionError):
        check_planted(packed_forward(conv, *data, regions), conv, data)


@torch.no_grad()
def test_planted_garbage_in_the_gaps_is_caught():
    regions, conv, data = planted_case()
    garbage = torch.full((), 3.0)
    with pytest.raises(AssertionError):
        check_planted(packed_forward(conv, *data, regions, gap_garbage=garbage), conv, data)


def mrope_positions(samples):
    """Qwen2-VL's M-RoPE (temporal, height, width) positions [3, s] of samples
    ``(text, (grid_h, grid_w), text)`` packed one after the other, restarting per sample."""
    rows = []
    for before, (gh, gw), after in samples:
        text = torch.arange(before).expand(3, -1)
        hh, ww = torch.meshgrid(torch.arange(gh), torch.arange(gw), indexing="ij")
        image = torch.stack([torch.zeros(gh * gw, dtype=torch.int64), hh.flatten(), ww.flatten()])
        tail = torch.arange(after).expand(3, -1) + before + max(gh, gw)
        rows.append(torch.cat([text, image + before, tail], dim=1))
    return torch.cat(rows, dim=1)


def lengths_from_positions(positions: torch.Tensor) -> list[int]:
    """A naive segmentation: a sample starts wherever the position does not increase (right
    for 1D positions restarting at 0 per sample, wrong for an M-RoPE row)."""
    starts = [0] + [i for i in range(1, len(positions)) if positions[i] <= positions[i - 1]]
    return [b - a for a, b in zip(starts, [*starts[1:], len(positions)], strict=True)]


@torch.no_grad()
def test_planted_boundaries_from_an_mrope_row_are_caught():
    # Row 0's samples: 14 = 2 + 2x3 + 6 tokens, 6 = 1 + 2x2 + 1, 9 = 3 + 1x4 + 2.
    samples = [(2, (2, 3), 6), (1, (2, 2), 1), (3, (1, 4), 2)]
    positions = mrope_positions(samples)
    assert positions.shape[1] == sum(PLANTED_ROWS[0])
    one_d = torch.cat([torch.arange(n) for n in PLANTED_ROWS[0]])
    assert lengths_from_positions(one_d) == PLANTED_ROWS[0]  # the rule is right for 1D
    wrong = lengths_from_positions(positions[0])  # the temporal row repeats over an image
    assert wrong != PLANTED_ROWS[0] and sum(wrong) == sum(PLANTED_ROWS[0])
    regions, conv, data = planted_case(lengths=[wrong, PLANTED_ROWS[1]])
    with pytest.raises(AssertionError):
        check_planted(packed_forward(conv, *data, regions), conv, data)


# Devices and dtypes ---------------------------------------------------------------------------


def test_the_composition_runs_on_meta():
    """Shapes only: the regions' indices are built on the host and moved to meta."""
    rows, seq_len = [[5, 9], [3]], 16
    segments = PackedSegments.from_lengths(rows, seq_len)
    regions = SampleRegions(
        segments.lengths, segments.padding, chunk_size=8, kernel=4, device="meta"
    )
    conv = make_conv(CHANNELS, 4).to("meta")
    x, g, beta = (t.to("meta") for t in packed_data(rows, seq_len))
    out = packed_forward(conv, x, g, beta, regions)
    assert out.device.type == "meta" and out.shape == (2, seq_len, HEADS, DV)
    assert regions.resets.device.type == "meta" and regions.resets.shape == (2, 3)
    state = torch.zeros(2, CHANNELS, 3, device="meta")
    step, state = conv_step(conv, x[:, :1], state)
    assert step.shape == (2, 1, CHANNELS) and state.shape == (2, CHANNELS, 3)


@torch.no_grad()
def test_packed_bfloat16_is_close_to_float32():
    rows, seq_len = [[13, 6], [20]], 22
    regions = SampleRegions.from_segments(
        PackedSegments.from_lengths(rows, seq_len), chunk_size=8, kernel=4
    )
    conv = make_conv(CHANNELS, 4)
    x, g, beta = packed_data(rows, seq_len, garbage=0.0)
    out32 = packed_forward(conv, x, g, beta, regions)
    out16 = packed_forward(conv.bfloat16(), x.bfloat16(), g, beta.bfloat16(), regions)
    assert out16.dtype == torch.bfloat16
    torch.testing.assert_close(out16.float(), out32, atol=6e-2, rtol=6e-2)
