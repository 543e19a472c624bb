"""Small models and data shared by the tests."""

import os
import resource
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import torch
from torch import nn

from fusion import EarlyFusion, register_fusion_module
from fusion.decoder import KVCache, TransformerDecoder
from fusion.models import llama3_2

VOCAB = 64
EMBED_DIM = 32


def build_tiny_decoder(tie_word_embeddings: bool = True, seed: int = 0) -> TransformerDecoder:
    """A 2-layer GQA Llama small enough for unit tests (4 query heads, 2 KV heads, width 32)."""
    torch.manual_seed(seed)
    return llama3_2(
        vocab_size=VOCAB,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        embed_dim=EMBED_DIM,
        max_seq_len=64,
        intermediate_dim=64,
        tie_word_embeddings=tie_word_embeddings,
    )


def lively_decoder(seed: int = 0) -> TransformerDecoder:
    """The tiny decoder, untied and with larger weights, in eval mode: greedy decoding does not
    just repeat the last token, so a wrong position, mask or cache slot changes the tokens."""
    decoder = build_tiny_decoder(tie_word_embeddings=False, seed=seed)
    with torch.no_grad():
        for param in decoder.parameters():
            if param.dim() == 2:
                param.mul_(3)
    return decoder.eval()


def use_full_caches(decoder: TransformerDecoder) -> None:
    """Replace the set-up caches of ``decoder``'s sliding-window layers (rings of their window)
    by caches of the whole length: the path before rings, where every layer kept every
    position."""
    for attn in decoder.attentions():
        cache = attn.kv_cache
        assert cache is not None, "set up the caches first"
        attn.kv_cache = KVCache(
            cache.batch_size,
            cache.max_seq_len,
            attn.num_kv_heads,
            attn.head_dim,
            cache.k_cache.dtype,
            cache.k_cache.device,
        )


IMAGE_ID = VOCAB + 5  # outside the vocabulary
AUDIO_ID = 3  # inside the vocabulary: reserved, never embedded as text
FEATURES = 6


class TinyEncoder(nn.Module):
    """``features`` [n_media, tokens, FEATURES] -> packed rows [n_media, tokens, EMBED_DIM],
    with a projection head registered as a fusion module."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Linear(FEATURES, FEATURES)
        self.proj = register_fusion_module(nn.Linear(FEATURES, EMBED_DIM))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.tanh(self.backbone(features)))


def build_tiny_fusion(seed: int = 0, **kwargs) -> EarlyFusion:
    """``EarlyFusion`` over :func:`build_tiny_decoder` with an image and an audio encoder."""
    decoder = build_tiny_decoder(seed=seed)
    torch.manual_seed(seed + 1)
    return EarlyFusion(
        decoder,
        {"image": TinyEncoder(), "audio": TinyEncoder()},
        {"image": IMAGE_ID, "audio": AUDIO_ID},
        **kwargs,
    )


def text_tokens(batch: int, seq_len: int, seed: int = 0) -> torch.Tensor:
    """Random text ids that are not placeholders."""
    return torch.randint(4, VOCAB, (batch, seq_len), generator=torch.Generator().manual_seed(seed))


HF_VOCAB = 96


def tiny_hf_llama(
    *,
    tied: bool,
    rope_scaling: dict | None = None,
    seed: int = 0,
    initializer_range: float = 0.1,
    randomize_norms: bool = True,
    **config: object,
):
    """A random 2-layer GQA ``transformers.LlamaForCausalLM`` (vocab ``HF_VOCAB``, width 32,
    4 heads, 2 KV heads), eager attention, in eval mode. ``randomize_norms`` draws the norm
    scales from [0.5, 1.5] so that layout errors in them show; ``config`` overrides
    ``LlamaConfig`` fields."""
    from transformers import LlamaConfig, LlamaForCausalLM  # a test extra only

    torch.manual_seed(seed)
    settings = dict(
        vocab_size=HF_VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_theta=500_000.0,
        rope_scaling=rope_scaling,
        tie_word_embeddings=tied,
        initializer_range=initializer_range,
        rms_norm_eps=1e-5,
        attn_implementation="eager",
    )
    model = LlamaForCausalLM(LlamaConfig(**{**settings, **config})).eval()
    if randomize_norms:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name:  # initialised to ones: make them matter
                    param.uniform_(0.5, 1.5)
    return model


def run_bounded(
    code: str, *args: str, memory_bytes: int = 2 << 30, timeout: float = 180.0
) -> subprocess.CompletedProcess:
    """Run ``python -c code args...`` from the repository root with its address space limited
    to ``memory_bytes`` (so an input that makes the code allocate gigabytes fails there, not
    on the machine) and a wall-clock ``timeout`` (so one that hangs fails the test). For
    hostile-input tests; returns the finished process (text stdout and stderr)."""

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))

    root = Path(__file__).resolve().parents[1]
    environment = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{root / 'tests'}"}
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        preexec_fn=limit,
        cwd=root,
        env=environment,
    )


@contextmanager
def recording_pin_memory() -> Iterator[list[torch.Tensor]]:
    """``Tensor.pin_memory`` recorded instead of run (a CPU-only torch cannot pin): the tensors
    asked to be pinned, in order; each returns a copy."""
    pinned: list[torch.Tensor] = []

    def pin(tensor: torch.Tensor) -> torch.Tensor:
        pinned.append(tensor)
        return tensor.clone()

    with mock.patch.object(torch.Tensor, "pin_memory", pin):
        yield pinned


# ATen tags of ops that synchronise with the host on an accelerator.
SYNC_TAGS = {torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output}


def sync_ops_in(graph: torch.fx.GraphModule) -> list[str]:
    """ATen ops of a graph that synchronise on an accelerator: a value read on the host
    (``.item()``, ``bool()``), ops whose output shape depends on the data (``nonzero``,
    ``masked_select``, ...) and boolean-mask indexing. Indexing with integer tensors (the rotary
    table) is neither."""
    found = []
    for node in graph.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        if node.target.overloadpacket in (torch.ops.aten.index, torch.ops.aten.index_put):
            indices = [i for i in node.args[1] if i is not None]
            if all(i.meta["val"].dtype in (torch.int64, torch.int32) for i in indices):
                continue
        if SYNC_TAGS & set(node.target.tags) or "item" in str(node.target):
            found.append(str(node.target))
    return found


def saved_bytes(run) -> int:
    """The bytes of the distinct tensors autograd keeps for the backward pass of ``run()``,
    parameters and views of them (a linear layer keeps ``weight.t()``) left out."""
    kept: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if not isinstance(tensor, torch.nn.Parameter) and not isinstance(
            tensor._base, torch.nn.Parameter
        ):
            storage = tensor.untyped_storage()
            kept[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        run()
    return sum(kept.values())
