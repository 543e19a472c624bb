"""The eager decoding step's overhead, counted deterministically (no timing): the ATen ops it
issues and the values it reads on the host, per step, through ``torch.profiler``. The bounds
are the counts measured when the step was trimmed (2026-12-03, torch 2.13: the rotary table
looked up once per layer, no per-step value checks of what the loop itself made); each fails
if that overhead comes back."""

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from fusion.generation import generate_stream, left_pad
from helpers import build_tiny_decoder

STEPS = 4


def step_counts(decoder: torch.nn.Module, tokens: torch.Tensor, **kwargs) -> tuple[float, float]:
    """Per decoding step of ``decoder`` on ``tokens``: (top-level ATen ops, host reads), over
    ``STEPS`` steps after the prefill and a first step (each ``next`` after the first runs one
    step)."""
    stream = generate_stream(decoder, tokens, max_new_tokens=STEPS + 2, temperature=0, **kwargs)
    next(stream), next(stream)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(STEPS):
            next(stream)
    stream.close()
    ops = reads = 0
    for event in prof.events():
        if not event.name.startswith("aten::"):
            continue
        reads += event.name == "aten::_local_scalar_dense"  # item(), bool(), int()
        parent = event.cpu_parent
        while parent is not None and not parent.name.startswith("aten::"):
            parent = parent.cpu_parent
        ops += parent is None  # issued by Python, not inside another op
    return ops / STEPS, reads / STEPS


# Measured 145 and 144 on this 2-layer decoder (2026-12-03), against 220 and 218 ops and 4.75
# host reads before the trim; the rotary embeddings' old per-call lookup alone would add 50.
# (Its layers are below few_rows.FEW_ROWS_MIN_WEIGHT: F.linear, one op each.)
@pytest.mark.parametrize(("batch", "most_ops"), [(1, 145), (2, 144)])
@pytest.mark.parametrize("stop_tokens", [(), (1,)])
def test_an_eager_cpu_step_issues_few_ops_and_reads_the_host_once(batch, most_ops, stop_tokens):
    decoder = build_tiny_decoder().eval()
    tokens = left_pad([[5, 6, 7], [2, 3, 4]][:batch], pad_id=0)
    ops, reads = step_counts(decoder, tokens, stop_tokens=stop_tokens)
    assert ops <= most_ops
    # The one read: the cache's fill level, to attend to the filled slots only (free on the
    # CPU). The stop check reads once every stop_check_interval (8) steps: not in these four.
    assert reads == 1


def test_the_steps_trust_only_their_own_inputs():
    """The decoder skips its value checks only inside the loop's steps: before, after and
    between generations every call is checked, the prefill's prompts included."""
    decoder = build_tiny_decoder().eval()
    tokens = left_pad([[5, 6, 7]], pad_id=0)
    assert not decoder._inputs_checked_by_caller
    stream = generate_stream(decoder, tokens, max_new_tokens=3, temperature=0)
    next(stream)
    assert not decoder._inputs_checked_by_caller  # set for a step's call only
    list(stream)
    assert not decoder._inputs_checked_by_caller
    with pytest.raises(ValueError, match=r"tokens: expected values in \[0, 64\)"):
        decoder(torch.tensor([[5, 64]]))
