"""fusion.testing over EarlyFusion models that hold a Hugging Face Llama or a torchtune-style
decoder: random wrapping trees, under DDP, torch.compile or FSDP2 on top (Hypothesis)."""

import pytest
import torch
import torch.distributed as dist
from foreign_decoders import fuse, hf_llama, torchtune_style
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from fusion.testing import (
    WrappingTree,
    assert_checkpoint_compatible,
    assert_state_dict_round_trip,
    find_prefix,
    wrapping_trees,
)

BUILDERS = {"huggingface": hf_llama, "torchtune": torchtune_style}
WRAPPERS = ["none", "ddp", "compile", "fsdp2"]


@pytest.fixture(scope="module")
def process_group(tmp_path_factory):
    """A one-process gloo group, for DDP and FSDP2 on CPU."""
    store = tmp_path_factory.mktemp("dist") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def wrap(root, models, wrapper: str):
    """The tree under one of PyTorch's wrappers, and the prefix that wrapper adds."""
    if wrapper == "ddp":
        return DistributedDataParallel(root), "module."
    if wrapper == "compile":
        return torch.compile(root), "_orig_mod."
    if wrapper == "fsdp2":
        for model in models:  # sharded models inside the tree; no key changes
            fully_shard(model)
    return root, ""


@settings(max_examples=5, deadline=None)  # builds models; each wrapper at least once:
@example(tree=WrappingTree(("leaf", 0), 1), kind="huggingface", wrapper="ddp")
@example(
    tree=WrappingTree(("list", [("leaf", 0), ("leaf", 1)]), 2), kind="torchtune", wrapper="compile"
)
@example(
    tree=WrappingTree(("custom", {"module": ("leaf", 0)}), 1), kind="huggingface", wrapper="fsdp2"
)
@example(
    tree=WrappingTree(("sequential", [("list", []), ("leaf", 0)]), 1),
    kind="torchtune",
    wrapper="fsdp2",
)
@given(
    tree=st.integers(1, 2).flatmap(lambda n: wrapping_trees(n_models=n, max_depth=3)),
    kind=st.sampled_from(sorted(BUILDERS)),
    wrapper=st.sampled_from(WRAPPERS),
)
def test_keys_under_any_wrapping(process_group, tree, kind, wrapper):
    build = BUILDERS[kind]
    models = [fuse(build(seed=i)) for i in range(tree.n_models)]
    root, prefixes = tree.build(models)
    root, outer = wrap(root, models, wrapper)
    for seed, (model, prefix) in enumerate(zip(models, prefixes, strict=True)):
        assert model.decoder_kind == kind
        assert find_prefix(root, model) == outer + prefix
        assert_checkpoint_compatible(root, model, build(seed=seed))
    if wrapper != "fsdp2":  # torch.save of DTensors is not a plain round trip
        fresh_models = [fuse(build(seed=100 + i)) for i in range(tree.n_models)]
        fresh, _ = tree.build(fresh_models)
        assert_state_dict_round_trip(root, wrap(fresh, fresh_models, wrapper)[0])


def test_a_different_decoder_is_caught(process_group):
    model = fuse(hf_llama(seed=0))
    with pytest.raises(AssertionError, match=r"differs from the plain decoder's"):
        assert_checkpoint_compatible(model, model, hf_llama(seed=1))
    fully_shard(model)
    with pytest.raises(AssertionError, match=r"differs from the plain decoder's"):
        assert_checkpoint_compatible(model, model, hf_llama(seed=1))
    assert_checkpoint_compatible(model, model, hf_llama(seed=0))
