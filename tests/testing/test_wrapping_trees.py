"""Checkpoint keys of EarlyFusion models inside arbitrary wrapping trees (Hypothesis)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from fusion import EarlyFusion
from fusion.testing import (
    WrappingTree,
    assert_checkpoint_compatible,
    assert_state_dict_round_trip,
    find_prefix,
    module_names,
    wrapping_trees,
)
from helpers import build_tiny_decoder, build_tiny_fusion

trees = st.integers(1, 3).flatmap(lambda n: wrapping_trees(n_models=n, max_depth=4))


@given(tree=trees)
def test_keys_under_any_wrapping(tree):
    models = [build_tiny_fusion(seed=i) for i in range(tree.n_models)]
    root, prefixes = tree.build(models)
    for seed, (model, prefix) in enumerate(zip(models, prefixes, strict=True)):
        assert find_prefix(root, model) == prefix
        assert_checkpoint_compatible(root, model, build_tiny_decoder(seed=seed))
    fresh, _ = tree.build([build_tiny_fusion(seed=100 + i) for i in range(tree.n_models)])
    assert_state_dict_round_trip(root, fresh)


@settings(max_examples=20)
@given(tree=wrapping_trees(n_models=2))
def test_trees_hold_each_model_once_at_its_prefix(tree):
    models = [nn.Linear(1, 1), nn.Linear(1, 1)]
    root, prefixes = tree.build(models)
    assert len(set(prefixes)) == 2
    keys = set(root.state_dict())
    for prefix in prefixes:
        assert {f"{prefix}weight", f"{prefix}bias"} <= keys


@given(name=module_names())
def test_module_names_are_valid_attributes(name):
    holder = nn.Module()
    setattr(holder, name, nn.Linear(1, 1))
    assert f"{name}.weight" in holder.state_dict()


class ModuleReplacingFusion(nn.Module):
    """The design we rejected: the decoder's embedding moves out and Identity takes its place."""

    def __init__(self, decoder):
        super().__init__()
        self.tok_embeddings = decoder.tok_embeddings
        decoder.tok_embeddings = nn.Identity()
        self.decoder = decoder


def test_assertion_catches_module_replacement():
    model = ModuleReplacingFusion(build_tiny_decoder())
    with pytest.raises(AssertionError, match=r"missing \['0.decoder.tok_embeddings.weight'\]"):
        assert_checkpoint_compatible(nn.Sequential(model), model, build_tiny_decoder())


def test_assertion_catches_different_weights():
    model = build_tiny_fusion(seed=0)
    with pytest.raises(AssertionError, match=r"differs from the plain decoder's"):
        assert_checkpoint_compatible(model, model, build_tiny_decoder(seed=1))


def test_find_prefix_rejects_outsiders():
    with pytest.raises(ValueError, match=r"module: expected a submodule of root, got a Linear"):
        find_prefix(nn.Sequential(nn.ReLU()), nn.Linear(1, 1))


def test_tree_build_checks_model_count():
    tree = WrappingTree(("list", [("leaf", 0), ("leaf", 1)]), n_models=2)
    with pytest.raises(ValueError, match=r"models: expected 2 models, got 1"):
        tree.build([build_tiny_fusion()])
    assert isinstance(build_tiny_fusion(), EarlyFusion)


def qwen3_vl_and_plain(seed: int):
    from fusion.models import llama3_2
    from qwen3_helpers import FUSION_TEXT, tiny_qwen3_vl

    return tiny_qwen3_vl(seed=seed), llama3_2(**FUSION_TEXT)


def qwen3_5_and_plain(seed: int):
    from fusion.models import qwen3_5_text
    from qwen3_helpers import QWEN3_5_TEXT, tiny_qwen3_5

    return tiny_qwen3_5(seed=seed), qwen3_5_text(**QWEN3_5_TEXT)


@pytest.mark.parametrize(
    "build", [qwen3_vl_and_plain, qwen3_5_and_plain], ids=["qwen3_vl", "qwen3_5"]
)
@settings(max_examples=10, deadline=None)
@given(tree=wrapping_trees(n_models=1, max_depth=4))
def test_hybrid_and_deepstack_model_keys_under_any_wrapping(build, tree):
    """Qwen3-VL adds its DeepStack rows through the decoder's forward, and Qwen3.5's Gated
    DeltaNet layers keep their state outside the state dict, replacing nothing: each decoder's
    keys stay a plain decoder's (Qwen3's, a standalone Qwen3.5 text stack) under any wrapping
    prefix."""
    model, plain = build(3)
    plain.load_state_dict(model.decoder.state_dict())
    root, (prefix,) = tree.build([model])
    assert find_prefix(root, model) == prefix
    assert_checkpoint_compatible(root, model, plain)
    fresh, _ = tree.build([build(4)[0]])
    assert_state_dict_round_trip(root, fresh)
