"""Gemma 3 generates through rings (issue 38, item 4: "the sliding-window layers keep at most
their window in the cache"), on the family suite's tiny models (window 5, three of four layers
sliding) and their left-padded prompt batches, text only and with images:

- while generating, each sliding layer's cache tensors are [b, kv_heads, 5, head_dim], the
  full layer's as long as prompt plus new tokens;
- greedy tokens equal transformers' ``generate`` and the full-length caches' (every layer
  keeping every position), with prompt plus new tokens past five windows (the rings wrap
  several times);
- compiled, they equal eager and other prompts of the same shapes never recompile.

The bytes saved are computed for a Gemma-3-4B-like stack in ``tests/decoder/test_sliding_cache.py``.
"""

import dataclasses

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from families.fixtures import FIXTURES
from fusion import EarlyFusion, generate
from fusion.checkpoint import load_hf_model
from fusion.decoder import KVCache, SlidingWindowKVCache
from fusion.generation import generate_stream
from gemma3_helpers import LAYER_TYPES, WINDOW
from helpers import use_full_caches

NEW = 5 * WINDOW


@pytest.fixture(scope="module", params=["gemma3_text", "gemma3"])
def built(request, tmp_path_factory):
    """(transformers' tiny model, ours loaded from its directory, the prompt batch)."""
    fixture = FIXTURES[request.param]
    directory = tmp_path_factory.mktemp(request.param)
    hf = fixture.write(directory)
    return hf, load_hf_model(directory).eval(), fixture.prompts()


def greedy(model, batch, **kwargs) -> torch.Tensor:
    out = generate(
        model,
        batch.ids,
        encoder_input=batch.ours or None,
        max_new_tokens=NEW,
        temperature=0,
        pad_id=0,
        **kwargs,
    )
    return out[:, batch.ids.size(1) :]


def decoder_of(model):
    return model.decoder if isinstance(model, EarlyFusion) else model


def test_the_sliding_layers_cache_their_window_while_generating(built):
    _, model, batch = built
    b, s = batch.ids.shape
    assert s + NEW > 2 * WINDOW  # the rings wrap
    stream = generate_stream(
        model, batch.ids, encoder_input=batch.ours or None, max_new_tokens=NEW, temperature=0
    )
    next(stream)  # the prefill: the caches are set up and filled
    caches = decoder_of(model).kv_caches()
    stream.close()
    assert [isinstance(c, SlidingWindowKVCache) for c in caches] == [
        kind == "sliding_attention" for kind in LAYER_TYPES
    ]
    for cache in caches:
        attn = decoder_of(model).attentions()[0]
        slots = WINDOW if isinstance(cache, SlidingWindowKVCache) else s + NEW - 1
        for tensor in (cache.k_cache, cache.v_cache):
            assert tensor.shape == (b, attn.num_kv_heads, slots, attn.head_dim)
            assert tensor.dtype == torch.float32
        assert cache.max_seq_len == s + NEW - 1
    assert not decoder_of(model).caches_are_setup()  # the stream's own caches: removed


def test_greedy_tokens_equal_transformers_and_the_full_length_caches(built):
    hf, model, batch = built
    with torch.no_grad():
        theirs = hf.generate(
            input_ids=batch.ids,
            attention_mask=batch.attention_mask,
            **batch.theirs,
            max_new_tokens=NEW,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )[:, batch.ids.size(1) :]
    ours = greedy(model, batch)
    assert ours.tolist() == theirs.tolist()
    assert len({tuple(row) for row in ours.tolist()}) == len(ours)  # a lively model
    decoder = decoder_of(model)
    decoder.setup_caches(len(batch.ids), torch.float32, decoder_max_seq_len=96)
    try:
        use_full_caches(decoder)
        assert all(type(c) is KVCache and c.num_slots == 96 for c in decoder.kv_caches())
        assert torch.equal(greedy(model, batch), ours)
    finally:
        decoder.teardown_caches()


def test_compiled_greedy_decoding_through_rings_equals_eager_and_never_recompiles(built):
    _, model, batch = built
    expected = greedy(model, batch)
    other = dataclasses.replace(batch, ids=batch.ids.flip(0))  # other prompts, same shapes
    if batch.ours:  # the rows swapped, their images with them
        pixels = batch.ours["image"]["pixel_values"]
        other = dataclasses.replace(
            other, ours={"image": {"pixel_values": torch.cat([pixels[1:], pixels[:1]])}}
        )
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("eager")
    try:
        assert torch.equal(greedy(model, batch, compile={"backend": counter}), expected)
        frames = counter.frame_count
        with torch._dynamo.config.patch(error_on_recompile=True):
            greedy(model, other, compile={"backend": counter})
            again = greedy(model, batch, compile={"backend": counter})
        assert torch.equal(again, expected) and counter.frame_count == frames >= 1
    finally:
        torch._dynamo.reset()
