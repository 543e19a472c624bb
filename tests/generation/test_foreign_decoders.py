"""generate / generate_stream over an EarlyFusion holding a Hugging Face Llama (through its own
cache) or a torchtune-style decoder (through its setup_caches), images and left padding
included."""

import pytest
import torch
from foreign_decoders import (
    IMAGE,
    CachelessTorchtuneStyleDecoder,
    TorchtuneStyleDecoder,
    fuse,
    hf_llama,
)

from fusion import generate, merge_embeddings
from fusion.generation import generate_stream, left_pad
from helpers import FEATURES, lively_decoder

NEW = 8


def prompts_with_images():
    """Two left-padded prompts, 3 image placeholders in the first and 2 in the second."""
    tokens = left_pad([[7, IMAGE, IMAGE, IMAGE, 9, 11, 5], [8, IMAGE, IMAGE, 12]], pad_id=0)
    features = torch.randn(5, 1, FEATURES, generator=torch.Generator().manual_seed(0))
    return tokens, {"image": {"features": features}}


@pytest.fixture(scope="module")
def hf_fusion():
    decoder = hf_llama()
    decoder.generation_config.eos_token_id = None  # run all the steps, as generate here does
    return fuse(decoder).eval()


def test_hf_greedy_tokens_equal_transformers_generate(hf_fusion):
    tokens, encoder_input = prompts_with_images()
    out = generate(
        hf_fusion, tokens, encoder_input=encoder_input, max_new_tokens=NEW, temperature=0
    )
    with torch.no_grad():
        merged = merge_embeddings(
            tokens,
            hf_fusion.decoder.get_input_embeddings(),
            hf_fusion.encode(encoder_input),
            hf_fusion.encoder_tokens,
            impl="reference",
        )
        expected = hf_fusion.decoder.generate(
            inputs_embeds=merged,
            attention_mask=(tokens != 0).long(),
            max_new_tokens=NEW,
            do_sample=False,
            pad_token_id=0,
        )
    assert torch.equal(out[:, : tokens.size(1)], tokens)
    assert torch.equal(out[:, tokens.size(1) :], expected)
    assert len(set(expected[0].tolist())) > 2  # not a repeated token: positions matter
    streamed = list(
        generate_stream(
            hf_fusion, tokens, encoder_input=encoder_input, max_new_tokens=NEW, temperature=0
        )
    )
    assert torch.equal(torch.stack(streamed, 1), expected)


def test_hf_each_prompt_alone_generates_what_it_does_in_the_batch(hf_fusion):
    tokens, encoder_input = prompts_with_images()
    batch = generate(
        hf_fusion, tokens, encoder_input=encoder_input, max_new_tokens=4, temperature=0
    )
    features = encoder_input["image"]["features"]
    alone = generate(
        hf_fusion,
        tokens[1:, 3:],  # the second prompt without its padding
        encoder_input={"image": {"features": features[3:]}},
        max_new_tokens=4,
        temperature=0,
    )
    assert torch.equal(batch[1, -4:], alone[0, -4:])


def test_hf_stop_tokens_and_sampling(hf_fusion):
    tokens, encoder_input = prompts_with_images()
    greedy = generate(
        hf_fusion, tokens, encoder_input=encoder_input, max_new_tokens=NEW, temperature=0
    )
    stop = int(greedy[0, tokens.size(1) + 1])  # sample 0's second new token
    out = generate(
        hf_fusion,
        tokens,
        encoder_input=encoder_input,
        max_new_tokens=NEW,
        temperature=0,
        stop_tokens=[stop],
        stop_check_interval=1,
    )
    new = out[0, tokens.size(1) :]
    first = int((new == stop).int().argmax())
    assert (new[first + 1 :] == 0).all()  # pad_id after the stop token
    top_1 = generate(  # the sampling path, with one candidate: the greedy tokens
        hf_fusion,
        tokens,
        encoder_input=encoder_input,
        max_new_tokens=NEW,
        temperature=0.7,
        top_k=1,
        generator=torch.Generator().manual_seed(0),
    )
    assert torch.equal(top_1, greedy)


def test_hf_refusals(hf_fusion):
    tokens, encoder_input = prompts_with_images()
    with pytest.raises(ValueError, match=r"compile: compiled generation needs this library's"):
        generate(hf_fusion, tokens, encoder_input=encoder_input, max_new_tokens=2, compile=True)
    with pytest.raises(ValueError, match=r"model: its decoder LlamaModel has no output layer"):
        generate(
            fuse(hf_fusion.decoder.model), tokens, encoder_input=encoder_input, max_new_tokens=2
        )
    with pytest.raises(TypeError, match=r"model: expected a TransformerDecoder or an EarlyFusion"):
        generate(hf_fusion.decoder, tokens, max_new_tokens=2)
    with pytest.raises(ValueError, match=r"tokens: expected ids in \[0, 96\)"):
        generate(hf_fusion, tokens.clamp(max=95) + 1, max_new_tokens=2)  # 96: not a text id


def test_torchtune_style_generates_as_fusions_decoder_does():
    fused_plain = fuse(lively_decoder()).eval()
    torchtune = fuse(TorchtuneStyleDecoder(lively_decoder())).eval()
    tokens, encoder_input = prompts_with_images()
    expected = generate(
        fused_plain, tokens, encoder_input=encoder_input, max_new_tokens=NEW, temperature=0
    )
    out = generate(
        torchtune, tokens, encoder_input=encoder_input, max_new_tokens=NEW, temperature=0
    )
    assert torch.equal(out, expected)
    assert len(set(expected[0, tokens.size(1) :].tolist())) > 2
    assert not torchtune.decoder.caches_are_setup()  # set up for the call, then torn down
    torchtune.decoder.setup_caches(2, torch.float32, decoder_max_seq_len=32)
    again = generate(
        torchtune, tokens, encoder_input=encoder_input, max_new_tokens=NEW, temperature=0
    )
    assert torch.equal(again, expected)
    assert torchtune.decoder.caches_are_setup()  # the caller's caches stay
    with pytest.raises(ValueError, match=r"need 36 cache positions, more than the KV cache's"):
        generate(torchtune, tokens, encoder_input=encoder_input, max_new_tokens=30)


def test_torchtune_style_without_caches_is_refused_by_name():
    model = fuse(CachelessTorchtuneStyleDecoder(lively_decoder()))
    tokens, encoder_input = prompts_with_images()
    with pytest.raises(
        ValueError,
        match=r"model: its torchtune-style decoder CachelessTorchtuneStyleDecoder has no "
        r"setup_caches, caches_are_setup, reset_caches",
    ):
        generate(model, tokens, encoder_input=encoder_input, max_new_tokens=2)
