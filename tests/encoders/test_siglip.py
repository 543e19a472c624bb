"""SigLIP's vision tower against ``transformers.SiglipVisionModel`` and Idefics3's vision
transformer (bucketed positions), and the connectors against theirs, on the same weights."""

import pytest
import torch

from fusion.encoders import (
    Idefics3Connector,
    LlavaProjector,
    SiglipVisionTransformer,
    pixel_shuffle,
)
from fusion.encoders.siglip import bucketed_position_ids
from vlm_helpers import randomize

KWARGS = {
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "patch_size": 2,
}


def pixels(size: int, n: int = 2) -> torch.Tensor:
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(1))


def test_matches_siglip_vision_model():
    from transformers import SiglipVisionConfig, SiglipVisionModel

    config = SiglipVisionConfig(**KWARGS, image_size=16, vision_use_head=False)
    hf = randomize(SiglipVisionModel(config))
    ours = SiglipVisionTransformer(**KWARGS, image_size=16).eval()
    state = {k.removeprefix("vision_model."): v for k, v in hf.state_dict().items()}
    ours.load_state_dict(state, strict=True)
    x = pixels(16)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), hf(x).last_hidden_state, rtol=0, atol=1e-5)


@pytest.mark.parametrize("image_size", [16, 50])
def test_matches_idefics3_vision_transformer(image_size):
    from transformers.models.idefics3.configuration_idefics3 import Idefics3VisionConfig
    from transformers.models.idefics3.modeling_idefics3 import Idefics3VisionTransformer

    hf = randomize(Idefics3VisionTransformer(Idefics3VisionConfig(**KWARGS, image_size=image_size)))
    ours = SiglipVisionTransformer(**KWARGS, image_size=image_size, position_scheme="bucketed")
    ours.load_state_dict(hf.state_dict(), strict=True)
    x = pixels(image_size)
    with torch.no_grad():
        torch.testing.assert_close(ours.eval()(x), hf(x).last_hidden_state, rtol=0, atol=1e-5)


def test_bucketed_positions_are_not_always_arange():
    # 25 patches per side: float rounding puts patch 5 in bucket 4, as Idefics3 does; the test
    # above at image_size 50 (25 x 25 patches) would fail with plain positions.
    ids = bucketed_position_ids(25, 25, 25)
    assert ids.shape == (625,) and not torch.equal(ids, torch.arange(625))
    assert torch.equal(bucketed_position_ids(8, 8, 8), torch.arange(64))


def test_connectors_match_transformers():
    from transformers import Idefics3Config, LlavaConfig
    from transformers.models.idefics3.modeling_idefics3 import Idefics3Connector as HFConnector
    from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

    config = Idefics3Config(
        vision_config={"hidden_size": 16, "num_attention_heads": 2},
        text_config={"hidden_size": 32, "num_attention_heads": 4},
        scale_factor=2,
    )
    hf = randomize(HFConnector(config))
    ours = Idefics3Connector(16, 32, scale_factor=2)
    ours.load_state_dict(hf.state_dict(), strict=True)
    x = torch.randn(3, 64, 16, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(pixel_shuffle(x, 2), hf.pixel_shuffle(x, 2), rtol=0, atol=0)
    torch.testing.assert_close(ours(x), hf(x), rtol=0, atol=1e-6)

    config = LlavaConfig(
        vision_config={
            "model_type": "clip_vision_model",
            "hidden_size": 16,
            "num_attention_heads": 2,
        },
        text_config={"model_type": "llama", "hidden_size": 32, "num_attention_heads": 4},
        vision_feature_layer=[-2, -1],
        projector_hidden_act="gelu",
    )
    hf = randomize(LlavaMultiModalProjector(config))
    ours = LlavaProjector(32, 32, "gelu")
    ours.load_state_dict(hf.state_dict(), strict=True)
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(ours(x), hf(x), rtol=0, atol=1e-6)


def test_bad_input():
    ours = SiglipVisionTransformer(**KWARGS, image_size=16)
    with pytest.raises(ValueError, match=r"pixel_values: expected floating images \[n, 3, 16, 16"):
        ours(pixels(18))
    with pytest.raises(ValueError, match="position_scheme: expected one of"):
        SiglipVisionTransformer(**KWARGS, image_size=16, position_scheme="interpolated")
    with pytest.raises(ValueError, match="features: expected a square grid"):
        pixel_shuffle(torch.randn(1, 36, 4), 4)
    with pytest.raises(ValueError, match="scale_factor: expected a positive integer, got 0"):
        Idefics3Connector(16, 32, scale_factor=0)
