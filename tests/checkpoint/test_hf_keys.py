import pytest
import torch

from fusion.checkpoint import (
    fusion_to_hf,
    fusion_to_meta,
    hf_to_fusion,
    load_state_dict,
    meta_to_fusion,
)
from fusion.checkpoint.keys import (
    fusion_key_to_hf,
    hf_key_to_fusion,
    interleaved_to_rotate_half,
    rotate_half_to_interleaved,
)
from fusion.decoder import RotaryPositionalEmbeddings
from helpers import build_tiny_decoder


def rotate_half_rope(x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    """Hugging Face's RoPE convention, written out: channel i pairs with i + head_dim / 2."""
    head_dim = x.size(-1)
    theta = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(positions.float(), theta)  # [s, head_dim / 2]
    cos = torch.cat([angles.cos(), angles.cos()], -1)[None, :, None]
    sin = torch.cat([angles.sin(), angles.sin()], -1)[None, :, None]
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-second, first], -1) * sin


class TestRowPermutation:
    def test_inverse_of_each_other_bitwise(self):
        weight = torch.randn(4 * 8, 32)
        meta = rotate_half_to_interleaved(weight, num_heads=4)
        assert not torch.equal(meta, weight)
        assert torch.equal(interleaved_to_rotate_half(meta, num_heads=4), weight)
        assert torch.equal(meta.sort(0).values, weight.sort(0).values)  # rows only move

    def test_layouts_rotate_the_same_vectors(self):
        # q = W x in each layout; rotating in each convention must give the same values,
        # only in permuted channel order.
        num_heads, head_dim, dim, seq = 2, 8, 16, 5
        weight_hf = torch.randn(num_heads * head_dim, dim)
        x = torch.randn(1, seq, dim)
        positions = torch.arange(seq) * 7
        q_hf = (x @ weight_hf.T).view(1, seq, num_heads, head_dim)
        q_meta = (x @ rotate_half_to_interleaved(weight_hf, num_heads).T).view(q_hf.shape)
        rope = RotaryPositionalEmbeddings(head_dim, max_seq_len=64, base=10_000.0)
        rotated_meta = rope(q_meta, positions)
        rotated_hf = rotate_half_rope(q_hf, positions, base=10_000.0)
        as_hf = interleaved_to_rotate_half(rotated_meta.reshape(-1, head_dim).T, 1).T
        torch.testing.assert_close(as_hf.reshape(rotated_hf.shape), rotated_hf)

    @pytest.mark.parametrize("shape", [(30, 8), (4 * 6, 8, 1)])
    def test_bad_shape_raises(self, shape):
        with pytest.raises(ValueError, match="weight"):
            rotate_half_to_interleaved(torch.zeros(shape), num_heads=4)


class TestStateDicts:
    @pytest.mark.parametrize("tied", [True, False])
    def test_round_trip_is_bitwise(self, tied):
        state_dict = build_tiny_decoder(tie_word_embeddings=tied).state_dict()
        hf = fusion_to_hf(state_dict, num_heads=4, num_kv_heads=2)
        assert ("lm_head.weight" in hf) is not tied
        assert hf["model.layers.1.mlp.down_proj.weight"] is state_dict["layers.1.mlp.w2.weight"]
        back = hf_to_fusion(hf, num_heads=4, num_kv_heads=2)
        assert back.keys() == state_dict.keys()
        for key, tensor in state_dict.items():
            assert torch.equal(back[key], tensor), key

    def test_key_names(self):
        pairs = {
            "model.embed_tokens.weight": "tok_embeddings.weight",
            "model.norm.weight": "norm.scale",
            "lm_head.weight": "output.weight",
            "model.layers.11.self_attn.o_proj.weight": "layers.11.attn.output_proj.weight",
            "model.layers.0.mlp.gate_proj.weight": "layers.0.mlp.w1.weight",
            "model.layers.0.mlp.up_proj.weight": "layers.0.mlp.w3.weight",
            "model.layers.2.input_layernorm.weight": "layers.2.sa_norm.scale",
            "model.layers.2.post_attention_layernorm.weight": "layers.2.mlp_norm.scale",
        }
        for hf, ours in pairs.items():
            assert hf_key_to_fusion(hf) == ours
            assert fusion_key_to_hf(ours) == hf

    def test_inv_freq_buffers_are_skipped(self):
        hf = {"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(4)}
        assert hf_to_fusion(hf, num_heads=1, num_kv_heads=1) == {}

    def test_unknown_keys_raise(self):
        # (q_norm, once the example here, is Qwen3's and known now; attention sinks are not)
        with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.sinks"):
            hf_to_fusion(
                {"model.layers.0.self_attn.sinks": torch.ones(4)},
                num_heads=1,
                num_kv_heads=1,
            )
        with pytest.raises(ValueError, match=r"encoders\.image\.proj"):
            fusion_to_hf({"encoders.image.proj.weight": torch.ones(4)}, num_heads=1, num_kv_heads=1)


class TestMetaKeys:
    @pytest.mark.parametrize("tied", [True, False])
    def test_round_trip_and_names(self, tied, tmp_path):
        decoder = build_tiny_decoder(tie_word_embeddings=tied)
        state_dict = decoder.state_dict()
        meta = fusion_to_meta(state_dict)
        assert meta["layers.1.attention.wq.weight"] is state_dict["layers.1.attn.q_proj.weight"]
        assert {
            "layers.0.feed_forward.w2.weight",
            "layers.0.ffn_norm.weight",
            "norm.weight",
        } <= set(meta)
        # Meta files are plain tensor dicts: they load with torch.load(weights_only=True).
        torch.save(meta, tmp_path / "consolidated.00.pth")
        fresh = build_tiny_decoder(tie_word_embeddings=tied, seed=5)
        fresh.load_state_dict(meta_to_fusion(load_state_dict(tmp_path / "consolidated.00.pth")))
        tokens = torch.randint(0, 64, (2, 7))
        assert torch.equal(fresh(tokens), decoder(tokens))

    def test_meta_and_hf_layouts_agree(self):
        # Meta's layout is ours, so HF q/k rows are Meta's rows permuted.
        state_dict = build_tiny_decoder().state_dict()
        meta, hf = fusion_to_meta(state_dict), fusion_to_hf(state_dict, num_heads=4, num_kv_heads=2)
        assert torch.equal(
            interleaved_to_rotate_half(meta["layers.0.attention.wk.weight"], 2),
            hf["model.layers.0.self_attn.k_proj.weight"],
        )

    def test_unknown_keys_raise(self):
        with pytest.raises(ValueError, match=r"layers\.0\.attention\.wqkv"):
            meta_to_fusion({"layers.0.attention.wqkv.weight": torch.ones(1)})
        with pytest.raises(ValueError, match=r"encoders\.x"):
            fusion_to_meta({"encoders.x": torch.ones(1)})
