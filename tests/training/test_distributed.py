"""Process setup in one process (the 2-process runs are the recipes' tests:
``tests/recipes/captioner/test_distributed.py``)."""

import pytest
import torch

from fusion.training import TrainingError, init_runtime, resolve_device, shutdown, wrap_model
from helpers import build_tiny_decoder

TORCHRUN = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


def test_one_process_without_torchrun(monkeypatch):
    for name in TORCHRUN:
        monkeypatch.delenv(name, raising=False)
    runtime = init_runtime("cpu")
    assert (runtime.rank, runtime.world_size, runtime.distributed) == (0, 1, False)
    assert runtime.is_main and runtime.device == torch.device("cpu")
    model = build_tiny_decoder()
    assert wrap_model(model, runtime, "fsdp") is model  # one process: the model itself
    shutdown(runtime)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            {"WORLD_SIZE": "two"},
            "environment variable WORLD_SIZE: expected an integer >= 1, got 'two'",
        ),
        ({"RANK": "-1"}, "environment variable RANK: expected an integer >= 0, got '-1'"),
        ({"RANK": "2"}, "environment variable RANK: expected < WORLD_SIZE=2, got 2"),
    ],
)
def test_malformed_torchrun_environment(env, message, monkeypatch):
    for name, value in ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"} | env).items():
        monkeypatch.setenv(name, value)
    with pytest.raises(TrainingError) as error:
        init_runtime("cpu")
    assert str(error.value).startswith(message)


def test_devices():
    assert resolve_device("cpu", 3) == torch.device("cpu")
    with pytest.raises(
        TrainingError, match="--device: expected 'auto', 'cpu' or 'cuda', got 'tpu'"
    ):
        resolve_device("tpu", 0)
    if not torch.cuda.is_available():
        assert resolve_device("auto", 0) == torch.device("cpu")
        with pytest.raises(TrainingError, match="'cuda' requested, but torch sees no CUDA device"):
            resolve_device("cuda", 0)


def test_wrap_model_names_a_bad_parallel_mode(monkeypatch):
    for name in TORCHRUN:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match=r"parallel: expected one of \['ddp', 'fsdp'\], got 'tp'"):
        wrap_model(build_tiny_decoder(), init_runtime("cpu"), "tp")
