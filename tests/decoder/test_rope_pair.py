"""The rotary embeddings' one-lookup rotation (``rotate_pair``, the op-lean ``forward``) against
the textbook formula, bitwise, in every layout the decoders use."""

import pytest
import torch

from fusion.decoder import RotaryPositionalEmbeddings


def textbook(rope: RotaryPositionalEmbeddings, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Each channel pair rotated by its angle, ``(a cos - b sin, b cos + a sin)``, as the rotary
    embeddings were computed before the rotation was rewritten (the table read per call)."""
    if pos.dim() == 3:
        tables = rope.cache[pos]
        rows = rope.frequency_rows.view(1, 1, 1, -1, 1).expand(1, *tables.shape[1:])
        angles = tables.gather(0, rows)[0]
    else:
        angles = rope.cache[pos]
    angles = angles.view(-1, x.size(1), 1, rope.dim // 2, 2)
    cos, sin = angles[..., 0], angles[..., 1]
    rotary, rest = x[..., : rope.dim].float(), x[..., rope.dim :]
    if rope.rotate_half:
        a, b = rotary.chunk(2, dim=-1)
    else:
        pairs = rotary.reshape(*rotary.shape[:-1], rope.dim // 2, 2)
        a, b = pairs[..., 0], pairs[..., 1]
    halves = (a * cos - b * sin, b * cos + a * sin)
    out = torch.cat(halves, -1) if rope.rotate_half else torch.stack(halves, -1).flatten(-2)
    if rest.size(-1):
        out = torch.cat([out, rest.float()], dim=-1)
    return out.type_as(x)


LAYOUTS = {
    "llama": dict(dim=16, scale_factor=8.0),
    "rotate_half": dict(dim=16, rotate_half=True),
    "partial": dict(dim=8, rotate_half=True),  # Qwen3.5: a quarter of the head rotated
    "partial_interleaved": dict(dim=8),
    "mrope": dict(dim=16, mrope_section=[2, 3, 3]),
    "mrope_interleaved": dict(dim=16, mrope_section=[4, 2, 2], mrope_interleaved=True),
}


# Each layout with the position shapes it takes: three position rows are M-RoPE's alone.
CASES = [
    (layout, pos_shape)
    for layout, kwargs in sorted(LAYOUTS.items())
    for pos_shape in ("s", "1s", "bs", *(("3bs",) if "mrope_section" in kwargs else ()))
]


@pytest.mark.parametrize(("layout", "pos_shape"), CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotate_pair_is_the_textbook_rotation_bitwise(layout, dtype, pos_shape):
    kwargs = LAYOUTS[layout]
    rope = RotaryPositionalEmbeddings(max_seq_len=40, base=10_000.0, **kwargs)
    generator = torch.Generator().manual_seed(0)
    b, s = 3, 5
    q = torch.randn(b, s, 4, 16, generator=generator).to(dtype)  # [b, s, h, head_dim]
    k = torch.randn(b, s, 2, 16, generator=generator).to(dtype)  # [b, s, h_kv, head_dim]
    shape = {"s": (s,), "1s": (1, s), "bs": (b, s), "3bs": (3, b, s)}[pos_shape]
    pos = torch.randint(0, 40, shape, generator=generator)
    rq, rk = rope.rotate_pair(q, k, pos)
    assert rq.dtype == rk.dtype == dtype
    assert torch.equal(rq, textbook(rope, q, pos))
    assert torch.equal(rk, textbook(rope, k, pos))
    assert torch.equal(rope(q, pos), rq)  # forward: the same rotation
