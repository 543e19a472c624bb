import json

import pytest
import torch

from fusion.checkpoint import CheckpointError, read_hf_config
from fusion.checkpoint.hf_config import hf_config_from_decoder, llama3_2_kwargs_from_hf_config
from fusion.models import llama3_2

LLAMA3_SCALING = {
    "factor": 32.0,
    "high_freq_factor": 4.0,
    "low_freq_factor": 1.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3",
}


def legacy_config(**overrides) -> dict:
    """A small config in the form Llama 3.2 checkpoints ship (rope_theta + rope_scaling)."""
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 96,
        "hidden_size": 32,
        "intermediate_size": 80,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": dict(LLAMA3_SCALING),
        "tie_word_embeddings": True,
        "hidden_act": "silu",
        "torch_dtype": "bfloat16",
    }
    return config | overrides


class TestKwargs:
    def test_legacy_llama3_config(self):
        kwargs = llama3_2_kwargs_from_hf_config(legacy_config())
        assert kwargs == {
            "vocab_size": 96,
            "num_layers": 3,
            "num_heads": 4,
            "num_kv_heads": 2,
            "embed_dim": 32,
            "max_seq_len": 256,
            "attn_dropout": 0.0,
            "rope_base": 500000.0,
            "intermediate_dim": 80,
            "norm_eps": 1e-5,
            "tie_word_embeddings": True,
            "scale_factor": 32.0,
            "rope_low_freq_factor": 1.0,
            "rope_high_freq_factor": 4.0,
            "rope_old_context_len": 8192,
        }

    def test_rope_parameters_form_reads_the_same(self):
        config = legacy_config()
        del config["rope_theta"], config["rope_scaling"]
        config["rope_parameters"] = LLAMA3_SCALING | {"rope_theta": 500000.0}
        assert llama3_2_kwargs_from_hf_config(config) == llama3_2_kwargs_from_hf_config(
            legacy_config()
        )

    def test_defaults_follow_hugging_face(self):
        config = legacy_config()
        for key in ("num_key_value_heads", "rms_norm_eps", "rope_theta", "rope_scaling"):
            del config[key]
        del config["tie_word_embeddings"]
        kwargs = llama3_2_kwargs_from_hf_config(config)
        assert kwargs["num_kv_heads"] == 4
        assert kwargs["norm_eps"] == 1e-6
        assert kwargs["rope_base"] == 10_000.0
        assert kwargs["scale_factor"] is None
        assert kwargs["tie_word_embeddings"] is False

    @pytest.mark.parametrize("tied", [True, False])
    @pytest.mark.parametrize("scaling", [None, LLAMA3_SCALING])
    def test_decoder_config_round_trip(self, tied, scaling):
        kwargs = llama3_2_kwargs_from_hf_config(
            legacy_config(rope_scaling=scaling, tie_word_embeddings=tied, attention_dropout=0.1)
        )
        config = hf_config_from_decoder(llama3_2(**kwargs).to(torch.bfloat16))
        assert config["torch_dtype"] == "bfloat16"
        assert llama3_2_kwargs_from_hf_config(json.loads(json.dumps(config))) == kwargs


class TestErrors:
    @pytest.mark.parametrize(
        ("overrides", "key"),
        [
            ({"hidden_size": None}, "hidden_size"),
            ({"model_type": "mistral"}, "model_type"),
            ({"attention_bias": True}, "attention_bias"),
            ({"mlp_bias": True}, "mlp_bias"),
            ({"hidden_act": "gelu"}, "hidden_act"),
            ({"head_dim": 16}, "head_dim"),
            ({"num_key_value_heads": 3}, "num_key_value_heads"),
            ({"num_hidden_layers": 0}, "num_hidden_layers"),
            ({"tie_word_embeddings": "yes"}, "tie_word_embeddings"),
            ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling"),
            ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling.low_freq"),
            ({"rms_norm_eps": "small"}, "rms_norm_eps"),
        ],
    )
    def test_unsupported_or_bad_values_name_file_and_key(self, overrides, key):
        config = legacy_config(**overrides)
        config = {k: v for k, v in config.items() if v is not None}
        with pytest.raises(CheckpointError, match=rf"my/config\.json, key '{key}") as info:
            llama3_2_kwargs_from_hf_config(config, source="my/config.json")
        assert info.value.key.startswith(key)

    def test_unreadable_config_names_the_file(self, tmp_path):
        (tmp_path / "config.json").write_text('{"vocab_size": 96,')
        with pytest.raises(CheckpointError, match=r"config\.json: unreadable config"):
            read_hf_config(tmp_path)
        with pytest.raises(CheckpointError, match=r"nowhere/config\.json"):
            read_hf_config(tmp_path / "nowhere" / "config.json")

    def test_non_llama_decoder_cannot_be_described(self):
        decoder = llama3_2(96, 2, 4, 2, 32, 64, intermediate_dim=64)
        decoder.layers[1].sa_norm.eps = 1e-3
        with pytest.raises(ValueError, match="decoder: expected all layers configured alike"):
            hf_config_from_decoder(decoder)


def scaling(**overrides) -> dict:
    return {"rope_scaling": LLAMA3_SCALING | overrides}


class TestDegenerateValues:
    @pytest.mark.parametrize(
        ("overrides", "key", "value"),
        [
            ({"rope_theta": 0}, "rope_theta", "0"),
            ({"rope_theta": -10_000.0}, "rope_theta", "-10000.0"),
            ({"rms_norm_eps": -1}, "rms_norm_eps", "-1"),
            ({"rms_norm_eps": 0.0}, "rms_norm_eps", "0.0"),
            ({"attention_dropout": 1.5}, "attention_dropout", "1.5"),
            (scaling(factor=0), "rope_scaling.factor", "0"),
            (scaling(low_freq_factor=0), "rope_scaling.low_freq_factor", "0"),
            (scaling(high_freq_factor=1.0), "rope_scaling.high_freq_factor", "1.0"),
            (scaling(high_freq_factor=0.5), "rope_scaling.high_freq_factor", "0.5"),
            (
                scaling(original_max_position_embeddings=0.5),
                "rope_scaling.original_max_position_embeddings",
                "0.5",
            ),
            ({"num_attention_heads": 0}, "num_attention_heads", "0"),
            ({"num_attention_heads": -4}, "num_attention_heads", "-4"),
            ({"num_key_value_heads": 0}, "num_key_value_heads", "0"),
            ({"num_attention_heads": 5}, "hidden_size", "32"),  # 5 heads do not divide 32
            ({"num_attention_heads": 8, "hidden_size": 24}, "hidden_size", "24 / 8"),  # odd
            ({"max_position_embeddings": 0}, "max_position_embeddings", "0"),
            ({"vocab_size": 2**40}, "vocab_size", str(2**40)),
        ],
    )
    def test_refused_naming_key_and_value(self, overrides, key, value):
        with pytest.raises(CheckpointError) as info:
            llama3_2_kwargs_from_hf_config(legacy_config(**overrides), source="c.json")
        assert info.value.key == key and f"got {value}" in str(info.value)

    def test_rope_parameters_keys_are_named_as_written(self):
        config = legacy_config()
        del config["rope_scaling"]
        config["rope_parameters"] = LLAMA3_SCALING | {"factor": 0, "rope_theta": 5e5}
        with pytest.raises(CheckpointError) as info:
            llama3_2_kwargs_from_hf_config(config)
        assert info.value.key == "rope_parameters.factor"

    def test_arguments_of_the_wrong_type(self, tmp_path):
        with pytest.raises(TypeError, match="config: expected a mapping"):
            llama3_2_kwargs_from_hf_config([("vocab_size", 96)])
        with pytest.raises(TypeError, match="source: expected a path"):
            llama3_2_kwargs_from_hf_config(legacy_config(), source=3)
        with pytest.raises(TypeError, match="path: expected a path"):
            read_hf_config(3)
        with pytest.raises(TypeError, match="decoder: expected a TransformerDecoder"):
            hf_config_from_decoder(torch.nn.Linear(2, 2))
