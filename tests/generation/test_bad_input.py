"""The generation API swept with odd input: the right result, or an error naming the argument
raised when the call is made (before any cache is set up or the model runs)."""

import numpy as np
import pytest
import torch

from fusion import generate
from fusion.generation import check_sampling_args, generate_stream, left_pad, sample_next_token
from helpers import AUDIO_ID, FEATURES, IMAGE_ID, VOCAB, build_tiny_decoder, build_tiny_fusion

PROMPT = [[5, 6, 7, 50, 9]]
NEW = 3


@pytest.fixture(scope="module")
def decoder():
    """Shared by the tests of this module: each leaves it as it found it (asserted)."""
    return build_tiny_decoder(tie_word_embeddings=False).eval()


@pytest.fixture(autouse=True)
def _model_left_clean(request):
    yield
    if "decoder" in request.fixturenames:
        model = request.getfixturevalue("decoder")
        assert not model.caches_are_setup()


def refused(call, match: str, error: type[Exception] = ValueError) -> None:
    with pytest.raises(error, match=match):
        call()


def sampled(decoder, tokens=None, **kwargs) -> torch.Tensor:
    """One seeded sampling run: the reference for arguments that are accepted."""
    # top_p and temperature exact in float32, so that NumPy float32 gives the same run
    kwargs = {"max_new_tokens": NEW, "top_k": 20, "top_p": 0.75, "temperature": 1.25} | kwargs
    tokens = torch.tensor(PROMPT) if tokens is None else tokens
    return generate(decoder, tokens, generator=torch.Generator().manual_seed(0), **kwargs)


INTEGER_DTYPES = [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64]
INTEGER_DTYPES += [torch.uint16, torch.uint32, torch.uint64]


@pytest.mark.parametrize("dtype", INTEGER_DTYPES, ids=str)
def test_every_integer_dtype_of_tokens(decoder, dtype):
    out = sampled(decoder, torch.tensor(PROMPT).to(dtype))
    assert out.dtype == torch.int64 and torch.equal(out, sampled(decoder))


@pytest.mark.parametrize(
    "tokens",
    [
        torch.tensor([[True, False, True]]),
        torch.tensor([[5.0, 6.0]]),
        torch.zeros(0, 3, dtype=torch.long),  # an empty batch
        torch.zeros(2, 0, dtype=torch.long),  # empty prompts
        torch.tensor([5, 6]),
        [[5, 6]],
    ],
    ids=["bool", "float", "empty-batch", "empty-prompts", "1-d", "list"],
)
def test_tokens_refused(decoder, tokens):
    refused(lambda: generate_stream(decoder, tokens, max_new_tokens=2), "^tokens: expected")


@pytest.mark.parametrize(
    ("tokens", "match"),
    [
        ([[5, VOCAB]], r"tokens: expected ids in \[0, 64\), got \[64\]"),
        ([[5, -1]], r"tokens: expected ids in \[0, 64\), got \[-1\]"),
        ([[5, 2**40]], "tokens: expected ids"),
    ],
)
def test_ids_outside_the_vocabulary_refused_when_called(decoder, tokens, match):
    # Refused by generate_stream itself, not later at the first next().
    refused(lambda: generate_stream(decoder, torch.tensor(tokens), max_new_tokens=2), match)


def test_wrong_devices(decoder):
    tokens = torch.tensor(PROMPT)
    refused(lambda: generate(decoder, tokens.to("meta"), max_new_tokens=2), "^tokens: .*device")
    meta_model = build_tiny_decoder().to("meta")
    refused(lambda: generate(meta_model, tokens.to("meta"), max_new_tokens=2), "^model: .*meta")
    refused(lambda: generate(decoder, tokens, max_new_tokens=2, generator=0), "^generator:")
    refused(
        lambda: sample_next_token(torch.zeros(2, 5, device="meta"), generator=torch.Generator()),
        "^generator: expected a generator on meta",
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_generator_on_another_device(decoder):
    cuda = torch.Generator("cuda")
    refused(
        lambda: generate(decoder, torch.tensor(PROMPT), max_new_tokens=2, generator=cuda),
        "^generator: expected a generator on cpu",
    )
    refused(lambda: sample_next_token(torch.zeros(2, 5), generator=cuda), "^generator:")
    refused(lambda: generate(decoder.cuda(), torch.tensor(PROMPT), max_new_tokens=2), "^tokens")
    decoder.cpu()


ACCEPTED = [np.int64(2), np.int32(2), np.uint8(2), torch.tensor(2), torch.tensor(2).to(torch.int8)]
BAD_IDS = [
    2.0,
    True,
    np.float64(2),
    np.bool_(True),
    torch.tensor(2.0),
    torch.tensor([2]),
    torch.tensor(True),
    "2",
    None,
    -1,
    VOCAB,
    2**70,
]


@pytest.mark.parametrize("value", ACCEPTED, ids=repr)
def test_ids_of_other_integer_types(decoder, value):
    stop = int(sampled(decoder)[0, len(PROMPT[0]) + 1])  # stops after the 2nd new token
    expected = sampled(decoder, stop_tokens=[stop])
    if isinstance(value, torch.Tensor):
        converted = torch.tensor(stop, dtype=value.dtype)
    else:
        converted = type(value)(stop)
    assert torch.equal(sampled(decoder, stop_tokens=[converted]), expected)
    assert torch.equal(sampled(decoder, stop_tokens=np.array([stop])), expected)
    assert torch.equal(sampled(decoder, stop_tokens=torch.tensor([stop])), expected)
    tokens = torch.tensor([[2, 2, 5, 6, 7]])
    assert torch.equal(sampled(decoder, tokens, pad_id=value), sampled(decoder, tokens, pad_id=2))


@pytest.mark.parametrize("value", BAD_IDS, ids=repr)
def test_bad_ids(decoder, value):
    tokens = torch.tensor(PROMPT)
    refused(lambda: generate_stream(decoder, tokens, max_new_tokens=2, pad_id=value), "^pad_id:")
    refused(
        lambda: generate_stream(decoder, tokens, max_new_tokens=2, stop_tokens=[4, value]),
        "^stop_tokens:",
    )


@pytest.mark.parametrize("value", [3, 3.5, torch.tensor(3), "ab", {3: 1}], ids=repr)
def test_stop_tokens_not_a_sequence(decoder, value):
    refused(
        lambda: generate_stream(decoder, torch.tensor(PROMPT), max_new_tokens=2, stop_tokens=value),
        "^stop_tokens:",
    )


NAN, INF = float("nan"), float("inf")
BAD_OPTIONS = {
    "max_new_tokens": [0, -1, True, 2.0, NAN, None, "2", np.float64(2)],
    "top_k": [0, -3, VOCAB + 1, True, 2.0, NAN, "5", torch.tensor(2.0)],
    "top_p": [0, 0.0, -0.1, 1.01, True, NAN, INF, "0.5", torch.tensor(0.5)],
    "temperature": [-1, -1e-9, True, NAN, INF, "1", None, torch.tensor(1.0)],
}
GOOD_OPTIONS = {
    "max_new_tokens": [np.int64(NEW), torch.tensor(NEW)],
    "top_k": [np.int64(20), torch.tensor(20)],
    "top_p": [np.float32(0.75), np.float64(0.75)],
    "temperature": [np.float32(1.25), np.float64(1.25)],
}


@pytest.mark.parametrize(
    ("name", "value"),
    [(name, value) for name, values in BAD_OPTIONS.items() for value in values],
    ids=repr,
)
def test_bad_options(decoder, name, value):
    kwargs = {"max_new_tokens": 2, name: value}
    refused(lambda: generate_stream(decoder, torch.tensor(PROMPT), **kwargs), f"^{name}: expected")
    if name != "max_new_tokens":
        args = {"temperature": 1.0, "top_k": None, "top_p": None, name: value}
        refused(lambda: check_sampling_args(**args, vocab_size=VOCAB), f"^{name}: expected")
        refused(lambda: sample_next_token(torch.zeros(2, VOCAB), **args), f"^{name}: expected")


@pytest.mark.parametrize(
    ("name", "value"),
    [(name, value) for name, values in GOOD_OPTIONS.items() for value in values],
    ids=repr,
)
def test_numpy_and_tensor_numbers(decoder, name, value):
    assert torch.equal(sampled(decoder, **{name: value}), sampled(decoder))


def test_a_tiny_temperature_is_greedy():
    logits = torch.tensor([[1.0, 2.0, 2.5, -3.0], [0.0, -1.0, 3.0, 2.9]])
    for temperature in (1e-40, 1e-45, 5e-324):  # dividing by them overflows float32
        assert sample_next_token(logits, temperature=temperature).tolist() == [2, 2]


def test_logits():
    assert sample_next_token(torch.zeros(0, 5)).shape == (0,)  # an empty batch: no draws
    for bad in (torch.zeros(2, 0), torch.zeros(5), torch.zeros(2, 5, dtype=torch.long), [[0.0]]):
        refused(lambda bad=bad: sample_next_token(bad), "^logits: expected")


def test_caches_of_another_dtype(decoder):
    decoder.setup_caches(1, torch.bfloat16, decoder_max_seq_len=20)
    try:
        refused(
            lambda: generate_stream(decoder, torch.tensor(PROMPT), max_new_tokens=2),
            r"^model: its KV caches are set up with dtype torch.bfloat16, .* torch.float32",
        )
        assert decoder.layers[0].attn.kv_cache.k_cache.dtype == torch.bfloat16  # untouched
    finally:
        decoder.teardown_caches()


@pytest.fixture(scope="module")
def model():
    return build_tiny_fusion().eval()


class TestEarlyFusion:
    def test_encoder_input_not_a_mapping(self, model):
        tokens = torch.tensor([[5, IMAGE_ID, 6]])
        for bad in (["image"], "image", 3):
            refused(
                lambda bad=bad: generate_stream(model, tokens, encoder_input=bad, max_new_tokens=2),
                "^encoder_input: expected a mapping",
            )

    def test_unknown_encoder_names(self, model):
        refused(
            lambda: generate_stream(
                model, torch.tensor([[5, 6]]), encoder_input={"video": {}, 3: {}}, max_new_tokens=2
            ),
            r"^encoder_input: unknown encoder names \[3, 'video'\]",
        )

    def test_placeholders_without_input_refused_when_called(self, model):
        features = {"features": torch.zeros(1, 1, FEATURES)}
        for tokens in ([[5, AUDIO_ID, 6]], [[5, IMAGE_ID, 6]]):
            refused(
                lambda tokens=tokens: generate_stream(
                    model, torch.tensor(tokens), max_new_tokens=2
                ),
                "^tokens: placeholder id .* has no input",
            )
        refused(
            lambda: generate_stream(
                model,
                torch.tensor([[5, IMAGE_ID, VOCAB + 1]]),
                encoder_input={"image": features},
                max_new_tokens=2,
            ),
            rf"^tokens: expected ids in \[0, {VOCAB}\) or placeholder ids \[{IMAGE_ID}\], got",
        )
        assert not model.caches_are_setup()

    def test_every_integer_dtype_with_placeholders(self, model):
        features = {"image": {"features": torch.randn(1, 2, FEATURES)}}
        tokens = torch.tensor([[5, IMAGE_ID, IMAGE_ID, 6]])
        expected = generate(model, tokens, encoder_input=features, max_new_tokens=2, temperature=0)
        for dtype in (torch.uint8, torch.int16, torch.int32):
            out = generate(
                model, tokens.to(dtype), encoder_input=features, max_new_tokens=2, temperature=0
            )
            assert torch.equal(out, expected)


class TestLeftPad:
    @pytest.mark.parametrize(
        "prompts",
        [
            [[4, 5], [6]],
            [np.array([4, 5]), np.array([6])],
            [torch.tensor([4, 5], dtype=torch.int8), torch.tensor([6], dtype=torch.uint8)],
            [(np.int64(4), np.int32(5)), [torch.tensor(6)]],
        ],
        ids=["lists", "numpy", "tensors", "mixed"],
    )
    def test_accepted(self, prompts):
        for pad_id in (0, np.int64(0), torch.tensor(0)):
            out = left_pad(prompts, pad_id)
            assert out.dtype == torch.int64 and out.tolist() == [[4, 5], [0, 6]]

    @pytest.mark.parametrize(
        ("prompts", "match"),
        [
            ([], r"^prompts: expected at least one prompt"),
            ("45", "^prompts: expected a sequence"),
            (5, "^prompts: expected a sequence"),
            ([[4, 5], []], r"^prompts\[1\]: expected at least one token"),
            ([[4.0, 5.7]], r"^prompts\[0\]: expected an integer, got 4.0"),
            ([[True, 5]], r"^prompts\[0\]: expected an integer, got True"),
            ([[[4, 5]]], r"^prompts\[0\]: expected an integer"),
            ([[4, -5]], r"^prompts\[0\]: expected ids >= 0"),
            ([[4, 2**64]], r"^prompts\[0\]: expected ids that fit in int64"),
            ([torch.tensor([4.0, 5.7])], r"^prompts\[0\]: expected a 1-D tensor of integer"),
            ([torch.tensor([[4, 5]])], r"^prompts\[0\]: expected a 1-D tensor of integer"),
            ([torch.tensor([4, 5], device="meta")], r"^prompts\[0\]: expected a 1-D tensor"),
            ([torch.tensor([-4, 5], dtype=torch.int8)], r"^prompts\[0\]: expected ids >= 0"),
            ([[0, 5]], r"^prompts\[0\]: starts with pad_id=0"),
            (["45"], r"^prompts\[0\]: expected a sequence of integer ids"),
        ],
    )
    def test_refused(self, prompts, match):
        refused(lambda: left_pad(prompts, 0), match)

    @pytest.mark.parametrize("pad_id", [0.0, True, -1, "0", None, torch.tensor([0])], ids=repr)
    def test_bad_pad_id(self, pad_id):
        refused(lambda: left_pad([[4, 5]], pad_id), "^pad_id: expected")

    @pytest.mark.parametrize("device", ["nonsense", "cuda:7", 3.5])
    def test_bad_device(self, device):
        if device == "cuda:7" and torch.cuda.device_count() > 7:
            pytest.skip("this machine has a cuda:7")
        refused(lambda: left_pad([[4, 5]], 0, device=device), "^device: ")

    def test_meta_device(self):
        out = left_pad([[4, 5], [6]], 0, device="meta")
        assert out.device.type == "meta" and out.shape == (2, 2)
