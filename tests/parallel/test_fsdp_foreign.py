"""FSDP2 over an EarlyFusion holding a Hugging Face Llama, on 2 gloo processes, against the
unsharded model in one process (logits and every gradient)."""

import pytest
import torch

from parallel.conftest import ShardedRuns, run_scenarios
from parallel.foreign_scenarios import BATCH, PLANS, build, train_step
from parallel.sharding_scenarios import TOLERANCE, full_grads


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> ShardedRuns:
    return run_scenarios("parallel.foreign_scenarios", tmp_path_factory.mktemp("foreign"))


@pytest.mark.parametrize("plan", ["per_module", "blocks_root"])
def test_sharded_step_matches_one_process(runs, plan):
    model = build(PLANS[plan])
    expected_logits = train_step(model, slice(None))
    expected_grads = full_grads(model)
    assert all(g.abs().sum() > 0 for g in expected_grads.values())  # every parameter matters
    assert len(runs.ranks) * (BATCH // len(runs.ranks)) == BATCH
    for rank in range(len(runs.ranks)):
        result = runs.result(plan, rank)
        start, stop = result["rows"]
        torch.testing.assert_close(result["logits"], expected_logits[start:stop], **TOLERANCE)
        assert result["grads"].keys() == expected_grads.keys()
        for name, grad in expected_grads.items():
            torch.testing.assert_close(result["grads"][name], grad, **TOLERANCE, msg=name)


def test_decoder_as_its_own_unit_is_refused(runs):
    """The merge embeds before the decoder's forward gathers the decoder's unit."""
    for result in runs.ranks:
        assert not result["decoder_unit"]["ok"]
        assert result["decoder_unit"]["error_type"] == "RuntimeError"
        message = result["decoder_unit"]["message"]
        assert message.startswith("decoder: its input embedding's weight is sharded"), message
        assert "unit of its own" in message and "root unit" in message
