"""The compiled single-pass merge: when ``auto`` picks it, one graph per bucket, inside a
compiled model, under a dispatch mode, without a compiler, and its errors.

Bits and gradients against ``reference`` are in tests/merge/test_differential.py. Every test
here stays in the bucket of one float32 encoder with a row-major table (the differential tests
compile it too), so the whole file compiles a single graph.
"""

import warnings
from unittest import mock

import pytest
import torch
from torch._dynamo.utils import counters
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


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


# ---------------------------------------------------------------- the auto rule


def test_auto_keeps_index_on_cpu_while_compiled_measures_slower():
    """``COMPILED_MIN_BYTES`` is None: on the benchmark machine ``compiled`` was slower than
    ``index`` at every size measured (benchmarks/README.md), so ``auto`` never picks it."""
    assert COMPILED_MIN_BYTES is None
    for embedding in (torch.zeros(32000, 2048), torch.nn.Embedding(16, 64)):
        assert default_impl(CPU, embedding, 16384) == "index"
        assert default_impl(CPU, embedding) == "index"


def test_auto_picks_compiled_for_plain_tables_on_cpu_from_the_threshold():
    row = 64 * 4  # float32, width 64
    tokens = 2**22 // row
    table = torch.zeros(16, 64)
    with mock.patch("fusion.merge.merge.COMPILED_MIN_BYTES", 2**22):
        assert default_impl(CPU, table, tokens) == "compiled"
        assert default_impl(CPU, table, tokens - 1) == "index"
        assert default_impl(CPU, torch.nn.Embedding(16, 64), tokens) == "compiled"
        assert default_impl(CPU, table) == "compiled"  # no size given: a size where it wins
        # bfloat16 rows are half the bytes: twice the tokens for the same output.
        assert default_impl(CPU, table.bfloat16(), tokens) == "index"
        assert default_impl(CPU, table.bfloat16(), 2 * tokens) == "compiled"


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


def test_merge_embeddings_auto_uses_compiled_above_the_threshold():
    args = _inputs(2, 8, 8, [1, 2])
    with mock.patch.object(compiled_module, "_run", wraps=compiled_module._run) as run:
        with mock.patch("fusion.merge.merge.COMPILED_MIN_BYTES", 2 * 8 * 8 * 4 + 1):
            merge_embeddings(*args)  # 2 x 8 x 8 float32: one byte below the threshold
        assert run.call_count == 0
        with mock.patch("fusion.merge.merge.COMPILED_MIN_BYTES", 2 * 8 * 8 * 4):
            merged = merge_embeddings(*args)
        assert run.call_count == 1
    assert torch.equal(merged, merge_embeddings(*args, impl="reference"))


# ---------------------------------------------------------------- one graph per bucket


def test_one_graph_serves_every_batch_shape():
    """Token counts, row counts (0 and 1 included), widths, int32 ids, padded rows, fp32 and
    bf16 of even width: after the bucket's first call, nothing compiles again."""
    merge_embeddings(*_inputs(2, 6, 8, [0, 3]), impl="compiled")
    before = _graphs()
    shapes = [(1, 1, 8, [0]), (3, 5, 2, [4]), (2, 7, 16, [1, 2, 3]), (5, 2, 4, [1])]
    for batch, seq_len, dim, placeholders in shapes:
        for dtype in (torch.float32, torch.bfloat16):
            tokens, table, rows, ids = _inputs(batch, seq_len, dim, placeholders)
            table, rows = table.to(dtype), {"image": rows["image"].to(dtype)}
            for t in (tokens, tokens.int()):
                merged = merge_embeddings(t, table, rows, ids, impl="compiled")
                assert torch.equal(merged, merge_embeddings(t, table, rows, ids, impl="reference"))
    tokens, table, rows, ids = _inputs(2, 5, 4, [1, 3])
    padded = Padded(torch.randn(2, 3, 4))
    merged = merge_embeddings(tokens, table, {"image": padded}, ids, impl="compiled")
    assert torch.equal(merged, merge_embeddings(tokens, table, {"image": padded}, ids))
    assert _graphs() == before


@pytest.mark.parametrize("shape", [(0, 3), (2, 0)])
def test_empty_batches_and_sequences(shape):
    tokens = torch.zeros(shape, dtype=torch.long)
    merged = merge_embeddings(tokens, torch.randn(8, 4), {}, {"image": 9}, impl="compiled")
    assert merged.shape == (*shape, 4)


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
    # fullgraph: a graph break would raise. The cached compiled merge is never called.
    with mock.patch.object(compiled_module, "_run", side_effect=AssertionError("nested")):
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
        actual = compiled(tokens, encoder_input=encoder_input)
        actual.sum().backward()
    torch.testing.assert_close(actual, expected)
    torch.testing.assert_close(model.decoder.tok_embeddings.weight.grad, expected_grad)


# ---------------------------------------------------------------- where dynamo cannot compile


def test_under_a_dispatch_mode_the_same_ops_run_eagerly_and_only_there():
    """Dynamo does not compile under a TorchDispatchMode (FlopCounterMode is one): the merge
    then runs the same ops uncompiled, with the same bits, and compiled again after it (a
    frame dynamo skipped once it would skip for good)."""
    args = _inputs(2, 6, 8, [0, 3])
    expected = merge_embeddings(*args, impl="reference")
    merge_embeddings(*args, impl="compiled")  # the bucket compiled before _fill is watched
    with mock.patch.object(compiled_module, "_fill", wraps=compiled_module._fill) as eager:
        with FlopCounterMode(display=False):
            assert torch.equal(merge_embeddings(*args, impl="compiled"), expected)
        assert eager.call_count == 1
        assert torch.equal(merge_embeddings(*args, impl="compiled"), expected)
        assert eager.call_count == 1


def test_without_a_working_compiler_it_warns_once_and_merges_uncompiled():
    args = _inputs(2, 6, 8, [0, 3])
    expected = merge_embeddings(*args, impl="reference")
    failure = torch._dynamo.exc.BackendCompilerFailed(
        lambda: None, RuntimeError("no C++ compiler"), None
    )
    with (
        mock.patch.object(compiled_module, "_compiled", side_effect=failure) as compiled,
        mock.patch.object(compiled_module, "_FAILED", set()),
        warnings.catch_warnings(record=True) as caught,
    ):
        warnings.simplefilter("always")
        for _ in range(2):
            assert torch.equal(merge_embeddings(*args, impl="compiled"), expected)
    assert compiled.call_count == 1  # the failed bucket is not tried again
    assert len(caught) == 1 and "RuntimeError: no C++ compiler" in str(caught[0].message)


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
