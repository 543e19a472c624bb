"""fusion.chunked_token_loss and fusion.fused_token_loss over the hidden states of sharded
models (FSDP2, DDP, tensor parallelism; the fused loss: FSDP2 with the output in the root
unit, tensor parallelism) on 2 gloo processes, against the full-logits step in one process
(loss and every gradient), and the plans they cannot run under refused by name."""

import pytest
import torch

from parallel.chunked_loss_scenarios import (
    CASES,
    DEFERRED_REFUSED,
    FUSED_REFUSED,
    REFUSED,
    reference,
)
from parallel.conftest import run_scenarios
from parallel.sharding_scenarios import TOLERANCE


@pytest.fixture(scope="module")
def chunked_runs(tmp_path_factory):
    return run_scenarios("parallel.chunked_loss_scenarios", tmp_path_factory.mktemp("chunked"))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_sharded_step_matches_the_full_logits_step(chunked_runs, case):
    # The ranks' micro-batches need different numbers of chunks (starved: rank 1 has no
    # target, and its loss calls still make FSDP's collectives).
    total, count, expected_grads = reference(case)
    assert all(g.abs().sum() > 0 for g in expected_grads.values())
    sums, counts = [], []
    for rank in range(len(chunked_runs.ranks)):
        result = chunked_runs.result(case.name, rank)
        sums.append(result["sum"])
        counts.append(int(result["count"]))
        assert result["grads"].keys() == expected_grads.keys()
        for name, grad in expected_grads.items():
            torch.testing.assert_close(result["grads"][name], grad, **TOLERANCE, msg=name)
    if case.data_parallel:  # each rank its samples: the sums add up
        torch.testing.assert_close(sum(sums), total, **TOLERANCE)
        assert sum(counts) == int(count)
    else:  # every rank the whole batch
        for rank_sum, rank_count in zip(sums, counts, strict=True):
            torch.testing.assert_close(rank_sum, total, **TOLERANCE)
            assert rank_count == int(count)
    if case.starved:
        assert counts[1] == 0 and float(sums[1]) == 0


@pytest.mark.parametrize("case", REFUSED, ids=lambda c: c.name)
def test_outputs_resharded_with_the_root_are_refused_by_name(chunked_runs, case):
    for result in chunked_runs.ranks:
        outcome = result[case.name]
        assert not outcome["ok"]
        assert outcome["error_type"] == "RuntimeError"
        message = outcome["message"]
        assert message.startswith("unembed: the output projection failed on sharded"), message
        assert "set_reshard_after_forward(False, recurse=False)" in message


@pytest.mark.parametrize(
    ("case", "message"),
    # The output its own FSDP2 unit: a reduce-scatter per chunk in the forward
    [(case, "unembed: the output layer is its own FSDP2 unit") for case in FUSED_REFUSED]
    # The deferred gradient of a sharded output parameter
    + [(case, "defer_output_grad: expected an output whose") for case in DEFERRED_REFUSED],
    ids=lambda value: value.name if hasattr(value, "name") else "",
)
def test_the_fused_loss_refuses_what_it_cannot_run_by_name(chunked_runs, case, message):
    for result in chunked_runs.ranks:
        outcome = result[case.name]
        assert not outcome["ok"] and outcome["error_type"] == "ValueError"
        assert outcome["message"].startswith(message)
