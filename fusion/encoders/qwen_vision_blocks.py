"""The layers of Qwen2-VL's, Qwen2.5-VL's and Qwen3-VL's vision towers: norms, the patch
embedding, the MLPs, the patch mergers (the connectors to the text decoder), 2-D rotary
attention within the segments of an :class:`~fusion.encoders.qwen_vision_plans.AttentionPlan`,
and the pre-norm block.

Parameter names are the checkpoints' (``proj``, ``qkv``, ``ln_q``, ``mlp.0``, ``linear_fc1``,
...), so that the towers built from them load by prefix alone.
"""

import torch
import torch.nn.functional as F
from torch import nn

from fusion.encoders.qwen_vision_plans import AttentionPlan
from fusion.encoders.vit_blocks import Activation


class RMSNorm(nn.Module):
    """Qwen's root-mean-square norm with a learned ``weight``: normalised in float32, cast back
    to the input's dtype, then scaled (in that order, as the checkpoints were trained).

    Shapes: input ``[..., dim]``, output the same shape and dtype as ``weight * input``.
    """

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class PatchEmbed(nn.Module):
    """Flattened patches ``[n_patches, in_channels * temporal_patch_size * patch_size**2]``
    (channel-major, then time, then rows, then columns) -> ``[n_patches, embed_dim]``.

    The weight is the checkpoints' ``Conv3d`` kernel (``proj.weight``, shape
    ``[embed_dim, in_channels, temporal_patch_size, patch_size, patch_size]``; bias-free in
    Qwen2-VL and Qwen2.5-VL, with ``proj.bias`` in Qwen3-VL). Its kernel equals
    its stride and each input is exactly one kernel's extent, so the convolution is one matrix
    product with the flattened kernel, and that is how it is computed: the same sums, as one
    plain matrix product rather than a 3-D convolution over volumes of a single kernel's size.
    """

    def __init__(
        self,
        embed_dim: int,
        in_channels: int,
        patch_size: int,
        temporal_patch_size: int,
        bias: bool = False,
    ) -> None:
        super().__init__()
        kernel = (temporal_patch_size, patch_size, patch_size)
        self.proj = nn.Conv3d(in_channels, embed_dim, kernel_size=kernel, stride=kernel, bias=bias)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        return F.linear(
            patches.to(weight.dtype), weight.reshape(weight.shape[0], -1), self.proj.bias
        )


class PatchMerger(nn.Module):
    """``ln_q`` on each patch, then ``spatial_merge_size**2`` consecutive patches (one merge
    block, as the tower orders them) concatenated and mapped by ``mlp`` (Linear, exact GELU,
    Linear) to the decoder's width.

    Shapes: ``[n_patches, context_dim]`` -> ``[n_patches / spatial_merge_size**2, out_dim]``.

    Args:
        out_dim: the text decoder's width.
        context_dim: the tower's width.
        spatial_merge_size: the side of a merge block, in patches.
        norm: ``"layer"`` (Qwen2-VL's LayerNorm) or ``"rms"`` (Qwen2.5-VL's RMSNorm).
    """

    def __init__(
        self, out_dim: int, context_dim: int, spatial_merge_size: int, norm: str = "layer"
    ) -> None:
        super().__init__()
        self.merged_dim = context_dim * spatial_merge_size**2
        self.ln_q: nn.Module = (
            nn.LayerNorm(context_dim, eps=1e-6) if norm == "layer" else RMSNorm(context_dim)
        )
        self.mlp = nn.Sequential(
            nn.Linear(self.merged_dim, self.merged_dim),
            nn.GELU(),
            nn.Linear(self.merged_dim, out_dim),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # reshape with the row count spelled out: with no patches, -1 would be ambiguous.
        rows = x.shape[0] * x.shape[1] // self.merged_dim
        return self.mlp(self.ln_q(x).reshape(rows, self.merged_dim))


class SwiGLU(nn.Module):
    """Qwen2.5-VL's vision MLP: ``down_proj(act(gate_proj(x)) * up_proj(x))``, all biased."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size)
        self.up_proj = nn.Linear(hidden_size, intermediate_size)
        self.down_proj = nn.Linear(intermediate_size, hidden_size)
        self.act_fn = Activation(hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class Qwen3VisionMLP(nn.Module):
    """Qwen3-VL's vision MLP: ``linear_fc2(act(linear_fc1(x)))``, both biased."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(hidden_size, intermediate_size)
        self.linear_fc2 = nn.Linear(intermediate_size, hidden_size)
        self.act_fn = Activation(hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act_fn(self.linear_fc1(x)))


class Qwen3PatchMerger(nn.Module):
    """Qwen3-VL's merger: ``spatial_merge_size**2`` consecutive patches (one merge block)
    concatenated, a LayerNorm (``norm``), then ``linear_fc1``, exact GELU, ``linear_fc2`` to the
    decoder's width.

    The main merger normalises each patch before concatenating (``norm`` over ``context_dim``);
    the DeepStack mergers normalise the concatenation (``postshuffle_norm=True``: ``norm`` over
    ``context_dim * spatial_merge_size**2``), as transformers' ``use_postshuffle_norm``.

    Shapes: ``[n_patches, context_dim]`` -> ``[n_patches / spatial_merge_size**2, out_dim]``.
    """

    def __init__(
        self, out_dim: int, context_dim: int, spatial_merge_size: int, postshuffle_norm: bool
    ) -> None:
        super().__init__()
        self.merged_dim = context_dim * spatial_merge_size**2
        self.postshuffle_norm = postshuffle_norm
        self.norm = nn.LayerNorm(self.merged_dim if postshuffle_norm else context_dim, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.merged_dim, self.merged_dim)
        self.act_fn = nn.GELU()
        self.linear_fc2 = nn.Linear(self.merged_dim, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # reshape with the row count spelled out: with no patches, -1 would be ambiguous.
        rows = x.shape[0] * x.shape[1] // self.merged_dim
        if self.postshuffle_norm:
            x = self.norm(x.reshape(rows, self.merged_dim))
        else:
            x = self.norm(x).reshape(rows, self.merged_dim)
        return self.linear_fc2(self.act_fn(self.linear_fc1(x)))


# ---------------------------------------------------------------------------------------------
# Rotary positions and attention.


def rotary_angles(
    positions: torch.Tensor, head_dim: int, theta: float, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``[n_patches, head_dim]`` (float32) of 2-D rotary embeddings.

    The first half of each rotated half of a head turns with the patch's row, the second with
    its column, at the frequencies ``theta ** (-j / (head_dim / 2))``, j = 0, 2, ... (the same
    frequencies for both axes).
    """
    half = head_dim // 2
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, half, 2, dtype=torch.float32, device=device) / half)
    )
    angles = positions.to(device=device, dtype=torch.float32)[..., None] * inv_freq  # [n, 2, f]
    angles = angles.flatten(1)  # [n, half]: row angles, then column angles
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x ``[n, heads, head_dim]`` rotated by angles ``[n, head_dim]``, in float32 (as the
    checkpoints were trained), returned in x's dtype."""
    x32 = x.float()
    first, second = x32.chunk(2, dim=-1)
    rotated = torch.cat([-second, first], dim=-1)
    return (x32 * cos[:, None] + rotated * sin[:, None]).to(x.dtype)


class QwenVisionAttention(nn.Module):
    """Multi-head self-attention with a fused, biased ``qkv`` and a biased ``proj``, 2-D rotary
    positions on queries and keys, and attention within the segments of an :class:`AttentionPlan`.

    Each group of equal-length segments is one ``scaled_dot_product_attention`` call on
    ``[count, heads, length, head_dim]``, with no mask. Exact, like a block-diagonal boolean
    mask over all patches, but without its quadratic cost in the total patch count (a window
    block would spend nearly all of it on masked pairs) and without a mask, so every SDPA
    backend (flash included) applies; and a handful of calls per block instead of one per
    image or window as transformers' per-segment loop makes.
    """

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, plan: AttentionPlan
    ) -> torch.Tensor:
        """x ``[n_patches, dim]``, cos and sin ``[n_patches, head_dim]`` (in plan order) ->
        ``[n_patches, dim]``."""
        n, dim = x.shape
        qkv = self.qkv(x).view(n, 3, self.num_heads, self.head_dim)
        if plan.order is not None:
            qkv = qkv[plan.order]
        q = _rotate(qkv[:, 0], cos, sin)
        k = _rotate(qkv[:, 1], cos, sin)
        v = qkv[:, 2]
        outs = []
        start = 0
        for length, count in plan.groups:
            stop = start + length * count
            q_, k_, v_ = (
                part[start:stop].view(count, length, self.num_heads, -1).transpose(1, 2)
                for part in (q, k, v)
            )
            out = F.scaled_dot_product_attention(q_, k_, v_)  # [count, heads, length, head_dim]
            outs.append(out.transpose(1, 2).reshape(length * count, dim))
            start = stop
        # No patches, no group: an empty slice of the projection keeps its weights in the graph.
        out = torch.cat(outs) if outs else v.reshape(0, dim)
        if plan.restore is not None:
            out = out[plan.restore]
        return self.proj(out)


class QwenVisionBlock(nn.Module):
    """Pre-norm block: ``x + attn(norm1(x))``, then ``x + mlp(norm2(x))``."""

    def __init__(
        self, norm1: nn.Module, norm2: nn.Module, attn: QwenVisionAttention, mlp: nn.Module
    ) -> None:
        super().__init__()
        # Registered in the checkpoints' order.
        self.norm1 = norm1
        self.norm2 = norm2
        self.attn = attn
        self.mlp = mlp

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, plan: AttentionPlan
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, plan)
        return x + self.mlp(self.norm2(x))
