"""One KV cache per model: concurrent, abandoned and failing streams."""

import gc

import pytest
import torch

from fusion import generate
from fusion.generation import generate_stream, left_pad
from helpers import FEATURES, IMAGE_ID, build_tiny_fusion, lively_decoder

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 4], [12, 13, 14, 15], [7, 0, 9, 0]]
NEW = 6
BUSY = "another generation on this model is in progress"


def tiny_fusion():
    return build_tiny_fusion().eval()


def greedy(model, tokens, **kwargs) -> torch.Tensor:
    return generate(model, tokens, max_new_tokens=NEW, temperature=0, **kwargs)[:, -NEW:]


def test_a_second_stream_is_refused_while_the_first_runs():
    decoder = lively_decoder()
    tokens = left_pad(PROMPTS, pad_id=0)
    expected = greedy(decoder, tokens)
    first = generate_stream(decoder, tokens, max_new_tokens=NEW, temperature=0)
    # Created before the first starts: allowed, but it must not start while the first runs.
    second = generate_stream(decoder, tokens, max_new_tokens=NEW, temperature=0)
    got = [next(first)]
    with pytest.raises(RuntimeError, match=BUSY):
        next(second)
    # While the first is live, new calls are refused when made, before any work.
    with pytest.raises(RuntimeError, match=BUSY):
        generate_stream(decoder, tokens, max_new_tokens=2)
    with pytest.raises(RuntimeError, match=BUSY):
        generate(decoder, tokens[:1], max_new_tokens=2)
    got += list(first)  # the first is unharmed: its tokens are those of a lone run
    assert torch.equal(torch.stack(got, dim=1), expected)
    assert not decoder.caches_are_setup()
    assert torch.equal(greedy(decoder, tokens), expected)  # and the model is free again


def test_streams_advanced_in_turn_on_a_model_with_its_own_caches():
    decoder = lively_decoder()
    tokens = left_pad(PROMPTS, pad_id=0)
    expected = greedy(decoder, tokens)
    decoder.setup_caches(len(PROMPTS), torch.float32, decoder_max_seq_len=40)
    first = generate_stream(decoder, tokens, max_new_tokens=NEW, temperature=0)
    second = generate_stream(decoder, tokens, max_new_tokens=NEW, temperature=0)
    got = [next(first)]
    with pytest.raises(RuntimeError, match=BUSY):
        next(second)
    got += list(first)
    assert torch.equal(torch.stack(got, dim=1), expected)
    assert decoder.caches_are_setup()  # the user's caches stay


def test_an_early_fusion_and_its_decoder_share_one_cache():
    model = tiny_fusion()
    stream = generate_stream(model, torch.tensor([[5, 6, 7]]), max_new_tokens=NEW)
    next(stream)
    with pytest.raises(RuntimeError, match=BUSY):
        generate(model.decoder, torch.tensor([[5, 6]]), max_new_tokens=2)
    stream.close()
    generate(model.decoder, torch.tensor([[5, 6]]), max_new_tokens=2)


@pytest.mark.parametrize("how", ["close", "garbage-collect"])
def test_an_abandoned_stream_leaves_nothing_behind(how):
    decoder = lively_decoder()
    tokens = left_pad(PROMPTS, pad_id=0)
    expected = greedy(decoder, tokens)
    stream = generate_stream(decoder, tokens, max_new_tokens=NEW, temperature=0)
    next(stream)
    next(stream)
    assert decoder.caches_are_setup()
    if how == "close":
        stream.close()
    else:
        del stream
        gc.collect()
    assert not decoder.caches_are_setup()
    assert torch.equal(greedy(decoder, tokens), expected)


def test_a_stream_never_started_holds_nothing():
    decoder = lively_decoder()
    tokens = left_pad(PROMPTS, pad_id=0)
    unused = generate_stream(decoder, tokens, max_new_tokens=NEW, temperature=0)
    assert torch.equal(greedy(decoder, tokens), greedy(decoder, tokens))
    unused.close()
    assert not decoder.caches_are_setup()


class Boom(Exception):
    pass


@pytest.mark.parametrize("own_caches", [False, True])
def test_an_error_inside_the_model_mid_stream(own_caches):
    decoder = lively_decoder()
    tokens = left_pad(PROMPTS, pad_id=0)
    expected = greedy(decoder, tokens)
    if own_caches:
        decoder.setup_caches(len(PROMPTS), torch.float32, decoder_max_seq_len=40)
    calls = []

    def fail_on_third_call(*_):
        calls.append(1)
        if len(calls) == 3:
            raise Boom

    handle = decoder.register_forward_hook(fail_on_third_call)
    stream = generate_stream(decoder, tokens, max_new_tokens=NEW, temperature=0)
    with pytest.raises(Boom):
        list(stream)
    handle.remove()
    assert len(calls) == 3
    assert decoder.caches_are_setup() == own_caches  # ours removed, the user's kept
    assert torch.equal(greedy(decoder, tokens), expected)  # not left busy
    assert decoder.skip_output_layer is False and decoder.output_hidden_states == []


def test_an_encoder_error_at_prefill():
    model = tiny_fusion()

    def broken(*_):
        raise Boom

    handle = model.encoders["image"].register_forward_hook(broken)
    tokens = torch.tensor([[5, IMAGE_ID, IMAGE_ID]])
    images = {"image": {"features": torch.zeros(1, 2, FEATURES)}}
    with pytest.raises(Boom):
        generate(model, tokens, encoder_input=images, max_new_tokens=2)
    handle.remove()
    assert not model.caches_are_setup()
    generate(model, tokens, encoder_input=images, max_new_tokens=2)
