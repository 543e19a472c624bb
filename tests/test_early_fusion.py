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
    VOCAB,
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


class TestTrainableFlagsAreOptIn:
    def test_no_flag_changes_no_requires_grad(self):
        decoder = build_tiny_decoder()
        decoder.layers[0].requires_grad_(False)  # the user froze a layer
        encoder = TinyEncoder()
        before = {n: p.requires_grad for n, p in decoder.named_parameters()}
        model = EarlyFusion(decoder, {"image": encoder}, {"image": IMAGE_ID})
        assert {n: p.requires_grad for n, p in decoder.named_parameters()} == before
        assert all(p.requires_grad for p in encoder.parameters())
        assert sum(p.requires_grad for p in model.parameters()) == sum(before.values()) + 4

    @pytest.mark.parametrize(
        ("flags", "decoder", "encoders", "fusion_flag"),
        [
            ({"fusion_trainable": True}, False, False, True),
            ({"decoder_trainable": True}, True, False, True),
            ({"encoders_trainable": {"image": True, "audio": False}}, False, None, True),
            ({"fusion_trainable": False}, False, False, False),
        ],
    )
    def test_any_flag_applies_torchtunes_semantics(self, flags, decoder, encoders, fusion_flag):
        model = build_tiny_fusion(**flags)
        per_encoder = flags.get("encoders_trainable") or dict.fromkeys(["image", "audio"], encoders)
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


# ---------------------------------------------------------------- through the decoder's modules


class LoRAEmbedding(nn.Module):
    """LoRA-style: the base table plus a low-rank update; no ``weight`` of its own."""

    def __init__(self, base: nn.Embedding, rank: int = 2) -> None:
        super().__init__()
        self.base = base
        self.lora_a = nn.Parameter(torch.randn(base.num_embeddings, rank) * 0.1)
        self.lora_b = nn.Parameter(torch.randn(rank, base.embedding_dim) * 0.1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.base(ids) + nn.functional.embedding(ids, self.lora_a) @ self.lora_b


class ScaledEmbedding(nn.Embedding):
    """Gemma-style: the looked-up rows times sqrt(d)."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) * self.embedding_dim**0.5


def merged_rows(model: EarlyFusion, tokens, encoder_input=None) -> torch.Tensor:
    """The input of the first layer: the merged embeddings [b, s, d]."""
    model.output_hidden_states = [0]
    try:
        return model(tokens, encoder_input=encoder_input)[0]
    finally:
        model.output_hidden_states = []


class TestThroughTheDecodersModules:
    @pytest.mark.parametrize("wrap", ["lora", "scaled"])
    @pytest.mark.parametrize("impl", ["reference", "index"])
    def test_text_rows_are_what_the_embedding_module_returns(self, wrap, impl):
        decoder = build_tiny_decoder(tie_word_embeddings=False)
        encoders = {"image": TinyEncoder(), "audio": TinyEncoder()}
        model = EarlyFusion(
            decoder, encoders, {"image": IMAGE_ID, "audio": AUDIO_ID}, merge_impl=impl
        )
        if wrap == "lora":
            decoder.tok_embeddings = LoRAEmbedding(decoder.tok_embeddings)
        else:
            scaled = ScaledEmbedding(decoder.vocab_size, decoder.embed_dim)
            scaled.load_state_dict(decoder.tok_embeddings.state_dict())
            decoder.tok_embeddings = scaled
        tokens, encoder_input = multimodal_batch()
        merged = merged_rows(model, tokens, encoder_input)
        text = (tokens != IMAGE_ID) & (tokens != AUDIO_ID)
        expected = decoder.tok_embeddings(tokens.masked_fill(~text, 0))
        assert torch.equal(merged[text], expected[text])
        rows = model.encode(encoder_input)
        assert torch.equal(merged[tokens == IMAGE_ID], rows["image"].reshape(-1, EMBED_DIM))
        assert torch.equal(model(text_tokens(2, 6)), decoder(text_tokens(2, 6)))

    def test_gradients_reach_a_wrapped_embedding(self):
        decoder = build_tiny_decoder(tie_word_embeddings=False)
        encoders = {"image": TinyEncoder(), "audio": TinyEncoder()}
        model = EarlyFusion(
            decoder, encoders, {"image": IMAGE_ID, "audio": AUDIO_ID}, decoder_trainable=True
        )
        model.decoder.tok_embeddings = LoRAEmbedding(model.decoder.tok_embeddings)
        tokens, encoder_input = multimodal_batch()
        model(tokens, encoder_input=encoder_input).sum().backward()
        lora = model.decoder.tok_embeddings
        assert lora.lora_a.grad is not None and lora.lora_a.grad.abs().sum() > 0
        unused = sorted(set(range(VOCAB)) - set(tokens.unique().tolist()) - {0})
        assert lora.lora_a.grad[unused].abs().sum() == 0  # only embedded ids get a gradient

    def test_tied_output_needs_the_wrappers_weight(self):
        model = build_tiny_fusion()
        model.decoder.tok_embeddings = LoRAEmbedding(model.decoder.tok_embeddings)
        with pytest.raises(RuntimeError, match=r"tied output: tok_embeddings \(LoRAEmbedding\)"):
            model(text_tokens(1, 3))

    def test_hooks_on_the_embedding_and_output_run(self):
        decoder = build_tiny_decoder(tie_word_embeddings=False)
        model = EarlyFusion(decoder, {"image": TinyEncoder()}, {"image": IMAGE_ID})
        calls = []
        decoder.tok_embeddings.register_forward_hook(lambda m, a, out: calls.append("embed"))
        decoder.output.register_forward_hook(lambda m, a, out: calls.append("output") or out * 2)
        tokens = text_tokens(2, 5)
        doubled = model(tokens)
        assert calls == ["embed", "output"]
        decoder.output._forward_hooks.clear()
        assert torch.equal(doubled, 2 * model(tokens))

    def test_decoder_embedding_runs_inside_the_decoders_forward(self):
        """So that hooks on the decoder (FSDP's unshard when it is its own unit) come first."""
        model = build_tiny_fusion()
        order = []
        model.decoder.register_forward_pre_hook(lambda m, a: order.append("decoder"))
        model.decoder.tok_embeddings.register_forward_pre_hook(lambda m, a: order.append("embed"))
        model(*multimodal_batch()[:1], encoder_input=multimodal_batch()[1])
        assert order == ["decoder", "embed"]


class TestAutocast:
    def test_low_precision_rows_are_merged_in_the_text_dtype(self):
        model = build_tiny_fusion(encoders_trainable=True)
        tokens, encoder_input = multimodal_batch()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            rows = model.encode(encoder_input)
            assert rows["image"].dtype == torch.bfloat16  # the encoders' Linear ran in bf16
            merged = merged_rows(model, tokens, rows)
            logits = model(tokens, encoder_input=encoder_input)
        assert merged.dtype == torch.float32  # the table's dtype: embedding is not autocast
        image = rows["image"].reshape(-1, EMBED_DIM).float()
        assert torch.equal(merged[tokens == IMAGE_ID], image)
        logits.sum().backward()
        grads = [p.grad for p in model.encoders["image"].parameters()]
        assert all(g is not None and g.abs().sum() > 0 for g in grads)

    def test_text_only_logits_equal_the_decoders_under_the_same_autocast(self):
        model = build_tiny_fusion()
        tokens = text_tokens(2, 7)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert torch.equal(model(tokens), model.decoder(tokens))

    def test_outside_autocast_other_dtypes_are_refused(self):
        model = build_tiny_fusion()
        tokens, _ = multimodal_batch()
        rows = {"image": torch.zeros(5, EMBED_DIM, dtype=torch.bfloat16)}
        with pytest.raises(ValueError, match=r"encoder 'image' rows: expected dtype torch.float32"):
            model(tokens, encoder_input={**rows, "audio": torch.zeros(1, EMBED_DIM)})
        rows = {"image": torch.zeros(5, EMBED_DIM, dtype=torch.long)}
        with torch.autocast("cpu", dtype=torch.bfloat16):  # integers: never cast
            with pytest.raises(ValueError, match=r"encoder 'image' rows: expected floating rows"):
                model(tokens, encoder_input={**rows, "audio": torch.zeros(1, EMBED_DIM)})


class TestBadArguments:
    """Each bad argument is refused with its name, before any encoder or layer runs."""

    @pytest.mark.parametrize(
        "dtype", [torch.int8, torch.uint8, torch.int16, torch.bool, torch.float32]
    )
    def test_token_dtypes(self, dtype):
        model = build_tiny_fusion()
        with pytest.raises(ValueError, match=r"tokens: expected integer ids \[b, s\] of dtype"):
            model(text_tokens(2, 4).to(dtype))

    def test_int32_tokens_work(self):
        model = build_tiny_fusion()
        tokens, encoder_input = multimodal_batch()
        expected = model(tokens, encoder_input=encoder_input)
        assert torch.equal(model(tokens.int(), encoder_input=encoder_input), expected)

    @pytest.mark.parametrize("shape", [(0, 4), (2, 0)])
    def test_empty(self, shape):
        model = build_tiny_fusion()
        with pytest.raises(ValueError, match=r"tokens: expected a non-empty batch and sequence"):
            model(torch.zeros(shape, dtype=torch.long))

    def test_wrong_device(self):
        model = build_tiny_fusion()
        tokens, _ = multimodal_batch()
        with pytest.raises(ValueError, match=r"tokens: expected device cpu .*got meta"):
            model(tokens.to("meta"))
        rows = {"image": torch.zeros(5, EMBED_DIM, device="meta"), "audio": torch.zeros(1, 32)}
        with pytest.raises(ValueError, match=r"encoder 'image' rows: expected device cpu"):
            model(tokens, encoder_input=rows)
        with pytest.raises(ValueError, match=r"mask: expected device cpu, got meta"):
            model(tokens, mask=torch.ones(1, 10, 10, dtype=torch.bool, device="meta"))
        with pytest.raises(ValueError, match=r"input_pos: expected device cpu, got meta"):
            model(tokens, input_pos=torch.arange(10, device="meta"))

    def test_encoder_returning_something_else(self):
        class Bad(nn.Module):
            def forward(self, features):
                return [features]

        model = EarlyFusion(build_tiny_decoder(), {"image": Bad()}, {"image": IMAGE_ID})
        tokens, encoder_input = multimodal_batch()
        with pytest.raises(TypeError, match=r"encoder 'image' rows: expected a tensor, or a Pa"):
            model(tokens, encoder_input={"image": encoder_input["image"]})
        with pytest.raises(TypeError, match=r"encoder 'image' rows: expected a tensor"):
            model(tokens, encoder_input={"image": Padded([1, 2])})

    @pytest.mark.parametrize("token_id", [69.0, "69", torch.tensor(69), True])
    def test_placeholder_ids_must_be_ints(self, token_id):
        with pytest.raises(TypeError, match=r"encoder_tokens: expected str names and int"):
            EarlyFusion(build_tiny_decoder(), {"image": TinyEncoder()}, {"image": token_id})

    def test_constructor_types(self):
        with pytest.raises(TypeError, match=r"decoder: expected a fusion TransformerDecoder"):
            EarlyFusion(torch.compile(build_tiny_decoder()), {}, {})
        with pytest.raises(TypeError, match=r"encoders: expected a mapping of name -> nn.Module"):
            EarlyFusion(build_tiny_decoder(), {"image": lambda x: x}, {"image": IMAGE_ID})
        with pytest.raises(ValueError, match=r"merge_impl: expected 'auto' or one of"):
            EarlyFusion(build_tiny_decoder(), {}, {}, merge_impl="fast")


def test_placeholder_ids_are_checked_at_construction_and_read_only():
    """Checked once when the model is built (not again on every forward); then read-only, so
    they cannot change unchecked."""
    model = build_tiny_fusion()
    assert model.encoder_tokens == {"image": IMAGE_ID, "audio": AUDIO_ID}
    with pytest.raises(TypeError):
        model.encoder_tokens["image"] = AUDIO_ID  # type: ignore[index]
