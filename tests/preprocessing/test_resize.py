"""``resize`` is Pillow's ``Image.resize``, bit for bit, for any channel count and layout."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from fusion.media.resize import (
    BICUBIC,
    BILINEAR,
    BOX,
    HAMMING,
    LANCZOS,
    NEAREST,
)
from fusion.preprocessing import resize
from vlm_helpers import as_tensor, make_image

# (in height, in width, out height, out width): up, down, mixed, extreme ratios, one pixel, and
# height shrinking far more than width (where Pillow 13 resizes vertically first).
SIZES = [
    (20, 30, 57, 81),
    (64, 48, 17, 23),
    (33, 90, 70, 12),
    (5, 120, 31, 7),
    (120, 9, 11, 64),
    (1, 1, 9, 4),
    (45, 13, 3, 2),
    (100, 28, 40, 30),
    (97, 64, 8, 60),
    (16, 16, 16, 40),
]


def pil_resize(array: np.ndarray, size: tuple[int, int], resample: int) -> np.ndarray:
    return np.array(Image.fromarray(array).resize(size[::-1], resample=resample))


BACKENDS = ["auto", "pillow"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("resample", [BICUBIC, LANCZOS, BILINEAR, BOX, HAMMING])
def test_equals_pillow(resample, backend):
    for seed, (h, w, oh, ow) in enumerate(SIZES):
        array = make_image(h, w, seed)
        ours = resize(as_tensor(array), (oh, ow), resample, backend=backend)
        assert ours.dtype == torch.uint8 and ours.shape == (3, oh, ow)
        expected = as_tensor(pil_resize(array, (oh, ow), resample))
        assert torch.equal(ours, expected), (h, w, oh, ow)


@pytest.mark.parametrize("backend", BACKENDS)
def test_single_channel_and_same_size(backend):
    gray = make_image(21, 34, 3)[..., :1]
    ours = resize(as_tensor(gray), (10, 50), LANCZOS, backend=backend)
    assert torch.equal(ours[0], torch.from_numpy(pil_resize(gray[..., 0], (10, 50), LANCZOS)))
    image = as_tensor(make_image(8, 8))
    same = resize(image, (8, 8), backend=backend)
    assert torch.equal(same, image) and same.data_ptr() != image.data_ptr()


@settings(max_examples=25, deadline=None)
@given(
    st.sampled_from([1, 3]),
    st.tuples(*[st.integers(1, 60)] * 4),
    st.sampled_from([BICUBIC, LANCZOS, BILINEAR, BOX, HAMMING]),
    st.integers(0, 2**32 - 1),
    st.booleans(),
)
def test_backends_give_the_same_bytes(channels, sizes, resample, seed, strided):
    h, w, oh, ow = sizes
    generator = torch.Generator().manual_seed(seed)
    image = torch.randint(0, 256, (channels, h, w), dtype=torch.uint8, generator=generator)
    if strided:  # a channels-last view, as decoded Pillow images are
        image = image.permute(1, 2, 0).contiguous().permute(2, 0, 1)
    pillow_out = resize(image, (oh, ow), resample, backend="pillow")
    auto_out = resize(image, (oh, ow), resample)
    assert auto_out.shape == pillow_out.shape == (channels, oh, ow)
    assert torch.equal(auto_out, pillow_out)


def test_the_torch_backend_is_deprecated_and_gives_the_same_bytes():
    image = as_tensor(make_image(20, 30, 1))
    with pytest.warns(DeprecationWarning, match=r"backend='torch'\) is deprecated"):
        out = resize(image, (9, 41), LANCZOS, backend="torch")
    assert torch.equal(out, resize(image, (9, 41), LANCZOS, backend="pillow"))


def test_auto_resizes_each_band_where_one_pillow_call_cannot():
    # 4 channels: Pillow would premultiply alpha; auto resizes each band alone.
    image = torch.randint(0, 256, (4, 9, 7), dtype=torch.uint8, generator=torch.Generator())
    out = resize(image, (5, 11), BICUBIC)
    assert torch.equal(out[:3], resize(image[:3], (5, 11), BICUBIC, backend="pillow"))
    assert torch.equal(out[3:], resize(image[3:], (5, 11), BICUBIC, backend="pillow"))
    with pytest.raises(ValueError, match="backend: 'pillow' takes 1 or 3 channels"):
        resize(image, (5, 11), backend="pillow")
    meta = torch.empty(3, 9, 7, dtype=torch.uint8, device="meta")
    with pytest.raises(ValueError, match="on the CPU, got shape \\[3, 9, 7\\] on meta"):
        resize(meta, (5, 11), backend="pillow")


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        ((torch.zeros(3, 4, 4), (2, 2)), ValueError, "image: expected a uint8 tensor"),
        ((torch.zeros(4, 4, dtype=torch.uint8), (2, 2)), ValueError, "image: expected a uint8"),
        ((torch.zeros(3, 4, 4, dtype=torch.uint8), (0, 2)), ValueError, "size: expected"),
        ((torch.zeros(3, 4, 4, dtype=torch.uint8), (2.0, 2)), ValueError, "size: expected"),
        ((torch.zeros(3, 4, 4, dtype=torch.uint8), (2, 2), NEAREST), ValueError, "resample:"),
        ((np.zeros((3, 4, 4), np.uint8), (2, 2)), TypeError, "image: expected a uint8 tensor"),
        ((torch.zeros(3, 4, 4, dtype=torch.uint8), (2, 2), BICUBIC, "gpu"), ValueError, "backend:"),
    ],
)
def test_bad_arguments(args, error, match):
    *positional, backend = args if len(args) == 4 else (*args, "auto")
    with pytest.raises(error, match=match):
        resize(*positional, backend=backend)
