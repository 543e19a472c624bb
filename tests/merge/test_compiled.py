"""The compiled single-pass merge: when ``auto`` picks it, one build of its C loop per
process, every bit pattern, inside a compiled model, where the loop cannot run, its errors.

Bits and gradients against ``reference`` for random batches are in
tests/merge/test_differential.py.
"""

import os
import re
import shutil
import warnings
from unittest import mock

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from fusion.merge import Padded, default_impl, merge_embeddings
from fusion.merge import compiled as compiled_module
from fusion.merge.merge import COMPILED_MIN_BYTES
from helpers import IMAGE_ID, build_tiny_fusion

CPU = torch.device("cpu")


def _inputs(batch: int, seq_len: int, dim: int, placeholders: list[int], seed: int = 0):
    """Tokens with image placeholders at ``placeholders`` (positions in every sample), a table
    [16, dim] and the packed rows."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 16, (batch, seq_len), generator=gen)
    tokens[:, placeholders] = 99
    table = torch.randn(16, dim, generator=gen)
    rows = torch.randn(batch * len(placeholders), dim, generator=gen)
    return tokens, table, {"image": rows}, {"image": 99}


# ---------------------------------------------------------------- the auto rule


def test_auto_picks_compiled_for_plain_tables_on_cpu_from_the_threshold():
    assert COMPILED_MIN_BYTES == 4 << 20  # benchmarks/README.md: where it was measured to win
    row = 64 * 4  # float32, width 64
    tokens = COMPILED_MIN_BYTES // row
    table = torch.zeros(16, 64)
    assert default_impl(CPU, table, tokens) == "compiled"
    assert default_impl(CPU, table, tokens - 1) == "index"
    assert default_impl(CPU, torch.nn.Embedding(16, 64), tokens) == "compiled"
    assert default_impl(CPU, table) == "compiled"  # no size given: a size where it wins
    # bfloat16 rows are half the bytes: twice the tokens for the same output.
    assert default_impl(CPU, table.bfloat16(), tokens) == "index"
    assert default_impl(CPU, table.bfloat16(), 2 * tokens) == "compiled"
    # Text only: the merge is the embedding's own call.
    assert default_impl(CPU, table, tokens, encoder_rows=0) == "index"
    assert default_impl(CPU, table, tokens, encoder_rows=1) == "compiled"
    # Under torch.compile the loop cannot run: the compiler traces index's ops.
    with mock.patch("torch.compiler.is_compiling", return_value=True):
        assert default_impl(CPU, table, tokens) == "index"


@pytest.mark.parametrize(
    ("encoder_rows", "error", "message"),
    [
        ("3", TypeError, "encoder_rows: expected an int or None, got '3'"),
        (True, TypeError, "encoder_rows: expected an int or None, got True"),
        (-1, ValueError, "encoder_rows: expected a count >= 0, got -1"),
    ],
)
def test_default_impl_refuses_a_bad_row_count(encoder_rows, error, message):
    with pytest.raises(error, match=re.escape(message)):
        default_impl(CPU, torch.zeros(16, 64), 10, encoder_rows=encoder_rows)


@pytest.mark.parametrize(
    "embedding",
    [
        pytest.param(torch.nn.Sequential(torch.nn.Embedding(16, 64)), id="wrapper module"),
        pytest.param(torch.nn.Embedding(16, 64, padding_idx=0), id="padding_idx"),
        pytest.param(torch.zeros(16, 64, device="meta"), id="meta table"),
    ],
)
def test_auto_keeps_index_for_what_is_not_a_plain_cpu_table(embedding):
    with mock.patch("fusion.merge.merge.COMPILED_MIN_BYTES", 1):
        assert default_impl(CPU, embedding, 10**9) == "index"


def test_merge_embeddings_auto_uses_compiled_above_the_threshold_with_rows():
    args = _inputs(2, 8, 8, [1, 2])
    text_only = (args[0].clamp(max=15), args[1], {}, args[3])
    with mock.patch.object(compiled_module, "kernel", wraps=compiled_module.kernel) as loop:
        with mock.patch("fusion.merge.merge.COMPILED_MIN_BYTES", 2 * 8 * 8 * 4 + 1):
            merge_embeddings(*args)  # 2 x 8 x 8 float32: one byte below the threshold
        assert loop.call_count == 0
        with mock.patch("fusion.merge.merge.COMPILED_MIN_BYTES", 2 * 8 * 8 * 4):
            merged = merge_embeddings(*args)
            assert loop.call_count == 1
            merge_embeddings(*text_only)
            merge_embeddings(*text_only[:2], {"image": torch.zeros(0, 8)}, args[3])
        assert loop.call_count == 1
    assert torch.equal(merged, merge_embeddings(*args, impl="reference"))


# ---------------------------------------------------------------- the C loop


@pytest.fixture
def unbuilt():
    """A process in which the loop has not been built yet (restored after the test)."""
    with mock.patch.object(compiled_module, "_kernel_fn", compiled_module._UNBUILT):
        yield


def _same_as_reference(*args, **kwargs) -> None:
    expected = merge_embeddings(*args, **kwargs, impl="reference")
    assert torch.equal(merge_embeddings(*args, **kwargs, impl="compiled"), expected)


def test_one_build_serves_every_shape_and_dtype(unbuilt):
    """Token and row counts (0 and 1 included), widths, int32 ids, padded rows, every floating
    dtype: the loop is built on the first call and never again."""
    with mock.patch.object(compiled_module, "_build", wraps=compiled_module._build) as build:
        shapes = [(2, 6, 8, [0, 3]), (1, 1, 8, [0]), (3, 5, 3, [4]), (2, 7, 1, []), (5, 2, 4, [1])]
        for batch, seq_len, dim, placeholders in shapes:
            for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
                tokens, table, rows, ids = _inputs(batch, seq_len, dim, placeholders)
                table, rows = table.to(dtype), {"image": rows["image"].to(dtype)}
                for t in (tokens, tokens.int()):
                    _same_as_reference(t, table, rows, ids)
        tokens, table, _, ids = _inputs(2, 5, 4, [1, 3])
        _same_as_reference(tokens, table, {"image": Padded(torch.randn(2, 3, 4))}, ids)
    assert build.call_count == 1


def test_every_bit_pattern_moves_unchanged():
    """NaN payloads, signalling NaNs, -0.0, subnormals and infinities: rows move as bytes."""
    gen = torch.Generator().manual_seed(3)
    for dtype, bits in ((torch.float32, torch.int32), (torch.bfloat16, torch.int16)):
        info = torch.iinfo(bits)
        table = torch.randint(info.min, info.max, (16, 6), generator=gen, dtype=bits).view(dtype)
        rows = torch.randint(info.min, info.max, (4, 6), generator=gen, dtype=bits).view(dtype)
        tokens = torch.randint(0, 16, (2, 9), generator=gen)
        tokens[:, [2, 5]] = 99
        args = (tokens, table, {"image": rows}, {"image": 99})
        merged = merge_embeddings(*args, impl="compiled").view(bits)
        assert torch.equal(merged, merge_embeddings(*args, impl="reference").view(bits))


def test_large_outputs_copy_on_every_thread_with_the_same_bits():
    args = _inputs(4, 64, 32, [3, 4, 5, 40])
    with mock.patch.object(compiled_module, "PARALLEL_MIN_BYTES", 0):
        _same_as_reference(*args)


@pytest.mark.parametrize("shape", [(0, 3), (2, 0)])
def test_empty_batches_and_sequences(shape):
    tokens = torch.zeros(shape, dtype=torch.long)
    merged = merge_embeddings(tokens, torch.randn(8, 4), {}, {"image": 9}, impl="compiled")
    assert merged.shape == (*shape, 4)


def test_a_text_id_beyond_the_table_is_refused_not_read():
    """``vocab_size`` above the table's rows lets the id through validation; the loop checks
    every id it reads."""
    tokens, table, rows, ids = _inputs(2, 6, 8, [0, 3])
    tokens[1, 4] = 16
    with pytest.raises(IndexError, match=r"tokens: text id 16 at flat position 10 is outside the "):
        merge_embeddings(tokens, table, rows, ids, impl="compiled", vocab_size=17)


# ---------------------------------------------------------------- inside a compiled model


def test_inside_a_compiled_model_no_nested_compile_no_graph_break():
    """``EarlyFusion`` compiled whole (``fullgraph=True``): the merge runs as plain ops inside
    the outer graph, with the eager model's outputs and gradients."""
    model = build_tiny_fusion(merge_impl="compiled")
    tokens = torch.randint(4, 64, (2, 10), generator=torch.Generator().manual_seed(1))
    tokens[0, 1:3] = IMAGE_ID
    tokens[1, 4:7] = IMAGE_ID
    features = torch.randn(5, 1, 6, generator=torch.Generator().manual_seed(2))
    encoder_input = {"image": {"features": features}}
    expected = model(tokens, encoder_input=encoder_input)
    expected.sum().backward()
    expected_grad = model.decoder.tok_embeddings.weight.grad.clone()
    model.zero_grad()
    # fullgraph: a graph break would raise. The C loop is never called.
    with mock.patch.object(compiled_module, "kernel", side_effect=AssertionError("opaque")):
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
        actual = compiled(tokens, encoder_input=encoder_input)
        actual.sum().backward()
    torch.testing.assert_close(actual, expected)
    torch.testing.assert_close(model.decoder.tok_embeddings.weight.grad, expected_grad)


# ---------------------------------------------------------------- where the loop cannot run


def _index_calls(*args) -> int:
    """How many times ``impl='compiled'`` fell back to ``index``'s merge for ``args``."""
    with mock.patch.object(compiled_module, "merge_index", wraps=compiled_module.merge_index) as m:
        _same_as_reference(*args)
    return m.call_count


def test_under_a_dispatch_mode_the_merge_is_index_and_only_there():
    """A TorchDispatchMode (FlopCounterMode is one) sees every op, which the C loop hides."""
    args = _inputs(2, 6, 8, [0, 3])
    with FlopCounterMode(display=False):
        assert _index_calls(*args) == 1
    assert _index_calls(*args) == 0


def test_a_column_major_table_is_read_by_index_strided_rows_by_the_loop():
    tokens, table, rows, ids = _inputs(2, 6, 8, [0, 3])
    assert _index_calls(tokens, table.t().contiguous().t(), rows, ids) == 1
    strided = {"image": torch.randn(4, 16)[:, ::2]}
    assert _index_calls(tokens, table, strided, ids) == 0


def _fake_compiler(tmp_path, body: str) -> str:
    script = tmp_path / "cc"
    script.write_text(f"#!/bin/sh\n{body}\n")
    script.chmod(0o755)
    return str(script)


@pytest.mark.parametrize(
    "compiler",
    [
        "/nonexistent/cc",
        pytest.param("cc 'unbalanced", id="a command line that does not parse"),
        pytest.param("failing", id="a compiler that fails"),
    ],
)
def test_without_a_working_compiler_it_warns_once_and_merges_as_index(unbuilt, tmp_path, compiler):
    if compiler == "failing":
        compiler = _fake_compiler(tmp_path, "echo 'cc: error: no' >&2; exit 1")
    args = _inputs(2, 6, 8, [0, 3])
    with (
        mock.patch.dict(os.environ, {"CC": compiler}),
        warnings.catch_warnings(record=True) as caught,
    ):
        warnings.simplefilter("always")
        assert _index_calls(*args) == 1
        assert _index_calls(*args) == 1  # not built again
    assert len(caught) == 1
    assert "could not build the merge loop" in str(caught[0].message)
    assert "merging as impl='index' instead" in str(caught[0].message)


def _system_cc() -> str:
    system_cc = shutil.which("cc")
    assert system_cc, "the tests need a C compiler, as inductor does"
    return system_cc


def test_cc_may_be_a_command_line(unbuilt):
    with mock.patch.dict(os.environ, {"CC": f"env FUSION_TEST=1 {_system_cc()} -g0"}):
        assert compiled_module.kernel() is not None


def test_a_compiler_without_openmp_builds_a_one_thread_loop(unbuilt, tmp_path):
    system_cc = _system_cc()
    compiler = _fake_compiler(
        tmp_path, f'case "$*" in *-fopenmp*) exit 1;; esac\nexec {system_cc} "$@"'
    )
    with mock.patch.dict(os.environ, {"CC": compiler}), warnings.catch_warnings():
        warnings.simplefilter("error")
        assert compiled_module.kernel() is not None
        with mock.patch.object(compiled_module, "PARALLEL_MIN_BYTES", 0):
            assert _index_calls(*_inputs(4, 64, 32, [3, 4, 5, 40])) == 0


# ---------------------------------------------------------------- bad input


def test_compiled_refuses_other_devices_before_any_work():
    tokens = torch.tensor([[1, 2]], device="meta")
    with pytest.raises(ValueError, match=r"impl: 'compiled' expected CPU tensors .* got device"):
        merge_embeddings(tokens, torch.zeros(4, 2, device="meta"), {}, {"i": 9}, impl="compiled")


def test_compiled_refuses_a_module_it_cannot_read():
    hooked = torch.nn.Embedding(4, 2)
    hooked.register_forward_hook(lambda module, args, out: out * 2)
    with pytest.raises(ValueError, match="impl: 'compiled' reads the embedding table directly"):
        merge_embeddings(torch.tensor([[1, 2]]), hooked, {}, {"image": 5}, impl="compiled")
