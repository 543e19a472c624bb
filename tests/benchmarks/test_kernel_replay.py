"""``benchmarks/kernel_replay.py``: a step's compute kernels logged by signature (operator,
shapes, strides, dtypes), and the log replayed alone in a fresh process."""

import json

import pytest
import torch
import torch.nn.functional as F

from bench_helpers import load_script, run_script

replay = load_script("kernel_replay")


def logged_step() -> dict[str, int]:
    """A linear layer's forward and backward and an attention's, under the log."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 32)
    x = torch.randn(10, 64, requires_grad=True)
    q, k, v = (torch.randn(1, 2, 8, 4, requires_grad=True) for _ in range(3))
    with replay.KernelLog() as log:
        y = layer(x)
        a = F.scaled_dot_product_attention(q, k, v)
        (y.square().sum() + a.sum()).backward()
        layer(x)  # the same forward again: the same signature, counted twice
    return dict(log.calls)


def test_the_log_counts_each_kernel_by_signature_and_nothing_else():
    calls = logged_step()
    by_op: dict[str, int] = {}
    for signature, count in calls.items():
        op = json.loads(signature)["op"]
        by_op[op] = by_op.get(op, 0) + count
    # Forward addmm twice; the backward's two matrix products (input and weight gradients);
    # no elementwise work (square, sum, the bias gradient's sum) is a compute kernel.
    assert by_op == {
        "aten::addmm": 2,
        "aten::mm": 2,
        "aten::_scaled_dot_product_flash_attention_for_cpu": 1,
        "aten::_scaled_dot_product_flash_attention_for_cpu_backward": 1,
    }
    forward = [json.loads(s) for s, n in calls.items() if n == 2]
    _, x, weight_t = forward[0]["args"]
    assert x["tensor"] == [[10, 64], [64, 1], "float32"]
    assert weight_t["tensor"] == [[64, 32], [1, 64], "float32"]  # the weight, transposed


def test_replay_builds_each_logged_layout():
    generator = torch.Generator().manual_seed(0)
    for shape, stride in [((3, 4), (1, 3)), ((2, 5), (0, 1)), ((0, 7), (7, 1)), ((), ())]:
        spec = {"tensor": [list(shape), list(stride), "float32"]}
        tensor = replay._built(spec, generator)
        assert tensor.shape == shape and tensor.stride() == stride
        assert bool(tensor.isfinite().all())
    mask = replay._built({"tensor": [[2, 3], [3, 1], "bool"]}, generator)
    assert mask.dtype == torch.bool and bool(mask.all())  # an all-true mask: no empty rows
    ints = replay._built({"tensor": [[4], [1], "int64"]}, generator)
    assert ints.dtype == torch.int64 and not bool(ints.any())


@pytest.mark.parametrize(
    ("layout", "message"),
    [
        ([[4], [1], "load"], "expected a torch dtype's name, got 'load'"),
        ([[4], [1], 7], "expected a torch dtype's name, got 7"),
        ([[4], [1]], r"expected a tensor as \[shape, stride, dtype\]"),
        ("[4]", r"expected a tensor as \[shape, stride, dtype\]"),
        ([[-1], [1], "float32"], "expected sizes and strides >= 0"),
        ([[4], [1.5], "float32"], "expected sizes and strides >= 0"),
        ([[4, 2], [1], "float32"], "expected a stride per dimension"),
        ([[2**20, 2**20], [2**20, 1], "float32"], "a tensor of 4398046511104 bytes, above"),
    ],
)
def test_replay_refuses_a_malformed_or_oversized_tensor_before_allocating(layout, message):
    with pytest.raises(ValueError, match=f"log: {message}"):
        replay._built({"tensor": layout}, torch.Generator())


@pytest.mark.parametrize(
    "signature",
    ["not json", "[]", '{"op": "aten::mm", "args": []}', '{"op": 1, "args": [], "kwargs": {}}'],
)
def test_replay_refuses_a_call_that_is_not_op_args_kwargs(signature, tmp_path):
    path = tmp_path / "log.json"
    path.write_text(json.dumps({signature: 1}))
    with pytest.raises(SystemExit, match=r"log: expected a call as \{op, args, kwargs\}, got"):
        replay.read_log(path)


def test_replay_refuses_a_whole_log_before_timing_any_of_it(tmp_path):
    """A log whose last call asks for an oversized tensor, or names something other than a
    compute kernel, is refused by read_log: nothing is timed."""
    calls = logged_step()
    path = tmp_path / "log.json"
    for bad in (
        {
            "op": "aten::mm",
            "args": [{"tensor": [[2**30, 2**30], [2**30, 1], "float32"]}],
            "kwargs": {},
        },
        {"op": "aten::add.Tensor", "args": [], "kwargs": {}},
        {"op": "aten::mm", "args": [], "kwargs": {"out": {"tensor": [[2], [1], "eval"]}}},
    ):
        path.write_text(json.dumps(calls | {json.dumps(bad): 1}))
        with pytest.raises(SystemExit, match=f"{path}: log: expected|{path}: log: a tensor of"):
            replay.read_log(path)
    path.write_text(json.dumps(calls))
    assert replay.read_log(path) == calls


def test_replay_times_every_signature_and_sums_them():
    calls = logged_step()
    best = replay.time_kernels(calls, repeats=2)
    assert set(best) == set(calls) and all(t > 0 for t in best.values())
    report = replay.summary(calls, best)
    assert report["seconds"] == pytest.approx(sum(calls[s] * best[s] for s in calls))
    assert report["by_op"]["aten::addmm"]["calls"] == 2


@pytest.mark.parametrize(
    "name", ["aten::add", "aten::mm.no_such_overload", "os::system", "aten::no_such_op", "mm"]
)
def test_replay_resolves_nothing_but_aten_compute_kernels(name):
    assert replay._operator("aten::mm.out") is torch.ops.aten.mm.out
    with pytest.raises(ValueError, match="log: expected an aten compute kernel, got"):
        replay._operator(name)


@pytest.mark.parametrize(
    "content", ["not json", "[]", '{"x": 0}', '{"x": true}', '{"x": 1.5}', '{"x": "1"}']
)
def test_replay_refuses_a_log_that_is_not_signatures_to_counts(tmp_path, content):
    path = tmp_path / "log.json"
    path.write_text(content)
    with pytest.raises(SystemExit, match="expected a JSON object of signatures to call counts"):
        replay.read_log(path)


def test_replay_end_to_end(tmp_path):
    log, out = tmp_path / "log.json", tmp_path / "times.json"
    log.write_text(json.dumps(logged_step()))
    run_script("kernel_replay.py", str(log), "--threads", "1", "--repeats", "1", "--out", str(out))
    report = json.loads(out.read_text())
    assert report["threads"] == 1 and report["repeats"] == 1
    assert report["seconds"] == pytest.approx(sum(e["seconds"] for e in report["by_op"].values()))
    assert report["by_op"]["aten::mm"]["calls"] == 2
