"""LLaVA and Idefics3 directories: both key layouts transformers writes, single and sharded
files, round trips both ways (bit for bit), and bad directories refused by name."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from fusion import EarlyFusion, TransformerDecoder
from fusion.checkpoint import CheckpointError
from fusion.checkpoint.hf_llama import load_hf_llama
from fusion.checkpoint.hf_vlm import (
    hf_model_kind,
    load_hf_idefics3,
    load_hf_llava,
    load_hf_model,
    load_hf_vlm,
    read_hf_vlm_layout,
    save_hf_idefics3,
    save_hf_llava,
)
from fusion.models import llava
from helpers import tiny_hf_llama
from vlm_helpers import IMAGE_ID, TEXT_VOCAB, tiny_hf_idefics3, tiny_hf_llava


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llava")
    hf = tiny_hf_llava()
    hf.save_pretrained(directory)
    return hf, directory


@pytest.fixture(scope="module")
def idefics3_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("idefics3")
    hf = tiny_hf_idefics3()
    hf.save_pretrained(directory)
    return hf, directory


def same_state(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


def copy_config(source, target) -> dict:
    target.mkdir(exist_ok=True)
    config = json.loads((source / "config.json").read_text())
    (target / "config.json").write_text(json.dumps(config))
    return config


def write_config(directory, config: dict) -> None:
    (directory / "config.json").write_text(json.dumps(config))


class TestRoundTrips:
    @pytest.mark.parametrize("shard", [None, 20_000], ids=["single", "sharded"])
    def test_llava_ours_to_hf_to_ours(self, tmp_path, llava_dir, shard):
        from transformers import LlavaForConditionalGeneration

        hf, directory = llava_dir
        model = load_hf_llava(directory)
        written = save_hf_llava(model, tmp_path / "ours", max_shard_size=shard)
        assert (tmp_path / "ours" / "config.json") in written
        if shard:
            assert (tmp_path / "ours" / "model.safetensors.index.json").is_file()
        keys = set()
        for file in written:
            if file.suffix == ".safetensors":
                keys |= set(load_file(file))
        assert "language_model.model.embed_tokens.weight" in keys  # the Hub layout
        assert "vision_tower.vision_model.pre_layrnorm.weight" in keys
        reloaded = LlavaForConditionalGeneration.from_pretrained(tmp_path / "ours").eval()
        same_state(reloaded, hf)  # ours -> HF is the checkpoint's bits
        same_state(load_hf_llava(tmp_path / "ours"), model)  # HF -> ours too

    def test_idefics3_ours_to_hf_to_ours(self, tmp_path, idefics3_dir):
        from transformers import Idefics3ForConditionalGeneration, SmolVLMForConditionalGeneration

        hf, directory = idefics3_dir
        model = load_hf_idefics3(directory)
        save_hf_idefics3(model, tmp_path / "ours", max_shard_size=30_000)
        same_state(Idefics3ForConditionalGeneration.from_pretrained(tmp_path / "ours"), hf)
        smol = SmolVLMForConditionalGeneration.from_pretrained(tmp_path / "ours")
        assert smol.state_dict().keys() == hf.state_dict().keys()
        same_state(load_hf_idefics3(tmp_path / "ours"), model)

    def test_tied_model_round_trip(self, tmp_path):
        from transformers import LlavaForConditionalGeneration

        hf = tiny_hf_llava(tied=True)
        hf.save_pretrained(tmp_path / "hf")
        model = load_hf_llava(tmp_path / "hf")
        assert model.decoder.output is None
        save_hf_llava(model, tmp_path / "ours")
        assert "language_model.lm_head.weight" not in load_file(
            tmp_path / "ours" / "model.safetensors"
        )
        same_state(LlavaForConditionalGeneration.from_pretrained(tmp_path / "ours"), hf)

    def test_builder_model_saves_and_loads(self, tmp_path):
        text = {
            "vocab_size": 64,
            "num_layers": 1,
            "num_heads": 2,
            "num_kv_heads": 1,
            "embed_dim": 16,
            "max_seq_len": 64,
            "rope_base": 10_000,
            "scale_factor": None,
        }
        vision = {
            "hidden_size": 8,
            "intermediate_size": 16,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "image_size": 8,
            "patch_size": 4,
        }
        model = llava(text=text, vision=vision, image_token_id=63, vision_feature_layer=[-1, 0])
        save_hf_llava(model, tmp_path)
        same_state(load_hf_llava(tmp_path), model)
        config = json.loads((tmp_path / "config.json").read_text())
        assert config["vision_feature_layer"] == [-1, 0]
        assert config["image_token_index"] == 63 and config["image_seq_length"] == 4


class TestLayouts:
    def test_llava_in_memory_layout(self, tmp_path, llava_dir):
        hf, directory = llava_dir
        copy_config(directory, tmp_path)
        state = {k: v.contiguous() for k, v in hf.state_dict().items()}
        assert "lm_head.weight" in state and "model.language_model.norm.weight" in state
        save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
        same_state(load_hf_llava(tmp_path), load_hf_llava(directory))

    def test_llava_vision_model_prefix_and_torch_bin(self, tmp_path, llava_dir):
        _, directory = llava_dir
        copy_config(directory, tmp_path)
        state = load_file(directory / "model.safetensors")
        legacy = {
            k.replace("vision_tower.", "vision_tower.vision_model.", 1): v for k, v in state.items()
        }
        # Old checkpoints also saved derived buffers: skipped.
        legacy["vision_tower.vision_model.embeddings.position_ids"] = torch.arange(17)[None]
        torch.save(legacy, tmp_path / "pytorch_model.bin")
        same_state(load_hf_llava(tmp_path), load_hf_llava(directory))

    def test_idefics3_bare_model_layout(self, tmp_path, idefics3_dir):
        _, directory = idefics3_dir
        copy_config(directory, tmp_path)
        state = load_file(directory / "model.safetensors")
        bare = {k.removeprefix("model."): v for k, v in state.items()}
        save_file(bare, tmp_path / "model.safetensors", metadata={"format": "pt"})
        same_state(load_hf_idefics3(tmp_path), load_hf_idefics3(directory))

    def test_sub_config_defaults_as_transformers_4_writes_them(self, tmp_path, llava_dir):
        # transformers 4.x leaves out of config.json the values equal to the defaults.
        _, directory = llava_dir
        config = copy_config(directory, tmp_path)
        for key in ("hidden_act", "layer_norm_eps", "num_channels", "model_type"):
            config["vision_config"].pop(key)
        for key in ("vision_feature_layer", "vision_feature_select_strategy"):
            config.pop(key)
        write_config(tmp_path, config)
        (tmp_path / "model.safetensors").symlink_to(directory / "model.safetensors")
        same_state(load_hf_llava(tmp_path), load_hf_llava(directory))

    def test_kind_and_layout(self, llava_dir, idefics3_dir, tmp_path):
        assert hf_model_kind(llava_dir[1]) == "llava"
        assert hf_model_kind(idefics3_dir[1] / "config.json") == "idefics3"
        tiny_hf_llama(tied=True).save_pretrained(tmp_path)
        assert hf_model_kind(tmp_path) == "llama"
        layout = read_hf_vlm_layout(idefics3_dir[1])
        assert (layout.kind, layout.image_token_id, layout.tokens_per_image) == (
            "idefics3",
            IMAGE_ID,
            16,
        )
        assert isinstance(load_hf_vlm(llava_dir[1]).encoders["image"].vision_tower, torch.nn.Module)

    def test_load_hf_model_takes_whichever_the_directory_holds(
        self, llava_dir, idefics3_dir, tmp_path
    ):
        tiny_hf_llama(tied=True).save_pretrained(tmp_path)
        llama = load_hf_model(tmp_path, dtype=torch.float64, max_seq_len=24)
        assert type(llama) is TransformerDecoder and llama.max_seq_len == 24
        assert llama.tok_embeddings.weight.dtype == torch.float64
        same_state(llama, load_hf_llama(tmp_path, dtype=torch.float64, max_seq_len=24))
        for directory in (llava_dir[1], idefics3_dir[1]):
            model = load_hf_model(directory)
            assert type(model) is EarlyFusion
            same_state(model, load_hf_vlm(directory))
        config = copy_config(llava_dir[1], tmp_path / "other")
        config["model_type"] = "paligemma"
        write_config(tmp_path / "other", config)
        with pytest.raises(CheckpointError, match=r"model_type.*'paligemma'"):
            load_hf_model(tmp_path / "other")


class TestBadInput:
    def test_other_model_types(self, tmp_path, llava_dir, idefics3_dir):
        tiny_hf_llama(tied=True).save_pretrained(tmp_path)
        with pytest.raises(
            CheckpointError, match=r"'model_type'.*got 'llama' \(a plain Llama: use load_hf_model\)"
        ):
            load_hf_llava(tmp_path)
        with pytest.raises(CheckpointError, match=r"'model_type'.*expected one of \['llava'\]"):
            load_hf_llava(idefics3_dir[1])
        with pytest.raises(CheckpointError, match=r"expected one of \['idefics3', 'smolvlm'\]"):
            load_hf_idefics3(llava_dir[1])
        config = copy_config(llava_dir[1], tmp_path / "qwen")
        config["model_type"] = "paligemma"
        write_config(tmp_path / "qwen", config)
        with pytest.raises(CheckpointError, match=r"model_type.*'paligemma'"):
            hf_model_kind(tmp_path / "qwen")

    @pytest.mark.parametrize(
        ("edit", "match"),
        [
            (
                lambda c: c.pop("vision_config"),
                r"'vision_config': missing; a LLaVA config needs it",
            ),
            (lambda c: c.pop("text_config"), r"'text_config': missing"),
            (lambda c: c.update(vision_config=[1]), r"'vision_config': expected an object"),
            (
                lambda c: c["vision_config"].update(model_type="siglip_vision_model"),
                r"'vision_config.model_type': expected one of \['clip_vision_model'\]",
            ),
            (
                lambda c: c["text_config"].update(num_attention_heads=5),
                r"'text_config.hidden_size': expected a multiple of num_attention_heads=5",
            ),
            (
                lambda c: c["text_config"].update(model_type="mistral"),
                r"'text_config.model_type': expected 'llama'",
            ),
            (
                lambda c: c["vision_config"].update(hidden_act="tanh"),
                r"'vision_config.hidden_act': expected one of",
            ),
            (lambda c: c.update(vision_feature_layer=7), r"vision_feature_layer: expected an int"),
            (
                lambda c: c.update(vision_feature_select_strategy="cls"),
                r"'vision_feature_select_strategy': expected one of",
            ),
            (
                lambda c: c["vision_config"].update(num_hidden_layers=9),
                r"'vision_config.num_hidden_layers': 9, but the checkpoint holds weights for 3",
            ),
            (
                lambda c: c["vision_config"].update(image_size=32),
                r"'vision_tower.embeddings.position_embedding.weight': shape \[17, 16\] differs "
                r"from \[65, 16\]",
            ),
            (
                lambda c: c.update(image_token_index=True),
                r"'image_token_index': expected an id, got True",
            ),
            (
                lambda c: c.update(projector_hidden_act=["gelu"]),
                r"'projector_hidden_act': expected one of .*, got \['gelu'\]",
            ),
            (
                lambda c: c["vision_config"].update(hidden_act={"name": "gelu"}),
                r"'vision_config.hidden_act': expected one of .*, got \{'name': 'gelu'\}",
            ),
        ],
        ids=[
            "no-vision",
            "no-text",
            "vision-not-object",
            "siglip-tower",
            "text-heads",
            "text-mistral",
            "act",
            "feature-layer",
            "strategy",
            "layers",
            "image-size",
            "token",
            "act-list",
            "vision-act-dict",
        ],
    )
    def test_bad_config(self, tmp_path, llava_dir, edit, match):
        config = copy_config(llava_dir[1], tmp_path)
        edit(config)
        write_config(tmp_path, config)
        (tmp_path / "model.safetensors").symlink_to(llava_dir[1] / "model.safetensors")
        with pytest.raises(CheckpointError, match=match):
            load_hf_llava(tmp_path)

    @pytest.mark.parametrize(
        ("edit", "match"),
        [
            (
                lambda s: s.update(extra=torch.zeros(1)),
                r"'extra': unexpected key for a llava model",
            ),
            (
                lambda s: s.pop("multi_modal_projector.linear_2.bias"),
                r"'multi_modal_projector.linear_2.bias': missing from the checkpoint",
            ),
            (
                lambda s: s.setdefault(
                    "model.multi_modal_projector.linear_1.bias",
                    s["multi_modal_projector.linear_1.bias"].clone(),
                ),
                r"mixes two key layouts",
            ),
            (
                lambda s: s.update({"language_model.model.norm.weight": torch.ones(8)}),
                r"'language_model.model.norm.weight': shape \[8\] differs from \[32\]",
            ),
            (
                lambda s: s.update(
                    {"multi_modal_projector.linear_2.bias": torch.zeros(32, dtype=torch.int32)}
                ),
                r"stored as torch.int32",
            ),
            (
                lambda s: s.update(
                    {"vision_tower.post_layernorm.bias": torch.zeros(16, dtype=torch.float16)}
                ),
                r"several dtypes",
            ),
        ],
        ids=["unexpected", "missing", "two-layouts", "shape", "int", "mixed-dtypes"],
    )
    def test_bad_weights(self, tmp_path, llava_dir, edit, match):
        copy_config(llava_dir[1], tmp_path)
        state = load_file(llava_dir[1] / "model.safetensors")
        edit(state)
        save_file(state, tmp_path / "model.safetensors")
        with pytest.raises(CheckpointError, match=match):
            load_hf_llava(tmp_path)

    def test_tied_lm_head_that_differs(self, tmp_path):
        hf = tiny_hf_llava(tied=True)
        hf.save_pretrained(tmp_path)
        state = load_file(tmp_path / "model.safetensors")
        state["language_model.lm_head.weight"] = torch.zeros(TEXT_VOCAB, 32)
        save_file(state, tmp_path / "model.safetensors")
        with pytest.raises(
            CheckpointError,
            match=r"tie_word_embeddings.*differs from language_model\.model\.embed_tokens\.weight",
        ):
            load_hf_llava(tmp_path)

    def test_bad_arguments(self, llava_dir):
        with pytest.raises(ValueError, match="dtype: expected float16"):
            load_hf_llava(llava_dir[1], dtype=torch.int8)
        with pytest.raises(ValueError, match="device: expected a device that holds data"):
            load_hf_llava(llava_dir[1], device="meta")
        with pytest.raises(TypeError, match="path: expected a path"):
            load_hf_llava(3)

    def test_savers_refuse_other_models(self, tmp_path, llava_dir, idefics3_dir):
        llava_model = load_hf_llava(llava_dir[1])
        with pytest.raises(
            ValueError, match="expected one encoder, 'image', a Idefics3ImageEncoder"
        ):
            save_hf_idefics3(llava_model, tmp_path / "a")
        with pytest.raises(TypeError, match="model: expected an EarlyFusion"):
            save_hf_llava(llava_model.decoder, tmp_path / "b")
        llava_model.encoder_tokens = {"image": TEXT_VOCAB + 3}
        with pytest.raises(ValueError, match=r"placeholder id 131 lies outside the vocabulary"):
            save_hf_llava(llava_model, tmp_path / "c")
        model = load_hf_idefics3(idefics3_dir[1])
        model.encoders["image"].vision_model.encoder.layers[0].layer_norm1.eps = 0.1
        with pytest.raises(ValueError, match="a LayerNorm differs from what its config describes"):
            save_hf_idefics3(model, tmp_path / "d")
        # A module without parameters that the config cannot describe.
        llava_model.encoder_tokens = {"image": IMAGE_ID}
        llava_model.encoders["image"].vision_tower.extra = torch.nn.Identity()
        with pytest.raises(ValueError, match=r"^model: not a llava model .* modules, expected"):
            save_hf_llava(llava_model, tmp_path / "e")
        assert not any((tmp_path / name).exists() for name in "abcde")

    def test_no_silent_overwrite(self, tmp_path, llava_dir):
        model = load_hf_llava(llava_dir[1])
        save_hf_llava(model, tmp_path)
        with pytest.raises(CheckpointError, match=r"config\.json: exists; pass overwrite=True"):
            save_hf_llava(model, tmp_path)
        save_hf_llava(model, tmp_path, overwrite=True)
