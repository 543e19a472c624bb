"""Qwen3-VL's vision tower against transformers' on the same weights: the merged rows and every
DeepStack layer's rows for one image, images of odd sizes, a video-like grid (t = 2), a 4 x 4
position table resampled to larger and non-square grids; the resampling itself (taps and weights
equal to transformers', values equal to ``F.interpolate``'s); the input checks, empty input,
bf16 and the meta device."""

import copy

import pytest
import torch
import torch.nn.functional as F

from fusion.encoders.qwen_vision import Qwen3VisionTransformer, bilinear_taps
from vlm_helpers import randomize

# A 4 x 4 position table (the published one is 48 x 48) and three DeepStack layers, after the
# first, a middle and the last block.
QWEN3 = {
    "depth": 4,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_heads": 2,
    "out_hidden_size": 24,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "num_position_embeddings": 16,
    "deepstack_visual_indexes": [0, 2, 3],
}
PATCH_DIM = 3 * 2 * 16 * 16

GRIDS = {
    "one image": [[1, 8, 12]],
    "two sizes": [[1, 6, 10], [1, 4, 4]],
    "video": [[2, 8, 12]],
    "mixed": [[1, 4, 4], [2, 6, 10], [1, 10, 6], [1, 2, 2]],
}


@pytest.fixture(scope="module")
def qwen3():
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    config = Qwen3VLVisionConfig(**QWEN3)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = randomize(Qwen3VLVisionModel._from_config(config, torch_dtype=torch.float32))
    ours = Qwen3VisionTransformer(**QWEN3)
    ours.load_state_dict(hf.state_dict(), strict=True)
    return hf, ours.eval()


def inputs(grid: list[list[int]], seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    thw = torch.tensor(grid, dtype=torch.long)
    n = int(thw.prod(dim=1).sum())
    return torch.randn(n, PATCH_DIM, generator=torch.Generator().manual_seed(seed)), thw


def test_state_dict_is_the_checkpoints(qwen3):
    hf, ours = qwen3
    assert list(ours.state_dict()) == list(hf.state_dict())  # same names, same order
    assert {
        "patch_embed.proj.bias",
        "pos_embed.weight",
        "blocks.0.mlp.linear_fc1.weight",
        "merger.norm.weight",
        "merger.linear_fc2.weight",
        "deepstack_merger_list.2.norm.weight",
    } <= set(ours.state_dict())
    assert ours.state_dict()["deepstack_merger_list.0.norm.weight"].shape == (128,)
    assert ours.state_dict()["merger.norm.weight"].shape == (32,)
    assert not list(ours.buffers())
    hf.load_state_dict(ours.state_dict(), strict=True)  # and back


@pytest.mark.parametrize("grid", GRIDS.values(), ids=GRIDS.keys())
def test_matches_transformers(qwen3, grid):
    hf, ours = qwen3
    x, thw = inputs(grid)
    with torch.no_grad():
        expected = hf(x, thw)
        rows, deepstack = ours(x, thw)
    assert rows.shape == (sum(ours.rows_per_image(thw)), 24)
    torch.testing.assert_close(rows, expected.pooler_output, rtol=0, atol=1e-5)
    assert isinstance(deepstack, tuple) and len(deepstack) == 3 == len(expected.deepstack_features)
    for got, want in zip(deepstack, expected.deepstack_features, strict=True):
        assert got.shape == rows.shape
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def reference_positions(table: torch.Tensor, grid, m: int) -> torch.Tensor:
    """The table resampled by ``F.interpolate`` (bilinear, align_corners=True) to each frame,
    then put in merge-block order and repeated over frames."""
    side = int(table.shape[0] ** 0.5)
    square = table.T.reshape(1, -1, side, side)
    parts = []
    for t, h, w in grid:
        frame = F.interpolate(square, size=(h, w), mode="bilinear", align_corners=True)[0]
        frame = frame.permute(1, 2, 0).reshape(h // m, m, w // m, m, -1).transpose(1, 2)
        parts.append(frame.reshape(h * w, -1).repeat(t, 1))
    return torch.cat(parts)


@pytest.mark.parametrize("side", [1, 3, 4, 48])
def test_position_resampling(side):
    from transformers.vision_utils import get_vision_interpolation_indices_and_weights

    grid = [(1, 4, 4), (2, 6, 10), (1, 10, 6), (1, 2, 2), (1, 2, 50)]
    taps, weights = bilinear_taps(grid, 2, side)
    hf_taps, hf_weights = get_vision_interpolation_indices_and_weights(
        torch.tensor(grid), side, mode="bilinear", align_corners=True, spatial_merge_size=2
    )
    assert taps.dtype == torch.long and weights.dtype == torch.float32
    assert torch.equal(taps, hf_taps) and torch.equal(weights, hf_weights)  # bitwise
    # And the values are the table resampled (against float64: both float32 forms round the
    # sample points, e.g. 48 * 47 / 49, differently, by up to an ulp of the table's side).
    table = torch.randn(side * side, 8, generator=torch.Generator().manual_seed(side))
    got = F.embedding_bag(taps, table, per_sample_weights=weights, mode="sum")
    expected = reference_positions(table.double(), grid, 2)
    torch.testing.assert_close(got.double(), expected, rtol=0, atol=1e-5)


def test_position_table_is_added(qwen3):
    # The blocks' input is the patch embedding plus the resampled table, within 1e-6 of
    # transformers' weighted gather (zero patches: the embedding is the bias, exactly).
    from transformers.vision_utils import get_vision_interpolation_indices_and_weights

    hf, ours = qwen3
    thw = torch.tensor(GRIDS["mixed"])
    x = torch.zeros(int(thw.prod(dim=1).sum()), PATCH_DIM)
    grid = [tuple(row) for row in thw.tolist()]
    indices, weights = get_vision_interpolation_indices_and_weights(
        thw, 4, mode="bilinear", align_corners=True, spatial_merge_size=2
    )
    with torch.no_grad():
        expected = hf.patch_embed(x) + (hf.pos_embed(indices) * weights[:, :, None]).sum(1)
        torch.testing.assert_close(ours._embed(x, grid), expected, rtol=0, atol=1e-6)


def test_images_are_independent(qwen3):
    _, ours = qwen3
    x, thw = inputs(GRIDS["mixed"])
    starts = [0, *thw.prod(dim=1).cumsum(0).tolist()]
    with torch.no_grad():
        rows, deepstack = ours(x, thw)
        for together in (rows, *deepstack):
            assert together.shape[0] == sum(ours.rows_per_image(thw))
        splits = [t.split(ours.rows_per_image(thw)) for t in (rows, *deepstack)]
        for i in range(len(thw)):
            alone_rows, alone_deep = ours(x[starts[i] : starts[i + 1]], thw[i : i + 1])
            for split, alone in zip(splits, (alone_rows, *alone_deep), strict=True):
                torch.testing.assert_close(split[i], alone, rtol=0, atol=1e-5)


def test_attributes(qwen3):
    _, ours = qwen3
    thw = torch.tensor([[1, 6, 10], [2, 4, 4]])
    assert ours.rows_per_image(thw) == [15, 8]
    assert (ours.out_dim, ours.spatial_merge_size, ours.patch_dim) == (24, 2, PATCH_DIM)
    assert (ours.deepstack_layers, ours.deepstack_visual_indexes) == (3, (0, 2, 3))
    assert (ours.num_grid_per_side, ours.num_position_embeddings) == (4, 16)
    plain = Qwen3VisionTransformer(**{**QWEN3, "deepstack_visual_indexes": []})
    x, thw = inputs([[1, 4, 4]])
    rows, deepstack = plain(x, thw)
    assert rows.shape == (4, 24) and deepstack == () and plain.deepstack_layers == 0


def test_empty_input(qwen3):
    _, ours = qwen3
    x, thw = torch.zeros(0, PATCH_DIM), torch.zeros(0, 3, dtype=torch.long)
    rows, deepstack = ours(x, thw)
    assert rows.shape == (0, 24) and rows.dtype == torch.float32
    assert [t.shape for t in deepstack] == [(0, 24)] * 3


BAD = [
    ("pixels", [[1.0]], "pixel_values: expected a tensor, got list", TypeError),
    (
        "pixels",
        torch.zeros(16, PATCH_DIM, dtype=torch.long),
        "pixel_values: expected floating",
        ValueError,
    ),
    (
        "pixels",
        torch.zeros(16, PATCH_DIM - 1),
        rf"\[n_patches, {PATCH_DIM}\].*got shape \[16, {PATCH_DIM - 1}\]",
        ValueError,
    ),
    ("pixels", torch.zeros(1, 16, PATCH_DIM), rf"got shape \[1, 16, {PATCH_DIM}\]", ValueError),
    ("grid", [[1, 4, 4]], "image_grid_thw: expected a tensor, got list", TypeError),
    ("grid", torch.tensor([[1.0, 4, 4]]), "image_grid_thw: expected an integer", ValueError),
    ("grid", torch.tensor([[4, 4]]), r"got shape \[1, 2\]", ValueError),
    ("grid", torch.tensor([[0, 4, 4]]), r"positive entries, got row 0 = \[0, 4, 4\]", ValueError),
    (
        "grid",
        torch.tensor([[1, 4, 4], [1, 3, 4]]),
        r"multiples of spatial_merge_size=2, got row 1 = \[1, 3, 4\]",
        ValueError,
    ),
    ("grid", torch.tensor([[1, 4, 6]]), r"pixel_values: expected 24 patches .* got 16", ValueError),
]


@pytest.mark.parametrize(("which", "value", "match", "error"), BAD)
def test_bad_inputs(qwen3, which, value, match, error):
    _, ours = qwen3
    x, thw = inputs([[1, 4, 4]])
    with pytest.raises(error, match=match):
        ours(*((value, thw) if which == "pixels" else (x, value)))


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"num_heads": 3}, "num_heads: expected a divisor of hidden_size=32"),
        ({"num_heads": 16}, "multiple of 4, got 16"),
        ({"num_position_embeddings": 15}, "num_position_embeddings: expected a square"),
        ({"num_position_embeddings": 0}, "num_position_embeddings: expected a positive"),
        ({"deepstack_visual_indexes": [4]}, r"deepstack_visual_indexes: .*\[0, depth=4\)"),
        ({"deepstack_visual_indexes": [2, 1]}, "expected increasing block indices"),
        ({"deepstack_visual_indexes": [1, 1]}, "expected increasing block indices"),
        ({"hidden_act": "tanh"}, "hidden_act: expected one of"),
        ({"patch_size": 0}, "patch_size: expected a positive integer, got 0"),
        ({"depth": -1}, "depth: expected a non-negative integer, got -1"),
        ({"out_hidden_size": 0}, "out_hidden_size: expected a positive integer"),
    ],
)
def test_bad_config(overrides, match):
    with pytest.raises(ValueError, match=match):
        Qwen3VisionTransformer(**{**QWEN3, **overrides})


def test_bfloat16(qwen3):
    _, ours = qwen3
    x, thw = inputs(GRIDS["mixed"])
    with torch.no_grad():
        reference = ours(x, thw)
        out = copy.deepcopy(ours).to(torch.bfloat16)(x, thw)  # float32 patches cast to bf16
    for got, want in zip((out[0], *out[1]), (reference[0], *reference[1]), strict=True):
        assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
        torch.testing.assert_close(got.float(), want, rtol=0.1, atol=0.1)


def test_meta_device(qwen3):
    hf, _ = qwen3
    with torch.device("meta"):
        ours = Qwen3VisionTransformer(**QWEN3)
    assert all(p.is_meta for p in ours.parameters())
    x, thw = inputs(GRIDS["two sizes"])
    rows, deepstack = ours(x.to("meta"), thw)  # shapes without memory; grid on the CPU
    assert rows.shape == (19, 24) and [t.shape for t in deepstack] == [(19, 24)] * 3
    ours.to_empty(device="cpu").load_state_dict(hf.state_dict(), strict=True)
    with torch.no_grad():
        rows, deepstack = ours.eval()(x, thw)
        expected = hf(x, thw)
    torch.testing.assert_close(rows, expected.pooler_output, rtol=0, atol=1e-5)
    torch.testing.assert_close(deepstack[1], expected.deepstack_features[1], rtol=0, atol=1e-5)


def test_gradients_reach_every_parameter(qwen3):
    _, ours = qwen3
    x, thw = inputs(GRIDS["two sizes"])
    ours.zero_grad()
    rows, deepstack = ours(x, thw)
    sum(t.square().sum() for t in (rows, *deepstack)).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in ours.parameters())
    ours.zero_grad(set_to_none=True)
