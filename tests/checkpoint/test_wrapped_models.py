"""Checkpoints of fusion models as users hold them: an ``EarlyFusion`` rather than its
decoder, behind ``torch.compile``, DDP, ``DataParallel`` or a container of their own."""

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DataParallel, DistributedDataParallel

from fusion.checkpoint import (
    decoder_state_dict,
    load_hf_llama,
    load_state_dict,
    save_hf_llama,
    save_state_dict,
    select_prefix,
)
from fusion.testing import wrapping_trees
from helpers import build_tiny_decoder, build_tiny_fusion


@pytest.fixture(scope="module")
def process_group(tmp_path_factory):
    """A one-process gloo group, enough for DDP on CPU (reused if a test left one open)."""
    if dist.is_initialized():
        yield
        return
    store = tmp_path_factory.mktemp("dist") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def compiled(module: nn.Module) -> nn.Module:
    return torch.compile(module, backend="eager")  # never called: only the wrapper matters


WRAPPERS = {
    "EarlyFusion": lambda model: model,
    "torch.compile": compiled,
    "DataParallel": DataParallel,  # on CPU: holds the model, no replicas
    "DDP": DistributedDataParallel,
    "compile(DDP)": lambda model: compiled(DistributedDataParallel(model)),
    "DDP(compile)": lambda model: DistributedDataParallel(compiled(model)),
}


def directory_bytes(directory) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


# ---------------------------------------------------------------- save_hf_llama


@pytest.mark.parametrize("wrap", WRAPPERS.values(), ids=WRAPPERS.keys())
def test_save_hf_llama_saves_the_decoder_of_a_fusion_model(wrap, process_group, tmp_path):
    model = build_tiny_fusion(seed=3)
    save_hf_llama(wrap(model), tmp_path / "wrapped")
    save_hf_llama(model.decoder, tmp_path / "decoder")
    # The same files, byte for byte, as saving the decoder itself: no encoder weight in them.
    assert directory_bytes(tmp_path / "wrapped") == directory_bytes(tmp_path / "decoder")
    loaded = load_hf_llama(tmp_path / "wrapped").state_dict()
    expected = model.decoder.state_dict()
    assert loaded.keys() == expected.keys()
    assert all(torch.equal(loaded[k], v) for k, v in expected.items())


def test_save_hf_llama_of_a_compiled_decoder(tmp_path):
    decoder = build_tiny_decoder(seed=4)
    save_hf_llama(compiled(decoder), tmp_path / "wrapped")
    save_hf_llama(decoder, tmp_path / "decoder")
    assert directory_bytes(tmp_path / "wrapped") == directory_bytes(tmp_path / "decoder")


@pytest.mark.parametrize(
    ("model", "match"),
    [
        (lambda: nn.Sequential(build_tiny_fusion()), r"got Sequential$"),
        (lambda: compiled(nn.Linear(2, 2)), r"got OptimizedModule around a Linear$"),
        (
            lambda: DataParallel(nn.ModuleList([build_tiny_decoder()])),
            r"got DataParallel around a ModuleList$",
        ),
        (lambda: build_tiny_fusion().encoders, r"got ModuleDict$"),
    ],
    ids=["container", "compiled-linear", "data-parallel-list", "encoders"],
)
def test_save_hf_llama_refuses_what_holds_no_single_decoder(model, match, tmp_path):
    expected = r"^decoder: expected a TransformerDecoder or an EarlyFusion \(possibly wrapped by "
    with pytest.raises(TypeError, match=expected + r"torch\.compile, .*\), " + match):
        save_hf_llama(model(), tmp_path / "out")
    assert not (tmp_path / "out").exists()  # refused before any write


def test_sharded_models_are_refused_before_any_write(process_group, tmp_path):
    model = build_tiny_fusion()
    fully_shard(model)  # parameters become DTensors
    with pytest.raises(ValueError, match=r"^decoder: 'tok_embeddings\.weight' is a DTensor"):
        save_hf_llama(model, tmp_path / "hf")
    with pytest.raises(ValueError, match=r"^state_dict: 'decoder\..*' is a DTensor.*full_state"):
        save_state_dict(model.state_dict(), tmp_path / "model.safetensors")
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- decoder_state_dict


def assert_plain_decoder_state(state: dict, expected: nn.Module) -> None:
    decoder = build_tiny_decoder(seed=99)
    decoder.load_state_dict(state)  # strict: every key of a plain decoder, and no other
    for key, tensor in expected.state_dict().items():
        assert torch.equal(decoder.state_dict()[key], tensor), key


@pytest.mark.parametrize("wrap", WRAPPERS.values(), ids=WRAPPERS.keys())
def test_decoder_state_dict_behind_wrappers(wrap, process_group, tmp_path):
    model = build_tiny_fusion(seed=5)
    wrapped = wrap(model)
    assert_plain_decoder_state(decoder_state_dict(wrapped.state_dict()), model.decoder)
    assert_plain_decoder_state(decoder_state_dict(wrapped), model.decoder)  # module accepted
    # A file saved from the wrapped model keeps the wrapper's prefix; it is found there too.
    save_state_dict(wrapped.state_dict(), tmp_path / "wrapped.safetensors")
    from_file = decoder_state_dict(load_state_dict(tmp_path / "wrapped.safetensors"))
    assert_plain_decoder_state(from_file, model.decoder)


def test_decoder_state_dict_of_a_plain_decoder():
    decoder = build_tiny_decoder(tie_word_embeddings=False, seed=6)
    state = decoder_state_dict(decoder.state_dict())
    assert state.keys() == decoder.state_dict().keys()
    assert "output.weight" in state


@settings(max_examples=25)
@given(tree=st.integers(1, 3).flatmap(lambda n: wrapping_trees(n_models=n, max_depth=4)))
def test_decoder_state_dict_under_any_wrapping(tree):
    """One decoder anywhere (attribute names such as ``tok_embeddings``, ``layers``,
    ``module`` included) is found; several are refused, each prefix listed."""
    models = [build_tiny_fusion(seed=i) for i in range(tree.n_models)]
    root, prefixes = tree.build(models)
    if tree.n_models == 1:
        assert_plain_decoder_state(decoder_state_dict(root.state_dict()), models[0].decoder)
        return
    expected = sorted(f"{prefix}decoder." for prefix in prefixes)
    with pytest.raises(ValueError, match=r"^source: expected one decoder") as info:
        decoder_state_dict(root.state_dict())
    assert f"found {tree.n_models}, under the prefixes {expected}:" in str(info.value)
    for prefix, model in zip(prefixes, models, strict=True):  # the way out the error names
        assert_plain_decoder_state(
            select_prefix(root.state_dict(), f"{prefix}decoder."), model.decoder
        )


def test_decoder_state_dict_policy_and_reference():
    root = nn.ModuleDict({"policy": build_tiny_fusion(seed=0), "reference": build_tiny_fusion()})
    message = (
        r"^source: expected one decoder, found 2, under the prefixes "
        r"\['policy\.decoder\.', 'reference\.decoder\.'\]: pick one with select_prefix"
    )
    with pytest.raises(ValueError, match=message):
        decoder_state_dict(root)


def test_decoder_state_dict_finds_decoders_by_structure_not_module_types():
    """A wrapped embedding (LoRA-style ``tok_embeddings.base.weight``) and another norm type
    (``norm.weight``) still make a decoder; an encoder with ``layers`` and ``norm`` but no
    ``tok_embeddings`` (a vision transformer) does not."""
    one = torch.ones(1)
    state = {
        "_orig_mod.decoder.tok_embeddings.base.weight": one,
        "_orig_mod.decoder.tok_embeddings.lora_a.weight": one,
        "_orig_mod.decoder.layers.0.attn.q_proj.weight": one,
        "_orig_mod.decoder.norm.weight": one,
        "_orig_mod.encoders.image.layers.0.weight": one,
        "_orig_mod.encoders.image.norm.weight": one,
    }
    assert decoder_state_dict(state) == {
        "tok_embeddings.base.weight": one,
        "tok_embeddings.lora_a.weight": one,
        "layers.0.attn.q_proj.weight": one,
        "norm.weight": one,
    }


def test_decoder_state_dict_containers_named_like_a_decoder():
    """A container whose children are called ``tok_embeddings``, ``layers`` and ``norm`` is
    not a decoder: only the three models inside are."""
    root = nn.Module()
    for seed, name in enumerate(("tok_embeddings", "layers", "norm")):
        setattr(root, name, build_tiny_fusion(seed=seed))
    prefixes = ["layers.decoder.", "norm.decoder.", "tok_embeddings.decoder."]
    with pytest.raises(ValueError, match=r"found 3, under the prefixes \[") as info:
        decoder_state_dict(root)
    assert str(prefixes) in str(info.value)
    root.layers, root.norm = nn.Linear(1, 1), nn.Linear(1, 1)  # one model left
    assert_plain_decoder_state(decoder_state_dict(root), root.tok_embeddings.decoder)


@pytest.mark.parametrize(
    ("source", "error", "match"),
    [
        ([("decoder.norm.scale", torch.ones(1))], TypeError, r"source: expected a state dict"),
        ({1: torch.ones(1)}, ValueError, r"source: expected string keys, got 1"),
        (nn.Linear(2, 2), ValueError, r"found none among 2 keys \(they begin \['bias', 'weight'"),
        (
            # A decoder's keys without its layers: no decoder.
            {"decoder.tok_embeddings.weight": torch.ones(1), "decoder.norm.scale": torch.ones(1)},
            ValueError,
            r"source: expected a decoder's keys \(tok_embeddings\.\*, layers\.\* and norm\.\*",
        ),
    ],
    ids=["list", "int-key", "no-decoder", "no-layers"],
)
def test_decoder_state_dict_errors(source, error, match):
    with pytest.raises(error, match=match):
        decoder_state_dict(source)
