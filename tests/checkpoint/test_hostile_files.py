"""A checkpoint directory is untrusted input: bombs, links to devices, malformed numbers and
types, tensors a model cannot hold. Each is refused with a CheckpointError naming the file and
the key, before anything the size of the model is allocated."""

import json
import os
import threading
import zipfile

import pytest
import torch
from safetensors.torch import load_file, save_file

from fusion.checkpoint import (
    CheckpointError,
    load_hf_llama,
    load_state_dict,
    read_hf_config,
    save_hf_llama,
)
from fusion.checkpoint import files as checkpoint_files
from fusion.checkpoint.files import CheckpointFiles
from fusion.hf import files as hf_files
from helpers import build_tiny_decoder


@pytest.fixture
def no_allocation(monkeypatch):
    """Fail the test if load_hf_llama allocates the decoder (it does so with to_empty)."""

    def refuse(*args, **kwargs):
        raise AssertionError("the decoder was allocated")

    monkeypatch.setattr(torch.nn.Module, "to_empty", refuse)


def hf_dir(tmp_path, *, torch_file: bool = False, **config_overrides):
    """A tiny Llama directory (float32, untied), optionally as pytorch_model.bin, with
    config.json overrides; returns (directory, its HF state dict)."""
    directory = tmp_path / "ckpt"
    save_hf_llama(build_tiny_decoder(tie_word_embeddings=False), directory)
    weights = load_file(directory / "model.safetensors")
    if torch_file:
        (directory / "model.safetensors").unlink()
        torch.save(weights, directory / "pytorch_model.bin")
    edit_config(directory, **config_overrides)
    return directory, weights


def edit_config(directory, **overrides) -> None:
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(config | overrides))


def raw_safetensors(header: str, data: bytes = b"") -> bytes:
    encoded = header.encode()
    return len(encoded).to_bytes(8, "little") + encoded + data


def run_with_timeout(function, seconds: float = 10.0):
    """Run ``function`` in a thread; fail (instead of hanging the suite) if it blocks."""
    result = {}

    def target():
        try:
            result["value"] = function()
        except BaseException as error:
            result["error"] = error

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"blocked for more than {seconds} s"
    return result


class TestAllocationBombs:
    @pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
    def test_stride_zero_tensor_in_a_torch_file(self, tmp_path, legacy):
        file = tmp_path / "bomb.bin"
        bomb = {"ok": torch.ones(3), "w": torch.ones(1).expand(1000, 1000)}
        torch.save(bomb, file, _use_new_zipfile_serialization=not legacy)
        with pytest.raises(CheckpointError, match="storage holds 4") as info:
            load_state_dict(file)
        assert info.value.file == file and info.value.key == "w"

    def test_stride_zero_weights_in_a_hf_directory(self, tmp_path, no_allocation):
        directory, weights = hf_dir(tmp_path, torch_file=True)
        bombs = {k: torch.ones(1).expand(v.shape) for k, v in weights.items()}
        torch.save(bombs, directory / "pytorch_model.bin")
        with pytest.raises(CheckpointError, match="storage holds"):
            load_hf_llama(directory)

    def test_weights_sharing_one_storage(self, tmp_path, no_allocation):
        # Every layer's tensors are layer 0's: the file holds one layer, the model needs two.
        directory, weights = hf_dir(tmp_path, torch_file=True)
        aliased = {k: weights[k.replace("layers.1.", "layers.0.")] for k in weights}
        torch.save(aliased, directory / "pytorch_model.bin")
        with pytest.raises(CheckpointError, match="share storage"):
            load_hf_llama(directory)

    def test_aliased_safetensors_entries(self, tmp_path):
        file = tmp_path / "w.safetensors"
        header = {k: {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]} for k in "ab"}
        file.write_bytes(raw_safetensors(json.dumps(header), bytes(16)))
        with pytest.raises(CheckpointError, match="data starts at byte 0, expected 16"):
            load_state_dict(file)

    def test_compressed_zip_member(self, tmp_path):
        plain, packed = tmp_path / "plain.pt", tmp_path / "packed.pt"
        torch.save({"w": torch.zeros(100_000)}, plain)
        with zipfile.ZipFile(plain) as source, zipfile.ZipFile(packed, "w") as target:
            for info in source.infolist():
                compress = zipfile.ZIP_DEFLATED if "/data/" in info.filename else 0
                target.writestr(info.filename, source.read(info), compress_type=compress)
        assert packed.stat().st_size < plain.stat().st_size / 10
        with pytest.raises(CheckpointError, match="compressed zip member") as info:
            load_state_dict(packed)
        assert info.value.file == packed

    def test_huge_max_position_embeddings(self, tmp_path, no_allocation):
        # head_dim 8: a 2.5M-position table is 80 MB, beside 80 kB of weights.
        directory, _ = hf_dir(tmp_path, max_position_embeddings=2_500_000)
        with pytest.raises(CheckpointError, match="rotary table") as info:
            load_hf_llama(directory)
        assert info.value.key == "max_position_embeddings"
        with pytest.raises(ValueError, match=r"max_seq_len: .*rotary table"):
            load_hf_llama(directory, max_seq_len=2_500_000)

    def test_huge_max_position_embeddings_loads_with_max_seq_len(self, tmp_path):
        directory, _ = hf_dir(tmp_path, max_position_embeddings=2_500_000)
        assert load_hf_llama(directory, max_seq_len=16).max_seq_len == 16

    def test_more_layers_than_the_weights_hold(self, tmp_path, no_allocation):
        directory, _ = hf_dir(tmp_path, num_hidden_layers=3000)
        with pytest.raises(CheckpointError, match="weights for 2 layers") as info:
            load_hf_llama(directory)
        assert info.value.key == "num_hidden_layers"

    @pytest.mark.parametrize("key", ["vocab_size", "hidden_size", "intermediate_size"])
    def test_sizes_beyond_any_tensor(self, tmp_path, key, no_allocation):
        directory, _ = hf_dir(tmp_path, **{key: 10**20})
        with pytest.raises(CheckpointError, match=r"2\*\*31") as info:
            load_hf_llama(directory)
        assert info.value.key == key

    def test_header_and_json_caps(self, tmp_path, monkeypatch):
        directory, _ = hf_dir(tmp_path)
        monkeypatch.setattr(checkpoint_files, "MAX_HEADER_BYTES", 100, raising=False)
        with pytest.raises(CheckpointError, match="capped at 100"):
            load_state_dict(directory)
        monkeypatch.setattr(hf_files, "MAX_JSON_BYTES", 100, raising=False)
        with pytest.raises(CheckpointError, match="larger than 100 bytes"):
            read_hf_config(directory)


class TestNotRegularFiles:
    def test_config_is_a_fifo(self, tmp_path):
        directory, _ = hf_dir(tmp_path)
        config = directory / "config.json"
        config.unlink()
        os.mkfifo(config)
        try:
            result = run_with_timeout(lambda: load_hf_llama(directory))
        finally:  # release a reader stuck on the FIFO, if any
            try:
                os.close(os.open(config, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
        assert isinstance(result.get("error"), CheckpointError)
        assert "not a regular file" in str(result["error"])

    @pytest.mark.parametrize("name", ["config.json", "model.safetensors"])
    def test_link_to_a_device(self, tmp_path, name):
        directory, _ = hf_dir(tmp_path)
        (directory / name).unlink()
        (directory / name).symlink_to("/dev/zero")
        result = run_with_timeout(lambda: load_hf_llama(directory))
        assert isinstance(result.get("error"), CheckpointError)
        assert "not a regular file" in str(result["error"])
        assert result["error"].file == directory / name

    def test_shard_is_a_directory(self, tmp_path):
        directory = tmp_path / "ckpt"
        save_hf_llama(build_tiny_decoder(), directory, max_shard_size=10_000)
        shard = sorted(directory.glob("model-*"))[0]
        shard.unlink()
        shard.mkdir()
        with pytest.raises(CheckpointError, match="not a regular file") as info:
            load_state_dict(directory)
        assert info.value.file == shard


MALFORMED = {
    "string": '"96"',
    "list": "[96]",
    "infinity": "Infinity",
    "nan": "NaN",
    "1e30": "1e30",
    "5000 digits": "9" * 5000,
    "true": "true",
}


class TestMalformedNumbers:
    @pytest.mark.parametrize(
        ("key", "raw"),
        [
            (key, raw)
            for key in ("vocab_size", "rope_theta", "rms_norm_eps")
            for raw in MALFORMED.values()
            if (key, raw) != ("rope_theta", "1e30")  # a valid, if extreme, rope base
        ],
        ids=lambda value: value if len(value) < 20 else f"{len(value)} chars",
    )
    def test_in_config(self, tmp_path, key, raw):
        directory, _ = hf_dir(tmp_path)
        text = (directory / "config.json").read_text()
        config = json.loads(text)
        text = text.replace(f'"{key}": {json.dumps(config[key])}', f'"{key}": {raw}')
        (directory / "config.json").write_text(text)
        with pytest.raises(CheckpointError) as info:
            load_hf_llama(directory)
        assert info.value.file == directory / "config.json" and info.value.key == key

    def test_nesting_in_config(self, tmp_path):
        directory, _ = hf_dir(tmp_path)
        (directory / "config.json").write_text("[" * 100_000 + "]" * 100_000)
        with pytest.raises(CheckpointError, match="nested too deeply") as info:
            load_hf_llama(directory)
        assert info.value.file == directory / "config.json"

    @pytest.mark.parametrize(
        "raw",
        [*list(MALFORMED.values())[1:], "[" * 100_000 + "]" * 100_000],
        ids=[*list(MALFORMED)[1:], "nested"],
    )
    def test_in_index(self, tmp_path, raw):
        directory = tmp_path / "ckpt"
        save_hf_llama(build_tiny_decoder(), directory, max_shard_size=10_000)
        index = directory / "model.safetensors.index.json"
        text = index.read_text()
        first = next(iter(json.loads(text)["weight_map"]))
        name = json.loads(text)["weight_map"][first]
        index.write_text(text.replace(f'"{first}": "{name}"', f'"{first}": {raw}', 1))
        with pytest.raises(CheckpointError) as info:
            load_state_dict(directory)
        assert info.value.file == index
        assert info.value.key == (None if raw.startswith("[[") else first)

    @pytest.mark.parametrize("field", ["shape", "data_offsets", "dtype"])
    @pytest.mark.parametrize("raw", MALFORMED.values(), ids=MALFORMED.keys())
    def test_in_safetensors_header(self, tmp_path, field, raw):
        entry = {"dtype": '"F32"', "shape": "[4]", "data_offsets": "[0, 16]"}
        entry[field] = raw if field == "dtype" else f"[{raw}]" if field == "shape" else raw
        header = "{" + '"w": {' + ", ".join(f'"{k}": {v}' for k, v in entry.items()) + "}}"
        file = tmp_path / "w.safetensors"
        file.write_bytes(raw_safetensors(header, bytes(16)))
        with pytest.raises(CheckpointError, match=r"corrupt header|unsupported dtype") as info:
            load_state_dict(file)
        assert info.value.file == file and info.value.key == "w"

    def test_nesting_in_safetensors_header(self, tmp_path):
        file = tmp_path / "w.safetensors"
        file.write_bytes(raw_safetensors('{"w": ' + "[" * 100_000 + "]" * 100_000 + "}"))
        with pytest.raises(CheckpointError, match="nested too deeply") as info:
            load_state_dict(file)
        assert info.value.file == file


class TestTensorsAModelCannotHold:
    @pytest.mark.parametrize("kind", ["meta", "sparse"])
    def test_in_a_torch_file(self, tmp_path, kind):
        tensor = torch.ones(3, device="meta") if kind == "meta" else torch.eye(3).to_sparse()
        file = tmp_path / "w.pt"
        torch.save({"ok": torch.ones(2), "w": tensor}, file)
        with pytest.raises(CheckpointError, match="expected a dense CPU tensor") as info:
            load_state_dict(file)
        assert info.value.file == file and info.value.key == "w"

    @pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.int32])
    def test_weights_a_llama_cannot_compute_with(self, tmp_path, dtype, no_allocation):
        directory, weights = hf_dir(tmp_path)
        weights["model.norm.weight"] = weights["model.norm.weight"].to(dtype)
        save_file(weights, directory / "model.safetensors")
        with pytest.raises(CheckpointError, match=f"stored as {dtype}") as info:
            load_hf_llama(directory, dtype=torch.float32)
        assert info.value.key == "model.norm.weight"

    def test_values_beyond_the_requested_dtype(self, tmp_path):
        directory, weights = hf_dir(tmp_path)
        weights["model.norm.weight"][3] = 1e6
        save_file(weights, directory / "model.safetensors")
        with pytest.raises(CheckpointError, match=r"1e\+06, beyond the range of torch\.float16"):
            load_hf_llama(directory, dtype=torch.float16)
        decoder = load_hf_llama(directory, dtype=torch.bfloat16)  # within bfloat16's range
        assert torch.isfinite(decoder.norm.scale).all()

    def test_legacy_torch_file_loads(self, tmp_path):
        state_dict = {"w": torch.randn(4, 3), "i": torch.arange(5), "t": torch.randn(3, 4).T}
        file = tmp_path / "legacy.pt"
        torch.save(state_dict, file, _use_new_zipfile_serialization=False)
        loaded = load_state_dict(file)
        assert loaded.keys() == state_dict.keys()
        assert all(torch.equal(loaded[k], v) for k, v in state_dict.items())

    def test_legacy_pytorch_model_bin_loads(self, tmp_path):
        directory, weights = hf_dir(tmp_path, torch_file=True)
        torch.save(weights, directory / "pytorch_model.bin", _use_new_zipfile_serialization=False)
        expected = build_tiny_decoder(tie_word_embeddings=False).state_dict()
        loaded = load_hf_llama(directory).state_dict()
        assert all(torch.equal(loaded[k], v) for k, v in expected.items())

    def test_headers_are_listed_for_a_legacy_file(self, tmp_path):
        file = tmp_path / "legacy.bin"
        torch.save({"w": torch.ones(2, 3)}, file, _use_new_zipfile_serialization=False)
        entry = CheckpointFiles(file).entries["w"]
        assert (entry.shape, entry.dtype) == ((2, 3), torch.float32)


class TestVisionSizes:
    """``read_hf_vlm_layout`` bounds what a config.json may ask preprocessing for, by
    arithmetic (the bounded-memory cases run in tests/preprocessing/test_hostile_inputs.py)."""

    @pytest.mark.parametrize(
        ("vision", "key", "match"),
        [
            ({"image_size": 10**6}, "vision_config.image_size", "<= 4096, got 1000000"),
            ({"image_size": 4096, "patch_size": 1}, "vision_config.patch_size", "16777216 patches"),
            ({"image_size": 18, "patch_size": 4}, "vision_config.image_size", "multiple of patch"),
        ],
    )
    def test_refused_naming_the_key(self, tmp_path, vision, key, match):
        from fusion.checkpoint.hf_vlm import read_hf_vlm_layout

        vision_config = {"model_type": "clip_vision_model", "image_size": 16, "patch_size": 4}
        text_config = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64}
        text_config |= {"num_hidden_layers": 1, "num_attention_heads": 4}
        config = {"model_type": "llava", "vision_config": vision_config | vision}
        (tmp_path / "config.json").write_text(json.dumps(config | {"text_config": text_config}))
        with pytest.raises(CheckpointError, match=match) as info:
            read_hf_vlm_layout(tmp_path)
        assert info.value.key == key and info.value.file == tmp_path / "config.json"
