"""FeedForward's ``chunk_rows`` (issue 40): when training, the rows go through the MLP a chunk
at a time, with the outputs and gradients of the whole batch at once, the same tensors kept
for the backward pass, and no intermediate larger than a chunk's."""

import pytest
import torch
from test_chunked_loss import LiveFloats

from fusion.decoder import FeedForward
from helpers import saved_bytes

DIM, HIDDEN, ROWS = 4, 32, 64


def mlp(chunk_rows: int | None, activation: str = "silu") -> FeedForward:
    torch.manual_seed(0)
    module = FeedForward(DIM, HIDDEN, activation=activation, chunk_rows=chunk_rows)
    with torch.no_grad():
        for param in module.parameters():
            param.normal_()
    return module


def run(module: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """The output and the gradients of the input and of every parameter (from none)."""
    module.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    out = module(x)
    out.backward(torch.linspace(-1, 1, out.numel()).view_as(out))
    return [out.detach(), x.grad, *(p.grad.clone() for p in module.parameters())]


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("chunk_rows", [1, 7, 32, 63])
def test_chunks_give_the_whole_batchs_outputs_and_gradients(activation, chunk_rows):
    x = torch.randn(2, ROWS // 2, DIM, generator=torch.Generator().manual_seed(1))
    whole = run(mlp(None, activation), x)
    chunked = run(mlp(chunk_rows, activation), x)
    assert chunked[0].shape == (2, ROWS // 2, DIM)
    for got, want in zip(chunked, whole, strict=True):
        # The weights' gradients are sums over the rows, here taken chunk by chunk: the same
        # terms in another order.
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * float(want.abs().max()))


def test_same_tensors_kept_and_no_intermediate_above_a_chunk():
    x = torch.randn(1, ROWS, DIM, requires_grad=True)
    kept = {n: saved_bytes(lambda n=n: mlp(n)(x)) for n in (None, 8)}
    assert kept[8] == kept[None] > 0
    largest = {}
    for chunk_rows in (None, 8):
        module = mlp(chunk_rows).requires_grad_(False)  # as under LoRA: no weight gradients
        live = LiveFloats()
        with live:
            module(x).sum().backward()
        largest[chunk_rows] = live.largest
    assert largest[None] == ROWS * HIDDEN
    assert largest[8] == max(8 * HIDDEN, ROWS * DIM)


def test_inference_goes_at_once_and_few_rows_are_not_split():
    x = torch.randn(1, ROWS, DIM)
    module = mlp(8)
    live = LiveFloats()
    with torch.no_grad(), live:
        module(x)
    assert live.largest == ROWS * HIDDEN
    short = torch.randn(1, 8, DIM, requires_grad=True)
    torch.testing.assert_close(module(short), mlp(None)(short), rtol=0, atol=0)


def test_meta_and_empty_inputs():
    with torch.device("meta"):
        module = FeedForward(DIM, HIDDEN, chunk_rows=8)
        out = module(torch.empty(3, 20, DIM, requires_grad=True))
    assert out.shape == (3, 20, DIM) and out.device.type == "meta"
    empty = mlp(8)(torch.empty(0, 5, DIM, requires_grad=True))
    assert empty.shape == (0, 5, DIM)


@pytest.mark.parametrize("bad", [0, -1, True, 2.0, "8"])
def test_bad_chunk_rows(bad):
    with pytest.raises(ValueError, match=r"chunk_rows: expected None or an int >= 1, got"):
        FeedForward(DIM, HIDDEN, chunk_rows=bad)


def test_compiled_rows_go_at_once_without_a_graph_per_chunk_count():
    """Under torch.compile (dynamic shapes, as ``compile_layers``) the rows are not chunked:
    row counts of two, three and four chunks' worth share one graph, with eager's gradients."""
    graphs = []

    def counting(graph, example_inputs):
        graphs.append(graph)
        return graph.forward

    module = mlp(8)
    compiled = torch.compile(module, backend=counting, dynamic=True)
    for rows in (12, 20, 30):
        x = torch.randn(1, rows, DIM, generator=torch.Generator().manual_seed(rows))
        got, want = run(compiled, x), run(module, x)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * float(b.abs().max()))
    assert len(graphs) == 1
