"""FSDP2 plans: the per-module plan of ``fusion.parallel`` and the decoder as its own unit, on
2 gloo processes, against the unsharded model in one process (logits and every gradient)."""

import pytest
from torch import nn

from fusion import EarlyFusion
from fusion.parallel import apply_fsdp, fsdp_units
from helpers import build_tiny_decoder
from parallel.sharding_scenarios import CASES, Case, assert_matches_one_process, build
from recipes.captioner.vision import VisionEncoder

FSDP_CASES = [c for c in CASES if c.plan in ("fsdp", "decoder_unit", "fsdp_lora")]


@pytest.mark.parametrize("case", FSDP_CASES, ids=lambda c: c.name)
def test_sharded_step_matches_one_process(sharded_runs, case):
    # Each rank trains on its own samples; FSDP averages the gradients over the ranks.
    assert_matches_one_process(sharded_runs, case)


@pytest.mark.parametrize("model", ["decoder", "fusion"])
def test_tied_embedding_alone_is_refused_clearly(sharded_runs, model):
    name = Case("embedding_alone", model, tied=True, images=model == "fusion").name
    for result in sharded_runs.ranks:
        assert not result[name]["ok"]
        assert result[name]["error_type"] == "RuntimeError"
        message = result[name]["message"]
        assert "tok_embeddings" in message and "untie" in message, message
        assert "mixed torch.Tensor and DTensor" not in message


def test_applying_twice_is_refused(sharded_runs):
    for rank in range(len(sharded_runs.ranks)):
        result = sharded_runs.result("fsdp-refused-twice", rank)
        assert result["error_type"] == "ValueError"
        assert "already sharded" in result["message"]
        assert not result["changed"]


def test_untied_plan_shards_embedding_and_head_on_their_own():
    decoder = build_tiny_decoder(tie_word_embeddings=False)
    units = fsdp_units(decoder)
    assert units == [
        *decoder.layers,
        decoder.tok_embeddings,
        [decoder.norm, decoder.output],
        decoder,
    ]
    assert fsdp_units(decoder, per_module=False) == [*decoder.layers, decoder]


def test_tied_plan_keeps_embedding_in_the_root():
    decoder = build_tiny_decoder(tie_word_embeddings=True)
    assert fsdp_units(decoder) == [*decoder.layers, decoder]


def test_fusion_plan_includes_encoder_blocks():
    decoder = build_tiny_decoder(tie_word_embeddings=False)
    vision = VisionEncoder(
        image_size=8, patch_size=4, in_channels=3, dim=16, num_layers=2, num_heads=2, out_dim=32
    )
    headless = nn.Linear(4, 32)  # no .layers: stays in the root
    model = EarlyFusion(decoder, {"image": vision, "other": headless}, {"image": 70, "other": 71})
    units = fsdp_units(model)
    assert units[:2] == list(vision.layers)
    assert units[2:] == [
        *decoder.layers,
        decoder.tok_embeddings,
        [decoder.norm, decoder.output],
        model,
    ]


def test_bad_arguments_are_refused_before_sharding():
    with pytest.raises(TypeError, match="model: expected a TransformerDecoder"):
        fsdp_units(nn.Linear(2, 2))
    model = build("fusion", tied=False)
    with pytest.raises(TypeError, match="mesh: expected a DeviceMesh, got str"):
        apply_fsdp(model, "cpu")
    assert all(type(p) is nn.Parameter for p in model.parameters())
