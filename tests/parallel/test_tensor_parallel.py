"""Tensor parallelism with ``fusion.parallel.apply_tp`` (the Llama plan through DTensor's
``parallelize_module``) on 2 gloo processes, against the unsharded model in one process."""

from fnmatch import fnmatch

import pytest
from torch import nn

from fusion.parallel import apply_tp, llama_tp_plan
from helpers import build_tiny_decoder
from parallel.sharding_scenarios import CASES, assert_matches_one_process

TP_CASES = [c for c in CASES if c.plan in ("tp", "fsdp_tp")]


@pytest.mark.parametrize("case", TP_CASES, ids=lambda c: c.name)
def test_tensor_parallel_step_matches_one_process(sharded_runs, case):
    # Both tensor-parallel ranks see the whole batch and hold the full gradients once gathered.
    assert_matches_one_process(sharded_runs, case)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("tp-refused-tied", "tie_word_embeddings=False"),
        ("tp-refused-heads", "2 ranks splits attention heads evenly, but layer 0 has "),
        ("tp-refused-wrapped", "'tok_embeddings', which must name nn.Linear or nn.Embedding"),
        ("tp-refused-caches", "call teardown_caches()"),
    ],
)
def test_unsupported_models_are_refused_before_sharding(sharded_runs, name, expected):
    for rank in range(len(sharded_runs.ranks)):
        result = sharded_runs.result(name, rank)
        assert result["error_type"] == "ValueError"
        assert expected in result["message"], result["message"]
        assert not result["changed"]


def test_plan_covers_every_linear_and_the_embedding():
    decoder = build_tiny_decoder(tie_word_embeddings=False)
    plan = llama_tp_plan(decoder)
    names = [name for name, m in decoder.named_modules() if isinstance(m, nn.Linear | nn.Embedding)]
    matched = {name for name in names if any(fnmatch(name, key) for key in plan)}
    assert matched == set(names)
    assert all(any(fnmatch(name, key) for name in names) for key in plan)  # no stale key


def test_tied_plan_is_refused():
    with pytest.raises(ValueError, match="decoder: tensor parallelism needs an untied output"):
        llama_tp_plan(build_tiny_decoder(tie_word_embeddings=True))


def test_bad_arguments_are_refused():
    with pytest.raises(TypeError, match="model: expected a TransformerDecoder"):
        apply_tp(nn.Linear(2, 2), None)
    decoder = build_tiny_decoder(tie_word_embeddings=False)
    with pytest.raises(TypeError, match="mesh: expected a DeviceMesh, got NoneType"):
        apply_tp(decoder, None)
    assert all(type(p) is nn.Parameter for p in decoder.parameters())
    assert decoder.layers[0].attn.num_heads == 4
