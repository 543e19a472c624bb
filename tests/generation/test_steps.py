"""Eager decoding projects the last slot through oneDNN in float32 on CPU (BLAS is slow there
for a few rows); everything else keeps ``F.linear``. The compiled steps are tested in
``test_compiled.py``."""

from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from fusion import generate
from fusion.generation import steps
from helpers import VOCAB, build_tiny_decoder, lively_decoder, text_tokens

pytestmark = pytest.mark.skipif(
    steps._ONEDNN_LINEAR is None, reason="no oneDNN linear in this torch build, or no AVX2"
)


class _Ops(TorchDispatchMode):
    """The aten ops that ran, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def _onednn_calls(ops: _Ops) -> int:
    return ops.names.count("mkldnn._linear_pointwise")


@pytest.mark.parametrize("batch", [1, 3])
def test_eager_generation_projects_the_last_slot_in_onednn(batch):
    """One oneDNN call per new token (the prefill's and each step's output projection), the
    layers' linear layers stay matrix products, and the tokens are those of plain BLAS, which a
    torch without oneDNN uses throughout."""
    decoder = lively_decoder()
    prompts = text_tokens(batch, 5)
    blas = _Ops()
    with blas, mock.patch.object(steps, "_ONEDNN_LINEAR", None):
        expected = generate(decoder, prompts, max_new_tokens=6, temperature=0)
    assert _onednn_calls(blas) == 0
    ops = _Ops()
    with ops:
        got = generate(decoder, prompts, max_new_tokens=6, temperature=0)
    assert torch.equal(got, expected)
    assert _onednn_calls(ops) == 6
    matrix_products = ops.names.count("aten.mm") + ops.names.count("aten.addmm")
    assert matrix_products == 6 * 7 * len(decoder.layers)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("bias", [False, True])
def test_last_slot_logits_equal_blas(tied, bias):
    """Tied and untied outputs, with or without a bias: the logits of F.linear, in float32."""
    decoder = build_tiny_decoder(tie_word_embeddings=tied).eval()
    if bias:
        decoder.output = nn.Linear(decoder.tok_embeddings.embedding_dim, VOCAB)
    hidden = torch.randn(3, 4, decoder.tok_embeddings.embedding_dim)
    with torch.no_grad():
        expected = decoder.unembed(hidden[:, -1])
        ops = _Ops()
        with ops:
            got = steps._last_slot_logits(decoder, hidden)
    assert _onednn_calls(ops) == 1
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


class _Marked(torch.Tensor):
    """A tensor subclass, standing in for DTensor and quantized weights."""


@pytest.mark.parametrize("case", ["bfloat16", "float64", "meta", "grad", "autocast", "subclass"])
def test_everything_else_keeps_f_linear(case):
    """Other dtypes and devices, gradients, autocast and tensor subclasses: ``F.linear``
    itself, with its result."""
    dtype = {"bfloat16": torch.bfloat16, "float64": torch.float64}.get(case, torch.float32)
    device = "meta" if case == "meta" else "cpu"
    x = torch.randn(2, 8, dtype=dtype, device=device)
    weight = torch.randn(5, 8, dtype=dtype, device=device, requires_grad=case == "grad")
    if case == "subclass":
        weight = weight.as_subclass(_Marked)
    grad = torch.enable_grad() if case == "grad" else torch.no_grad()
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=case == "autocast")
    ops = _Ops()
    with grad, autocast:
        expected = F.linear(x, weight)
        with ops, steps._Float32LinearsInOneDNN():
            got = F.linear(x, weight)
    assert _onednn_calls(ops) == 0
    assert got.dtype == expected.dtype and got.device == expected.device
    if device == "cpu":
        torch.testing.assert_close(got, expected)
