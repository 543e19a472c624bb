"""``fusion.testing.fusion_inputs``: drawn batches are complete, consistent model inputs."""

import pytest
import torch
from hypothesis import find, given, settings
from hypothesis import strategies as st
from testing.fusion_models import AUDIO, IMAGE, VOCAB, build

from fusion.testing import EncoderSpec, FusionInputs, encoder_specs, fusion_inputs, tensors

MODEL = build()
DRAWN = {"audio": (3, tensors(1, 48)), "image": (2, tensors(2, 12))}
INPUTS = fusion_inputs(MODEL, DRAWN)


def _placeholders_per_sample(inputs: FusionInputs, name: str) -> list[int]:
    return (inputs.tokens == inputs.encoder_tokens[name]).sum(1).tolist()


@settings(max_examples=40, deadline=None)
@given(inputs=INPUTS)
def test_drawn_batches_are_consistent(inputs):
    b, s = inputs.tokens.shape
    assert 1 <= b <= 3 and 1 <= s <= 24
    # Placeholders come in whole inputs, and each drawn input is there.
    for name, per_input in inputs.rows_per_input.items():
        counts = inputs.inputs_per_sample[name]
        assert _placeholders_per_sample(inputs, name) == [n * per_input for n in counts]
        if sum(counts):
            (value,) = inputs.encoder_input[name].values()
            assert value.shape[0] == sum(counts)
        else:
            assert name not in inputs.encoder_input
    # Text ids lie in the vocabulary; pad slots hold pad_id and are outside [start, start+len).
    placeholder = torch.isin(inputs.tokens, torch.tensor([AUDIO, IMAGE]))
    assert bool((inputs.tokens[~placeholder] < VOCAB).all())
    for i in range(b):
        real = torch.zeros(s, dtype=torch.bool)
        real[inputs.real_slots(i)] = True
        assert bool((inputs.tokens[i, ~real] == inputs.pad_id).all())
        if inputs.padding == "none":
            assert bool(real.all()) and inputs.mask is None and inputs.input_pos is None
            continue
        assert inputs.input_pos[i, real].tolist() == list(range(int(inputs.lengths[i])))
        mask = inputs.mask[i]
        for q in range(s):
            if real[q]:  # causal over its sample's real tokens
                allowed = real & (torch.arange(s) <= q)
                assert torch.equal(mask[q], allowed)
            else:
                assert mask[q].tolist() == [k == q for k in range(s)]
        if inputs.padding == "right":
            assert int(inputs.starts[i]) == 0
        else:
            assert int(inputs.starts[i] + inputs.lengths[i]) == s


@settings(max_examples=20, deadline=None)
@given(inputs=INPUTS)
def test_the_model_runs_on_them_and_a_sample_alone_is_its_own(inputs):
    with torch.no_grad():
        logits = inputs.run(MODEL)
    assert logits.shape == (*inputs.tokens.shape, VOCAB)
    padded = inputs.rows(MODEL, "padded")
    for name, rows in padded.items():
        widest = max(inputs.inputs_per_sample[name]) * inputs.rows_per_input[name]
        assert rows.rows.shape == (inputs.batch_size, widest + inputs.extra_width, 16)
    alone = inputs.sample(inputs.batch_size - 1)
    assert alone.padding == "none" and alone.tokens.shape[0] == 1
    assert torch.equal(
        alone.tokens[0], inputs.tokens[-1, inputs.real_slots(-1 % inputs.batch_size)]
    )
    text = inputs.text_only()
    assert not bool(torch.isin(text.tokens, torch.tensor([AUDIO, IMAGE])).any())


def _kinds(inputs: FusionInputs) -> set[str]:
    """What a drawn batch shows, among the kinds every test of a model needs."""
    audio, image = inputs.inputs_per_sample.values()
    placeholder = torch.isin(inputs.tokens, torch.tensor([AUDIO, IMAGE]))
    kinds = {f"{inputs.padding} padding", f"{inputs.layout} rows"}
    for i in range(inputs.batch_size):
        real = placeholder[i, inputs.real_slots(i)]
        kinds |= {"no placeholder"} if not real.any() else set()
        kinds |= {"placeholders only"} if real.all() else set()
        kinds |= {"both encoders"} if audio[i] and image[i] else set()
        kinds |= {"two inputs"} if audio[i] + image[i] == 2 else set()
    if inputs.padding == "left" and inputs.starts.any():
        kinds.add("shifted start")
    if inputs.extra_width:
        kinds.add("padding rows")
    return kinds


def test_every_kind_of_sample_is_drawn():
    """Samples without placeholders, of placeholders only, with two encoders' inputs; every
    padding and layout, left padding that shifts a sample, padding rows: all drawn."""
    seen: set[str] = set()

    @settings(max_examples=100, deadline=None, derandomize=True, database=None)
    @given(inputs=INPUTS)
    def collect(inputs):
        seen.update(_kinds(inputs))

    collect()
    assert seen == {
        "none padding", "left padding", "right padding", "packed rows", "padded rows",
        "no placeholder", "placeholders only", "both encoders", "two inputs", "shifted start",
        "padding rows",
    }  # fmt: skip


def test_encoder_specs_without_a_model():
    clips = EncoderSpec("audio", AUDIO, 3, tensors(1, 48), argument="clips")
    several = EncoderSpec("image", IMAGE, 2, st.fixed_dictionaries({"patches": tensors(2, 12)}))
    assert encoder_specs(MODEL, DRAWN) == [
        EncoderSpec("audio", AUDIO, 3, DRAWN["audio"][1], "clips"),
        EncoderSpec("image", IMAGE, 2, DRAWN["image"][1], "patches"),
    ]

    @settings(max_examples=10, deadline=None)
    @given(inputs=fusion_inputs([clips, several], vocab_size=VOCAB, paddings=["right"]))
    def run(inputs):
        assert inputs.padding == "right"
        with torch.no_grad():
            assert inputs.run(MODEL).shape == (*inputs.tokens.shape, VOCAB)

    run()


def _spec(name="a", placeholder=0):
    return EncoderSpec(name, placeholder, 1, tensors(1), "x")


BAD = [
    (lambda: tensors(2, -1), ValueError, r"shape: expected non-negative integers"),
    (lambda: tensors(2, dtype=torch.int64), ValueError, r"dtype: expected a floating"),
    (lambda: tensors(2, scale=float("nan")), ValueError, r"scale: expected a finite number"),
    (lambda: EncoderSpec("", 1, 1, tensors(1)), ValueError, r"name: expected a non-empty"),
    (lambda: EncoderSpec("a", -1, 1, tensors(1)), ValueError, r"placeholder_id: .* >= 0"),
    (lambda: EncoderSpec("a", 1, 0, tensors(1)), ValueError, r"rows_per_input: .* >= 1"),
    (lambda: EncoderSpec("a", 1, 1, torch.ones(1)), ValueError, r"one_input: expected a"),
    (lambda: EncoderSpec("a", 1, 1, tensors(1), "x y"), ValueError, r"argument: expected"),
    (lambda: fusion_inputs("model"), TypeError, r"encoders: expected an EarlyFusion"),
    (
        lambda: fusion_inputs(MODEL, {"audio": DRAWN["audio"]}),
        ValueError,
        r"inputs: expected one entry per encoder .*\['audio', 'image'\], got \['audio'\]",
    ),
    (
        lambda: fusion_inputs(MODEL, {**DRAWN, "audio": tensors(1)}),
        ValueError,
        r"inputs\['audio'\]: expected \(rows_per_input",
    ),
    (
        lambda: fusion_inputs(MODEL, DRAWN, max_batch=0),
        ValueError,
        r"max_batch: expected a positive integer, got 0",
    ),
    (
        lambda: fusion_inputs(MODEL, DRAWN, max_seq_len=2),
        ValueError,
        r"max_seq_len: expected room for one input of encoder 'audio' \(3 rows\), got 2",
    ),
    (
        lambda: fusion_inputs(MODEL, DRAWN, pad_id=-1),
        ValueError,
        r"pad_id: expected an integer >= 0, got -1",
    ),
    (lambda: fusion_inputs(MODEL, DRAWN, paddings=["mid"]), ValueError, r"paddings: expected"),
    (lambda: fusion_inputs(MODEL, DRAWN, layouts=[]), ValueError, r"layouts: expected some of"),
    (
        lambda: fusion_inputs([_spec()], vocab_size=1),
        ValueError,
        r"vocab_size: expected text ids besides the placeholders, got 1",
    ),
    (lambda: fusion_inputs([_spec()]), ValueError, r"vocab_size: expected the decoder's"),
    (
        lambda: fusion_inputs([_spec("a", 9), _spec("b", 9)], vocab_size=4),
        ValueError,
        r"encoders: expected distinct names and placeholder ids",
    ),
]


@pytest.mark.parametrize(("call", "error", "match"), BAD)
def test_bad_arguments_are_refused_when_the_strategy_is_built(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_an_input_strategy_without_an_argument_name_must_draw_keyword_arguments():
    spec = EncoderSpec("audio", AUDIO, 3, tensors(1, 48))  # no argument name
    strategy = fusion_inputs([spec], vocab_size=VOCAB, max_batch=1)
    with pytest.raises(ValueError, match=r"one_input: encoder 'audio' drew a Tensor; give"):
        find(strategy, lambda x: False, settings=settings(database=None, deadline=None))
