"""A decoding step's linear layers on few CPU rows (``fusion.decoder.few_rows.linear``): the
same outputs as the module to the last bits, and the module itself wherever it is anything
but a plain, hook-free ``nn.Linear`` on few float32 rows."""

import contextlib
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fusion.decoder import few_rows
from fusion.decoder.few_rows import FEW_ROWS, FEW_ROWS_MIN_WEIGHT, linear


def layer(bias: bool = False, out: int = 1024) -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(256, out, bias=bias)  # 256 x 1024: FEW_ROWS_MIN_WEIGHT elements


def rows(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, 256, generator=torch.Generator().manual_seed(1))


@pytest.fixture
def forwards(monkeypatch) -> list[nn.Module]:
    """The modules whose own ``forward`` ran (patched on the class: no hook is added)."""
    called: list[nn.Module] = []
    forward = nn.Linear.forward

    def recording(self, x):
        called.append(self)
        return forward(self, x)

    monkeypatch.setattr(nn.Linear, "forward", recording)
    return called


@pytest.mark.parametrize("shape", [(1, 1), (1,), (2, 1), (1, 3), (4,), (2, 2)])
def test_few_rows_match_f_linear(shape, forwards):
    module, h = layer(), rows(*shape)
    with torch.no_grad():
        out = linear(module, h)
        expected = F.linear(h, module.weight)
    assert forwards == []  # the product of few_rows.py, not the module's
    assert out.shape == (*shape, 1024) and out.dtype == torch.float32
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    # Views of the result keep working (attention splits it into heads).
    assert torch.equal(out.view(*shape, 16, 64), out.reshape(*shape, 16, 64))


class Wrapped(nn.Linear):
    """A subclass (as adapters and quantized layers are): never bypassed."""


@pytest.mark.parametrize(
    "case",
    [
        *("many_rows", "bias", "bf16", "autocast", "subclass", "hook", "pre_hook", "global"),
        *("grad", "small"),
    ],
)
def test_anything_else_is_the_module_call_itself(case, forwards):
    module = (
        Wrapped(256, 1024, bias=False)
        if case == "subclass"
        else layer(bias=case == "bias", out=1023 if case == "small" else 1024)
    )
    h = rows(FEW_ROWS + 1) if case == "many_rows" else rows(1, 1)
    if case == "bf16":
        module, h = module.to(torch.bfloat16), h.to(torch.bfloat16)
    calls: list[str] = []
    handles = []
    stack = contextlib.ExitStack()
    if case == "hook":
        handles.append(module.register_forward_hook(lambda *_: calls.append("hook")))
    if case == "pre_hook":
        handles.append(module.register_forward_pre_hook(lambda *_: calls.append("hook")))
    if case == "global":
        handles.append(
            nn.modules.module.register_module_forward_hook(lambda *_: calls.append("hook"))
        )
    try:
        if case != "grad":  # with gradients: training, whose compiled rows may be symbolic
            stack.enter_context(torch.no_grad())
        if case == "autocast":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out, expected = linear(module, h), module(h)
        else:
            out, expected = linear(module, h), F.linear(h, module.weight, module.bias)
    finally:
        stack.close()
        for handle in handles:
            handle.remove()
    assert torch.equal(out, expected)  # bitwise: the module's own product
    assert forwards[0] is module  # through its forward
    if case in ("hook", "pre_hook", "global"):
        assert calls == ["hook"]


def test_a_decoding_step_takes_the_product_for_its_large_layers(forwards):
    """In a decoding step of a 512-wide decoder, the layers of at least FEW_ROWS_MIN_WEIGHT
    elements skip their module call (queries, output, MLP), the small ones keep it (keys and
    values, 128 x 512), and the greedy tokens equal those of the module calls throughout."""
    from fusion.generation import generate, generate_stream
    from fusion.models import llama3_2

    torch.manual_seed(0)
    decoder = llama3_2(
        vocab_size=64, num_layers=1, num_heads=8, num_kv_heads=2, embed_dim=512,
        max_seq_len=64, intermediate_dim=512,
    ).eval()  # fmt: skip
    assert decoder.layers[0].attn.q_proj.weight.numel() == FEW_ROWS_MIN_WEIGHT
    tokens = torch.tensor([[5, 6, 7]])
    stream = generate_stream(decoder, tokens, max_new_tokens=3, temperature=0)
    next(stream)  # the prefill
    forwards.clear()
    next(stream)  # one step
    stream.close()
    attn = decoder.layers[0].attn
    assert {id(m) for m in forwards} == {id(attn.k_proj), id(attn.v_proj)}
    fast = generate(decoder, tokens, max_new_tokens=6, temperature=0)
    with mock.patch.object(few_rows, "FEW_ROWS", 0):  # every product through its module
        assert torch.equal(generate(decoder, tokens, max_new_tokens=6, temperature=0), fast)
