"""CLIP's and SigLIP's towers run their images in chunks of at most ``chunk_rows`` positions
(``VisionTower.chunk_rows``): the same outputs and gradients as all images at once, and no
tensor larger than a chunk's."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from fusion.encoders import ClipVisionTransformer, SiglipVisionTransformer
from vlm_helpers import CLIP_CONFIG, randomize

SIGLIP = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
          "num_attention_heads": 2, "patch_size": 2, "image_size": 8}  # fmt: skip
CLIP = {**CLIP_CONFIG, "num_hidden_layers": 2}


def tower(kind: str, chunk_rows: int | None):
    torch.manual_seed(0)
    if kind == "siglip":
        built = SiglipVisionTransformer(**SIGLIP, chunk_rows=chunk_rows)
    else:
        built = ClipVisionTransformer(**CLIP, chunk_rows=chunk_rows)
    return randomize(built).eval()


def positions(model) -> int:
    return model.num_patches + isinstance(model, ClipVisionTransformer)  # CLIP's class token


def run(model, x: torch.Tensor) -> list[torch.Tensor]:
    if isinstance(model, ClipVisionTransformer):
        return model.hidden_states(x, [0, 1, -1])
    return [model(x)]


class LargestWide(TorchDispatchMode):
    """The most elements of any tensor an op makes whose last dimension is ``width``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.width = width
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and tensor.dim() and tensor.size(-1) == self.width:
                self.largest = max(self.largest, tensor.numel())
        return out


@pytest.mark.parametrize("images", [0, 1, 5])
@pytest.mark.parametrize("kind", ["siglip", "clip"])
def test_chunks_of_images_give_the_batchs_outputs_and_gradients(kind, images):
    """Five images in chunks of two positions' worth of images (2, 2, 1), no images, one:
    outputs (CLIP: several hidden states) and the weights' and pixels' gradients equal those
    of all images at once, within fp32 rounding; the first layer sees the chunks."""
    chunked, whole = tower(kind, None), tower(kind, None)
    chunked.chunk_rows = 2 * positions(chunked)
    seen: list[int] = []
    chunked.encoder.layers[0].register_forward_pre_hook(lambda m, args: seen.append(len(args[0])))
    x = torch.randn(images, 3, chunked.image_size, chunked.image_size)
    x_chunked, x_whole = x.clone().requires_grad_(), x.clone().requires_grad_()
    got, want = run(chunked, x_chunked), run(whole, x_whole)
    assert seen == ([2, 2, 1] if images == 5 else [images])
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape == (images, positions(chunked), chunked.hidden_size)
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    if images:
        sum(t.square().sum() for t in got).backward()
        sum(t.square().sum() for t in want).backward()
        pairs = [(x_chunked.grad, x_whole.grad)]
        params = list(zip(chunked.parameters(), whole.parameters(), strict=True))
        assert all((p.grad is None) == (q.grad is None) for p, q in params)
        pairs += [(p.grad, q.grad) for p, q in params if q.grad is not None]  # CLIP's unused
        # Sums over the images in another order: within fp32 rounding of the largest gradient
        # (some parameters' gradients cancel to rounding noise).
        scale = max(float(b.abs().max()) for _, b in pairs)
        for a, b in pairs:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * scale)


@pytest.mark.parametrize("kind", ["siglip", "clip"])
def test_no_tensor_is_larger_than_a_chunks(kind):
    """Without gradients, the largest MLP intermediate a chunked forward makes is one chunk's;
    all at once it is the batch's."""
    model = tower(kind, None)
    x = torch.randn(6, 3, model.image_size, model.image_size)
    intermediate = model.encoder.layers[0].mlp.fc1.out_features
    for chunk_images, chunk_rows in ((6, None), (1, positions(model))):
        model.chunk_rows = chunk_rows
        largest = LargestWide(intermediate)
        with torch.no_grad(), largest:
            run(model, x)
        assert largest.largest == chunk_images * positions(model) * intermediate


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "8"])
@pytest.mark.parametrize("kind", ["siglip", "clip"])
def test_bad_chunk_rows(kind, value):
    build = SiglipVisionTransformer if kind == "siglip" else ClipVisionTransformer
    config = SIGLIP if kind == "siglip" else CLIP
    with pytest.raises(ValueError, match=r"chunk_rows: expected None or an int >= 1, got"):
        build(**config, chunk_rows=value)
