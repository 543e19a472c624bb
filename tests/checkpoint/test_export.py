"""export_hf: LoRA-trained, merged models exported as Hugging Face directories that
transformers' own classes load with our logits, with the source's tokenizer and processor; the
directory appears whole or not at all."""

import json
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import fusion.checkpoint.export as export_module
from fusion.checkpoint import CheckpointError, export_hf, load_hf_llama, load_hf_vlm
from fusion.lora import apply_lora, merge_lora
from helpers import build_tiny_decoder, build_tiny_fusion
from vlm_helpers import (
    IDEFICS3_TOKENS,
    IMAGE_ID,
    LLAVA_TOKENS,
    TEXT_CONFIG,
    TEXT_VOCAB,
    char_tokenizer,
    hf_tokenizer,
    make_image,
    randomize,
    tiny_hf_idefics3,
    tiny_hf_llava,
    tiny_hf_processor,
)

TEMPLATE = "{% for m in messages %}{{ m['role'] }}:{{ m['content'] }}\n{% endfor %}"
TARGETS = ("q_proj", "v_proj", "output_proj", "w1", "w2", "w3")


def write_source(kind: str, directory):
    """A tiny random transformers model of ``kind`` with its tokenizer, processor, chat
    template and generation config; returns the transformers model."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    tokenizer = hf_tokenizer(char_tokenizer())
    tokenizer.chat_template = TEMPLATE
    if kind == "llama":
        model = randomize(LlamaForCausalLM(LlamaConfig(**TEXT_CONFIG, tie_word_embeddings=False)))
        tokenizer.save_pretrained(directory)
    else:
        model = tiny_hf_llava() if kind == "llava" else tiny_hf_idefics3()
        tiny_hf_processor(kind, tokenizer, TEMPLATE).save_pretrained(directory)
    model.save_pretrained(directory)
    GenerationConfig(max_new_tokens=7, eos_token_id=2).save_pretrained(directory)
    return model


def batch(kind: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Two samples; with images for the vision-language kinds: one image each."""
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(8, TEXT_VOCAB, (2, 40), generator=generator)
    if kind == "llama":
        return tokens, None
    rows = LLAVA_TOKENS if kind == "llava" else IDEFICS3_TOKENS
    tokens[0, 2 : 2 + rows] = IMAGE_ID
    tokens[1, 10 : 10 + rows] = IMAGE_ID
    return tokens, torch.randn(2, 3, 16, 16, generator=generator)


def ours_forward(model, tokens, pixels):
    if pixels is None:
        return model(tokens)
    return model(tokens, encoder_input={"image": {"pixel_values": pixels}})


def theirs_forward(model, kind, tokens, pixels):
    if pixels is None:
        return model(input_ids=tokens).logits
    if kind == "idefics3":  # [batch, tiles, 3, h, w]: one tile per sample
        pixels = pixels[:, None]
    return model(input_ids=tokens, pixel_values=pixels).logits


@pytest.mark.parametrize("kind", ["llava", "idefics3", "llama"])
def test_trained_merged_export_loads_in_transformers(tmp_path, kind):
    from transformers import (
        AutoTokenizer,
        GenerationConfig,
        Idefics3ForConditionalGeneration,
        LlamaForCausalLM,
        LlavaForConditionalGeneration,
    )

    source = tmp_path / "source"
    original = write_source(kind, source)
    model = load_hf_llama(source) if kind == "llama" else load_hf_vlm(source)
    apply_lora(model, TARGETS, rank=4, alpha=8.0)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.02)
    tokens, pixels = batch(kind)
    for _ in range(2):  # B starts at zero: two steps make both factors matter
        logits = ours_forward(model, tokens, pixels)
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten() % 100)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    with torch.no_grad():
        trained = ours_forward(model, tokens, pixels)
        merge_lora(model)
        ours = ours_forward(model, tokens, pixels)
        before = theirs_forward(original.eval(), kind, tokens, pixels)
    assert (ours - trained).abs().max() <= 1e-5
    assert (ours - before).abs().max() > 1e-2  # the training step changed the model

    out = tmp_path / "final"
    written = export_hf(model, source, out)
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in written)
    names = {p.name for p in written}
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= names
    for name in names - {"config.json", "model.safetensors"}:
        assert (out / name).read_bytes() == (source / name).read_bytes(), name
    cls = {
        "llava": LlavaForConditionalGeneration,
        "idefics3": Idefics3ForConditionalGeneration,
        "llama": LlamaForCausalLM,
    }[kind]
    loaded = cls.from_pretrained(out).eval()
    with torch.no_grad():
        theirs = theirs_forward(loaded, kind, tokens, pixels)
    assert (theirs - ours).abs().max() <= 1e-4
    assert GenerationConfig.from_pretrained(out).max_new_tokens == 7
    tokenizer = AutoTokenizer.from_pretrained(out)
    chat = [{"role": "user", "content": "hi"}]
    assert tokenizer.apply_chat_template(chat, tokenize=False) == "user:hi\n"
    if kind != "llama":
        check_processor(source, out)


def check_processor(source, out):
    from transformers import AutoProcessor

    image = make_image(20, 30)
    text = "look <image> here"
    expected = AutoProcessor.from_pretrained(source)(text=[text], images=[[image]])
    got = AutoProcessor.from_pretrained(out)(text=[text], images=[[image]])
    assert got["input_ids"] == expected["input_ids"]
    assert np.array_equal(np.array(got["pixel_values"]), np.array(expected["pixel_values"]))


@pytest.fixture
def source(tmp_path):
    directory = tmp_path / "source"
    directory.mkdir()
    (directory / "tokenizer.json").write_text('{"version": "1.0"}')
    (directory / "chat_template.jinja").write_text(TEMPLATE)
    (directory / "model.safetensors").write_bytes(b"not copied")  # weights come from the model
    (directory / "notes.txt").write_text("not a side file")
    return directory


def test_only_side_files_are_copied_and_overwrite_replaces_whole(tmp_path, source):
    decoder = build_tiny_decoder()
    out = tmp_path / "out"
    export_hf(decoder, source, out)
    assert sorted(os.listdir(out)) == [
        "chat_template.jinja",
        "config.json",
        "model.safetensors",
        "tokenizer.json",
    ]
    assert load_hf_llama(out).state_dict().keys() == decoder.state_dict().keys()
    with pytest.raises(CheckpointError, match=r"out: exists; pass overwrite=True"):
        export_hf(decoder, source, out)
    (out / "stale.txt").write_text("from the old export")
    export_hf(decoder, None, out, overwrite=True)  # weights only
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    assert sorted(os.listdir(tmp_path)) == ["out", "source"]  # nothing left aside


def test_refusals_before_anything_is_written(tmp_path, source):
    decoder = build_tiny_decoder()
    out = tmp_path / "out"
    apply_lora(decoder, "q_proj")
    with pytest.raises(ValueError, match=r"carries LoRA adapters \('layers.0.attn.q_proj', "):
        export_hf(decoder, source, out)
    merge_lora(decoder)
    with pytest.raises(
        TypeError, match=r"model: expected a model of \['llama', 'llava', .*\], got \{'image': "
    ):
        export_hf(build_tiny_fusion(), source, out)
    with pytest.raises(TypeError, match=r"model: expected an EarlyFusion .* got Linear"):
        export_hf(torch.nn.Linear(2, 2), source, out)
    (tmp_path / "elsewhere.json").write_text("{}")
    (source / "tokenizer_config.json").symlink_to(tmp_path / "elsewhere.json")
    with pytest.raises(CheckpointError, match=r"tokenizer_config.json: is a symbolic link"):
        export_hf(decoder, source, out)
    (source / "tokenizer_config.json").unlink()
    os.mkfifo(source / "vocab.json")
    with pytest.raises(CheckpointError, match=r"vocab.json: not a regular file"):
        export_hf(decoder, source, out)
    (source / "vocab.json").unlink()
    with pytest.raises(CheckpointError, match=r"source_dir: not a directory"):
        export_hf(decoder, source / "tokenizer.json", out)
    (tmp_path / "file").write_text("")
    with pytest.raises(CheckpointError, match=r"file: exists and is not a directory"):
        export_hf(decoder, source, tmp_path / "file", overwrite=True)
    assert sorted(os.listdir(tmp_path)) == ["elsewhere.json", "file", "source"]


def test_large_side_file_refused(tmp_path, source, monkeypatch):
    monkeypatch.setattr(export_module, "MAX_SIDE_FILE_BYTES", 10)
    with pytest.raises(CheckpointError, match=r"tokenizer.json: 18 bytes, more than 10: refused"):
        export_hf(build_tiny_decoder(), source, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_crash_leaves_the_old_export_or_none(tmp_path, source, monkeypatch):
    decoder = build_tiny_decoder()
    out = tmp_path / "out"
    export_hf(decoder, source, out)
    old = {name: (out / name).read_bytes() for name in os.listdir(out)}

    def crash(*args, **kwargs):
        raise OSError("disk full")

    # While the weights are written, and at the final rename: the old export stays.
    monkeypatch.setattr(export_module, "fsync_path", crash)
    with pytest.raises(OSError, match="disk full"):
        export_hf(build_tiny_decoder(seed=1), source, out, overwrite=True)
    monkeypatch.undo()
    real_rename = os.rename
    monkeypatch.setattr(export_module.os, "rename", crash)
    with pytest.raises(OSError, match="disk full"):
        export_hf(build_tiny_decoder(seed=1), source, out, overwrite=True)
    monkeypatch.setattr(export_module.os, "rename", real_rename)
    assert {name: (out / name).read_bytes() for name in os.listdir(out)} == old
    assert sorted(os.listdir(tmp_path)) == ["out", "source"]
    with pytest.raises(OSError, match="disk full"):  # a first export: no directory at all
        monkeypatch.setattr(export_module.os, "rename", crash)
        export_hf(decoder, source, tmp_path / "new")
    assert sorted(os.listdir(tmp_path)) == ["out", "source"]
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
