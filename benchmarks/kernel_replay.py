"""The compute kernels of a piece of work, logged and then timed alone: how long its matrix
products, convolutions and attention take at their own shapes and layouts, with nothing else
running between them.

``finetune_floor.py`` logs a training step under :class:`KernelLog` and replays the log in a
fresh process with the run's environment (threads, huge pages), so that a step's time can be
split into what its kernels cost alone and everything else (elementwise work, copies, the
allocator, the Python between kernels). A kernel's time alone at its shape is also what a
step decomposed the same way cannot beat: where it is above the arithmetic floor (FLOPs at
the machine's best matrix rate), the shapes, not the glue between them, are why.

    python benchmarks/kernel_replay.py LOG.json --threads 2 --out TIMES.json

The log is JSON data (operator names and tensor shapes); replaying it resolves each name among
``torch.ops.aten``'s operators and runs nothing else.
"""

import argparse
import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

#: The kernels logged: those FlopCounterMode counts, and the CPU flash attention it does not
#: (torch 2.13), which a step on CPU runs for every attention.
KERNELS = {
    *flop_registry,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward,
}


#: The largest tensor a replayed log may ask for (16 GiB).
MAX_TENSOR_BYTES = 2**34


def _spec(value: Any) -> Any:
    """A call argument as JSON data: a tensor by its layout, a sequence item by item."""
    if isinstance(value, torch.Tensor):
        layout = [list(value.shape), list(value.stride()), str(value.dtype).removeprefix("torch.")]
        return {"tensor": layout}
    if isinstance(value, list | tuple):
        return [_spec(item) for item in value]
    if value is None or isinstance(value, bool | int | float):
        return value
    raise TypeError(f"a kernel argument of type {type(value).__name__} cannot be logged")


class KernelLog(TorchDispatchMode):
    """Counts every call of a compute kernel (:data:`KERNELS`) made under it, forward and
    backward, by signature: the operator and its arguments, tensors by shape, stride and
    dtype. ``log.calls`` maps each signature (a JSON string) to its count."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in KERNELS or func.overloadpacket in KERNELS:
            kwargs_spec = {name: _spec(value) for name, value in kwargs.items()}
            call = {"op": func.name(), "args": _spec(args), "kwargs": kwargs_spec}
            self.calls[json.dumps(call, sort_keys=True)] += 1
        return func(*args, **kwargs)


def _operator(name: str) -> Any:
    """``aten::mm`` or ``aten::addmm.out`` as its ``torch.ops.aten`` overload; nothing but
    aten's compute kernels (:data:`KERNELS`) is resolved."""
    namespace, _, rest = name.partition("::")
    packet_name, _, overload = rest.partition(".")
    packet = getattr(torch.ops.aten, packet_name, None) if namespace == "aten" else None
    overload = overload or "default"
    if packet not in KERNELS or overload not in packet.overloads():
        raise ValueError(f"log: expected an aten compute kernel, got {name!r:.80}")
    return getattr(packet, overload)


def _layout(spec: dict) -> tuple[list[int], list[int], torch.dtype, int]:
    """A logged tensor's shape, stride, dtype and the elements its storage spans, refused
    unless well formed and at most :data:`MAX_TENSOR_BYTES`: a log is data, checked before
    anything is allocated."""
    layout = spec.get("tensor")
    if not isinstance(layout, list) or len(layout) != 3:
        raise ValueError(f"log: expected a tensor as [shape, stride, dtype], got {layout!r:.80}")
    shape, stride, dtype_name = layout
    dtype = getattr(torch, dtype_name, None) if isinstance(dtype_name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"log: expected a torch dtype's name, got {dtype_name!r:.40}")
    sizes = (shape, stride)
    if not all(isinstance(x, list) and all(type(n) is int and n >= 0 for n in x) for x in sizes):
        raise ValueError(f"log: expected sizes and strides >= 0, got {shape!r:.60}, {stride!r:.60}")
    if len(shape) != len(stride):
        raise ValueError(f"log: expected a stride per dimension, got {shape!r:.60}, {stride!r:.60}")
    # The storage the layout spans: broadcast (stride 0) and transposed layouts as logged
    span = 0 if 0 in shape else 1 + sum((n - 1) * s for n, s in zip(shape, stride, strict=True))
    if span * dtype.itemsize > MAX_TENSOR_BYTES:
        raise ValueError(
            f"log: a tensor of {span * dtype.itemsize} bytes, above the {MAX_TENSOR_BYTES} allowed"
        )
    return shape, stride, dtype, span


def _built(spec: Any, generator: torch.Generator) -> Any:
    """An argument from its JSON data: a tensor of the logged layout with random values
    (floating point), ones (bool: an all-true mask) or zeros (integers)."""
    if isinstance(spec, dict):
        shape, stride, dtype, span = _layout(spec)
        storage = torch.empty(span, dtype=dtype)
        if dtype.is_floating_point:
            storage.normal_(generator=generator)
        else:
            storage.fill_(dtype == torch.bool)
        return storage.as_strided(shape, stride)
    if isinstance(spec, list):
        return [_built(item, generator) for item in spec]
    return spec


def _call(signature: str) -> dict:
    """A signature's call: an object of the operator's name, its arguments and keywords."""
    try:
        call = json.loads(signature)
    except json.JSONDecodeError:
        call = None
    fields = {"op": str, "args": list, "kwargs": dict}
    if not isinstance(call, dict) or not all(isinstance(call.get(k), t) for k, t in fields.items()):
        raise ValueError(f"log: expected a call as {{op, args, kwargs}}, got {signature!r:.80}")
    return call


def _check_specs(spec: Any) -> None:
    """Every tensor layout in an argument's JSON data checked (:func:`_layout`)."""
    if isinstance(spec, dict):
        _layout(spec)
    elif isinstance(spec, list):
        for item in spec:
            _check_specs(item)


def time_kernels(calls: dict[str, int], repeats: int) -> dict[str, float]:
    """Each logged signature's best time in seconds over ``repeats`` calls after an untimed
    one, on fresh inputs built once per signature (outputs freshly allocated, as the step's
    are). The signatures are :func:`read_log`'s or a :class:`KernelLog`'s."""
    generator = torch.Generator().manual_seed(0)
    best = {}
    for signature in calls:
        call = json.loads(signature)
        op = _operator(call["op"])
        args = _built(call["args"], generator)
        kwargs = {k: _built(v, generator) for k, v in call["kwargs"].items()}
        op(*args, **kwargs)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            op(*args, **kwargs)
            times.append(time.perf_counter() - start)
        best[signature] = min(times)
    return best


def summary(calls: dict[str, int], best: dict[str, float]) -> dict[str, Any]:
    """The log's total time alone, and per operator: calls and seconds."""
    by_op: dict[str, dict[str, float]] = {}
    for signature, count in calls.items():
        entry = by_op.setdefault(json.loads(signature)["op"], {"calls": 0, "seconds": 0.0})
        entry["calls"] += count
        entry["seconds"] += count * best[signature]
    return {"seconds": sum(e["seconds"] for e in by_op.values()), "by_op": by_op}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("log", type=Path, help="a JSON object: signature -> calls (KernelLog.calls)")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--repeats", type=int, default=3, help="timed calls per signature")
    p.add_argument("--out", type=Path, required=True, help="write the timings here as JSON")
    args = p.parse_args(argv)
    if args.threads < 1 or args.repeats < 1:
        p.error(f"--threads and --repeats: expected >= 1, got {args.threads}, {args.repeats}")
    return args


def read_log(path: Path) -> dict[str, int]:
    """A log file, refused before anything runs unless a JSON object of signatures to positive
    call counts, each signature an aten compute kernel's call with well-formed tensor layouts
    of at most :data:`MAX_TENSOR_BYTES`."""
    try:
        calls = json.loads(path.read_text())
    except json.JSONDecodeError:
        calls = None
    if not isinstance(calls, dict) or not all(
        isinstance(k, str) and type(v) is int and v > 0 for k, v in calls.items()
    ):
        raise SystemExit(f"{path}: expected a JSON object of signatures to call counts >= 1")
    try:
        for signature in calls:
            call = _call(signature)
            _operator(call["op"])
            _check_specs([call["args"], list(call["kwargs"].values())])
    except ValueError as error:
        raise SystemExit(f"{path}: {error}") from None
    return calls


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    calls = read_log(args.log)
    torch.set_num_threads(args.threads)
    best = time_kernels(calls, args.repeats)
    report = summary(calls, best) | {"threads": args.threads, "repeats": args.repeats}
    args.out.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
