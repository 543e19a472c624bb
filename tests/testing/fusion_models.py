"""Tiny fusion models for the tests of ``fusion.testing``'s inputs and properties, correct and
with planted bugs."""

import torch
from torch import nn

from fusion import EarlyFusion, Padded, merge_embeddings
from fusion.models import llama3_2

AUDIO, IMAGE = 200, 7  # one placeholder outside the vocabulary, one inside
VOCAB, DIM = 64, 16


class Audio(nn.Module):
    """Clips [n, 1, 48] -> 3 rows per clip [n, 3, d]: a strided 1-D convolution, BatchNorm;
    plus ``offset``, a buffer left out of the state dict."""

    def __init__(self, dim: int, offset: float = 0.0) -> None:
        super().__init__()
        self.register_buffer("offset", torch.tensor(offset), persistent=False)
        self.conv = nn.Conv1d(1, 8, kernel_size=8, stride=4)
        self.norm = nn.BatchNorm1d(8)
        self.proj = nn.Linear(8, dim)

    def forward(self, clips: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.norm(self.conv(clips)))  # [n, 8, 11]
        return self.proj(nn.functional.adaptive_avg_pool1d(h, 3).transpose(1, 2)) + self.offset


class Patches(nn.Module):
    """Images [n, 2, 12] -> 2 rows per image [n, 2, d]."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(12, dim)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        return self.proj(patches)


def build(
    seed: int = 0, cls: type[EarlyFusion] = EarlyFusion, images: bool = True, offset: float = 0.0
):
    """A 1-layer decoder with an audio encoder (and an image encoder), in eval mode."""
    torch.manual_seed(seed)
    decoder = llama3_2(VOCAB, 1, 2, 1, DIM, 32)
    encoders: dict[str, nn.Module] = {"audio": Audio(DIM, offset)}
    tokens = {"audio": AUDIO}
    if images:
        encoders["image"], tokens["image"] = Patches(DIM), IMAGE
    return cls(decoder, encoders, tokens).eval()


def _placeholders(model: EarlyFusion, ids: torch.Tensor) -> torch.Tensor:
    return torch.isin(ids, torch.tensor(list(model.encoder_tokens.values())))


class ShiftedRows(EarlyFusion):
    """Planted bug: within each sample, every placeholder takes the row meant for the one
    before it (rows rotate by one)."""

    def forward(self, tokens, *, mask=None, encoder_input=None, input_pos=None, **kwargs):
        rows = self.encode(encoder_input or {})

        def embed(tok_embeddings, ids):
            out = merge_embeddings(
                ids, tok_embeddings, rows, self.encoder_tokens, vocab_size=self.decoder.vocab_size
            )
            where = _placeholders(self, ids)
            for i in range(ids.size(0)):
                slots = where[i].nonzero().flatten()
                out[i, slots] = out[i, slots.roll(1)]
            return out

        return self.decoder(tokens, mask=mask, input_pos=input_pos, embed=embed, **kwargs)


class RestartingRows(EarlyFusion):
    """Planted bug: a batch-dependent merge. Packed rows restart at every sample (each sample
    reads the batch's first rows), which is right for a batch of one sample only."""

    def forward(self, tokens, *, mask=None, encoder_input=None, input_pos=None, **kwargs):
        rows = {}
        for name, value in self.encode(encoder_input or {}).items():
            if isinstance(value, Padded):
                rows[name] = value
                continue
            flat = value.reshape(-1, value.size(-1))
            count = int((tokens == self.encoder_tokens[name]).sum(1).max())
            rows[name] = Padded(flat[:count].expand(tokens.size(0), -1, -1))
        return super().forward(tokens, mask=mask, encoder_input=rows, input_pos=input_pos, **kwargs)
