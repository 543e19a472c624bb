import io

import pytest
import torch

from fusion.decoder import RotaryPositionalEmbeddings
from fusion.models import llama3_2, scale_hidden_dim_for_mlp
from helpers import VOCAB, build_tiny_decoder


def expected_keys(num_layers: int, tied: bool) -> set[str]:
    per_layer = [
        "sa_norm.scale",
        "attn.q_proj.weight",
        "attn.k_proj.weight",
        "attn.v_proj.weight",
        "attn.output_proj.weight",
        "mlp_norm.scale",
        "mlp.w1.weight",
        "mlp.w2.weight",
        "mlp.w3.weight",
    ]
    keys = {"tok_embeddings.weight", "norm.scale"}
    keys |= {f"layers.{i}.{k}" for i in range(num_layers) for k in per_layer}
    return keys if tied else keys | {"output.weight"}


@pytest.mark.parametrize("tied", [True, False])
def test_state_dict_keys_follow_torchtune_layout(tied):
    decoder = build_tiny_decoder(tie_word_embeddings=tied)
    assert set(decoder.state_dict()) == expected_keys(2, tied)
    assert {name for name, _ in decoder.named_parameters()} == expected_keys(2, tied)


@pytest.mark.parametrize("tied", [True, False])
def test_save_load_round_trip(tied):
    source = build_tiny_decoder(tie_word_embeddings=tied, seed=0)
    target = build_tiny_decoder(tie_word_embeddings=tied, seed=1)
    buffer = io.BytesIO()
    torch.save(source.state_dict(), buffer)
    buffer.seek(0)
    target.load_state_dict(torch.load(buffer, weights_only=True), strict=True)
    tokens = torch.randint(0, VOCAB, (2, 9))
    assert torch.equal(source(tokens), target(tokens))


def test_tied_output_stays_tied():
    decoder = build_tiny_decoder(tie_word_embeddings=True)
    decoder.load_state_dict(build_tiny_decoder(seed=3).state_dict(), strict=True)
    decoder = decoder.to(torch.float64)
    hidden = torch.randn(1, 3, decoder.embed_dim, dtype=torch.float64)
    expected = (hidden @ decoder.tok_embeddings.weight.T).float()
    assert torch.equal(decoder.unembed(hidden), expected)
    wrapped = torch.nn.Sequential(decoder)
    assert "0.output.weight" not in wrapped.state_dict()


def test_presets_have_published_shapes():
    with torch.device("meta"):
        one_b = torch.nn.Module()
        from fusion.models import llama3_2_1b, llama3_2_3b

        one_b, three_b = llama3_2_1b(), llama3_2_3b()
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert round(count(one_b) / 1e9, 2) == 1.24  # Llama 3.2 1B: 1.24B parameters
    assert round(count(three_b) / 1e9, 2) == 3.21  # Llama 3.2 3B: 3.21B parameters
    assert three_b.layers[0].attn.num_kv_heads == 8 and len(three_b.layers) == 28


def test_default_mlp_width():
    assert scale_hidden_dim_for_mlp(4096) == 11008
    decoder = llama3_2(VOCAB, 1, 4, 4, 64, 16)
    assert decoder.layers[0].mlp.w1.out_features == scale_hidden_dim_for_mlp(64)


def test_llama3_rope_scaling():
    plain = RotaryPositionalEmbeddings(64, 16, base=500_000)
    scaled = RotaryPositionalEmbeddings(64, 16, base=500_000, scale_factor=32)
    theta, theta_scaled = plain._frequencies(), scaled._frequencies()
    wavelen = 2 * torch.pi / theta
    assert torch.equal(theta_scaled[wavelen < 8192 / 4], theta[wavelen < 8192 / 4])
    assert torch.allclose(theta_scaled[wavelen > 8192], theta[wavelen > 8192] / 32)
    assert (theta_scaled <= theta).all()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"embed_dim": 30}, r"embed_dim: expected a multiple of num_heads=4, got 30"),
        ({"num_kv_heads": 3}, r"num_kv_heads: expected a divisor of num_heads=4, got 3"),
        ({"num_layers": 0}, r"num_layers: expected a positive integer, got 0"),
    ],
)
def test_builder_rejects_bad_config(kwargs, match):
    config = dict(
        vocab_size=VOCAB, num_layers=1, num_heads=4, num_kv_heads=2, embed_dim=32, max_seq_len=16
    )
    with pytest.raises(ValueError, match=match):
        llama3_2(**{**config, **kwargs})


@pytest.mark.parametrize("tied", [True, False])
def test_a_fresh_model_starts_near_the_uniform_loss(tied):
    """Initial logits are O(1): the loss on random tokens is close to ln(vocab) (with
    nn.Embedding's N(0, 1) as the tied output it was about 24x that at these sizes)."""
    torch.manual_seed(0)
    vocab, dim = 32_000, 256
    decoder = llama3_2(vocab, 2, 8, 2, dim, 64, tie_word_embeddings=tied)
    tokens = torch.randint(0, vocab, (2, 32))
    with torch.no_grad():
        logits = decoder(tokens)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
    assert abs(loss.item() - torch.log(torch.tensor(float(vocab))).item()) < 1.0, loss
