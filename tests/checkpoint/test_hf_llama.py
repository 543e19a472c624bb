"""Parity with a real implementation: tiny random ``transformers`` Llamas, saved and loaded."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaForCausalLM

from fusion.checkpoint import CheckpointError, load_hf_llama, save_hf_llama
from helpers import HF_VOCAB as VOCAB
from helpers import build_tiny_decoder, tiny_hf_llama

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # With head_dim 8 and theta 5e5 the wavelengths (6, 167, 4444, 118000) fall in all three
    # bands of llama3 scaling: kept, interpolated and divided by the factor.
    "original_max_position_embeddings": 256,
}


def random_tokens(seq: int = 300) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, seq), generator=torch.Generator().manual_seed(1))


def max_diff(hf_model: LlamaForCausalLM, decoder, tokens: torch.Tensor) -> float:
    with torch.no_grad():
        return (hf_model(tokens).logits - decoder.eval()(tokens)).abs().max().item()


class TestParityWithTransformers:
    @pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
    @pytest.mark.parametrize("scaling", [None, LLAMA3_SCALING], ids=["plain", "llama3"])
    def test_logits_match(self, tmp_path, tied, scaling):
        hf_model = tiny_hf_llama(tied=tied, rope_scaling=scaling)
        hf_model.save_pretrained(tmp_path)
        decoder = load_hf_llama(tmp_path)
        assert (decoder.output is None) is tied
        assert decoder.tok_embeddings.weight.dtype == torch.float32
        assert max_diff(hf_model, decoder, random_tokens()) <= 1e-4

    def test_scaling_is_exercised(self, tmp_path):
        # The tolerance above is meaningful: ignoring the rope scaling is far outside it.
        hf_model = tiny_hf_llama(tied=False, rope_scaling=LLAMA3_SCALING)
        hf_model.save_pretrained(tmp_path)
        config = json.loads((tmp_path / "config.json").read_text())
        for key in ("rope_scaling", "rope_parameters"):
            config.pop(key, None)
        config["rope_theta"] = 500_000.0
        (tmp_path / "config.json").write_text(json.dumps(config))
        assert max_diff(hf_model, load_hf_llama(tmp_path), random_tokens()) > 1e-2

    def test_sharded_checkpoint(self, tmp_path):
        hf_model = tiny_hf_llama(tied=False, rope_scaling=LLAMA3_SCALING)
        hf_model.save_pretrained(tmp_path, max_shard_size="20KB")
        assert (tmp_path / "model.safetensors.index.json").is_file()
        assert max_diff(hf_model, load_hf_llama(tmp_path), random_tokens()) <= 1e-4

    def test_torch_bin_checkpoint(self, tmp_path):
        hf_model = tiny_hf_llama(tied=True, rope_scaling=None)
        hf_model.config.save_pretrained(tmp_path)
        weights = {k: v for k, v in hf_model.state_dict().items() if k != "lm_head.weight"}
        torch.save(weights, tmp_path / "pytorch_model.bin")
        assert max_diff(hf_model, load_hf_llama(tmp_path), random_tokens()) <= 1e-4

    @pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
    def test_our_save_loads_in_transformers(self, tmp_path, tied):
        hf_model = tiny_hf_llama(tied=tied, rope_scaling=LLAMA3_SCALING)
        hf_model.save_pretrained(tmp_path / "hf")
        decoder = load_hf_llama(tmp_path / "hf")
        save_hf_llama(decoder, tmp_path / "ours", max_shard_size=20_000)
        reloaded = LlamaForCausalLM.from_pretrained(tmp_path / "ours", attn_implementation="eager")
        assert max_diff(reloaded.eval(), decoder, random_tokens()) <= 1e-4
        for key, tensor in hf_model.state_dict().items():  # ours -> HF is the same bits
            assert torch.equal(reloaded.state_dict()[key], tensor), key


class TestRoundTrip:
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    @pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
    def test_ours_to_hf_to_ours_is_bitwise(self, tmp_path, tied, dtype):
        decoder = build_tiny_decoder(tie_word_embeddings=tied).to(dtype)
        save_hf_llama(decoder, tmp_path, max_shard_size=10_000)
        loaded = load_hf_llama(tmp_path)
        assert loaded.tok_embeddings.weight.dtype == dtype
        expected, actual = decoder.state_dict(), loaded.state_dict()
        assert actual.keys() == expected.keys()
        for key, tensor in expected.items():
            assert torch.equal(actual[key], tensor), key
        rope = loaded.layers[0].attn.pos_embeddings
        assert rope.cache.dtype == torch.float32
        fresh = build_tiny_decoder().layers[0].attn.pos_embeddings.cache
        assert torch.equal(rope.cache, fresh)  # rebuilt in float32, even for bfloat16 weights

    def test_dtype_and_max_seq_len_overrides(self, tmp_path):
        save_hf_llama(build_tiny_decoder().to(torch.bfloat16), tmp_path)
        loaded = load_hf_llama(tmp_path, dtype=torch.float32, max_seq_len=16)
        assert loaded.tok_embeddings.weight.dtype == torch.float32
        assert loaded.max_seq_len == 16
        assert loaded.layers[0].attn.pos_embeddings.cache.shape[0] == 16

    def test_refuses_to_overwrite(self, tmp_path):
        save_hf_llama(build_tiny_decoder(), tmp_path)
        with pytest.raises(CheckpointError, match=r"config\.json: exists"):
            save_hf_llama(build_tiny_decoder(), tmp_path)
        save_hf_llama(build_tiny_decoder(seed=3), tmp_path, overwrite=True)
        expected = build_tiny_decoder(seed=3).state_dict()
        assert all(
            torch.equal(load_hf_llama(tmp_path).state_dict()[k], v) for k, v in expected.items()
        )


def saved(tmp_path, *, tied: bool = False):
    save_hf_llama(build_tiny_decoder(tie_word_embeddings=tied), tmp_path)
    return tmp_path / "model.safetensors", load_file(tmp_path / "model.safetensors")


class TestErrors:
    def test_shape_mismatch_names_file_and_key(self, tmp_path):
        file, _ = saved(tmp_path)
        config = json.loads((tmp_path / "config.json").read_text())
        config["intermediate_size"] = 48
        (tmp_path / "config.json").write_text(json.dumps(config))
        with pytest.raises(CheckpointError, match=r"64.* differs from .*48.* config\.json") as e:
            load_hf_llama(tmp_path)
        assert e.value.file == file
        assert e.value.key.endswith(("gate_proj.weight", "up_proj.weight", "down_proj.weight"))

    def test_missing_key(self, tmp_path):
        file, weights = saved(tmp_path)
        del weights["model.layers.1.self_attn.k_proj.weight"]
        save_file(weights, file)
        with pytest.raises(CheckpointError, match="missing from the checkpoint") as info:
            load_hf_llama(tmp_path)
        assert info.value.key == "model.layers.1.self_attn.k_proj.weight"

    def test_unexpected_key(self, tmp_path):
        file, weights = saved(tmp_path)
        weights["model.layers.2.self_attn.q_proj.weight"] = torch.zeros(32, 32)
        save_file(weights, file)
        with pytest.raises(CheckpointError, match="unexpected key") as info:
            load_hf_llama(tmp_path)
        assert (
            info.value.file == file and info.value.key == "model.layers.2.self_attn.q_proj.weight"
        )

    def test_lm_head_of_a_tied_model(self, tmp_path):
        file, weights = saved(tmp_path, tied=True)
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
        save_file(weights, file)
        load_hf_llama(tmp_path)  # a redundant equal copy is fine
        weights["lm_head.weight"][0, 0] += 1
        save_file(weights, file)
        with pytest.raises(CheckpointError, match=r"differs from model\.embed_tokens") as info:
            load_hf_llama(tmp_path)
        assert info.value.key == "lm_head.weight"

    def test_truncated_shard(self, tmp_path):
        save_hf_llama(build_tiny_decoder(), tmp_path, max_shard_size=10_000)
        shard = sorted(tmp_path.glob("model-*.safetensors"))[1]
        shard.write_bytes(shard.read_bytes()[:-100])
        with pytest.raises(CheckpointError, match="truncated") as info:
            load_hf_llama(tmp_path)
        assert info.value.file == shard and info.value.key is not None

    def test_mixed_dtypes_need_a_dtype(self, tmp_path):
        file, weights = saved(tmp_path)
        weights["model.norm.weight"] = weights["model.norm.weight"].half()
        save_file(weights, file)
        with pytest.raises(CheckpointError, match="several dtypes"):
            load_hf_llama(tmp_path)
        assert load_hf_llama(tmp_path, dtype=torch.float32).norm.scale.dtype == torch.float32

    def test_missing_config(self, tmp_path):
        saved(tmp_path)
        (tmp_path / "config.json").unlink()
        with pytest.raises(CheckpointError, match=r"config\.json: unreadable config"):
            load_hf_llama(tmp_path)
