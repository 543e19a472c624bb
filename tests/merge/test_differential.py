"""Every merge implementation against ``reference``: the same bits forward, the same gradients
w.r.t. the table and the rows, the same errors.

The fused Triton kernel runs here on CPU through Triton's interpreter. Triton reads
``TRITON_INTERPRET`` when a kernel is built and launched, and :mod:`fusion.merge.fused` builds
one kernel per mode on first use, so setting the variable inside :func:`implementation` scopes
the interpreter to these calls; the rest of the suite never sees it.
"""

import dataclasses
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from unittest import mock

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from fusion.merge import (
    IMPLEMENTATIONS,
    Packed,
    Padded,
    default_impl,
    embedding_table,
    merge_embeddings,
)
from fusion.merge.fused import triton
from fusion.testing import MergeCase, merge_inputs

_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
NEEDS_TRITON = pytest.mark.skipif(triton is None, reason="Triton is not installed")
OTHERS = [
    pytest.param(name, marks=NEEDS_TRITON) if name == "fused" else name
    for name in sorted(IMPLEMENTATIONS)
    if name != "reference"
]
# The interpreter runs a kernel program in NumPy: tiny shapes keep the fused tests fast.
SMALL = {"max_batch": 3, "max_seq_len": 12, "vocab_size": 16, "dims": (1, 3, 8)}


@contextmanager
def implementation(impl: str) -> Iterator[None]:
    """Run ``impl``; the fused kernel on CPU under Triton's interpreter, for this call only."""
    if impl != "fused":
        yield
        return
    with mock.patch.dict(os.environ, {"TRITON_INTERPRET": "1"}):
        yield


def assert_bitwise(actual: torch.Tensor | None, expected: torch.Tensor | None, what: str) -> None:
    """Equal bits (so -0.0 differs from 0.0), dtype and shape."""
    assert (actual is None) == (expected is None), f"{what}: one gradient is missing"
    if expected is None:
        return
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
    bits = _BITS[expected.element_size()]
    assert torch.equal(actual.view(bits), expected.view(bits)), f"{what}: bits differ"


@dataclasses.dataclass
class Leaves:
    """Fresh leaf tensors (the gradients land here) and the views a merge is called with."""

    weight: torch.Tensor
    rows: dict[str, torch.Tensor]
    weight_view: torch.Tensor
    rows_views: dict[str, Packed | Padded]


def make_leaves(case: MergeCase, weight_transposed: bool, rows_grad: dict[str, bool]) -> Leaves:
    """Copies of the case's table and rows with the same values and the same kind of strides:
    a column-major table when ``weight_transposed``; every other column of a wider leaf for
    non-contiguous rows."""
    if weight_transposed:
        weight = case.weight.t().contiguous().requires_grad_()
        weight_view = weight.t()
    else:
        weight = case.weight.clone().requires_grad_()
        weight_view = weight
    rows, views = {}, {}
    for name, layout in case.encoder_rows.items():
        r = layout.rows
        if r.is_contiguous():
            leaf = r.clone().requires_grad_(rows_grad[name])
            view = leaf
        else:
            leaf = r.new_zeros(*r.shape[:-1], 2 * r.shape[-1])
            leaf[..., ::2] = r
            leaf.requires_grad_(rows_grad[name])
            view = leaf[..., ::2]
        rows[name] = leaf
        views[name] = type(layout)(view)
    return Leaves(weight, rows, weight_view, views)


def run(impl: str, case: MergeCase, tokens: torch.Tensor, leaves: Leaves, grad: torch.Tensor):
    """Forward, then backward of ``(out * grad).sum()``; returns the output and the grads."""
    with implementation(impl):
        out = merge_embeddings(
            tokens, leaves.weight_view, leaves.rows_views, case.encoder_tokens, impl=impl
        )
        out.backward(grad)
    grads = {name: leaf.grad for name, leaf in leaves.rows.items()}
    return out.detach(), leaves.weight.grad, grads


@pytest.mark.parametrize("impl", OTHERS)
@given(case=merge_inputs(**SMALL), data=st.data())
def test_same_bits_and_gradients_as_reference(impl, case, data):
    check_against_reference(impl, case, data)


def check_against_reference(impl: str, case: MergeCase, data: st.DataObject) -> None:
    """``impl`` and ``reference`` on the same drawn variations of ``case``: the same bits out,
    the same gradients w.r.t. the table and each encoder's rows."""
    tokens = case.tokens
    if data.draw(st.booleans(), label="int32 tokens"):
        tokens = tokens.int()
    if data.draw(st.booleans(), label="non-contiguous tokens"):
        tokens = tokens.t().contiguous().t()
    weight_transposed = data.draw(st.booleans(), label="column-major table")
    rows_grad = {
        name: data.draw(st.booleans(), label=f"{name} requires grad") for name in case.encoder_rows
    }
    seed = data.draw(st.integers(0, 2**31 - 1), label="grad seed")
    shape = (*case.tokens.shape, case.weight.size(1))
    grad = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(case.weight.dtype)
    if data.draw(st.booleans(), label="non-contiguous grad"):
        grad = grad.transpose(0, 1).contiguous().transpose(0, 1)

    expected = run("reference", case, tokens, make_leaves(case, weight_transposed, rows_grad), grad)
    actual = run(impl, case, tokens, make_leaves(case, weight_transposed, rows_grad), grad)

    assert_bitwise(actual[0], expected[0], "output")
    assert_bitwise(actual[1], expected[1], "gradient w.r.t. the table")
    for name in case.encoder_rows:
        assert_bitwise(actual[2][name], expected[2][name], f"gradient w.r.t. {name}'s rows")
        assert (actual[2][name] is not None) == rows_grad[name]


def _errors(case: MergeCase, impl: str, eager_checks: bool) -> tuple[type, str]:
    with implementation(impl), pytest.raises((ValueError, RuntimeError)) as raised:
        merge_embeddings(
            case.tokens,
            case.weight,
            case.encoder_rows,
            case.encoder_tokens,
            impl=impl,
            eager_checks=eager_checks,
        )
    return type(raised.value), str(raised.value)


@pytest.mark.parametrize("impl", OTHERS)
@given(case=merge_inputs(**SMALL), data=st.data(), eager_checks=st.booleans())
@settings(max_examples=25)
def test_same_errors_as_reference_on_count_mismatch(impl, case, data, eager_checks):
    """Too many or too few packed rows, or a padded width below a sample's count: the same
    exception type and message as ``reference`` (eager ValueError, or the device-side
    assertion, which fires as RuntimeError on CPU)."""
    name = data.draw(st.sampled_from(sorted(case.encoder_rows)))
    layout = case.encoder_rows[name]
    counts = (case.tokens == case.encoder_tokens[name]).sum(1)
    if isinstance(layout, Packed):
        flat = layout.rows.reshape(-1, layout.rows.size(-1))
        extra = data.draw(st.integers(-len(flat), 3).filter(lambda k: k != 0))
        grown = torch.cat([flat, flat.new_zeros(max(extra, 0), flat.size(1))])
        bad = Packed(grown[: len(flat) + extra])
    else:
        assume(counts.numel() > 0 and int(counts.max()) > 0)
        bad = Padded(layout.rows[:, : data.draw(st.integers(0, int(counts.max()) - 1))])
    case = dataclasses.replace(case, encoder_rows={**case.encoder_rows, name: bad})
    expected = _errors(case, "reference", eager_checks)
    assert _errors(case, impl, eager_checks) == expected
    assert f"encoder {name!r}" in expected[1]


# ---------------------------------------------------------------- choosing and lacking Triton


def test_default_rule():
    """On CPU ``index``; on CUDA ``fused`` where Triton is."""
    table = torch.zeros(4, 2)
    assert default_impl(torch.device("cpu"), table) == "index"
    assert default_impl(torch.device("cpu"), table.bfloat16()) == "index"
    with implementation("fused"):  # the interpreter is for tests; auto never picks it
        assert default_impl(torch.device("cpu"), table) == "index"
    expected = "index" if triton is None else "fused"
    cuda = torch.device("cuda")
    assert default_impl(cuda, table.bfloat16()) == expected
    assert default_impl(cuda, torch.nn.Embedding(4, 2)) == expected
    assert default_impl(cuda, table.to(torch.complex128)) == "index"  # 16-byte elements


class _Subclass(torch.nn.Embedding):
    pass


class _SubclassTensor(torch.Tensor):
    pass


def _with_hook() -> torch.nn.Embedding:
    embedding = torch.nn.Embedding(4, 2)
    embedding.register_forward_hook(lambda module, args, out: out * 2)
    return embedding


@pytest.mark.parametrize(
    "embedding",
    [
        pytest.param(_with_hook(), id="forward hook"),
        pytest.param(_Subclass(4, 2), id="subclass (FSDP2, parametrize)"),
        pytest.param(torch.nn.Embedding(4, 2, padding_idx=0), id="padding_idx"),
        pytest.param(torch.nn.Embedding(4, 2, max_norm=1.0), id="max_norm"),
        pytest.param(torch.nn.Sequential(torch.nn.Embedding(4, 2)), id="wrapper module"),
        pytest.param(torch.zeros(4, 2).as_subclass(_SubclassTensor), id="tensor subclass"),
    ],
)
def test_anything_but_a_plain_table_is_called_not_read(embedding):
    """The fused kernel reads the table itself: ``auto`` never picks it, and asking for it
    fails, unless reading the table is provably what calling the embedding does."""
    assert embedding_table(embedding) is None
    assert default_impl(torch.device("cuda"), embedding) == "index"
    assert default_impl(torch.device("cpu"), embedding) == "index"
    tokens = torch.tensor([[1, 2]])
    with pytest.raises(ValueError, match="impl: 'fused' reads the embedding table directly"):
        merge_embeddings(tokens, embedding, {}, {"image": 5}, impl="fused")


def test_the_removed_compiled_impl_is_refused_by_name():
    """``impl="compiled"`` (removed) raises the unknown-impl error, naming the accepted impls
    and what ``auto`` does instead, before any other check."""
    match = (
        r"impl: expected 'auto' or one of \['reference', 'index', 'fused'\], got 'compiled' "
        r"\('compiled' was removed: 'auto' merges with 'index' on CPU\)"
    )
    with pytest.raises(ValueError, match=match):
        merge_embeddings(*_tiny_merge_args(), impl="compiled")
    with pytest.raises(ValueError, match=r"got 'magic'$"):
        merge_embeddings(*_tiny_merge_args(), impl="magic")


def test_plain_tables_may_be_read():
    embedding = torch.nn.Embedding(4, 2)
    assert embedding_table(embedding) is embedding.weight
    table = torch.zeros(4, 2)
    assert embedding_table(table) is table


def _tiny_merge_args() -> tuple:
    tokens = torch.tensor([[5, 1, 5], [2, 5, 3]])
    weight = torch.randn(4, 2, generator=torch.Generator().manual_seed(0))
    rows = torch.randn(3, 2, generator=torch.Generator().manual_seed(1))
    return tokens, weight, {"image": rows}, {"image": 5}


@NEEDS_TRITON
def test_fused_on_cpu_without_the_interpreter_raises_before_any_work():
    environ = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    with mock.patch.dict(os.environ, environ, clear=True):
        with pytest.raises(ValueError, match=r"impl: 'fused' expected CUDA tensors .* cpu"):
            merge_embeddings(*_tiny_merge_args(), impl="fused")
        # Bad input elsewhere is not reached: the impl is checked first.
        tokens, weight, rows, ids = _tiny_merge_args()
        with pytest.raises(ValueError, match="impl: 'fused'"):
            merge_embeddings(tokens, weight, {"image": rows["image"][:1]}, ids, impl="fused")


def test_without_triton_auto_falls_back_and_fused_raises():
    """In a fresh interpreter where ``import triton`` fails: the package imports, ``auto``
    merges with ``index`` on every device, ``fused`` raises a clear ImportError."""
    script = """
import sys
sys.modules["triton"] = None  # makes `import triton` raise ImportError
import torch
from fusion.merge import default_impl, merge_embeddings
assert default_impl(torch.device("cuda"), torch.zeros(4, 2, dtype=torch.bfloat16)) == "index"
tokens = torch.tensor([[5, 1]])
weight = torch.arange(8.0).view(4, 2)
rows = torch.full((1, 2), -1.0)
out = merge_embeddings(tokens, weight, {"image": rows}, {"image": 5})
assert out.tolist() == [[[-1.0, -1.0], [2.0, 3.0]]], out
try:
    merge_embeddings(tokens, weight, {"image": rows}, {"image": 5}, impl="fused")
except ImportError as e:
    print("ImportError:", e)
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "ImportError: impl: 'fused' needs Triton, which is not installed" in done.stdout
    assert "pip install 'triton>=3.3'" in done.stdout


@NEEDS_TRITON
def test_fused_compiles_without_graph_breaks():
    """The fused merge is one opaque operator to ``torch.compile`` (``fullgraph=True``), with
    the same bits and gradients as eager."""
    tokens, weight, rows, ids = _tiny_merge_args()

    def merge_and_grads(fn):
        w = weight.clone().requires_grad_()
        r = rows["image"].clone().requires_grad_()
        out = fn(tokens, w, {"image": r}, ids, impl="fused")
        out.backward(torch.ones_like(out))
        return out.detach(), w.grad, r.grad

    compiled = torch.compile(merge_embeddings, backend="aot_eager", fullgraph=True)
    with implementation("fused"):
        expected = merge_and_grads(merge_embeddings)
        actual = merge_and_grads(compiled)
    for a, e, what in zip(actual, expected, ("output", "table grad", "rows grad"), strict=True):
        assert_bitwise(a, e, what)
