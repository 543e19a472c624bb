"""A distributed checkpoint (DCP) saved under the per-module FSDP2 plan on 2 processes loads
under tensor parallelism and in one process without a process group, with the plain model's
keys and bitwise the saved values."""

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from helpers import build_tiny_decoder
from parallel.sharding_scenarios import CHECKPOINT, LOAD, SAVE, TOLERANCE, Case, build, reference


def test_checkpoint_has_the_plain_keys(sharded_runs):
    sharded_runs.result(SAVE, 0)
    metadata = FileSystemReader(sharded_runs.out_dir / CHECKPOINT).read_metadata()
    keys = set(metadata.state_dict_metadata)
    assert keys == set(build("fusion", tied=False).state_dict())
    plain = build_tiny_decoder(tie_word_embeddings=False).state_dict()
    assert {k for k in keys if k.startswith("decoder.")} == {f"decoder.{k}" for k in plain}


def test_loads_under_tensor_parallelism(sharded_runs):
    saved = build("fusion", tied=False).state_dict()
    expected_logits, _ = reference(Case("tp", "fusion", tied=False, images=False))
    for rank in range(len(sharded_runs.ranks)):
        result = sharded_runs.result(LOAD, rank)
        assert result["state"].keys() == saved.keys()
        for key, value in saved.items():
            assert torch.equal(result["state"][key], value), key
        torch.testing.assert_close(result["logits"], expected_logits, **TOLERANCE)


def test_loads_in_one_process(sharded_runs):
    sharded_runs.result(SAVE, 0)
    path = sharded_runs.out_dir / CHECKPOINT
    saved = build("fusion", tied=False).state_dict()

    model = build("fusion", tied=False, seed=7)
    state = model.state_dict()
    dcp.load(state, checkpoint_id=path, no_dist=True)
    model.load_state_dict(state, strict=True)
    for key, value in model.state_dict().items():
        assert torch.equal(value, saved[key]), key

    decoder = build_tiny_decoder(tie_word_embeddings=False, seed=7)
    state = {f"decoder.{k}": v for k, v in decoder.state_dict().items()}
    dcp.load(state, checkpoint_id=path, no_dist=True)
    decoder.load_state_dict({k.removeprefix("decoder."): v for k, v in state.items()})
    for key, value in decoder.state_dict().items():
        assert torch.equal(value, saved[f"decoder.{key}"]), key
