"""The FLA backend of the packed gated delta rule, without a GPU or FLA: the backend choice,
and the packed layer through the "fla" path with a fake ``fla`` whose kernel follows FLA's
documented contract (varlen ``cu_seqlens``, batch 1, in-kernel q/k L2 norm, ``scale``,
grouped values) by running our recurrent reference per sequence. Its outputs and gradients
equal the torch path's: the arguments we pass FLA describe the same computation."""

import itertools
import sys
import types

import pytest
import torch

from fusion.decoder import (
    GatedDeltaNet,
    PackedSegments,
    SampleRegions,
    delta_rule_backend,
    delta_rule_fla,
)
from fusion.decoder.delta_rule import recurrent_gated_delta_rule

CALLS: list[dict] = []


def fake_chunk_gated_delta_rule(
    q,
    k,
    v,
    g,
    beta,
    scale=None,
    initial_state=None,
    output_final_state=False,
    use_qk_l2norm_in_kernel=False,
    cu_seqlens=None,
    cu_seqlens_cpu=None,
):
    """FLA's contract, for the arguments the layer may pass: q, k [1, T, H, K], v [1, T, HV, V]
    (HV a multiple of H, value head i on key head i // (HV // H)), g, beta [1, T, HV], a
    zero state at each ``cu_seqlens`` start. Only the in-kernel L2 norm with the default scale
    is implemented (what our recurrence computes); anything else fails the test."""
    CALLS.append({"cu_seqlens": cu_seqlens, "cu_seqlens_cpu": cu_seqlens_cpu, "T": q.shape[1]})
    assert q.shape[0] == 1 and cu_seqlens is not None, "varlen: batch 1 with cu_seqlens"
    assert cu_seqlens.dtype == torch.int64 and cu_seqlens.device == q.device
    assert torch.equal(cu_seqlens.cpu(), cu_seqlens_cpu) and cu_seqlens_cpu.device.type == "cpu"
    assert int(cu_seqlens[0]) == 0 and int(cu_seqlens[-1]) == q.shape[1]
    assert bool((cu_seqlens[1:] > cu_seqlens[:-1]).all())
    assert use_qk_l2norm_in_kernel is True and scale == q.shape[-1] ** -0.5
    assert initial_state is None and output_final_state is False
    assert k.shape == q.shape and v.shape[2] % q.shape[2] == 0
    heads, dk, dv = v.shape[2], q.shape[3], v.shape[3]
    bounds = cu_seqlens_cpu.tolist()
    outs = []
    for start, end in itertools.pairwise(bounds):
        piece = (x[:, start:end] for x in (q, k, v, g, beta))
        state = q.new_zeros(1, heads, dk, dv, dtype=torch.float64)
        outs.append(recurrent_gated_delta_rule(*piece, state.to(v.dtype))[0])
    return torch.cat(outs, dim=1), None


@pytest.fixture
def fake_fla(monkeypatch):
    """A fake ``fla`` package in ``sys.modules`` (and found by ``find_spec``)."""
    modules = {name: types.ModuleType(name) for name in ("fla", "fla.ops")}
    ops = types.ModuleType("fla.ops.gated_delta_rule")
    ops.chunk_gated_delta_rule = fake_chunk_gated_delta_rule  # type: ignore[attr-defined]
    modules["fla.ops.gated_delta_rule"] = ops
    for name, module in modules.items():
        module.__spec__ = None  # find_spec of a module in sys.modules without a spec raises
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(delta_rule_fla, "fla_installed", lambda: True)
    CALLS.clear()
    return ops


@pytest.fixture
def no_env(monkeypatch):
    monkeypatch.delenv(delta_rule_fla.BACKEND_ENV, raising=False)


def test_backend_is_torch_on_the_cpu_and_without_fla(no_env, monkeypatch):
    assert delta_rule_backend("cpu") == "torch"
    monkeypatch.setattr(delta_rule_fla, "fla_installed", lambda: False)
    assert delta_rule_backend("cuda") == "torch"
    assert delta_rule_backend(torch.device("meta")) == "torch"


def test_backend_is_fla_on_cuda_with_fla_unless_forced(no_env, monkeypatch):
    monkeypatch.setattr(delta_rule_fla, "fla_installed", lambda: True)
    assert delta_rule_backend("cuda") == "fla"
    assert delta_rule_backend("cuda:1", "auto") == "fla"
    assert delta_rule_backend("cpu") == "torch"
    assert delta_rule_backend("cuda", "torch") == "torch"
    assert delta_rule_backend("cpu", "fla") == "fla"  # forced: it runs (or raises) there
    monkeypatch.setenv(delta_rule_fla.BACKEND_ENV, "torch")
    assert delta_rule_backend("cuda") == "torch"
    assert delta_rule_backend("cuda", "fla") == "fla"  # the argument before the environment
    monkeypatch.setenv(delta_rule_fla.BACKEND_ENV, "")
    assert delta_rule_backend("cuda") == "fla"


def test_backend_refuses_unknown_names(no_env, monkeypatch):
    with pytest.raises(ValueError, match="delta_rule_backend: expected one of auto, torch, fla"):
        delta_rule_backend("cpu", "triton")
    with pytest.raises(ValueError, match="delta_rule_backend"):
        GatedDeltaNet(16, 2, 2, 4, 4, 4, delta_rule_backend="flash")
    monkeypatch.setenv(delta_rule_fla.BACKEND_ENV, "FLA")
    with pytest.raises(ValueError, match=delta_rule_fla.BACKEND_ENV):
        delta_rule_backend("cpu")


def test_forced_fla_without_fla_raises(no_env, monkeypatch):
    """No silent fallback: a forced FLA that cannot be imported fails the call."""
    monkeypatch.setitem(sys.modules, "fla", None)  # import fla raises ImportError
    layer = GatedDeltaNet(16, 2, 2, 4, 4, 4, chunk_size=8, delta_rule_backend="fla")
    mask = layer.token_layout(PackedSegments.from_lengths([[3, 5]], 8), None)
    with pytest.raises(ImportError):
        layer(torch.randn(1, 8, 16), mask=mask)


def test_bounds_mark_every_region_and_row():
    # kernel 4, chunk 8: row 0's regions [0, 8) (3 + 3 = 6 -> 8) and [8, 24) (3 + 9 -> 16),
    # row 1's one region [24, 32) then its trailing zero chunks, to 48.
    regions = SampleRegions([[3, 9], [5, 7]], [0, 7], chunk_size=8, kernel=4)
    assert regions.relaid_len == 24
    assert regions.bounds == (0, 8, 24, 48)
    assert regions.cu_seqlens_on(torch.device("cpu")).tolist() == list(regions.bounds)


# Layouts (rows, seq_len) for kernel 4, chunk 8: samples shorter than the kernel, shorter than
# a chunk, filling their region exactly (5 = 8 - 3) or ending on a chunk boundary, and
# trailing padding segments.
LAYOUTS = [
    ([[2, 1, 5]], 8),
    ([[13, 5], [8, 8, 2]], 18),
    ([[5, 13], [3]], 20),
    ([[16, 3], [1, 2], [21]], 21),
]


def layer_and_inputs(k_heads, v_heads, seed=0):
    torch.manual_seed(seed)
    layer = GatedDeltaNet(24, k_heads, v_heads, 8, 6, 4, chunk_size=8).double()
    with torch.no_grad():  # the zero-initialised parts random too, so every path matters
        layer.conv1d.weight.normal_(0, 0.5)
        layer.norm.scale.uniform_(0.5, 1.5)
    return layer


@pytest.mark.parametrize("heads", [(2, 2), (1, 3)], ids=["mha", "grouped"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_fla_path_equals_the_torch_path(fake_fla, no_env, layout, heads):
    rows, seq_len = layout
    layer = layer_and_inputs(*heads)
    segments = PackedSegments.from_lengths(rows, seq_len)
    mask = layer.token_layout(segments, None)
    x = torch.randn(len(rows), seq_len, 24, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(len(rows), seq_len, 24, dtype=torch.float64)
    results = {}
    for backend in ("torch", "fla"):
        layer.delta_rule_backend = backend
        out = layer(x, mask=mask)
        params = [x, *layer.parameters()]
        results[backend] = [out, *torch.autograd.grad(out, params, grad)]
    assert len(CALLS) == 1  # the torch path did not call the fake
    assert CALLS[0]["T"] == len(rows) * mask.relaid_len
    assert CALLS[0]["cu_seqlens_cpu"].tolist() == list(mask.bounds)
    names = ["out", "x", *dict(layer.named_parameters())]
    for name, a, b in zip(names, *results.values(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=name)


def test_auto_keeps_torch_on_the_cpu_with_fla_installed(fake_fla, no_env):
    layer = layer_and_inputs(2, 2)
    mask = layer.token_layout(PackedSegments.from_lengths([[3, 5]], 8), None)
    layer(torch.randn(1, 8, 24, dtype=torch.float64), mask=mask)
    assert CALLS == []


def test_only_the_packed_path_uses_fla(fake_fla, no_env):
    """Padded batches and decoding keep the torch kernels, even with FLA forced."""
    layer = layer_and_inputs(2, 2)
    layer.delta_rule_backend = "fla"
    x = torch.randn(2, 5, 24, dtype=torch.float64)
    layer(x, mask=None)
    layer.setup_state(2, torch.float64, torch.device("cpu"))
    layer(x, mask=None)
    layer(x[:, :1], mask=None)
    assert CALLS == []
