"""Selective recomputation (issue 40): norms, SwiGLU's gate and packed attention's
concatenation are recomputed in the backward pass; losses and gradients equal those without
it bit for bit (fp32), and fewer tensors are kept, counted through saved-tensor hooks."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fusion.decoder import (
    FeedForward,
    GatedRMSNorm,
    MultiHeadAttention,
    PackedSegments,
    RMSNorm,
    RotaryPositionalEmbeddings,
    ZeroCenteredRMSNorm,
)
from fusion.decoder.packed_attention import prepare
from helpers import VOCAB, build_tiny_decoder, saved_bytes


def set_recompute(model: torch.nn.Module, on: bool) -> None:
    for module in model.modules():
        if hasattr(module, "recompute"):
            module.recompute = on


def gradients(model: torch.nn.Module, inputs, output_grad) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    for tensor in inputs:
        tensor.grad = None
    out = model(*inputs)
    out.backward(output_grad)
    return [out.detach(), *(t.grad for t in inputs), *(p.grad for p in model.parameters())]


MODULES = {
    "swiglu": (lambda: FeedForward(16, 48), 1, 16),
    "rms_norm": (lambda: RMSNorm(16), 1, 16),
    "zero_centred": (lambda: ZeroCenteredRMSNorm(16), 1, 16),
    "gated": (lambda: GatedRMSNorm(16), 2, 16),
}


@pytest.mark.parametrize("name", MODULES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_recomputed_modules_give_the_same_gradients_and_keep_less(name, dtype):
    build, arity, dim = MODULES[name]
    torch.manual_seed(0)
    module = build().to(dtype)
    with torch.no_grad():
        for param in module.parameters():
            param.normal_()
    inputs = [torch.randn(2, 5, dim, dtype=dtype, requires_grad=True) for _ in range(arity)]
    output_grad = torch.randn(2, 5, dim, dtype=dtype)
    assert module.recompute  # the default
    recomputed = gradients(module, inputs, output_grad)
    kept = saved_bytes(lambda: module(*inputs))
    set_recompute(module, False)
    plain = gradients(module, inputs, output_grad)
    kept_plain = saved_bytes(lambda: module(*inputs))
    for a, b in zip(recomputed, plain, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert kept < kept_plain


def test_swiglu_keeps_two_hidden_tensors_of_four():
    """``act(gate)`` and the gated product (``w2``'s input) go; ``gate`` and ``up`` stay."""
    mlp, x = FeedForward(8, 1000), torch.randn(3, 8, requires_grad=True)
    hidden = 3 * 1000 * 4  # one [3, 1000] float32 tensor
    with_recompute = saved_bytes(lambda: mlp(x))
    mlp.recompute = False
    assert saved_bytes(lambda: mlp(x)) - with_recompute == 2 * hidden


class MatrixProducts(TorchDispatchMode):
    """Counts the matrix products that run while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("recompute", [True, False])
def test_swiglu_backward_runs_no_matrix_product_again(recompute):
    """The recomputation stops once the gated product is back: the backward pass runs the six
    products of the three projections' gradients, as without recomputation, not ``w2``'s
    forward product again."""
    mlp, x = FeedForward(8, 32, recompute=recompute), torch.randn(5, 8, requires_grad=True)
    out = mlp(x)
    with MatrixProducts() as products:
        out.sum().backward()
    assert products.count == 6


def test_swiglu_under_an_adapter_keeps_the_adapters_input():
    """A ``w2`` that is not a plain linear layer is left outside the recomputed region (its
    products would run again there): its input is kept, gradients are unchanged."""

    class Scaled(torch.nn.Linear):  # stands in for an adapter: any subclass
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * 2

    torch.manual_seed(0)
    mlp = FeedForward(8, 1000)
    plain_kept = saved_bytes(lambda: mlp(torch.randn(3, 8, requires_grad=True)))
    adapted = Scaled(1000, 8, bias=False)
    adapted.load_state_dict(mlp.w2.state_dict())
    mlp.w2 = adapted
    x, output_grad = torch.randn(3, 8, requires_grad=True), torch.randn(3, 8)
    assert saved_bytes(lambda: mlp(x)) == plain_kept + 3 * 1000 * 4  # the gated product too
    out = mlp(x)
    with MatrixProducts() as products:
        out.sum().backward()
    assert products.count == 6
    recomputed = gradients(mlp, [x], output_grad)
    mlp.recompute = False
    for a, b in zip(recomputed, gradients(mlp, [x], output_grad), strict=True):
        assert torch.equal(a, b)


def test_a_decoder_trains_bit_for_bit_as_without_recomputation():
    decoder = build_tiny_decoder(tie_word_embeddings=False)
    tokens = torch.randint(0, VOCAB, (2, 12))

    def step() -> tuple[torch.Tensor, list[torch.Tensor]]:
        decoder.zero_grad(set_to_none=True)
        loss = decoder(tokens).float().logsumexp(-1).mean()
        loss.backward()
        return loss.detach(), [p.grad for p in decoder.parameters()]

    loss, grads = step()
    kept = saved_bytes(lambda: decoder(tokens))
    set_recompute(decoder, False)
    plain_loss, plain_grads = step()
    assert torch.equal(loss, plain_loss)
    assert all(torch.equal(a, b) for a, b in zip(grads, plain_grads, strict=True))
    assert kept < saved_bytes(lambda: decoder(tokens))


def test_without_autograd_recomputation_is_a_plain_call(monkeypatch):
    """Inference pays nothing: no checkpoint is set up under no_grad or inference mode."""
    import fusion.decoder.recompute as recompute

    def refuse(*args, **kwargs):
        raise AssertionError("checkpoint called outside autograd")

    monkeypatch.setattr(recompute, "checkpoint", refuse)
    decoder = build_tiny_decoder()
    tokens = torch.randint(0, VOCAB, (1, 6))
    with torch.no_grad():
        expected = decoder(tokens)
    with torch.inference_mode():
        assert torch.equal(decoder(tokens), expected)
    with pytest.raises(AssertionError, match="checkpoint called"):
        decoder(tokens)  # with grad: checkpointed


def test_recomputation_compiles_to_the_same_gradients():
    torch.manual_seed(0)
    mlp = FeedForward(16, 32)
    x = torch.randn(4, 16, requires_grad=True)
    output_grad = torch.randn(4, 16)
    eager = gradients(mlp, [x], output_grad)
    compiled = torch.compile(mlp, fullgraph=True, backend="aot_eager")
    for a, b in zip(gradients(compiled, [x], output_grad), eager, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_swiglu_recomputes_bit_for_bit_under_autocast():
    """Under bf16 autocast (the recipe's ``--dtype bfloat16``) the recomputed region casts the
    gated product for ``w2`` again, as the forward did: outputs and gradients as without
    recomputation, bit for bit, with chunks."""
    torch.manual_seed(0)
    mlp, x = FeedForward(8, 64, chunk_rows=3), torch.randn(2, 5, 8, requires_grad=True)
    output_grad = torch.randn(2, 5, 8, dtype=torch.bfloat16)

    def run(recompute: bool) -> list[torch.Tensor]:
        mlp.recompute = recompute
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return gradients(mlp, [x], output_grad)

    for a, b in zip(run(True), run(False), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


# ---------------------------------------------------------------------- packed attention

LENGTHS, SEQ_LEN, HEADS, HEAD_DIM = [[5, 9, 2], [16]], 16, 4, 8


def packed_layer(output_gate: bool) -> tuple[MultiHeadAttention, dict]:
    """A GQA layer and its packed inputs (per-sample SDPA, two rows, no padding)."""
    torch.manual_seed(0)
    rope = RotaryPositionalEmbeddings(HEAD_DIM, SEQ_LEN)
    layer = MultiHeadAttention(32, HEADS, 2, HEAD_DIM, rope, output_gate=output_gate)
    segments = PackedSegments.from_lengths(LENGTHS, SEQ_LEN, backend="sdpa")
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in LENGTHS])
    inputs = {"mask": prepare(segments, torch.float32), "input_pos": positions}
    return layer, inputs


def layer_gradients(layer, x, inputs, output_grad) -> list[torch.Tensor]:
    layer.zero_grad(set_to_none=True)
    x.grad = None
    out = layer(x, **inputs)
    out.backward(output_grad)
    return [out.detach(), x.grad, *(p.grad for p in layer.parameters())]


def without_recomputation(monkeypatch) -> None:
    monkeypatch.setattr(MultiHeadAttention, "_recomputes_concatenation", lambda *_: False)


@pytest.mark.parametrize("output_gate", [False, True])
def test_packed_attention_keeps_the_samples_outputs_once(output_gate, monkeypatch):
    """SDPA keeps each sample's outputs; the output projection no longer keeps their
    concatenation (nor, gated, ``sigmoid(gate)`` and the gated product: the gate's own
    storage, ``q_proj``'s output, stays alive through the region instead, which these hooks
    do not see). Gradients and the backward's matrix products are unchanged."""
    layer, inputs = packed_layer(output_gate)
    x = torch.randn(2, SEQ_LEN, 32, requires_grad=True)
    output_grad = torch.randn(2, SEQ_LEN, 32)
    recomputed = layer_gradients(layer, x, inputs, output_grad)
    kept = saved_bytes(lambda: layer(x, **inputs))
    out = layer(x, **inputs)
    with MatrixProducts() as products:
        out.backward(output_grad)
    without_recomputation(monkeypatch)
    plain = layer_gradients(layer, x, inputs, output_grad)
    kept_plain = saved_bytes(lambda: layer(x, **inputs))
    out = layer(x, **inputs)
    with MatrixProducts() as plain_products:
        out.backward(output_grad)
    for a, b in zip(recomputed, plain, strict=True):
        assert torch.equal(a, b)
    one = 2 * SEQ_LEN * HEADS * HEAD_DIM * 4  # a float32 [b, s, h * hd] tensor
    assert kept_plain - kept == (3 if output_gate else 1) * one
    assert products.count == plain_products.count == 8  # q, k, v, output: two each


def test_packed_attention_under_an_adapter_keeps_the_concatenation(monkeypatch):
    """An ``output_proj`` that is not a plain linear layer stays outside any recomputed region,
    so nothing of it runs twice."""

    class Scaled(torch.nn.Linear):  # stands in for an adapter: any subclass
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * 2

    layer, inputs = packed_layer(output_gate=False)
    adapted = Scaled(HEADS * HEAD_DIM, 32, bias=False)
    adapted.load_state_dict(layer.output_proj.state_dict())
    layer.output_proj = adapted
    x = torch.randn(2, SEQ_LEN, 32, requires_grad=True)
    kept = saved_bytes(lambda: layer(x, **inputs))
    without_recomputation(monkeypatch)
    assert saved_bytes(lambda: layer(x, **inputs)) == kept


def test_a_packed_decoder_with_padding_trains_bit_for_bit(monkeypatch):
    """Packed rows with padding through a whole decoder: the same loss and gradients, one
    concatenation fewer kept per layer."""
    decoder = build_tiny_decoder(tie_word_embeddings=False)
    segments = PackedSegments.from_lengths([[3, 4], [6]], 9, backend="sdpa")
    tokens = torch.randint(0, VOCAB, (2, 9))

    def step() -> tuple[torch.Tensor, list[torch.Tensor]]:
        decoder.zero_grad(set_to_none=True)
        loss = decoder(tokens, mask=segments).float().logsumexp(-1).mean()
        loss.backward()
        return loss.detach(), [p.grad for p in decoder.parameters()]

    loss, grads = step()
    kept = saved_bytes(lambda: decoder(tokens, mask=segments))
    without_recomputation(monkeypatch)
    plain_loss, plain_grads = step()
    kept_plain = saved_bytes(lambda: decoder(tokens, mask=segments))
    assert torch.equal(loss, plain_loss)
    assert all(torch.equal(a, b) for a, b in zip(grads, plain_grads, strict=True))
    attention = decoder.layers[0].attn
    concatenation = 2 * 9 * attention.num_heads * attention.head_dim * 4
    padding = 2 * 4  # each padded row's part: one float32 zero, broadcast
    assert kept_plain - kept == len(decoder.layers) * (concatenation - padding)
