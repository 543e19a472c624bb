import torch
from torch import nn

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class ScaledEmbedding(nn.Embedding):
    """An ``nn.Embedding`` whose rows come out multiplied by ``embed_scale`` (Gemma's square
    root of the width), the factor first rounded to the weights' dtype, as transformers
    rounds it (in bfloat16 Gemma 3 4B's sqrt(2560) = 50.596... becomes 50.5). The weight and
    its key are an ``nn.Embedding``'s; a tied output projects with the unscaled weight.

    Shapes: ids ``[...]`` -> ``[..., embedding_dim]``.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, embed_scale: float) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.embed_scale = embed_scale
        # The factor as each floating dtype rounds it, made once here (on the CPU whatever the
        # default device, meta while a loader builds): the forward looks it up, with no tensor
        # made and nothing read back (nor a graph break when compiled).
        self._rounded = {d: torch.tensor(embed_scale, device="cpu").to(d).item() for d in _FLOATS}

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        # A Python scalar of the weights' dtype: the product of two values of that dtype,
        # rounded once, as transformers multiplies by its scale buffer cast to that dtype.
        return super().forward(input) * self._rounded[self.weight.dtype]
