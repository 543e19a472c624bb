"""Every public function of fusion.checkpoint with arguments of the wrong type or value: a
TypeError or ValueError naming the argument, raised before anything is written."""

import pytest
import torch

from fusion.checkpoint import (
    fusion_to_hf,
    fusion_to_meta,
    hf_to_fusion,
    load_hf_llama,
    load_state_dict,
    meta_to_fusion,
    save_hf_llama,
    save_state_dict,
    select_prefix,
)
from fusion.checkpoint.files import CheckpointFiles
from fusion.checkpoint.keys import interleaved_to_rotate_half, rotate_half_to_interleaved
from helpers import build_tiny_decoder

WEIGHTS = {"a.weight": torch.ones(2, 3)}


@pytest.fixture
def hf_dir(tmp_path):
    save_hf_llama(build_tiny_decoder(), tmp_path / "hf")
    return tmp_path / "hf"


class TestSavers:
    @pytest.mark.parametrize(
        ("kwargs", "error", "match"),
        [
            ({"path": 3}, TypeError, "path: expected a path"),
            ({"path": ""}, ValueError, "path: expected a non-empty path"),
            ({"state_dict": [("a", torch.ones(1))]}, TypeError, "state_dict: expected a mapping"),
            ({"state_dict": {"a": [1.0]}}, ValueError, "state_dict: expected .* tensor values"),
            ({"state_dict": {1: torch.ones(1)}}, ValueError, "state_dict: expected string keys"),
            ({"max_shard_size": True}, TypeError, "max_shard_size: expected a positive int"),
            ({"max_shard_size": "1GB"}, TypeError, "max_shard_size: expected a positive int"),
            ({"max_shard_size": 1.5}, TypeError, "max_shard_size: expected a positive int"),
            ({"max_shard_size": 0}, ValueError, "max_shard_size: expected a positive int"),
            ({"max_shard_size": -8}, ValueError, "max_shard_size: expected a positive int"),
            ({"overwrite": "no"}, TypeError, "overwrite: expected a bool"),
            ({"state_dict": {"m": torch.ones(2, device="meta")}}, ValueError, "'m' has no dense"),
            ({"state_dict": {"s": torch.eye(2).to_sparse()}}, ValueError, "'s' has no dense"),
            ({"state_dict": {"__metadata__": torch.ones(1)}}, ValueError, "__metadata__"),
        ],
    )
    def test_save_state_dict_refuses_before_writing(self, tmp_path, kwargs, error, match):
        arguments = {"state_dict": WEIGHTS, "path": tmp_path / "out"} | kwargs
        with pytest.raises(error, match=match):
            save_state_dict(arguments.pop("state_dict"), arguments.pop("path"), **arguments)
        assert list(tmp_path.iterdir()) == []

    def test_save_hf_llama_refuses_before_writing(self, tmp_path):
        with pytest.raises(TypeError, match="decoder: expected a TransformerDecoder"):
            save_hf_llama(torch.nn.Linear(2, 2), tmp_path / "out")
        with torch.device("meta"):
            meta_decoder = build_tiny_decoder()
        with pytest.raises(ValueError, match=r"decoder: .* has no dense data"):
            save_hf_llama(meta_decoder, tmp_path / "out")
        with pytest.raises(TypeError, match="directory: expected a path"):
            save_hf_llama(build_tiny_decoder(), None)
        with pytest.raises(TypeError, match="overwrite: expected a bool"):
            save_hf_llama(build_tiny_decoder(), tmp_path / "out", overwrite=1)
        with pytest.raises(ValueError, match="max_shard_size: expected a positive int"):
            save_hf_llama(build_tiny_decoder(), tmp_path / "out", max_shard_size=0)
        assert list(tmp_path.iterdir()) == []

    def test_target_occupied_by_something_else(self, tmp_path):
        (tmp_path / "file").write_text("not a directory")
        with pytest.raises(ValueError, match="not a directory"):
            save_state_dict(WEIGHTS, tmp_path / "file")
        (tmp_path / "dir.safetensors").mkdir()
        with pytest.raises(ValueError, match="is a directory"):
            save_state_dict(WEIGHTS, tmp_path / "dir.safetensors", overwrite=True)

    @pytest.mark.parametrize("name", ["w.safetensors", "w.pt", "dir"])
    def test_unusual_but_valid_state_dicts(self, tmp_path, name):
        base = torch.arange(24.0).reshape(4, 6)
        state_dict = {
            "empty": torch.zeros(0, 3),
            "also_empty": torch.zeros(0),
            "view": base[1:3, ::2],  # non-contiguous view into a larger storage
            "base": base,
            "same": base,  # shared storage
            "bool": torch.tensor([True, False]),
            "param": torch.nn.Parameter(torch.ones(2)),
        }
        save_state_dict(state_dict, tmp_path / name)
        loaded = load_state_dict(tmp_path / name)
        assert loaded.keys() == state_dict.keys()
        for key, tensor in state_dict.items():
            assert loaded[key].dtype == tensor.dtype and torch.equal(loaded[key], tensor), key

    @pytest.mark.parametrize("name", ["w.safetensors", "w.pt", "dir"])
    def test_empty_state_dict_round_trips(self, tmp_path, name):
        save_state_dict({}, tmp_path / name)
        assert load_state_dict(tmp_path / name) == {}


class TestLoaders:
    def test_paths(self, tmp_path):
        for function in (load_state_dict, CheckpointFiles, load_hf_llama):
            with pytest.raises(TypeError, match="path: expected a path"):
                function(42)
        with pytest.raises(ValueError, match="path: expected a non-empty path"):
            load_state_dict("")

    @pytest.mark.parametrize(
        ("kwargs", "error", "match"),
        [
            ({"dtype": "float16"}, TypeError, "dtype: expected a torch.dtype"),
            ({"dtype": torch.int8}, ValueError, "dtype: expected float16"),
            ({"dtype": torch.float8_e4m3fn}, ValueError, "dtype: expected float16"),
            ({"device": 0.5}, TypeError, "device: expected a str or torch.device"),
            ({"device": "nonsense"}, ValueError, "device: 'nonsense' is not available"),
            ({"device": "meta"}, ValueError, "device: expected a device that holds data"),
            ({"max_seq_len": 0}, ValueError, "max_seq_len: expected a positive int"),
            ({"max_seq_len": True}, TypeError, "max_seq_len: expected a positive int"),
            ({"max_seq_len": 2**40}, ValueError, r"max_seq_len: expected less than 2\*\*31"),
        ],
    )
    def test_load_hf_llama_options(self, hf_dir, kwargs, error, match):
        with pytest.raises(error, match=match):
            load_hf_llama(hf_dir, **kwargs)

    @pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
    def test_unavailable_device(self, hf_dir):
        with pytest.raises(ValueError, match="device: 'cuda' is not available"):
            load_hf_llama(hf_dir, device="cuda")


class TestConversions:
    def test_hf_and_meta_state_dicts(self):
        decoder_sd = build_tiny_decoder().state_dict()
        for convert in (hf_to_fusion, fusion_to_hf):
            with pytest.raises(TypeError, match="state_dict: expected a mapping"):
                convert(list(decoder_sd.items()), num_heads=4, num_kv_heads=2)
            with pytest.raises(TypeError, match="num_heads: expected a positive int"):
                convert(decoder_sd, num_heads="4", num_kv_heads=2)
            with pytest.raises(ValueError, match="num_kv_heads: expected a positive int"):
                convert(decoder_sd, num_heads=4, num_kv_heads=0)
        q_key = "layers.0.attn.q_proj.weight"
        with pytest.raises(ValueError, match=rf"state_dict: expected .* got '{q_key}' -> list"):
            fusion_to_hf(decoder_sd | {q_key: [[1.0]]}, num_heads=4, num_kv_heads=2)
        with pytest.raises(ValueError, match=rf"state_dict: '{q_key}': expected a weight"):
            fusion_to_hf(decoder_sd, num_heads=3, num_kv_heads=2)
        for convert in (meta_to_fusion, fusion_to_meta):
            with pytest.raises(TypeError, match="state_dict: expected a mapping"):
                convert(None)
            with pytest.raises(ValueError, match="state_dict: expected string keys"):
                convert({0: torch.ones(1)})
            assert convert({}) == {}
        assert hf_to_fusion({}, num_heads=4, num_kv_heads=2) == {}

    def test_row_permutations(self):
        with pytest.raises(TypeError, match="weight: expected a tensor"):
            rotate_half_to_interleaved([[1.0]], 1)
        with pytest.raises(ValueError, match="num_heads: expected a positive int"):
            interleaved_to_rotate_half(torch.ones(4, 2), 0)
        with pytest.raises(TypeError, match="num_heads: expected a positive int"):
            interleaved_to_rotate_half(torch.ones(4, 2), 2.0)

    def test_select_prefix(self):
        with pytest.raises(TypeError, match="prefix: expected a str"):
            select_prefix({"decoder.a": torch.ones(1)}, None)
        with pytest.raises(TypeError, match="state_dict: expected a mapping"):
            select_prefix([("decoder.a", torch.ones(1))], "decoder.")
        with pytest.raises(ValueError, match="state_dict: expected string keys"):
            select_prefix({"decoder.a": torch.ones(1), 1: torch.ones(1)}, "decoder.")
        with pytest.raises(ValueError, match="state_dict: no key starts with"):
            select_prefix({}, "decoder.")
