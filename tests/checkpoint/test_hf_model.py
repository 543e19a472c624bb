"""load_hf_model / save_hf_model over the family registry: config.json read once per load
(and once for a model, its processor and its conversation encoder, handed one HfDirectory),
any family's model saved and given back bit for bit, wrappers looked through."""

import pytest
import torch

from fusion.checkpoint import CheckpointError, load_hf_model, save_hf_model
from fusion.checkpoint.hf_model import HfDirectory
from fusion.data import ConversationEncoder
from fusion.families import FAMILIES, family_named, family_of
from fusion.lora import apply_lora, save_peft_adapter
from fusion.preprocessing import VisionLanguageProcessor
from helpers import build_tiny_decoder
from vlm_helpers import char_tokenizer, hf_tokenizer, tiny_hf_llava, tiny_hf_processor


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


def test_one_directory_is_parsed_once_for_model_processor_encoder_and_adapter(
    tmp_path, config_reads
):
    base = tmp_path / "base"
    tiny_hf_llava().save_pretrained(base)
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tiny_hf_processor("llava", hf_tokenizer(char_tokenizer()), template).save_pretrained(base)
    config_reads.clear()
    directory = HfDirectory(base)
    assert config_reads == []  # nothing is read before it is asked for
    model = load_hf_model(directory)
    processor = VisionLanguageProcessor.from_directory(directory)
    encoder = ConversationEncoder.from_directory(directory)
    apply_lora(model, ["q_proj"], rank=2)
    save_peft_adapter(model, tmp_path / "adapter", base_model_name_or_path=directory)
    assert config_reads == [str(base / "config.json")]
    assert processor.kind == encoder.processor.kind == directory.family.processor == "llava"
    assert (
        f'"base_model_name_or_path": "{base}"'
        in (tmp_path / "adapter" / "adapter_config.json").read_text()
    )
    # Each also takes a path, and then reads it itself.
    assert type(VisionLanguageProcessor.from_directory(base)) is type(processor)
    assert len(config_reads) == 2


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
