"""The strategies refuse bad arguments when they are built, naming the argument."""

import pytest
import torch

from fusion.testing import merge_inputs, wrapping_trees


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_batch": 0}, r"max_batch: expected an integer >= 1, got 0"),
        ({"max_batch": 2.0}, r"max_batch: expected an integer >= 1, got 2.0"),
        ({"max_seq_len": -1}, r"max_seq_len: expected an integer >= 0"),
        ({"max_encoders": True}, r"max_encoders: expected an integer >= 1, got True"),
        ({"vocab_size": 3, "max_encoders": 3}, r"vocab_size: expected more than max_encoders=3"),
        ({"dims": ()}, r"dims: expected positive integers, got \(\)"),
        ({"dims": (4, 0)}, r"dims: expected positive integers"),
        ({"dtypes": (torch.int64,)}, r"dtypes: expected floating torch dtypes"),
        ({"dtypes": ("float32",)}, r"dtypes: expected floating torch dtypes"),
    ],
)
def test_merge_inputs_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        merge_inputs(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"n_models": 0}, r"expected n_models >= 1"),
        ({"n_models": 2, "max_depth": 0}, r"room for a container around several models"),
        ({"n_models": "2"}, r"n_models: expected an integer, got '2'"),
        ({"max_depth": 1.5}, r"max_depth: expected an integer, got 1.5"),
    ],
)
def test_wrapping_trees_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        wrapping_trees(**kwargs)
