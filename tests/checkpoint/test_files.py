import json

import pytest
import torch

from fusion.checkpoint import CheckpointError, load_state_dict, save_state_dict
from fusion.checkpoint.files import CheckpointFiles


def sample_state_dict() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(16, 8, generator=g),
        "b.weight": torch.randn(40, generator=g).to(torch.bfloat16),
        "c.index": torch.randint(0, 9, (3, 5), generator=g),
        "d.scale": torch.randn(8, generator=g).to(torch.float16),
    }


def assert_same(actual: dict, expected: dict) -> None:
    assert sorted(actual) == sorted(expected)
    for key, tensor in expected.items():
        assert actual[key].dtype == tensor.dtype and torch.equal(actual[key], tensor), key


# Protocol-level tamper check: unpickling this would create the marker file.
MARKER = {"path": None}


def _touch(path: str) -> None:
    open(path, "w").close()


class Payload:
    def __reduce__(self):
        return _touch, (MARKER["path"],)


class TestRoundTrip:
    @pytest.mark.parametrize("name", ["weights.safetensors", "weights.pt", "weights.bin", "dir"])
    def test_bitwise(self, tmp_path, name):
        state_dict = sample_state_dict()
        written = save_state_dict(state_dict, tmp_path / name)
        assert all(f.is_file() for f in written)
        assert_same(load_state_dict(tmp_path / name), state_dict)

    def test_shards_with_index(self, tmp_path):
        state_dict = sample_state_dict()
        written = save_state_dict(state_dict, tmp_path, max_shard_size=600)
        shards = [f for f in written if f.suffix == ".safetensors"]
        assert len(shards) == 2 and (tmp_path / "model.safetensors.index.json") in written
        index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"]) == set(state_dict)
        assert_same(load_state_dict(tmp_path), state_dict)
        assert_same(load_state_dict(tmp_path / "model.safetensors.index.json"), state_dict)

    def test_headers_are_listed_without_reading(self, tmp_path):
        state_dict = sample_state_dict()
        save_state_dict(state_dict, tmp_path, max_shard_size=600)
        entries = CheckpointFiles(tmp_path).entries
        assert {k: (e.shape, e.dtype) for k, e in entries.items()} == {
            k: (tuple(t.shape), t.dtype) for k, t in state_dict.items()
        }

    def test_shared_and_non_contiguous_tensors(self, tmp_path):
        base = torch.randn(6, 4)
        state_dict = {"x": base, "tied": base, "t": base.T, "row": base[2]}
        save_state_dict(state_dict, tmp_path / "w.safetensors")
        assert_same(load_state_dict(tmp_path / "w.safetensors"), state_dict)

    def test_overwrite(self, tmp_path):
        save_state_dict(sample_state_dict(), tmp_path, max_shard_size=600)
        with pytest.raises(CheckpointError, match="already holds a checkpoint"):
            save_state_dict({"z": torch.ones(2)}, tmp_path)
        save_state_dict({"z": torch.ones(2)}, tmp_path, overwrite=True)
        assert sorted(f.name for f in tmp_path.iterdir()) == ["model.safetensors"]
        assert_same(load_state_dict(tmp_path), {"z": torch.ones(2)})
        with pytest.raises(CheckpointError, match="exists"):
            save_state_dict({"z": torch.ones(2)}, tmp_path / "model.safetensors")

    def test_bad_arguments(self, tmp_path):
        with pytest.raises(ValueError, match="state_dict"):
            save_state_dict({"step": 3}, tmp_path)
        with pytest.raises(ValueError, match="max_shard_size"):
            save_state_dict({"z": torch.ones(2)}, tmp_path / "w.safetensors", max_shard_size=8)
        with pytest.raises(ValueError, match="max_shard_size"):
            save_state_dict({"z": torch.ones(2)}, tmp_path, max_shard_size=0)


class TestErrors:
    def test_truncated_safetensors_names_file_and_key(self, tmp_path):
        file = tmp_path / "w.safetensors"
        save_state_dict(sample_state_dict(), file)
        last = list(CheckpointFiles(file).entries)[-1]
        data = file.read_bytes()
        file.write_bytes(data[:-3])
        with pytest.raises(CheckpointError, match="truncated") as info:
            load_state_dict(file)
        assert info.value.file == file and info.value.key == last
        assert str(file) in str(info.value) and repr(last) in str(info.value)
        file.write_bytes(data[:5])
        with pytest.raises(CheckpointError, match="truncated"):
            load_state_dict(file)
        file.write_bytes(data[:40])
        with pytest.raises(CheckpointError, match="truncated or corrupt"):
            load_state_dict(file)

    def test_corrupt_header(self, tmp_path):
        file = tmp_path / "w.safetensors"
        save_state_dict(sample_state_dict(), file)
        data = bytearray(file.read_bytes())
        data[9:12] = b"\xff\xfe\x00"
        file.write_bytes(bytes(data))
        with pytest.raises(CheckpointError, match="corrupt header") as info:
            load_state_dict(file)
        assert info.value.file == file

    def test_missing_shard_names_file_and_key(self, tmp_path):
        save_state_dict(sample_state_dict(), tmp_path, max_shard_size=600)
        index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
        missing = tmp_path / "model-00002-of-00002.safetensors"
        missing.unlink()
        keys = sorted(k for k, v in index["weight_map"].items() if v == missing.name)
        with pytest.raises(CheckpointError, match="missing shard") as info:
            load_state_dict(tmp_path)
        assert info.value.file == missing and info.value.key in keys

    def test_index_and_shard_disagree(self, tmp_path):
        save_state_dict(sample_state_dict(), tmp_path, max_shard_size=600)
        index_file = tmp_path / "model.safetensors.index.json"
        index = json.loads(index_file.read_text())
        index["weight_map"]["e.extra"] = "model-00001-of-00002.safetensors"
        index_file.write_text(json.dumps(index))
        with pytest.raises(CheckpointError, match=r"listed in model\.safetensors\.index") as e:
            load_state_dict(tmp_path)
        assert e.value.key == "e.extra"
        del index["weight_map"]["e.extra"]
        omitted = next(iter(index["weight_map"]))
        del index["weight_map"][omitted]
        index_file.write_text(json.dumps(index))
        with pytest.raises(CheckpointError, match="omits it") as e:
            load_state_dict(tmp_path)
        assert e.value.key == omitted

    def test_index_may_not_point_elsewhere(self, tmp_path):
        index = {"weight_map": {"a.weight": "../outside.safetensors"}}
        (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
        with pytest.raises(CheckpointError, match="expected a shard file name") as info:
            load_state_dict(tmp_path)
        assert info.value.key == "a.weight"

    def test_torch_load_never_unpickles_objects(self, tmp_path):
        file, marker = tmp_path / "evil.pt", tmp_path / "pwned"
        MARKER["path"] = str(marker)
        torch.save({"w": torch.ones(2), "x": Payload()}, file)
        with pytest.raises(CheckpointError, match="weights_only") as info:
            load_state_dict(file)
        assert info.value.file == file and not marker.exists()

    def test_torch_file_errors(self, tmp_path):
        file = tmp_path / "w.pt"
        torch.save({"w": torch.ones(2), "step": 3}, file)
        with pytest.raises(CheckpointError, match="expected a tensor") as info:
            load_state_dict(file)
        assert info.value.key == "step"
        torch.save({"w": torch.ones(1000)}, file)
        file.write_bytes(file.read_bytes()[:500])
        with pytest.raises(CheckpointError, match="unreadable") as info:
            load_state_dict(file)
        assert info.value.file == file

    def test_what_is_not_a_checkpoint(self, tmp_path):
        with pytest.raises(CheckpointError, match="no such file"):
            load_state_dict(tmp_path / "absent.safetensors")
        with pytest.raises(CheckpointError, match="no checkpoint"):
            load_state_dict(tmp_path)
        (tmp_path / "notes.txt").write_text("hi")
        with pytest.raises(CheckpointError, match="unknown format"):
            load_state_dict(tmp_path / "notes.txt")
        save_state_dict({"z": torch.ones(2)}, tmp_path / "model.safetensors")
        (tmp_path / "model.safetensors.index.json").write_text("{}")
        with pytest.raises(CheckpointError, match="ambiguous"):
            load_state_dict(tmp_path)
