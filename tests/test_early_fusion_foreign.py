"""EarlyFusion over the three kinds of decoder: this library's, a torchtune-style one and a
Hugging Face Llama. The same promises for each: text-only output bitwise the decoder's own,
rows merged as the reference merge does, the plain decoder's keys, nothing replaced, gradients
everywhere, a merge without host reads, placeholders never embedded, bad input refused before
any layer runs."""

import inspect

import pytest
import torch
from foreign_decoders import (
    AUDIO,
    IMAGE,
    CachelessTorchtuneStyleDecoder,
    fuse,
    hf_llama,
    torchtune_style,
)
from torch import nn
from torch.overrides import TorchFunctionMode

import fusion._validation
import fusion.merge.placement
from fusion import EarlyFusion, merge_embeddings
from fusion.decoder_kinds import decoder_kind
from fusion.testing import assert_checkpoint_compatible
from helpers import EMBED_DIM, FEATURES, TinyEncoder, build_tiny_decoder, text_tokens

KINDS = ["fusion", "torchtune", "huggingface"]


def plain(kind: str, seed: int = 0) -> nn.Module:
    """The decoder of ``kind``, the same weights for the same seed."""
    if kind == "fusion":
        return build_tiny_decoder(seed=seed)
    if kind == "torchtune":
        return torchtune_style(seed=seed)
    return hf_llama(seed=seed)


def logits(out) -> torch.Tensor:
    return getattr(out, "logits", out)


def decoder_on(decoder: nn.Module, kind: str, *, ids=None, embeds=None) -> torch.Tensor:
    """The plain decoder's logits on ids or on embeddings, called as its library calls it."""
    if kind == "huggingface":
        return decoder(input_ids=ids, inputs_embeds=embeds).logits
    return decoder(ids, input_embeds=embeds)


def embedding(decoder: nn.Module, kind: str) -> nn.Module:
    return decoder.get_input_embeddings() if kind == "huggingface" else decoder.tok_embeddings


def multimodal_batch():
    """2 samples: sample 0 has 2 image and 1 audio placeholders, sample 1 has 3 image ones."""
    tokens = text_tokens(2, 10)
    tokens[0, 1:3] = IMAGE
    tokens[0, 6] = AUDIO
    tokens[1, 4:7] = IMAGE
    gen = torch.Generator().manual_seed(5)
    encoder_input = {
        "image": {"features": torch.randn(5, 1, FEATURES, generator=gen)},
        "audio": {"features": torch.randn(1, FEATURES, generator=gen)},
    }
    return tokens, encoder_input


@pytest.mark.parametrize("kind", KINDS)
class TestEveryKind:
    def test_kind_read_from_attributes_without_calling_the_decoder(self, kind):
        decoder = plain(kind)
        calls = []
        for module in decoder.modules():
            module.register_forward_pre_hook(lambda *_: calls.append(1))
        model = fuse(decoder)
        assert model.decoder_kind == kind == decoder_kind(decoder)
        assert calls == []

    def test_text_only_output_is_bitwise_the_decoders(self, kind):
        decoder = plain(kind)
        tokens = text_tokens(2, 9)
        expected = decoder_on(decoder, kind, ids=tokens)
        model = fuse(decoder)
        assert torch.equal(logits(model(tokens)), expected)
        assert torch.equal(decoder_on(decoder, kind, ids=tokens), expected)  # still works alone

    def test_rows_equal_the_decoder_on_reference_merged_embeddings(self, kind):
        model = fuse(plain(kind))
        tokens, encoder_input = multimodal_batch()
        out = logits(model(tokens, encoder_input=encoder_input))
        rows = model.encode(encoder_input)
        merged = merge_embeddings(
            tokens,
            embedding(model.decoder, kind),
            rows,
            model.encoder_tokens,
            impl="reference",
        )
        assert torch.equal(out, decoder_on(model.decoder, kind, embeds=merged))
        text = decoder_on(model.decoder, kind, ids=torch.where(tokens >= 64, 5, tokens))
        assert not torch.allclose(out, text)  # the rows changed something

    def test_checkpoint_keys_nothing_replaced_no_hooks(self, kind):
        decoder = plain(kind)
        modules = {name: module for name, module in decoder.named_modules()}
        model = fuse(decoder)
        assert model.decoder is decoder
        assert dict(decoder.named_modules()) == modules  # same objects under the same names
        assert_checkpoint_compatible(model, model, plain(kind))
        for module in model.modules():
            assert not module._state_dict_hooks and not module._state_dict_pre_hooks
            assert not module._load_state_dict_pre_hooks
            assert not module._load_state_dict_post_hooks

    def test_gradients_reach_encoders_and_decoder(self, kind):
        model = fuse(plain(kind), decoder_trainable=True, encoders_trainable=True)
        tokens, encoder_input = multimodal_batch()
        logits(model(tokens, encoder_input=encoder_input)).square().mean().backward()
        for name, param in model.named_parameters():
            assert param.grad is not None and param.grad.abs().sum() > 0, name

    def test_requires_grad_flags_as_for_fusions_decoder(self, kind):
        decoder = plain(kind)
        decoder.requires_grad_(False)
        untouched = fuse(decoder)  # no flag: nothing changes
        assert not any(p.requires_grad for p in untouched.decoder.parameters())
        assert all(p.requires_grad for p in untouched.encoders.parameters())
        model = fuse(plain(kind), encoders_trainable={"image": True, "audio": False})
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        fusion = {n for n, _ in model.named_parameters() if ".proj." in n}
        image = {n for n, _ in model.named_parameters() if n.startswith("encoders.image.")}
        assert trainable == image | fusion  # decoder frozen by default, fusion modules trained

    def test_placeholders_never_reach_the_embedding(self, kind):
        model = fuse(plain(kind))
        seen = []
        embedding(model.decoder, kind).register_forward_pre_hook(
            lambda _, args: seen.append(args[0].clone())
        )
        tokens, encoder_input = multimodal_batch()
        model(tokens, encoder_input=encoder_input)
        (ids,) = seen
        placeholders = (tokens == IMAGE) | (tokens == AUDIO)
        assert not torch.isin(ids, torch.tensor([IMAGE, AUDIO])).any()
        assert torch.equal(ids[~placeholders], tokens[~placeholders])

    def test_bad_rows_refused_before_any_layer_runs(self, kind):
        model = fuse(plain(kind))
        ran = []
        for name, module in model.decoder.named_modules():
            if name.endswith("layers.0"):
                module.register_forward_pre_hook(lambda *_: ran.append(1))
        tokens, _ = multimodal_batch()
        image = torch.randn(5, EMBED_DIM)
        audio = torch.randn(1, EMBED_DIM)
        with pytest.raises(ValueError, match=r"encoder 'image' rows: expected width 32"):
            model(tokens, encoder_input={"image": torch.randn(5, 48), "audio": audio})
        model.encoders["audio"].double()  # an encoder returning float64 rows
        wide = {"features": torch.randn(1, FEATURES, dtype=torch.float64)}
        with pytest.raises(ValueError, match=r"encoder 'audio' rows: expected dtype torch.float"):
            model(tokens, encoder_input={"image": image, "audio": wide})
        with pytest.raises(ValueError, match=r"encoder 'image': the tokens' placeholder count"):
            model(tokens, encoder_input={"image": image[:4], "audio": audio})
        assert ran == []
        model(tokens, encoder_input={"image": image, "audio": audio})
        assert ran == [1]


class _HostReads(TorchFunctionMode):
    """Records what reads tensor values on the host (a synchronisation on accelerators),
    except inside ``skip``'s forward."""

    READS = frozenset({"item", "tolist", "__bool__", "__int__", "__float__", "nonzero"})

    def __init__(self, skip: nn.Module) -> None:
        super().__init__()
        self.reads: list[str] = []
        self.inside = 0
        skip.register_forward_pre_hook(lambda *_: setattr(self, "inside", self.inside + 1))
        skip.register_forward_hook(lambda *_: setattr(self, "inside", self.inside - 1))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if not self.inside:
            boolean_index = name == "__getitem__" and any(
                isinstance(a, torch.Tensor) and a.dtype == torch.bool for a in args[1:]
            )
            if name in self.READS or boolean_index or name == "unique":
                self.reads.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("kind", ["torchtune", "huggingface"])
def test_everything_but_the_decoder_is_sync_free(kind, monkeypatch):
    """Encoders and merge of an EarlyFusion over another library's decoder read nothing on the
    host, with the checks accelerators get (device-side assertions, here made to run on the
    CPU). This library's decoder is covered by compiling the whole model with
    ``fullgraph=True`` (test_early_fusion.py)."""
    model = fuse(plain(kind))
    tokens, encoder_input = multimodal_batch()
    expected = logits(model(tokens, encoder_input=encoder_input))
    monkeypatch.setattr(fusion._validation, "host_reads_are_free", lambda device: False)
    monkeypatch.setattr(fusion.merge.placement, "host_reads_are_free", lambda device: False)
    mode = _HostReads(model.decoder)
    with mode:
        out = logits(model(tokens, encoder_input=encoder_input))
    assert mode.reads == []
    assert torch.equal(out, expected)
    monkeypatch.undo()  # the CPU's eager checks read values: the probe sees them
    with _HostReads(model.decoder) as eager:
        model(tokens, encoder_input=encoder_input)
    assert "__bool__" in eager.reads


class TestHuggingFace:
    def test_keyword_arguments_pass_through_and_the_output_is_the_models(self):
        model = fuse(hf_llama())
        tokens, encoder_input = multimodal_batch()
        attention = torch.ones_like(tokens)
        attention[1, :2] = 0
        labels = text_tokens(2, 10, seed=3)
        out = model(tokens, encoder_input=encoder_input, attention_mask=attention, labels=labels)
        merged = merge_embeddings(
            tokens, model.decoder.get_input_embeddings(), model.encode(encoder_input), {
                "image": IMAGE, "audio": AUDIO
            }
        )  # fmt: skip
        expected = model.decoder(inputs_embeds=merged, attention_mask=attention, labels=labels)
        assert type(out) is type(expected)
        assert torch.equal(out.loss, expected.loss) and torch.equal(out.logits, expected.logits)

    def test_base_model_returns_hidden_states(self):
        model = fuse(hf_llama().model)
        tokens, encoder_input = multimodal_batch()
        out = model(tokens, encoder_input=encoder_input)
        assert out.last_hidden_state.shape == (2, 10, EMBED_DIM)
        text = text_tokens(2, 6)
        assert torch.equal(
            model(text).last_hidden_state, model.decoder(input_ids=text).last_hidden_state
        )

    def test_fusion_arguments_and_computed_inputs_are_refused(self):
        model = fuse(hf_llama())
        tokens = text_tokens(2, 5)
        with pytest.raises(ValueError, match=r"mask: a Hugging Face decoder takes attention_mask"):
            model(tokens, mask=torch.ones(2, 5, 5, dtype=torch.bool))
        with pytest.raises(ValueError, match=r"input_pos: a Hugging Face decoder takes position"):
            model(tokens, input_pos=torch.arange(5))
        for name in ("input_ids", "inputs_embeds"):
            with pytest.raises(ValueError, match=rf"{name}: EarlyFusion computes"):
                model(tokens, **{name: tokens})

    def test_model_without_inputs_embeds_is_refused(self):
        class IdsOnly(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.embed = nn.Embedding(8, 4)

            def get_input_embeddings(self) -> nn.Module:
                return self.embed

            def forward(self, input_ids, attention_mask=None, **kwargs):
                return self.embed(input_ids)

        with pytest.raises(TypeError, match=r"decoder: IdsOnly has get_input_embeddings\(\) but"):
            EarlyFusion(IdsOnly(), {}, {})


class TestTorchtuneStyle:
    def test_mask_and_positions_reach_the_decoder(self):
        model = fuse(torchtune_style())
        tokens, encoder_input = multimodal_batch()
        mask = torch.ones(10, 10, dtype=torch.bool).tril()[None].expand(2, 10, 10).clone()
        mask[0, 5:, :3] = False
        positions = torch.arange(10)[None].expand(2, 10) + 3
        out = model(tokens, encoder_input=encoder_input, mask=mask, input_pos=positions)
        merged = merge_embeddings(
            tokens, model.decoder.tok_embeddings, model.encode(encoder_input), model.encoder_tokens
        )
        expected = model.decoder(None, mask=mask, input_pos=positions, input_embeds=merged)
        assert torch.equal(out, expected)
        assert not torch.equal(out, model(tokens, encoder_input=encoder_input))

    def test_computed_inputs_are_refused(self):
        model = fuse(torchtune_style())
        tokens = text_tokens(2, 5)
        with pytest.raises(ValueError, match=r"input_embeds: EarlyFusion computes"):
            model(tokens, input_embeds=torch.zeros(2, 5, EMBED_DIM))

    def test_forward_without_input_embeds_is_refused(self):
        class NoEmbeds(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.tok_embeddings = nn.Embedding(8, 4)

            def forward(self, tokens, **kwargs):
                return self.tok_embeddings(tokens)

        with pytest.raises(TypeError, match=r"NoEmbeds has tok_embeddings but its forward takes"):
            EarlyFusion(NoEmbeds(), {}, {})


def test_anything_else_is_refused_naming_what_was_looked_for():
    expected = r"decoder: expected a fusion TransformerDecoder, a module with tok_embeddings"
    with pytest.raises(TypeError, match=expected + r".*Linear has neither"):
        EarlyFusion(nn.Linear(2, 2), {}, {})
    with pytest.raises(TypeError, match=expected + r".*got the wrapper OptimizedModule"):
        EarlyFusion(torch.compile(hf_llama()), {}, {})
    with pytest.raises(TypeError, match=expected + r".*got function"):
        EarlyFusion(lambda tokens: tokens, {"image": TinyEncoder()}, {"image": IMAGE})


def test_the_cacheless_decoder_is_still_a_torchtune_style_decoder():
    decoder = CachelessTorchtuneStyleDecoder(build_tiny_decoder())
    assert "input_embeds" in inspect.signature(decoder.forward).parameters
    assert fuse(decoder).decoder_kind == "torchtune"
