"""Idefics3 / SmolVLM loaded from a directory ``transformers`` wrote: a tied SmolVLM's logits
equal ``SmolVLMForConditionalGeneration``'s with samples of different numbers of tiles; the
model's structure, SmolVLM-256M's shape and the builder's checks (the untied models' logits,
greedy generation, save, export and peft are the family suite's, ``tests/families``)."""

import pytest
import torch

from fusion import EarlyFusion
from fusion.checkpoint.hf_vlm import load_hf_idefics3
from fusion.early_fusion import fusion_parameter_names
from fusion.encoders import Idefics3Connector, SiglipVisionTransformer
from fusion.models import Idefics3ImageEncoder, idefics3, smolvlm_256m
from vlm_helpers import IDEFICS3_TOKENS, IMAGE_ID, TEXT_VOCAB, tiny_hf_idefics3

TILES = (1, 3)  # tiles of sample 0 and sample 1


def padded_tiles(tiles: torch.Tensor) -> torch.Tensor:
    """Packed tiles -> transformers' [batch, max tiles, 3, h, w], zero tiles as padding."""
    out = torch.zeros(2, max(TILES), *tiles.shape[1:])
    out[0, : TILES[0]] = tiles[: TILES[0]]
    out[1, : TILES[1]] = tiles[TILES[0] :]
    return out


def tile_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Two samples of the same length, with 1 and 3 tiles' placeholders."""
    generator = torch.Generator().manual_seed(0)
    t = IDEFICS3_TOKENS
    tokens = torch.randint(8, TEXT_VOCAB, (2, 4 * t + 8), generator=generator)
    tokens[:, 0] = 1
    tokens[0, 5 : 5 + t] = IMAGE_ID
    for start in (2, 3 + t, 4 + 2 * t):
        tokens[1, start : start + t] = IMAGE_ID
    tiles = torch.randn(sum(TILES), 3, 16, 16, generator=generator)
    return tokens, tiles


def loaded(directory, **config) -> tuple[torch.nn.Module, EarlyFusion]:
    hf = tiny_hf_idefics3(**config)
    hf.save_pretrained(directory)
    return hf, load_hf_idefics3(directory).eval()


@pytest.fixture(scope="module")
def default_pair(tmp_path_factory) -> tuple[torch.nn.Module, EarlyFusion]:
    return loaded(tmp_path_factory.mktemp("idefics3"))


@pytest.mark.parametrize(
    "config",
    [{"smolvlm": True, "tied": True}],
    ids=["smolvlm-tied"],
)
def test_logits_match_transformers(tmp_path, config):
    hf, model = loaded(tmp_path, **config)
    tokens, tiles = tile_batch()
    assert int((tokens == IMAGE_ID).sum()) == sum(TILES) * IDEFICS3_TOKENS
    with torch.no_grad():
        theirs = hf(input_ids=tokens, pixel_values=padded_tiles(tiles)).logits
        ours = model(tokens, encoder_input={"image": {"pixel_values": tiles}})
        text_only = hf(input_ids=tokens).logits
    assert (ours - theirs).abs().max() <= 1e-4
    assert (text_only - theirs).abs().max() > 1e-2  # the tiles matter


def test_structure(default_pair):
    _, model = default_pair
    encoder = model.encoders["image"]
    assert isinstance(encoder, Idefics3ImageEncoder)
    assert isinstance(encoder.vision_model, SiglipVisionTransformer)
    assert encoder.vision_model.embeddings.position_scheme == "bucketed"
    assert encoder.tokens_per_image == IDEFICS3_TOKENS
    assert model.encoder_tokens == {"image": IMAGE_ID}
    connector = {f"encoders.image.connector.{n}" for n, _ in encoder.connector.named_parameters()}
    assert fusion_parameter_names(model) == connector


def test_smolvlm_256m_shape():
    with torch.device("meta"):
        model = smolvlm_256m()
    params = sum(p.numel() for p in model.parameters())
    assert 250e6 < params < 265e6, params
    encoder = model.encoders["image"]
    assert encoder.tokens_per_image == 64 and encoder.vision_model.image_size == 512
    assert model.decoder.embed_dim == 576 and len(model.decoder.layers) == 30


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
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "image_size": 8,
        "patch_size": 2,
    }
    model = idefics3(text=text, vision=vision, image_token_id=64, scale_factor=2)
    assert model.encoders["image"](torch.randn(3, 3, 8, 8)).shape == (3, 4, 16)
    tower = SiglipVisionTransformer(**vision)
    with pytest.raises(ValueError, match="scale_factor: expected a divisor of the patch grid's"):
        Idefics3ImageEncoder(tower, Idefics3Connector(8, 16, scale_factor=3))
    with pytest.raises(ValueError, match="connector: expected an input width of 32"):
        Idefics3ImageEncoder(tower, Idefics3Connector(4, 16, scale_factor=2))
