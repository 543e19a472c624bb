"""The base model's keys stay exactly the plain model's under any wrapping; adapters are saved
apart, crash-safely, and loaded only into matching adapters."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from lora.test_apply import randomize_adapters
from torch import nn

import fusion.lora.state as lora_state
from fusion.checkpoint import CheckpointError, save_state_dict
from fusion.lora import (
    adapter_state_dict,
    apply_lora,
    base_state_dict,
    load_adapter,
    lora_linears,
    save_adapter,
)
from fusion.testing import wrapping_trees
from helpers import build_tiny_fusion, text_tokens

TARGETS = ("q_proj", "w2", "encoders.image.proj")


@settings(max_examples=15, deadline=None)
@given(tree=st.integers(1, 2).flatmap(lambda n: wrapping_trees(n_models=n, max_depth=3)))
def test_base_keys_are_the_plain_models_under_any_wrapping(tree):
    plain, _ = tree.build([build_tiny_fusion(seed=i) for i in range(tree.n_models)])
    models = [build_tiny_fusion(seed=i) for i in range(tree.n_models)]
    root, prefixes = tree.build(models)
    holder = nn.Module()  # a user's own child named like an adapter is base state
    holder.lora_a = root
    plain_holder = nn.Module()
    plain_holder.lora_a = plain
    apply_lora(holder, tuple(f"lora_a.{p}{t}" for p in prefixes for t in ("*q_proj", "*w2")))
    randomize_adapters(holder)

    base, adapters, whole = base_state_dict(holder), adapter_state_dict(holder), holder.state_dict()
    expected = plain_holder.state_dict()
    assert list(base) == list(expected)  # same keys, same order
    assert all(torch.equal(base[k], expected[k]) for k in expected)
    assert set(base) | set(adapters) == set(whole) and not set(base) & set(adapters)
    assert set(adapters) == {
        f"lora_a.{p}decoder.layers.{i}.{m}.lora_{x}.weight"
        for p in prefixes
        for i in (0, 1)
        for m in ("attn.q_proj", "mlp.w2")
        for x in "ab"
    }
    plain_holder.load_state_dict(base, strict=True)
    # A plain checkpoint loads into the adapted model: only the adapters are missing.
    result = holder.load_state_dict(expected, strict=False)
    assert set(result.missing_keys) == set(adapters) and not result.unexpected_keys


def adapted(seed: int = 0, rank: int = 3, alpha: float = 6.0) -> nn.Module:
    model = build_tiny_fusion()
    apply_lora(model, TARGETS, rank=rank, alpha=alpha)
    randomize_adapters(model, seed)
    return model


def test_save_and_load_round_trip(tmp_path):
    source = adapted(seed=1)
    file = save_adapter(source, tmp_path / "run" / "adapter.safetensors")
    assert file == tmp_path / "run" / "adapter.safetensors"
    assert sorted(p.name for p in file.parent.iterdir()) == ["adapter.safetensors"]
    target = adapted(seed=2)
    load_adapter(target, file)
    for key, tensor in adapter_state_dict(source).items():
        assert torch.equal(adapter_state_dict(target)[key], tensor), key
    tokens = text_tokens(2, 8)
    assert torch.equal(target(tokens), source(tokens))
    # bfloat16 adapters load cast; the base stays as it was
    low = adapted(seed=3).to(torch.bfloat16)
    load_adapter(low, file)
    assert lora_linears(low)["decoder.layers.0.attn.q_proj"].lora_a.weight.dtype == torch.bfloat16


def test_mismatches_are_refused_before_anything_is_copied(tmp_path):
    file = save_adapter(adapted(seed=1), tmp_path / "a.safetensors")
    for model, message in (
        (
            adapted(rank=4),
            r"key 'decoder.layers.0.attn.q_proj.lora_a.weight': expected a "
            r"floating tensor of shape \(4, 32\) \(the model's rank\), got torch.float32 of shape "
            r"\(3, 32\)",
        ),
        (
            adapted(alpha=3.0),
            r"key 'decoder.layers.0.attn.q_proj': saved with LoRA settings "
            r"\{'alpha': 6.0, 'rank': 3\}, the model's are \{'rank': 3, 'alpha': 3.0\}",
        ),
    ):
        before = {k: v.clone() for k, v in adapter_state_dict(model).items()}
        with pytest.raises(CheckpointError, match=message):
            load_adapter(model, file)
        assert all(torch.equal(adapter_state_dict(model)[k], v) for k, v in before.items())
    other = build_tiny_fusion()
    apply_lora(other, "v_proj", rank=3, alpha=6.0)
    with pytest.raises(CheckpointError, match=r"adapters differ from the model's: missing "):
        load_adapter(other, file)
    with pytest.raises(ValueError, match=r"model: has no LoRA adapters"):
        load_adapter(build_tiny_fusion(), file)
    plain = tmp_path / "plain.safetensors"  # right keys, no settings: not an adapter file
    save_state_dict(adapter_state_dict(adapted()), plain)
    with pytest.raises(CheckpointError, match=r"no 'fusion_lora' entry: not an adapter file"):
        load_adapter(adapted(), plain)
    with pytest.raises(CheckpointError, match=r"no such file"):
        load_adapter(adapted(), tmp_path / "missing.safetensors")
    (tmp_path / "short.safetensors").write_bytes(file.read_bytes()[:-5])
    with pytest.raises(CheckpointError, match=r"truncated"):
        load_adapter(adapted(), tmp_path / "short.safetensors")


def test_save_refusals(tmp_path):
    model = adapted()
    with pytest.raises(ValueError, match=r"path: expected a .safetensors file name"):
        save_adapter(model, tmp_path / "adapter.pt")
    with pytest.raises(ValueError, match=r"model: has no LoRA adapters"):
        save_adapter(build_tiny_fusion(), tmp_path / "a.safetensors")
    with pytest.raises(TypeError, match=r"overwrite: expected a bool"):
        save_adapter(model, tmp_path / "a.safetensors", overwrite=1)
    save_adapter(model, tmp_path / "a.safetensors")
    with pytest.raises(CheckpointError, match=r"exists; pass overwrite=True"):
        save_adapter(model, tmp_path / "a.safetensors")
    save_adapter(model, tmp_path / "a.safetensors", overwrite=True)
    (tmp_path / "d.safetensors").mkdir()
    with pytest.raises(CheckpointError, match=r"is a directory"):
        save_adapter(model, tmp_path / "d.safetensors")
    with torch.device("meta"):
        meta = build_tiny_fusion()
    apply_lora(meta, "q_proj")
    with pytest.raises(ValueError, match=r"has no dense data to save \(device meta"):
        save_adapter(meta, tmp_path / "m.safetensors")


def test_a_crash_while_writing_leaves_the_old_file(tmp_path, monkeypatch):
    file = save_adapter(adapted(seed=1), tmp_path / "a.safetensors")
    old = file.read_bytes()

    def crash(tensors, target, metadata):
        with open(target, "wb") as f:
            f.write(b"half a file")
        raise OSError("disk full")

    monkeypatch.setattr(lora_state, "save_file", crash)
    with pytest.raises(OSError, match="disk full"):
        save_adapter(adapted(seed=2), file, overwrite=True)
    assert file.read_bytes() == old
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.safetensors"]  # no temporary left
