import itertools
from pathlib import Path

import pytest
import torch
from torch import nn

import fusion
from fusion import EarlyFusion, Packed, Padded
from helpers import (
    AUDIO_ID,
    EMBED_DIM,
    FEATURES,
    IMAGE_ID,
    TinyEncoder,
    build_tiny_decoder,
    build_tiny_fusion,
    text_tokens,
)


def multimodal_batch():
    """2 samples: sample 0 has 2 image + 1 audio placeholders, sample 1 has 3 image ones."""
    tokens = text_tokens(2, 10)
    tokens[0, 1:3] = IMAGE_ID
    tokens[0, 6] = AUDIO_ID
    tokens[1, 4:7] = IMAGE_ID
    gen = torch.Generator().manual_seed(5)
    encoder_input = {
        "image": {"features": torch.randn(5, 1, FEATURES, generator=gen)},
        "audio": {"features": torch.randn(1, FEATURES, generator=gen)},
    }
    return tokens, encoder_input


class TestDropIn:
    def test_no_module_replaced_and_decoder_still_works(self):
        decoder = build_tiny_decoder()
        tokens = text_tokens(2, 8)
        before = decoder(tokens)
        model = EarlyFusion(decoder, {"image": TinyEncoder()}, {"image": IMAGE_ID})
        assert model.decoder is decoder
        assert type(decoder.tok_embeddings) is nn.Embedding
        assert torch.equal(decoder(tokens), before)
        assert torch.equal(model(tokens), before)  # no encoder input: bitwise the decoder's

    def test_names_and_keys(self):
        model = build_tiny_fusion()
        names = {name for name, _ in model.named_parameters()}
        assert names == set(model.state_dict())
        assert {k for k in names if k.startswith("decoder.")} == {
            f"decoder.{k}" for k in build_tiny_decoder().state_dict()
        }

    def test_no_state_dict_hooks_anywhere(self):
        model = build_tiny_fusion()
        for module in model.modules():
            assert not module._state_dict_hooks and not module._state_dict_pre_hooks
            assert not module._load_state_dict_pre_hooks
            assert not module._load_state_dict_post_hooks
        package = Path(fusion.__file__).parent
        for source in package.rglob("*.py"):
            text = source.read_text()
            assert "state_dict_hook" not in text and "state_dict_pre_hook" not in text, source

    def test_encoder_rows_land_on_placeholders(self):
        model = build_tiny_fusion()
        tokens, encoder_input = multimodal_batch()
        model.decoder.skip_output_layer = True
        model.decoder.output_hidden_states = [0]  # the decoder's input embeddings
        embeds, _ = model(tokens, encoder_input=encoder_input)
        image = model.encoders["image"](**encoder_input["image"]).reshape(-1, EMBED_DIM)
        audio = model.encoders["audio"](**encoder_input["audio"])
        assert torch.equal(embeds[tokens == IMAGE_ID], image)
        assert torch.equal(embeds[tokens == AUDIO_ID], audio)
        text = (tokens != IMAGE_ID) & (tokens != AUDIO_ID)
        assert torch.equal(embeds[text], model.decoder.tok_embeddings(tokens[text]))

    def test_precomputed_outputs_equal_encoder_input_and_encode_once(self):
        model = build_tiny_fusion()
        tokens, encoder_input = multimodal_batch()
        calls = []
        model.encoders["image"].register_forward_hook(lambda *_: calls.append(1))
        expected = model(tokens, encoder_input=encoder_input)
        cached = model.encode(encoder_input)
        assert len(calls) == 2
        assert torch.equal(model(tokens, encoder_input=cached), expected)
        assert len(calls) == 2  # precomputed rows are not re-encoded
        rows = cached["image"].reshape(-1, EMBED_DIM)
        padded = torch.zeros(2, 4, EMBED_DIM)
        padded[0, :2], padded[1, :3] = rows[:2], rows[2:]
        mixed = {"image": Padded(padded), "audio": Packed(cached["audio"])}
        assert torch.equal(model(tokens, encoder_input=mixed), expected)

    def test_gradients_reach_encoders_and_embedding_table(self):
        model = build_tiny_fusion(decoder_trainable=True, encoders_trainable=True)
        tokens, encoder_input = multimodal_batch()
        model(tokens, encoder_input=encoder_input).sum().backward()
        for name, param in model.named_parameters():
            assert param.grad is not None and param.grad.abs().sum() > 0, name

    def test_delegates_to_decoder(self):
        model = build_tiny_fusion()
        tokens, encoder_input = multimodal_batch()
        full = model(tokens, encoder_input=encoder_input)
        assert not model.caches_are_setup()
        model.setup_caches(2, torch.float32, decoder_max_seq_len=12)
        assert model.caches_are_setup() and model.caches_are_enabled()
        assert model.decoder.caches_are_enabled()
        prefill = model(tokens[:, :7], encoder_input=encoder_input)
        step = model(tokens[:, 7:])
        torch.testing.assert_close(torch.cat([prefill, step], 1), full, atol=1e-5, rtol=1e-5)
        with model.caches_disabled():
            assert not model.caches_are_enabled()
        model.reset_caches()
        assert model.decoder.layers[0].attn.kv_cache.size == 0
        model.skip_output_layer = True
        assert model.decoder.skip_output_layer
        hidden = model(text_tokens(2, 3), encoder_input={"image": torch.zeros(0, EMBED_DIM)})
        assert hidden.shape == (2, 3, EMBED_DIM)
        assert model.unembed(hidden).shape == (2, 3, model.decoder.vocab_size)

    def test_compiles_without_graph_break(self):
        model = build_tiny_fusion()
        tokens, encoder_input = multimodal_batch()
        expected = model(tokens, encoder_input=encoder_input)
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
        torch.testing.assert_close(compiled(tokens, encoder_input=encoder_input), expected)


def _expected_trainable(decoder: bool, encoders: dict[str, bool], fusion: bool) -> set[str]:
    """The flag rules spelled out per parameter name, independently of the implementation."""
    names = {name for name, _ in build_tiny_fusion().named_parameters()}
    result = set()
    for name in names:
        if name.startswith("decoder."):
            if decoder:
                result.add(name)
            continue
        encoder = name.split(".")[1]
        is_fusion = name.split(".")[2] == "proj"
        if (is_fusion and fusion) or (not is_fusion and encoders[encoder]):
            result.add(name)
    return result


@pytest.mark.parametrize(
    ("decoder", "encoders", "fusion_flag"),
    [
        (d, e, f)
        for d, e, f in itertools.product(
            [False, True],
            [False, True, {"image": True, "audio": False}, {"image": False, "audio": True}],
            [False, True],
        )
    ],
)
def test_trainable_flags(decoder, encoders, fusion_flag):
    model = build_tiny_fusion(
        decoder_trainable=decoder, encoders_trainable=encoders, fusion_trainable=fusion_flag
    )
    per_encoder = (
        encoders if isinstance(encoders, dict) else dict.fromkeys(["image", "audio"], encoders)
    )
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable == _expected_trainable(decoder, per_encoder, fusion_flag)


class TestBadInput:
    def test_name_mismatch_lists_both(self):
        decoder = build_tiny_decoder()
        with pytest.raises(
            ValueError, match=r"encoders has \['image'\], encoder_tokens has \['audio'\]"
        ):
            EarlyFusion(decoder, {"image": TinyEncoder()}, {"audio": 3})
        with pytest.raises(ValueError, match=r"encoders_trainable has \['img'\]"):
            EarlyFusion(
                decoder, {"image": TinyEncoder()}, {"image": 3}, encoders_trainable={"img": True}
            )
        with pytest.raises(ValueError, match=r"encoder_tokens: expected distinct placeholder ids"):
            EarlyFusion(decoder, {"a": TinyEncoder(), "b": TinyEncoder()}, {"a": 3, "b": 3})

    def test_unknown_encoder_input(self):
        model = build_tiny_fusion()
        with pytest.raises(ValueError, match=r"encoder_input: unknown encoder names \['video'\]"):
            model(text_tokens(1, 4), encoder_input={"video": {}})

    def test_placeholders_without_rows(self):
        model = build_tiny_fusion()
        tokens, _ = multimodal_batch()
        with pytest.raises(
            ValueError, match=r"encoder 'image'.*must equal the 0 packed rows given"
        ):
            model(tokens)

    def test_count_mismatch_names_encoder_counts_and_rows(self):
        model = build_tiny_fusion()
        tokens, encoder_input = multimodal_batch()
        encoder_input["image"] = torch.zeros(4, EMBED_DIM)
        with pytest.raises(
            ValueError,
            match=r"encoder 'image': the tokens' placeholder count \(id 69\) must equal the 4 "
            r"packed rows given; per-sample placeholder counts: \[2, 3\]",
        ):
            model(tokens, encoder_input=encoder_input)

    def test_wrong_dim_or_dtype(self):
        model = build_tiny_fusion()
        tokens, encoder_input = multimodal_batch()
        encoder_input["image"] = torch.zeros(5, EMBED_DIM + 1)
        with pytest.raises(
            ValueError, match=r"encoder 'image' rows: expected width 32 .*got shape \[5, 33\]"
        ):
            model(tokens, encoder_input=encoder_input)
        encoder_input["image"] = torch.zeros(5, EMBED_DIM, dtype=torch.bfloat16)
        with pytest.raises(ValueError, match=r"expected dtype torch.float32 .*got torch.bfloat16"):
            model(tokens, encoder_input=encoder_input)
