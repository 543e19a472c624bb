"""LLaVA loaded from a directory ``transformers`` wrote: logits equal
``LlavaForConditionalGeneration``'s on the same weights with the config's feature-layer,
feature-strategy, projector and tying options (the default config's logits, greedy generation,
save, export and peft are the family suite's, ``tests/families``)."""

import pytest
import torch

from fusion import EarlyFusion
from fusion.checkpoint.hf_vlm import load_hf_llava
from fusion.early_fusion import fusion_parameter_names
from fusion.encoders import ClipVisionTransformer, LlavaProjector
from fusion.models import LlavaImageEncoder, llava
from vlm_helpers import IMAGE_ID, LLAVA_TOKENS, TEXT_VOCAB, tiny_hf_llava


def prompt_batch(tokens_per_image: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two samples of the same length: one image in the first, two in the second."""
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(8, TEXT_VOCAB, (2, 3 * tokens_per_image + 6), generator=generator)
    tokens[:, 0] = 1
    tokens[0, 3 : 3 + tokens_per_image] = IMAGE_ID
    tokens[1, 1 : 1 + tokens_per_image] = IMAGE_ID
    tokens[1, 4 + tokens_per_image : 4 + 2 * tokens_per_image] = IMAGE_ID
    pixels = torch.randn(3, 3, 16, 16, generator=generator)
    return tokens, pixels


def loaded(directory, **config) -> tuple[torch.nn.Module, EarlyFusion]:
    hf = tiny_hf_llava(**config)
    hf.save_pretrained(directory)
    return hf, load_hf_llava(directory).eval()


@pytest.fixture(scope="module")
def default_pair(tmp_path_factory) -> tuple[torch.nn.Module, EarlyFusion]:
    return loaded(tmp_path_factory.mktemp("llava"))


@pytest.mark.parametrize(
    "config",
    [
        {"vision_feature_select_strategy": "full"},
        {"vision_feature_layer": [-3, -1], "projector_hidden_act": "quick_gelu"},
        {"tied": True, "multimodal_projector_bias": False, "vision_feature_layer": 1},
    ],
    ids=["full", "two-layers", "tied-nobias-layer1"],
)
def test_logits_match_transformers(tmp_path, config):
    hf, model = loaded(tmp_path, **config)
    per_image = LLAVA_TOKENS + (config.get("vision_feature_select_strategy") == "full")
    assert model.encoders["image"].tokens_per_image == per_image
    tokens, pixels = prompt_batch(per_image)
    with torch.no_grad():
        theirs = hf(input_ids=tokens, pixel_values=pixels).logits
        ours = model(tokens, encoder_input={"image": {"pixel_values": pixels}})
    assert (ours - theirs).abs().max() <= 1e-4
    # The images matter: without them (placeholders as text) the logits are far off.
    with torch.no_grad():
        text_only = hf(input_ids=tokens).logits
    assert (text_only - theirs).abs().max() > 1e-2


def test_structure(default_pair):
    _, model = default_pair
    encoder = model.encoders["image"]
    assert isinstance(encoder, LlavaImageEncoder)
    assert isinstance(encoder.vision_tower, ClipVisionTransformer)
    assert model.encoder_tokens == {"image": IMAGE_ID}
    assert model.decoder.output is not None  # untied, as the config says
    projector = {
        f"encoders.image.multi_modal_projector.{n}"
        for n, _ in encoder.multi_modal_projector.named_parameters()
    }
    assert fusion_parameter_names(model) == projector  # trainable with fusion_trainable


def test_builder_and_encoder_checks():
    text = {
        "vocab_size": 64,
        "num_layers": 1,
        "num_heads": 2,
        "num_kv_heads": 1,
        "embed_dim": 16,
        "max_seq_len": 64,
    }
    vision = {
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "image_size": 8,
        "patch_size": 4,
    }
    model = llava(text=text, vision=vision, image_token_id=64)
    out = model.encoders["image"](torch.randn(2, 3, 8, 8))
    assert out.shape == (2, 4, 16)
    tower = ClipVisionTransformer(**vision)
    with pytest.raises(ValueError, match="vision_feature_select_strategy: expected one of"):
        LlavaImageEncoder(tower, LlavaProjector(8, 16), vision_feature_select_strategy="cls")
    with pytest.raises(ValueError, match=r"multi_modal_projector: expected an input width of 16"):
        LlavaImageEncoder(tower, LlavaProjector(8, 16), vision_feature_layer=[-1, -2])
    with pytest.raises(ValueError, match="vision_feature_layer: expected an int in"):
        LlavaImageEncoder(tower, LlavaProjector(8, 16), vision_feature_layer=3)
    with pytest.raises(ValueError, match="vision_feature_layer: expected at least one layer"):
        LlavaImageEncoder(tower, LlavaProjector(0 + 8, 16), vision_feature_layer=[])
