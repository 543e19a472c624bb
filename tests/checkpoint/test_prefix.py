import pytest
import torch
from torch import nn

from fusion import EarlyFusion
from fusion.checkpoint import load_state_dict, save_state_dict, select_prefix
from helpers import EMBED_DIM, VOCAB, build_tiny_decoder

IMAGE = VOCAB + 1  # placeholder outside the text vocabulary


def tiny_fusion(seed: int) -> EarlyFusion:
    decoder = build_tiny_decoder(tie_word_embeddings=False, seed=seed)
    return EarlyFusion(decoder, {"image": nn.Linear(6, EMBED_DIM)}, {"image": IMAGE})


def text_tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(2))


def test_fusion_checkpoint_into_plain_decoder(tmp_path):
    fusion_model = tiny_fusion(seed=0)
    save_state_dict(fusion_model.state_dict(), tmp_path / "fusion.safetensors")
    decoder = build_tiny_decoder(tie_word_embeddings=False, seed=1)
    state_dict = load_state_dict(tmp_path / "fusion.safetensors")
    decoder.load_state_dict(select_prefix(state_dict, "decoder."))  # strict: every key, no other
    tokens = text_tokens()
    assert torch.equal(decoder(tokens), fusion_model(tokens))


def test_plain_checkpoint_into_fusion_decoder(tmp_path):
    decoder = build_tiny_decoder(tie_word_embeddings=False, seed=0)
    save_state_dict(decoder.state_dict(), tmp_path / "decoder.safetensors")
    fusion_model = tiny_fusion(seed=1)
    fusion_model.decoder.load_state_dict(load_state_dict(tmp_path / "decoder.safetensors"))
    tokens = text_tokens()
    assert torch.equal(fusion_model(tokens), decoder(tokens))


def test_select_prefix_errors():
    with pytest.raises(ValueError, match="prefix"):
        select_prefix({"decoder.norm.scale": torch.ones(1)}, "decoder")
    with pytest.raises(ValueError, match=r"no key starts with 'decoder\.'"):
        select_prefix({"norm.scale": torch.ones(1)}, "decoder.")
