"""CLIP's vision tower against ``transformers.CLIPVisionModel`` on the same weights."""

import pytest
import torch

from fusion.encoders import ClipVisionTransformer
from vlm_helpers import CLIP_CONFIG, randomize

KWARGS = {**CLIP_CONFIG, "num_hidden_layers": 3}


def build(hidden_act: str = "quick_gelu"):
    from transformers import CLIPVisionConfig, CLIPVisionModel

    hf = randomize(CLIPVisionModel(CLIPVisionConfig(**KWARGS, hidden_act=hidden_act)))
    ours = ClipVisionTransformer(**KWARGS, hidden_act=hidden_act)
    state = {k.removeprefix("vision_model."): v for k, v in hf.state_dict().items()}
    ours.load_state_dict(state, strict=True)  # the checkpoint's own names
    return hf, ours.eval()


@pytest.fixture(scope="module")
def tower() -> ClipVisionTransformer:
    return build()[1]


def pixels(n: int = 2) -> torch.Tensor:
    return torch.randn(n, 3, 16, 16, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("hidden_act", ["quick_gelu", "gelu"])
def test_hidden_states_match_transformers(hidden_act):
    hf, ours = build(hidden_act)
    x = pixels()
    with torch.no_grad():
        theirs = hf(x, output_hidden_states=True)
        layers = [0, 1, 2, 3, -1, -2, -4]
        mine = ours.hidden_states(x, layers)
        last = ours(x)
    assert len(theirs.hidden_states) == 4  # embeddings + 3 layers
    for layer, state in zip(layers, mine, strict=True):
        torch.testing.assert_close(state, theirs.hidden_states[layer], rtol=0, atol=1e-5)
    torch.testing.assert_close(last, theirs.last_hidden_state, rtol=0, atol=1e-5)
    # The layers differ from each other: the comparison above is not between equal tensors.
    assert (mine[1] - mine[2]).abs().max() > 1e-2


def test_layers_after_the_last_one_asked_for_do_not_run():
    _, ours = build()
    calls = []
    for i, layer in enumerate(ours.encoder.layers):
        layer.register_forward_hook(lambda *_, i=i: calls.append(i))
    ours.hidden_states(pixels(1), [1])
    assert calls == [0]
    ours.hidden_states(pixels(1), [-2])
    assert calls == [0, 0, 1]


@pytest.mark.parametrize(
    "bad",
    [
        torch.randn(2, 3, 16, 15),
        torch.randn(2, 1, 16, 16),
        torch.randn(3, 16, 16),
        torch.zeros(2, 3, 16, 16, dtype=torch.uint8),
    ],
)
def test_bad_pixels_are_refused_before_any_work(bad, tower):
    with pytest.raises(ValueError, match=r"pixel_values: expected floating images \[n, 3, 16, 16"):
        tower(bad)


@pytest.mark.parametrize("layer", [4, -5, 1.0, True])
def test_layer_out_of_range(layer, tower):
    with pytest.raises(ValueError, match=r"vision_feature_layer: expected an int in \[-4, 3\]"):
        tower.hidden_states(pixels(1), [layer])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"image_size": 18}, "image_size: expected a multiple of patch_size=4, got 18"),
        ({"num_attention_heads": 3}, "num_attention_heads: expected a divisor of hidden_size=16"),
        ({"hidden_act": "tanh"}, "hidden_act: expected one of"),
        ({"hidden_size": 0}, "hidden_size: expected a positive integer, got 0"),
        ({"layer_norm_eps": 0.0}, r"layer_norm_eps: expected a number in \(0, 1\)"),
    ],
)
def test_bad_config(change, message):
    with pytest.raises(ValueError, match=message):
        ClipVisionTransformer(**{**KWARGS, **change})
