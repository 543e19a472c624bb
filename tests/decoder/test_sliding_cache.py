"""Sliding-window layers' KV caches: rings of their window's slots
(:class:`~fusion.decoder.kv_cache.SlidingWindowKVCache`), chosen from the attention module's
``sliding_window`` alone (any family; a tiny Llama with a window set on a layer here):

- shapes and dtypes: a sliding layer's cache tensors are [b, kv_heads, window, head_dim], the
  full layers' [b, kv_heads, max_len, head_dim]; a window as long as the cache gets a plain one;
- memory, computed on the meta device for a Gemma-3-4B-like stack in bfloat16 at 8192
  positions: 1088 MiB per sequence with full caches, 276 MiB with rings (0.254x);
- the ring gives the logits of the full-length cache and of the full forward, for prefills
  longer and shorter than the window, chunks of any length, decoding steps past the wrap and
  left padding;
- compiled steps compile once across the wrap, and their graphs hold no synchronising op.
"""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch._dynamo.testing import CompileCounterWithBackend

from fusion.decoder import KVCache, SlidingWindowKVCache, TransformerDecoder
from fusion.models import llama3_2
from fusion.padding import prefill_mask, prompt_positions
from helpers import VOCAB, lively_decoder, sync_ops_in, use_full_caches

MiB = 2**20


def sliding_decoder(window: int, seed: int = 0) -> TransformerDecoder:
    """The lively tiny Llama (2 layers, 2 KV heads of 8), its first layer sliding: the first
    cache, whose fill level and length are the decoder's, is then a ring."""
    decoder = lively_decoder(seed)
    decoder.attentions()[0].sliding_window = window
    return decoder


def test_a_sliding_layer_caches_its_window_only():
    decoder = sliding_decoder(window=5)
    decoder.setup_caches(3, torch.bfloat16, decoder_max_seq_len=40)
    ring, full = decoder.kv_caches()
    assert isinstance(ring, SlidingWindowKVCache) and type(full) is KVCache
    for tensor in (ring.k_cache, ring.v_cache):
        assert tensor.shape == (3, 2, 5, 8) and tensor.dtype == torch.bfloat16
    for tensor in (full.k_cache, full.v_cache):
        assert tensor.shape == (3, 2, 40, 8) and tensor.dtype == torch.bfloat16
    assert (ring.max_seq_len, ring.num_slots, full.num_slots) == (40, 5, 40)
    assert ring.fill.dtype == torch.long and ring.fill.dim() == 0
    assert decoder.decoder_max_cache_seq_len == 40  # positions taken, not slots held
    ids = torch.randint(1, VOCAB, (3, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        # float32 in, bfloat16 kept: converted on write and read, as a full cache does
        logits = [decoder(ids[:, :7]), *(decoder(ids[:, i : i + 1]) for i in range(7, 12))]
        assert ring.size == full.size == 12 and ring.k_cache.any()  # past the window: wrapped
        decoder.setup_caches(3, torch.bfloat16, decoder_max_seq_len=40)
        use_full_caches(decoder)
        expected = [decoder(ids[:, :7]), *(decoder(ids[:, i : i + 1]) for i in range(7, 12))]
    torch.testing.assert_close(torch.cat(logits, 1), torch.cat(expected, 1))
    decoder.setup_caches(3, torch.bfloat16, decoder_max_seq_len=40)
    ring = decoder.kv_caches()[0]
    with torch.no_grad():
        decoder(ids)
    decoder.reset_caches()
    assert ring.size == 0 and not ring.k_cache.any() and not ring.v_cache.any()
    # A window as long as the cache: a plain cache holds every position in no more slots.
    decoder.setup_caches(3, torch.float32, decoder_max_seq_len=5)
    assert type(decoder.kv_caches()[0]) is KVCache


def test_a_ring_needs_a_window_shorter_than_its_length():
    for window in (0, 8, 9):
        with pytest.raises(ValueError, match="window: expected 1 to max_seq_len - 1 = 7"):
            SlidingWindowKVCache(1, 8, window, 2, 8, torch.float32)


def cache_bytes(decoder: TransformerDecoder) -> int:
    return sum(c.k_cache.nbytes + c.v_cache.nbytes for c in decoder.kv_caches())


def test_memory_of_a_gemma3_4b_like_stack():
    """Gemma 3 4B's attention: 34 layers, every 6th full, the others sliding over 1024
    positions, 4 KV heads of 256. On the meta device (shapes only, nothing allocated); the
    cache sizes depend on the KV heads alone, so a Llama of that layout stands in."""
    with torch.device("meta"):
        decoder = llama3_2(
            vocab_size=256,
            num_layers=34,
            num_heads=8,
            num_kv_heads=4,
            embed_dim=2048,  # 8 heads of 256
            max_seq_len=8192,
            intermediate_dim=64,
        )
    decoder.setup_caches(1, torch.bfloat16)
    full = cache_bytes(decoder)
    for i, attn in enumerate(decoder.attentions()):
        if (i + 1) % 6:
            attn.sliding_window = 1024
    decoder.setup_caches(1, torch.bfloat16)
    rings = cache_bytes(decoder)
    per_position = 2 * 4 * 256 * 2  # keys and values, 4 heads of 256, bfloat16
    assert full == 34 * 8192 * per_position == 1088 * MiB
    assert rings == (5 * 8192 + 29 * 1024) * per_position == 276 * MiB


def run_calls(decoder, ids, mask, positions, lengths):
    out, start = [], 0
    for n in lengths:
        stop = start + n
        out.append(
            decoder(
                ids[:, start:stop], mask=mask[:, start:stop], input_pos=positions[:, start:stop]
            )
        )
        start = stop
    return torch.cat(out, dim=1)


@st.composite
def schedules(draw):
    """A window, a left-padded batch and the lengths of the calls that feed it: a prefill
    (shorter or longer than the window), then chunks and single steps."""
    window = draw(st.integers(1, 6))
    lengths = draw(st.lists(st.integers(1, 3 * window + 2), min_size=1, max_size=6))
    total = sum(lengths)
    pads = draw(st.lists(st.integers(0, min(total - 1, 4)), min_size=2, max_size=2))
    return window, lengths, pads, draw(st.integers(0, 2**16))


@given(schedules())
def test_the_ring_gives_the_full_cache_s_and_the_full_forward_s_logits(schedule):
    window, lengths, pads, seed = schedule
    total = sum(lengths)
    cache_len = max(total, window) + 3  # longer than the window: a ring
    pad_counts = torch.tensor(pads)
    ids = torch.randint(1, VOCAB, (2, total), generator=torch.Generator().manual_seed(seed))
    mask = prefill_mask(pad_counts, total, cache_len)
    positions = prompt_positions(pad_counts, total)
    decoder = sliding_decoder(window)
    with torch.no_grad():
        forward = decoder(ids, mask=mask[..., :total], input_pos=positions)
        decoder.setup_caches(2, torch.float32, decoder_max_seq_len=cache_len)
        assert isinstance(decoder.kv_caches()[0], SlidingWindowKVCache)
        rings = run_calls(decoder, ids, mask, positions, lengths)
        decoder.setup_caches(2, torch.float32, decoder_max_seq_len=cache_len)
        use_full_caches(decoder)
        full = run_calls(decoder, ids, mask, positions, lengths)
    real = torch.arange(total)[None] >= pad_counts[:, None]  # pad slots' outputs: never read
    torch.testing.assert_close(rings[real], full[real], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rings[real], forward[real], atol=1e-5, rtol=1e-5)


def test_the_window_is_what_the_ring_changes():
    """Planted: a ring one slot short (what the window lets a step see is its ``window``
    latest positions, itself included) moves the logits."""
    ids = torch.randint(1, VOCAB, (1, 12), generator=torch.Generator().manual_seed(3))
    decoder = sliding_decoder(window=4)
    with torch.no_grad():
        expected = decoder(ids)
        decoder.setup_caches(1, torch.float32, decoder_max_seq_len=16)
        attn = decoder.attentions()[0]
        attn.kv_cache = SlidingWindowKVCache(
            1, 16, 3, attn.num_kv_heads, attn.head_dim, torch.float32
        )
        short = torch.cat([decoder(ids[:, i : i + 1]) for i in range(12)], dim=1)
    assert (short - expected).abs().max() > 1e-2


def test_compiled_steps_compile_once_across_the_wrap_and_never_synchronise():
    from torch._functorch.aot_autograd import aot_module_simplified, make_boxed_func

    graphs: list[torch.fx.GraphModule] = []

    def record(gm, example_inputs):
        def compiler(aten_graph, _):
            graphs.append(aten_graph)
            return make_boxed_func(aten_graph.forward)

        return aot_module_simplified(gm, example_inputs, fw_compiler=compiler)

    torch._dynamo.reset()
    decoder = sliding_decoder(window=3)
    counter = CompileCounterWithBackend(record)
    step = torch.compile(decoder, backend=counter, fullgraph=True, dynamic=False)
    ids = torch.randint(1, VOCAB, (2, 14), generator=torch.Generator().manual_seed(1))
    try:
        with torch.no_grad():
            expected = decoder(ids)
            decoder.setup_caches(2, torch.float32, decoder_max_seq_len=16)
            with torch._dynamo.config.patch(error_on_recompile=True):
                logits = [step(ids[:, i : i + 1]) for i in range(14)]  # wraps 4 times
    finally:
        torch._dynamo.reset()
    assert counter.frame_count == 1 and len(graphs) == 1
    assert sync_ops_in(graphs[0]) == []
    assert decoder.kv_caches()[0].size == 14
    torch.testing.assert_close(torch.cat(logits, 1), expected, atol=1e-5, rtol=1e-5)
