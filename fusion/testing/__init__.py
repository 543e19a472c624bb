"""Public testing helpers: Hypothesis strategies and assertions for fusion models."""

from fusion.testing.assertions import (
    assert_checkpoint_compatible,
    assert_state_dict_round_trip,
    find_prefix,
)
from fusion.testing.strategies import (
    MergeCase,
    WrappingTree,
    merge_inputs,
    module_names,
    wrapping_trees,
)

__all__ = [
    "MergeCase",
    "WrappingTree",
    "assert_checkpoint_compatible",
    "assert_state_dict_round_trip",
    "find_prefix",
    "merge_inputs",
    "module_names",
    "wrapping_trees",
]
