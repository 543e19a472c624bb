"""load_hf_model / save_hf_model over the family registry: config.json read once per load,
any family's model saved and given back bit for bit, wrappers looked through."""

import pytest
import torch

import fusion.hf.files
from fusion.checkpoint import CheckpointError, load_hf_model, save_hf_model
from fusion.families import FAMILIES, family_named, family_of
from helpers import build_tiny_decoder
from vlm_helpers import tiny_hf_llava


@pytest.fixture
def config_reads(monkeypatch):
    """The number of times a config.json is read, through the one bounded reader."""
    reads: list[str] = []
    read = fusion.hf.files.read_bounded

    def counting(file, *args, **kwargs):
        if file.name == "config.json":
            reads.append(str(file))
        return read(file, *args, **kwargs)

    monkeypatch.setattr(fusion.hf.files, "read_bounded", counting)
    return reads


@pytest.mark.parametrize("kind", ["llama", "llava"])
def test_a_load_reads_config_json_once(tmp_path, config_reads, kind):
    model = build_tiny_decoder() if kind == "llama" else None
    if model is not None:
        save_hf_model(model, tmp_path)
    else:
        tiny_hf_llava().save_pretrained(tmp_path)
    config_reads.clear()
    loaded = load_hf_model(tmp_path)
    assert config_reads == [str(tmp_path / "config.json")]
    assert family_of(loaded) is family_named(kind)


def test_save_hf_model_round_trip_through_a_wrapper(tmp_path):
    decoder = build_tiny_decoder(tie_word_embeddings=False)
    save_hf_model(torch.nn.DataParallel(decoder), tmp_path)
    loaded = load_hf_model(tmp_path)
    for (name, ours), (_, theirs) in zip(
        decoder.state_dict().items(), loaded.state_dict().items(), strict=True
    ):
        assert torch.equal(ours, theirs), name


def test_every_family_is_found_by_each_of_its_model_types():
    for family in FAMILIES:
        for model_type in family.model_types:
            assert family_of({"model_type": model_type}) is family


def test_refusals_name_what_was_given(tmp_path):
    with pytest.raises(CheckpointError, match=r"model_type.*expected one of \['llama', 'llava'"):
        family_of({"model_type": "mistral"})
    with pytest.raises(TypeError, match=r"model: expected a model of .* got Linear"):
        save_hf_model(torch.nn.Linear(2, 2), tmp_path)
    with pytest.raises(ValueError, match=r"family: expected one of \['llama'.*got 'gemma'"):
        family_named("gemma")
