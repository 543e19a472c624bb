"""Qwen2-VL's and Qwen2.5-VL's vision towers against transformers' on the same weights: one
image, images of different sizes, a video-like grid (t = 2), windows cut at the edges, the
input checks, empty input, bf16 and the meta device."""

import copy

import pytest
import torch

from fusion.encoders import Qwen2VisionTransformer, Qwen25VisionTransformer
from fusion.encoders.qwen_vision import frame_plan, window_plan
from vlm_helpers import randomize

QWEN2 = {
    "depth": 2,
    "embed_dim": 32,
    "hidden_size": 24,
    "num_heads": 2,
    "mlp_ratio": 2,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
}
# 56-pixel windows: 2 x 2 merge blocks (4 x 4 patches) a side; blocks 1 and 3 attend fully.
QWEN25 = {
    "depth": 4,
    "hidden_size": 32,
    "intermediate_size": 40,
    "num_heads": 2,
    "out_hidden_size": 24,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "window_size": 56,
    "fullatt_block_indexes": [1, 3],
}
PATCH_DIM = 3 * 2 * 14 * 14

GRIDS = {
    "one image": [[1, 8, 12]],
    "two sizes": [[1, 6, 10], [1, 4, 4]],
    "video": [[2, 8, 12]],
    "mixed": [[1, 4, 4], [2, 6, 10], [1, 10, 6]],
}


def hf_qwen2():
    from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import (
        Qwen2VisionTransformerPretrainedModel,
    )

    config = Qwen2VLVisionConfig(**QWEN2)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return randomize(Qwen2VisionTransformerPretrainedModel(config))


def hf_qwen25(**overrides):
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
        Qwen2_5_VisionTransformerPretrainedModel,
    )

    config = Qwen2_5_VLVisionConfig(**{**QWEN25, **overrides})
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return randomize(Qwen2_5_VisionTransformerPretrainedModel(config))


@pytest.fixture(scope="module")
def qwen2():
    hf = hf_qwen2()
    ours = Qwen2VisionTransformer(**QWEN2)
    ours.load_state_dict(hf.state_dict(), strict=True)
    return hf, ours.eval()


@pytest.fixture(scope="module")
def qwen25():
    hf = hf_qwen25()
    ours = Qwen25VisionTransformer(**QWEN25)
    ours.load_state_dict(hf.state_dict(), strict=True)
    return hf, ours.eval()


def inputs(grid: list[list[int]], seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    thw = torch.tensor(grid, dtype=torch.long)
    n = int(thw.prod(dim=1).sum())
    return torch.randn(n, PATCH_DIM, generator=torch.Generator().manual_seed(seed)), thw


@pytest.mark.parametrize("tower", ["qwen2", "qwen25"])
def test_state_dicts_are_the_checkpoints(tower, request):
    hf, ours = request.getfixturevalue(tower)
    assert list(ours.state_dict()) == list(hf.state_dict())  # same names, same order
    assert {"patch_embed.proj.weight", "merger.ln_q.weight", "merger.mlp.0.weight"} <= set(
        ours.state_dict()
    )
    assert not any("rotary" in name or "inv_freq" in name for name in ours.state_dict())
    assert not list(ours.buffers())
    hf.load_state_dict(ours.state_dict(), strict=True)  # and back


@pytest.mark.parametrize("grid", GRIDS.values(), ids=GRIDS.keys())
@pytest.mark.parametrize("tower", ["qwen2", "qwen25"])
def test_matches_transformers(tower, grid, request):
    hf, ours = request.getfixturevalue(tower)
    x, thw = inputs(grid)
    with torch.no_grad():
        expected = hf(x, thw).pooler_output
        got = ours(x, thw)
    assert got.shape == (sum(ours.rows_per_image(thw)), ours.out_dim)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_images_are_independent(qwen25):
    # Each image's rows are those of the image alone: no attention across images.
    _, ours = qwen25
    x, thw = inputs(GRIDS["mixed"])
    with torch.no_grad():
        together = ours(x, thw).split(ours.rows_per_image(thw))
        starts = [0, *thw.prod(dim=1).cumsum(0).tolist()]
        for i, rows in enumerate(together):
            alone = ours(x[starts[i] : starts[i + 1]], thw[i : i + 1])
            torch.testing.assert_close(rows, alone, rtol=0, atol=1e-5)


def test_windows_matter(qwen25):
    # The comparison above can tell windows from full attention: with every block attending
    # fully the output moves well beyond its tolerance.
    hf, _ = qwen25
    full = Qwen25VisionTransformer(**{**QWEN25, "fullatt_block_indexes": [0, 1, 2, 3]})
    full.load_state_dict(hf.state_dict(), strict=True)
    x, thw = inputs(GRIDS["one image"])
    with torch.no_grad():
        assert (full.eval()(x, thw) - hf(x, thw).pooler_output).abs().max() > 1e-3


def test_plans():
    # 6 x 10 patches = 3 x 5 merge blocks: windows of 2 x 2, 2 x 1, 1 x 2 and 1 x 1 blocks.
    plan = window_plan([(1, 6, 10), (1, 4, 4)], spatial_merge_size=2, window_blocks=2)
    assert plan.groups == ((4, 1), (8, 3), (16, 3))
    assert plan.order is not None and plan.restore is not None
    assert torch.equal(plan.order.sort().values, torch.arange(76))
    assert torch.equal(plan.order[plan.restore], torch.arange(76))
    # Frames keep their order: no gather, one group per run of equal frames.
    assert frame_plan([(2, 4, 4), (1, 4, 4), (1, 6, 10)]) == (None, None, ((16, 3), (60, 1)))


def test_rows_per_image_and_attributes(qwen2, qwen25):
    _, ours2 = qwen2
    _, ours25 = qwen25
    thw = torch.tensor([[1, 6, 10], [2, 4, 4]])
    assert ours2.rows_per_image(thw) == [15, 8] == ours25.rows_per_image(thw)
    assert (ours2.out_dim, ours2.spatial_merge_size, ours2.patch_dim) == (24, 2, PATCH_DIM)
    assert (ours25.out_dim, ours25.window_blocks) == (24, 2)


def test_empty_input(qwen25):
    _, ours = qwen25
    x, thw = torch.zeros(0, PATCH_DIM), torch.zeros(0, 3, dtype=torch.long)
    out = ours(x, thw)
    assert out.shape == (0, 24) and out.dtype == torch.float32
    assert ours.rows_per_image(thw) == []


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
        r"\[n_patches, 1176\].*got shape \[16, 1175\]",
        ValueError,
    ),
    ("pixels", torch.zeros(1, 16, PATCH_DIM), r"got shape \[1, 16, 1176\]", ValueError),
    ("grid", [[1, 4, 4]], "image_grid_thw: expected a tensor, got list", TypeError),
    (
        "grid",
        torch.tensor([[1.0, 4, 4]]),
        "image_grid_thw: expected an integer tensor.*float32",
        ValueError,
    ),
    (
        "grid",
        torch.tensor([[4, 4]]),
        r"image_grid_thw: expected an integer.*got shape \[1, 2\]",
        ValueError,
    ),
    ("grid", torch.tensor([1, 4, 4]), r"got shape \[3\]", ValueError),
    (
        "grid",
        torch.tensor([[0, 4, 4]]),
        r"expected positive entries, got row 0 = \[0, 4, 4\]",
        ValueError,
    ),
    ("grid", torch.tensor([[1, 4, 4], [1, -2, 4]]), r"positive entries, got row 1", ValueError),
    (
        "grid",
        torch.tensor([[1, 4, 4], [1, 3, 4]]),
        r"multiples of spatial_merge_size=2, got row 1 = \[1, 3, 4\]",
        ValueError,
    ),
    ("grid", torch.tensor([[1, 4, 6]]), r"pixel_values: expected 24 patches .* got 16", ValueError),
]


@pytest.mark.parametrize(("which", "value", "match", "error"), BAD)
def test_bad_inputs(qwen2, qwen25, which, value, match, error):
    x, thw = inputs([[1, 4, 4]])
    args = (value, thw) if which == "pixels" else (x, value)
    for _, ours in (qwen2, qwen25):
        with pytest.raises(error, match=match):
            ours(*args)


@pytest.mark.parametrize(
    ("tower", "overrides", "match"),
    [
        ("qwen25", {"num_heads": 3}, "num_heads: expected a divisor of hidden_size=32"),
        # head width 2: no (row, column) pair of rotary halves
        ("qwen25", {"num_heads": 16}, "multiple of 4, got 16"),
        ("qwen25", {"window_size": 27}, "window_size: expected at least .* = 28 pixels, got 27"),
        ("qwen25", {"fullatt_block_indexes": [4]}, r"fullatt_block_indexes: .*\[0, depth=4\)"),
        ("qwen25", {"hidden_act": "tanh"}, "hidden_act: expected one of"),
        ("qwen25", {"patch_size": 0}, "patch_size: expected a positive integer, got 0"),
        ("qwen2", {"num_heads": 5}, "num_heads: expected a divisor of embed_dim=32"),
        ("qwen2", {"mlp_ratio": 0}, "mlp_ratio: expected a positive number, got 0"),
        ("qwen2", {"depth": -1}, "depth: expected a non-negative integer, got -1"),
    ],
)
def test_bad_config(tower, overrides, match):
    cls, kwargs = {
        "qwen2": (Qwen2VisionTransformer, QWEN2),
        "qwen25": (Qwen25VisionTransformer, QWEN25),
    }[tower]
    with pytest.raises(ValueError, match=match):
        cls(**{**kwargs, **overrides})


def test_bfloat16(qwen2, qwen25):
    x, thw = inputs(GRIDS["mixed"])
    for _, ours in (qwen2, qwen25):
        with torch.no_grad():
            reference = ours(x, thw)
            out = copy.deepcopy(ours).to(torch.bfloat16)(x, thw)  # float32 patches cast to bf16
        assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
        torch.testing.assert_close(out.float(), reference, rtol=0.1, atol=0.1)


def test_meta_device(qwen25):
    hf, _ = qwen25
    with torch.device("meta"):
        ours = Qwen25VisionTransformer(**QWEN25)
    assert all(p.is_meta for p in ours.parameters())
    x, thw = inputs(GRIDS["two sizes"])
    assert ours(x.to("meta"), thw).shape == (19, 24)  # shapes without memory; grid on the CPU
    ours.to_empty(device="cpu").load_state_dict(hf.state_dict(), strict=True)
    with torch.no_grad():
        torch.testing.assert_close(ours.eval()(x, thw), hf(x, thw).pooler_output, rtol=0, atol=1e-5)


def test_gradients_reach_every_parameter(qwen25):
    _, ours = qwen25
    x, thw = inputs(GRIDS["two sizes"])
    ours.zero_grad()
    ours(x, thw).square().sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in ours.parameters())
    ours.zero_grad(set_to_none=True)
