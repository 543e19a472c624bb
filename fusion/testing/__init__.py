"""Public testing helpers: Hypothesis strategies and assertions for fusion models."""

from fusion.testing.assertions import (
    assert_checkpoint_compatible,
    assert_state_dict_round_trip,
    find_prefix,
)
from fusion.testing.inputs import (
    EncoderSpec,
    FusionInputs,
    encoder_specs,
    fusion_inputs,
    tensors,
)
from fusion.testing.properties import (
    assert_outputs_survive_wrapping,
    assert_padded_matches_packed,
    assert_rows_at_placeholders,
    assert_samples_independent,
    assert_text_only_matches_decoder,
    check_all,
)
from fusion.testing.strategies import (
    MergeCase,
    WrappingTree,
    merge_inputs,
    module_names,
    wrapping_trees,
)

__all__ = [
    "EncoderSpec",
    "FusionInputs",
    "MergeCase",
    "WrappingTree",
    "assert_checkpoint_compatible",
    "assert_outputs_survive_wrapping",
    "assert_padded_matches_packed",
    "assert_rows_at_placeholders",
    "assert_samples_independent",
    "assert_state_dict_round_trip",
    "assert_text_only_matches_decoder",
    "check_all",
    "encoder_specs",
    "find_prefix",
    "fusion_inputs",
    "merge_inputs",
    "module_names",
    "tensors",
    "wrapping_trees",
]
