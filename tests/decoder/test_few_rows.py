"""The decoder's linear layers on few CPU rows (``fusion.decoder.FewRowsLinear``): an
``nn.Linear`` whose own forward takes ``few_rows_product`` on a decoding step's few float32
rows, the same outputs as ``F.linear`` to the last bits, and ``F.linear`` itself for anything
else; called as a module, so its hooks always run."""

from typing import ClassVar
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fusion.decoder import FewRowsLinear, few_rows
from fusion.decoder.few_rows import FEW_ROWS, FEW_ROWS_MIN_WEIGHT, is_plain_linear


def layer(bias: bool = False, out: int = 1024) -> FewRowsLinear:
    torch.manual_seed(0)
    return FewRowsLinear(256, out, bias=bias)  # 256 x 1024: FEW_ROWS_MIN_WEIGHT elements


def rows(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, 256, generator=torch.Generator().manual_seed(1))


@pytest.fixture
def products(monkeypatch) -> list[torch.Tensor]:
    """The weights ``few_rows_product`` took its product with (it returned a tensor)."""
    taken: list[torch.Tensor] = []
    product = few_rows.few_rows_product

    def recording(h, weight):
        out = product(h, weight)
        if out is not None:
            taken.append(weight)
        return out

    monkeypatch.setattr(few_rows, "few_rows_product", recording)
    return taken


@pytest.mark.parametrize("shape", [(1, 1), (1,), (2, 1), (1, 3), (4,), (2, 2)])
@pytest.mark.parametrize("out_features", [1024, 1536])
def test_few_rows_match_f_linear(shape, out_features, products):
    module, h = layer(out=out_features), rows(*shape)
    with torch.no_grad():
        out = module(h)
        expected = F.linear(h, module.weight)
    assert [id(w) for w in products] == [id(module.weight)]  # the product of few_rows.py
    assert out.shape == (*shape, out_features) and out.dtype == torch.float32
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    # Views of the result keep working (attention splits it into heads).
    heads = out_features // 64
    assert torch.equal(out.view(*shape, heads, 64), out.reshape(*shape, heads, 64))


@pytest.mark.parametrize(
    "case", ["many_rows", "bias", "bf16", "autocast", "grad", "small", "meta", "empty"]
)
def test_anything_else_is_f_linear(case, products):
    module = layer(bias=case == "bias", out=1023 if case == "small" else 1024)
    h = rows(FEW_ROWS + 1) if case == "many_rows" else rows(0) if case == "empty" else rows(1, 1)
    if case == "bf16":
        module, h = module.to(torch.bfloat16), h.to(torch.bfloat16)
    if case == "meta":
        module, h = module.to("meta"), h.to("meta")
    with torch.set_grad_enabled(case == "grad"):  # gradients: training, rows maybe symbolic
        if case == "autocast":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out, expected = module(h), F.linear(h, module.weight)
        else:
            out, expected = module(h), F.linear(h, module.weight, module.bias)
    assert products == []
    assert out.shape == expected.shape and out.dtype == expected.dtype
    if case != "meta":
        assert torch.equal(out, expected)  # bitwise: F.linear's own product
    assert out.requires_grad == (case == "grad")


def test_hooks_run_and_change_the_output(products):
    """Its own forward hook and pre-hook and a global hook all run (the layer is never
    bypassed), each changing the output, while the forward still takes the product."""
    module, h = layer(), rows(1, 1)
    calls: list[str] = []

    def pre_hook(_module, args):
        calls.append("pre")
        return (args[0] * 2,)

    def hook(_module, _args, output):
        calls.append("hook")
        return output + 1

    def global_hook(module_, _args, output):
        if module_ is module:
            calls.append("global")
            return output * 3
        return None

    handles = [
        module.register_forward_pre_hook(pre_hook),
        module.register_forward_hook(hook),
        nn.modules.module.register_module_forward_hook(global_hook),
    ]
    try:
        with torch.no_grad():
            out = module(h)
    finally:
        for handle in handles:
            handle.remove()
    assert calls == ["pre", "global", "hook"]  # global forward hooks run before the layer's
    assert [id(w) for w in products] == [id(module.weight)]
    with torch.no_grad():
        expected = F.linear(h * 2, module.weight) * 3 + 1
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-5)


class Marked(torch.Tensor):
    """A tensor subclass (as DTensor and quantized tensors are) that records its ops."""

    ops: ClassVar[list[object]] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.ops.append(func)
        return super().__torch_function__(func, types, args, kwargs or {})


def test_a_tensor_subclass_weight_keeps_f_linear(products):
    module, h = layer(), rows(1, 1)
    module.weight = nn.Parameter(module.weight.detach().as_subclass(Marked))
    assert type(module.weight) is Marked
    Marked.ops.clear()
    with torch.no_grad():
        out = module(h)
    assert products == []
    assert F.linear in Marked.ops
    torch.testing.assert_close(out.as_subclass(torch.Tensor), h @ module.weight.detach().T)


@pytest.mark.parametrize("bias", [False, True])
def test_an_nn_linear_in_all_but_its_forward(bias):
    ours, theirs = FewRowsLinear(8, 4, bias=bias), nn.Linear(8, 4, bias=bias)
    assert isinstance(ours, nn.Linear) and is_plain_linear(ours) and is_plain_linear(theirs)
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(3, 8)
    assert torch.equal(ours(x), theirs(x))

    class Wrapped(nn.Linear):
        """A subclass (as adapters and quantized layers are): no plain linear layer."""

    assert not is_plain_linear(Wrapped(8, 4)) and not is_plain_linear(nn.Identity())


def test_a_decoding_step_takes_the_product_for_its_large_layers(products):
    """In a decoding step of a 512-wide decoder, the layers of at least FEW_ROWS_MIN_WEIGHT
    elements take the product (queries, output, MLP), the small ones F.linear (keys and
    values, 128 x 512), and the greedy tokens equal those of F.linear throughout."""
    from fusion.generation import generate, generate_stream
    from fusion.models import llama3_2

    torch.manual_seed(0)
    decoder = llama3_2(
        vocab_size=64, num_layers=1, num_heads=8, num_kv_heads=2, embed_dim=512,
        max_seq_len=64, intermediate_dim=512,
    ).eval()  # fmt: skip
    attn, mlp = decoder.layers[0].attn, decoder.layers[0].mlp
    assert all(type(m) is FewRowsLinear for m in (attn.q_proj, attn.k_proj, mlp.w1, mlp.w2))
    assert attn.q_proj.weight.numel() == FEW_ROWS_MIN_WEIGHT
    tokens = torch.tensor([[5, 6, 7]])
    stream = generate_stream(decoder, tokens, max_new_tokens=3, temperature=0)
    next(stream)  # the prefill
    products.clear()
    next(stream)  # one step
    stream.close()
    large = [attn.q_proj, attn.output_proj, mlp.w1, mlp.w2, mlp.w3]
    expected = {id(m.weight) for m in large}
    if decoder.output is None:  # tied: tied_projection takes the same product
        expected.add(id(decoder.tok_embeddings.weight))
    assert {id(w) for w in products} == expected
    fast = generate(decoder, tokens, max_new_tokens=6, temperature=0)
    with mock.patch.object(few_rows, "FEW_ROWS", 0):  # every product F.linear's
        assert torch.equal(generate(decoder, tokens, max_new_tokens=6, temperature=0), fast)
