"""Shared entries (``EarlyFusion(shared_encoders=...)``): an entry with a placeholder id of its
own whose rows another entry's module computes, looked up by name at each call: its rows
are that module's on the renamed input, the model's modules, parameters and keys are those
without it, what trains is the target's, and mistakes are refused by name."""

import pytest
import torch

from fusion import EarlyFusion, SharedEncoder
from helpers import FEATURES, IMAGE_ID, VOCAB, TinyEncoder, build_tiny_decoder, text_tokens

CLIP_ID = VOCAB + 7  # outside the vocabulary, as a fusion placeholder may be
CLIPS = SharedEncoder("image", {"clip_features": "features", "seconds": None})


def build(**kwargs) -> EarlyFusion:
    torch.manual_seed(0)
    return EarlyFusion(
        build_tiny_decoder(),
        {"image": TinyEncoder()},
        {"image": IMAGE_ID, "clip": CLIP_ID},
        shared_encoders={"clip": CLIPS},
        **kwargs,
    )


def prompt() -> torch.Tensor:
    tokens = text_tokens(1, 12)
    tokens[0, 2:4] = IMAGE_ID  # one image of 2 rows
    tokens[0, 6:9] = CLIP_ID  # one clip of 3 rows
    return tokens


def test_rows_are_the_target_s_and_keys_unchanged():
    model = build()
    plain = EarlyFusion(model.decoder, {"image": model.encoders["image"]}, {"image": IMAGE_ID})
    assert list(model.state_dict()) == list(plain.state_dict())
    assert [n for n, _ in model.named_modules()] == [n for n, _ in plain.named_modules()]
    clip = torch.randn(1, 3, FEATURES)
    rows = model.encode({"clip": {"clip_features": clip, "seconds": [1.0]}})["clip"]
    assert torch.equal(rows, model.encoders["image"](clip))
    # As if the clip's rows were more of the image encoder's, at its own placeholders.
    image = torch.randn(1, 2, FEATURES)
    tokens = prompt()
    as_images = torch.where(tokens == CLIP_ID, IMAGE_ID, tokens)
    with torch.no_grad():
        ours = model(
            tokens,
            encoder_input={"image": {"features": image}, "clip": {"clip_features": clip}},
        )
        both = torch.cat([model.encoders["image"](image), rows], dim=1)
        expected = plain(as_images, encoder_input={"image": both})
    assert torch.equal(ours, expected)


def test_what_trains_is_the_target_s():
    model = build(encoders_trainable={"image": True}, decoder_trainable=False)
    clip = torch.randn(1, 3, FEATURES)
    tokens = text_tokens(1, 8)
    tokens[0, 1:4] = CLIP_ID
    model(tokens, encoder_input={"clip": {"clip_features": clip}}).sum().backward()
    assert all(p.grad is not None for p in model.encoders["image"].parameters())
    # A frozen target runs under no_grad for the shared entry too.
    frozen = build(encoders_trainable=False, fusion_trainable=False)
    assert not frozen.encode({"clip": {"clip_features": clip}})["clip"].requires_grad


def test_the_target_is_looked_up_at_each_call():
    model = build()
    replacement = TinyEncoder()
    model.encoders["image"] = replacement  # e.g. a wrapper put in its place
    clip = torch.randn(1, 3, FEATURES)
    rows = model.encode({"clip": {"clip_features": clip}})["clip"]
    assert torch.equal(rows, replacement(clip))


def test_mistakes_are_refused_by_name():
    decoder = build_tiny_decoder()
    with pytest.raises(ValueError, match=r"shared_encoders\['clip'\]: expected a name not in"):
        EarlyFusion(
            decoder, {"image": TinyEncoder()}, {"image": IMAGE_ID, "clip": CLIP_ID},
            shared_encoders={"clip": SharedEncoder("audio", {})},
        )  # fmt: skip
    with pytest.raises(TypeError, match="shared_encoders: expected a mapping of name -> "):
        EarlyFusion(
            decoder, {"image": TinyEncoder()}, {"image": IMAGE_ID, "clip": CLIP_ID},
            shared_encoders={"clip": "image"},
        )  # fmt: skip
    with pytest.raises(ValueError, match=r"encoder_tokens has \['clip', 'image'\]"):
        EarlyFusion(decoder, {"image": TinyEncoder()}, {"image": IMAGE_ID, "clip": CLIP_ID})
    model = build()
    with pytest.raises(ValueError, match=r"encoder_input\['clip'\]: unknown keys \['features'\]"):
        model.encode({"clip": {"features": torch.randn(1, 3, FEATURES)}})
    with pytest.raises(ValueError, match=r"unknown encoder names \['audio'\].*'clip', 'image'"):
        model.encode({"audio": {}})
