"""The transformer blocks CLIP and SigLIP vision towers share, named as their checkpoints name
them (``encoder.layers.{i}.self_attn.q_proj``, ``layer_norm1``, ``mlp.fc1``, ...), so that
real checkpoints load by prefix alone."""

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from fusion._validation import check_int, is_int


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


def _tanh_gelu(x: torch.Tensor) -> torch.Tensor:
    # Written out (not F.gelu(approximate="tanh")): the form checkpoints naming "gelu_new" use.
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))))


def _fast_gelu(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))


# The activations vision towers and projectors name in their configs (``hidden_act``).
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": _tanh_gelu,
    "gelu_fast": _fast_gelu,
    "quick_gelu": _quick_gelu,
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
}


class Activation(nn.Module):
    """An activation chosen by its config name (see :data:`ACTIVATIONS`).

    Raises:
        ValueError: an unknown name.
    """

    def __init__(self, name: str) -> None:
        super().__init__()
        if name not in ACTIVATIONS:
            raise ValueError(f"hidden_act: expected one of {sorted(ACTIVATIONS)}, got {name!r}")
        self.name = name
        self._fn = ACTIVATIONS[name]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._fn(x)

    def extra_repr(self) -> str:
        return self.name


class VisionAttention(nn.Module):
    """Bidirectional multi-head self-attention with biased q/k/v/out projections."""

    def __init__(self, hidden_size: int, num_heads: int) -> None:
        super().__init__()
        if num_heads <= 0 or hidden_size % num_heads:
            raise ValueError(
                f"num_attention_heads: expected a divisor of hidden_size={hidden_size}, "
                f"got {num_heads}"
            )
        self.num_heads = num_heads
        self.q_proj = nn.Linear(hidden_size, hidden_size)
        self.k_proj = nn.Linear(hidden_size, hidden_size)
        self.v_proj = nn.Linear(hidden_size, hidden_size)
        self.out_proj = nn.Linear(hidden_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[n, p, d] -> [n, p, d]; every position attends to every position."""
        n, p, d = x.shape
        shape = (n, p, self.num_heads, d // self.num_heads)
        q, k, v = (
            proj(x).view(shape).transpose(1, 2) for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        out = F.scaled_dot_product_attention(q, k, v)
        return self.out_proj(out.transpose(1, 2).reshape(n, p, d))


class VisionMLP(nn.Module):
    """``fc2(act(fc1(x)))``."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden_size, intermediate_size)
        self.act = Activation(hidden_act)
        self.fc2 = nn.Linear(intermediate_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionEncoderLayer(nn.Module):
    """Pre-norm block: ``x + self_attn(layer_norm1(x))``, then ``x + mlp(layer_norm2(x))``."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_heads: int,
        hidden_act: str,
        layer_norm_eps: float,
    ) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(hidden_size, eps=layer_norm_eps)
        self.self_attn = VisionAttention(hidden_size, num_heads)
        self.layer_norm2 = nn.LayerNorm(hidden_size, eps=layer_norm_eps)
        self.mlp = VisionMLP(hidden_size, intermediate_size, hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class VisionLayerStack(nn.Module):
    """``num_layers`` :class:`VisionEncoderLayer` blocks, kept as ``self.layers``."""

    def __init__(
        self,
        num_layers: int,
        hidden_size: int,
        intermediate_size: int,
        num_heads: int,
        hidden_act: str,
        layer_norm_eps: float,
    ) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            VisionEncoderLayer(
                hidden_size, intermediate_size, num_heads, hidden_act, layer_norm_eps
            )
            for _ in range(num_layers)
        )


class VisionTower(nn.Module):
    """What CLIP's and SigLIP's vision transformers share: their config, checked and kept as
    attributes (savers write configs from them), the encoder layers they stack, and the
    images they take at a time.

    ``chunk_rows`` (keyword, 1024 by default; None: all images at once): the towers run their
    images through every layer in chunks of as many images as keep a chunk's positions
    within ``chunk_rows`` (at least one image a chunk), then concatenate. Each image attends
    to itself alone, so the outputs are the same up to fp32 rounding; what changes is that the
    ``[positions, intermediate_size]`` tensors each layer makes and frees are a chunk's, not
    the batch's. On the SmolVLM shape's frozen tower (eight 1024-patch images, intermediate
    3072) the fine-tuning step ran about 2% faster with them one at a time: 12 MiB buffers
    come back from the heap, where the whole batch's 96 MiB ones are fresh pages on every
    call. Under ``torch.compile`` the images go at once (the chunk count would be one more
    guard).

    Raises:
        ValueError: naming the first argument a vision tower cannot be built from: a size that
            is not a positive integer, ``image_size`` not a multiple of ``patch_size``, heads
            that do not divide ``hidden_size``, an unknown activation or ``layer_norm_eps``
            outside (0, 1).
    """

    encoder: "VisionLayerStack"

    def __init__(
        self,
        *,
        hidden_size: int,
        intermediate_size: int,
        num_hidden_layers: int,
        num_attention_heads: int,
        image_size: int,
        patch_size: int,
        num_channels: int,
        hidden_act: str,
        layer_norm_eps: float,
        chunk_rows: int | None = 1024,
    ) -> None:
        super().__init__()
        if chunk_rows is not None and not is_int(chunk_rows, 1):
            raise ValueError(f"chunk_rows: expected None or an int >= 1, got {chunk_rows!r:.40}")
        _check_vision_sizes(
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            num_layers=num_hidden_layers,
            num_heads=num_attention_heads,
            image_size=image_size,
            patch_size=patch_size,
            num_channels=num_channels,
            layer_norm_eps=layer_norm_eps,
            hidden_act=hidden_act,
        )
        self.image_size = image_size
        self.patch_size = patch_size
        self.num_channels = num_channels
        self.hidden_size = hidden_size
        self.hidden_act = hidden_act
        self.layer_norm_eps = layer_norm_eps
        self.chunk_rows = chunk_rows
        self._layer_config = (
            num_hidden_layers,
            hidden_size,
            intermediate_size,
            num_attention_heads,
            hidden_act,
            layer_norm_eps,
        )

    def layer_stack(self) -> "VisionLayerStack":
        """A new stack of the encoder layers this config describes (subclasses register it as
        ``encoder``, in the place their checkpoints' key order puts it)."""
        return VisionLayerStack(*self._layer_config)

    @property
    def num_layers(self) -> int:
        return len(self.encoder.layers)

    def image_chunks(self, pixel_values: torch.Tensor, rows_per_image: int) -> list[torch.Tensor]:
        """``pixel_values`` [n, ...] split into the chunks of images the tower runs at a time
        (see the class; ``rows_per_image``: an image's positions in the layers), in order; one
        chunk where all fit, ``chunk_rows`` is None or under ``torch.compile``."""
        if self.chunk_rows is None or torch.compiler.is_compiling():
            return [pixel_values]
        return list(pixel_values.split(max(1, self.chunk_rows // rows_per_image)))

    @property
    def num_patches(self) -> int:
        """Patches per image (CLIP's class token not counted)."""
        return (self.image_size // self.patch_size) ** 2


def _check_vision_sizes(
    *,
    hidden_size: int,
    intermediate_size: int,
    num_layers: int,
    num_heads: int,
    image_size: int,
    patch_size: int,
    num_channels: int,
    layer_norm_eps: float,
    hidden_act: str,
) -> None:
    """Raise ``ValueError`` naming the first argument a vision tower cannot be built from."""
    for name, value in (
        ("hidden_size", hidden_size),
        ("intermediate_size", intermediate_size),
        ("num_attention_heads", num_heads),
        ("image_size", image_size),
        ("patch_size", patch_size),
        ("num_channels", num_channels),
    ):
        check_int(value, name, low=1)
    check_int(num_layers, "num_hidden_layers", low=0)
    if image_size % patch_size:
        raise ValueError(
            f"image_size: expected a multiple of patch_size={patch_size}, got {image_size}"
        )
    if hidden_size % num_heads:
        raise ValueError(
            f"num_attention_heads: expected a divisor of hidden_size={hidden_size}, got {num_heads}"
        )
    if not isinstance(layer_norm_eps, int | float) or not 0 < layer_norm_eps < 1:
        raise ValueError(f"layer_norm_eps: expected a number in (0, 1), got {layer_norm_eps!r}")
    if hidden_act not in ACTIVATIONS:
        raise ValueError(f"hidden_act: expected one of {sorted(ACTIVATIONS)}, got {hidden_act!r}")


def check_pixels(
    pixel_values: object, channels: int, size: int, name: str = "pixel_values"
) -> None:
    """Raise unless ``pixel_values`` is a floating tensor [n, channels, size, size]."""
    if not isinstance(pixel_values, torch.Tensor):
        raise TypeError(f"{name}: expected a tensor, got {type(pixel_values).__name__}")
    if (
        pixel_values.dim() != 4
        or tuple(pixel_values.shape[1:]) != (channels, size, size)
        or not pixel_values.is_floating_point()
    ):
        raise ValueError(
            f"{name}: expected floating images [n, {channels}, {size}, {size}], got shape "
            f"{list(pixel_values.shape)}, dtype {pixel_values.dtype}"
        )
