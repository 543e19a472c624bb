"""The end of a fine-tuning run: a checkpoint's tensors read back into a model over its base
(checked to be the base it trained on), then exported whole or not at all, the LoRA adapter in
PEFT's format beside the merged model."""

import json

import pytest
import torch

from fusion.checkpoint import load_hf_llama
from fusion.lora import apply_lora, lora_linears
from fusion.training import (
    TrainingError,
    check_base_model,
    export_trained,
    load_model_tensors,
    load_train_state,
    save_checkpoint,
)
from fusion.training.fingerprint import model_fingerprint
from helpers import VOCAB, build_tiny_decoder

CPU = torch.device("cpu")


def lora_decoder(seed: int = 0) -> torch.nn.Module:
    """The tiny decoder with LoRA on q_proj and v_proj (their B factors non-zero, so that the
    adapters change the output), the base frozen."""
    decoder = build_tiny_decoder(tie_word_embeddings=False, seed=seed)
    decoder.requires_grad_(False)
    apply_lora(decoder, ("q_proj", "v_proj"), rank=2, alpha=4.0)
    with torch.no_grad():
        for linear in lora_linears(decoder).values():
            linear.lora_b.weight.normal_()
    return decoder


def save(trained, root, model, *, trainable_only: bool, **settings):
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    state = trained.state(1, scheduler, **settings)
    return save_checkpoint(
        root, model, optimizer, state, device=CPU, keep=1, trainable_only=trainable_only
    )


def test_a_checkpoint_of_what_trains_loads_over_the_base(trained, tmp_path):
    model = lora_decoder(seed=0)
    path = save(trained, tmp_path / "lora", model, trainable_only=True)
    fresh = lora_decoder(seed=1)  # other adapters and another base
    base = {k: v.clone() for k, v in fresh.state_dict().items() if ".lora_" not in k}
    load_model_tensors(path, fresh, trainable_only=True)
    for key, value in fresh.state_dict().items():
        expected = model.state_dict()[key] if ".lora_" in key else base[key]
        assert torch.equal(value, expected), key  # the adapters loaded, the base kept

    path = save(trained, tmp_path / "full", model, trainable_only=False)
    with pytest.raises(TrainingError, match=r"its model tensors do not match: unexpected \(8\)"):
        load_model_tensors(path, build_tiny_decoder(tie_word_embeddings=False))  # no adapters
    load_model_tensors(path, fresh)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in fresh.state_dict().items())
    with pytest.raises(TrainingError, match=r"its model tensors do not match: missing"):
        load_model_tensors(save(trained, tmp_path / "lora", model, trainable_only=True), fresh)


def write_base(directory, seed: int = 0):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({"model_type": "llama", "seed": seed}))
    return directory


def test_a_changed_base_is_refused(trained, tmp_path):
    base = write_base(tmp_path / "base")
    model = lora_decoder()
    fingerprint = model_fingerprint(base)
    path = save(trained, tmp_path / "run", model, trainable_only=True, base_model=fingerprint)
    state = load_train_state(path)
    check_base_model(path, state, base)  # the same base
    write_base(base, seed=1)
    changed = r"another base model: in --model .*base, config\.json changed \(content\)"
    with pytest.raises(TrainingError, match=changed):
        check_base_model(path, state, base)
    state.base_model = None
    with pytest.raises(
        TrainingError, match="no fingerprint of its base model, so --base cannot be"
    ):
        check_base_model(path, state, base, flag="--base")
    whole = load_train_state(save(trained, tmp_path / "whole", model, trainable_only=False))
    check_base_model(path, whole, tmp_path / "nowhere")  # the whole model needs no base


def test_the_export_is_whole_with_its_peft_adapter(tmp_path):
    source = tmp_path / "source"
    source.mkdir()
    (source / "tokenizer.json").write_text('{"tokenizer": 1}')
    final = tmp_path / "final"
    final.mkdir()
    (final / "old-file").write_text("the previous export")
    (tmp_path / ".tmp-final").mkdir()  # what a crash left
    (tmp_path / ".old-final").write_text("")
    model = lora_decoder().eval()
    tokens = torch.randint(0, VOCAB, (1, 8))
    with torch.no_grad():
        expected = model(tokens)
    assert export_trained(model, str(source), final, peft_adapter="adapter") == final
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final", "source"]
    assert not lora_linears(model)  # merged in place
    names = sorted(p.name for p in final.iterdir())
    assert names == ["adapter", "config.json", "model.safetensors", "tokenizer.json"]
    adapter = json.loads((final / "adapter" / "adapter_config.json").read_text())
    assert adapter["r"] == 2 and adapter["base_model_name_or_path"] == str(source)
    with torch.no_grad():
        torch.testing.assert_close(load_hf_llama(final)(tokens), expected, atol=1e-5, rtol=0)

    before = {p.name: p.read_bytes() for p in final.iterdir() if p.is_file()}
    with pytest.raises(TrainingError, match=r"cannot export .*final/adapter: .*no LoRA adapters"):
        export_trained(model, str(source), final, peft_adapter="adapter")
    with pytest.raises(TrainingError, match=r"cannot export .*final: "):
        export_trained(torch.nn.Linear(2, 2), str(source), final)
    assert {p.name: p.read_bytes() for p in final.iterdir() if p.is_file()} == before
    export_trained(model, str(source), final)  # a full run: no adapter
    assert not (final / "adapter").exists() and (final / "model.safetensors").exists()
