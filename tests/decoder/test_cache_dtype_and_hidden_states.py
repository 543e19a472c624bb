"""A KV cache set up in another dtype than the decoder's works (converted on write and read),
and ``output_hidden_states`` refuses layer indices the decoder does not have when set."""

import pytest
import torch

from fusion import EarlyFusion
from helpers import build_tiny_decoder, lively_decoder, text_tokens


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float64])
def test_cache_in_another_dtype_than_the_decoder(cache_dtype):
    decoder = lively_decoder()
    tokens = text_tokens(2, 5)
    decoder.setup_caches(2, cache_dtype, decoder_max_seq_len=16)
    assert decoder.layers[0].attn.kv_cache.k_cache.dtype == cache_dtype
    with torch.no_grad():
        prefill = decoder(tokens)
        step = decoder(tokens[:, -1:])
        decoder.reset_caches()
        with decoder.caches_disabled():
            full = decoder(torch.cat([tokens, tokens[:, -1:]], 1))
    assert prefill.dtype == step.dtype == torch.float32
    tolerance = {"atol": 0.1, "rtol": 0.05} if cache_dtype == torch.bfloat16 else {}
    torch.testing.assert_close(step[:, -1], full[:, -1], **tolerance)


def test_cache_dtype_must_be_floating():
    decoder = build_tiny_decoder()
    with pytest.raises(
        ValueError, match=r"dtype: expected a floating torch\.dtype, got torch\.int64"
    ):
        decoder.setup_caches(1, torch.int64)
    assert not decoder.caches_are_setup()


def test_output_hidden_states_in_range():
    decoder = build_tiny_decoder()  # 2 layers
    decoder.output_hidden_states = [0, 2]
    out = decoder(text_tokens(1, 3))
    assert isinstance(out, list) and len(out) == 3
    for bad in ([5], [-1], [True], [0.0]):
        with pytest.raises(
            ValueError, match=r"output_hidden_states: expected layer indices in \[0, 2\]"
        ):
            decoder.output_hidden_states = bad
    with pytest.raises(ValueError, match="expected a list of layer indices"):
        decoder.output_hidden_states = 1
    assert decoder.output_hidden_states == [0, 2]  # unchanged by the refusals
    model = EarlyFusion(decoder, {}, {})
    with pytest.raises(ValueError, match=r"got \[3\]"):
        model.output_hidden_states = [3]
