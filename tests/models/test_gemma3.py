"""Gemma 3's text stack beyond the family suite (``tests/families``: logits, greedy
generation on a left-padded batch, save, export, peft, layer counts):

- the sliding window and the attention scale matter (without them, far from transformers);
- the published config form (``rope_theta``, ``rope_local_base_freq``, ``rope_scaling``,
  ``sliding_window_pattern``) loads as transformers reads it;
- packed rows: each sample's logits and loss as alone, the gradients their sum, and a planted
  bug (the window not applied to packed rows) found;
- step-by-step decoding through the KV cache equals the full forward; compiled greedy
  decoding equals eager and never recompiles; the command line generates as transformers;
- the embedding scale rounds as transformers' in bfloat16;
- a modified model is refused by the saver; hostile configs are refused before anything is
  built, naming the file and key.
"""

import copy
import io
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, find, given, settings
from hypothesis import strategies as st
from torch._dynamo.testing import CompileCounterWithBackend

from fusion import generate, masked_token_loss
from fusion.checkpoint import CheckpointError, load_hf_model, save_hf_model
from fusion.decoder import PackedSegments, ScaledEmbedding
from gemma3_helpers import VOCAB, WINDOW, max_error, tiny_hf_gemma3_text, with_config

SETTINGS = settings(
    max_examples=10,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """transformers' tiny model, its directory, and ours loaded from it (shared: read only)."""
    hf = tiny_hf_gemma3_text()
    directory = tmp_path_factory.mktemp("gemma3")
    hf.save_pretrained(directory)
    return hf, directory, load_hf_model(directory).eval()


def tokens(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------- against transformers


def test_the_window_and_the_scale_matter(pair):
    hf, _, model = pair
    ids = tokens(2, 14)
    with torch.no_grad():
        theirs = hf(input_ids=ids).logits
        assert max_error(model(ids), theirs) <= 1e-4
        for change in ("sliding_window", "attn_scale"):
            changed = copy.deepcopy(model)
            for attn in changed.attentions():
                setattr(attn, change, None)
            assert max_error(changed(ids), theirs) > 1e-2, change


def test_the_published_config_form_loads_as_transformers_reads_it(pair, tmp_path):
    """Gemma 3's Hub configs (transformers 4.50): the bases and the global scaling beside
    the layers' pattern, no ``layer_types``, no ``rope_parameters``."""
    from transformers import Gemma3ForCausalLM

    _, source, _ = pair

    def published(config):
        for key in ("layer_types", "rope_parameters", "_sliding_window_pattern"):
            config.pop(key, None)
        config |= {
            "sliding_window_pattern": 2,  # sliding, full, sliding, full
            "rope_theta": 500_000.0,
            "rope_local_base_freq": 20_000.0,
            "rope_scaling": {"rope_type": "linear", "factor": 2.0},
        }

    directory = with_config(source, tmp_path / "published", published)
    ours = load_hf_model(directory).eval()
    kinds = [attn.sliding_window for attn in ours.attentions()]
    assert kinds == [WINDOW, None, WINDOW, None]
    hf = Gemma3ForCausalLM.from_pretrained(directory, attn_implementation="eager").eval()
    assert hf.config.layer_types == ["sliding_attention", "full_attention"] * 2
    ids = tokens(2, 14)
    with torch.no_grad():
        theirs = hf(input_ids=ids).logits
        assert max_error(ours(ids), theirs) <= 1e-4
        assert max_error(pair[2](ids), theirs) > 1e-2  # the edit matters


# ---------------------------------------------------------------------- packed rows

LENGTHS = st.integers(1, 3 * WINDOW)


@st.composite
def packed_rows(draw) -> tuple[list[list[int]], int]:
    """One or two rows of samples, some longer than the window, with padding or none."""
    rows = draw(st.lists(st.lists(LENGTHS, min_size=1, max_size=3), min_size=1, max_size=2))
    seq_len = max(map(sum, rows)) + draw(st.integers(0, 3))
    return rows, seq_len


def packed_inputs(rows: list[list[int]], seq_len: int, seed: int = 0):
    """Ids [b, s], positions restarting per sample, the segments, and each sample's ids."""
    samples = [
        [tokens(n, seed=seed + 7 * r + i) for i, n in enumerate(row)] for r, row in enumerate(rows)
    ]
    ids = torch.zeros(len(rows), seq_len, dtype=torch.long)
    positions = torch.zeros(len(rows), seq_len, dtype=torch.long)
    for r, row in enumerate(samples):
        start = 0
        for sample in row:
            ids[r, start : start + len(sample)] = sample
            positions[r, start : start + len(sample)] = torch.arange(len(sample))
            start += len(sample)
    segments = PackedSegments.from_lengths(rows, seq_len, backend="sdpa")
    return ids, positions, segments, samples


def packed_differs(model, rows, seq_len) -> bool:
    ids, positions, segments, samples = packed_inputs(rows, seq_len)
    with torch.no_grad():
        logits = model(ids, mask=segments, input_pos=positions)
        for r, row in enumerate(samples):
            start = 0
            for sample in row:
                alone = model(sample[None])[0]
                if max_error(logits[r, start : start + len(sample)], alone) > 1e-5:
                    return True
                start += len(sample)
    return False


@SETTINGS
@given(layout=packed_rows())
def test_each_packed_sample_equals_itself_alone(pair, layout):
    assert not packed_differs(pair[2], *layout)


def test_packed_loss_and_gradients_are_the_samples_sums(pair):
    # float64 weights; the norms and the rotary compute in float32 whatever the input
    model = copy.deepcopy(pair[2]).double()
    rows, seq_len = [[3, 2 * WINDOW + 1], [WINDOW + 2]], 2 * WINDOW + 6
    ids, positions, segments, samples = packed_inputs(rows, seq_len, seed=3)
    labels = torch.where(segments.segment_ids >= 0, ids, -100)
    loss, _ = masked_token_loss(model(ids, mask=segments, input_pos=positions), labels)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    total = sum(masked_token_loss(model(s[None]), s[None])[0] for row in samples for s in row)
    torch.testing.assert_close(loss, total)
    for grad, expected in zip(
        grads, torch.autograd.grad(total, list(model.parameters())), strict=True
    ):
        torch.testing.assert_close(grad, expected, atol=1e-5, rtol=1e-5)


def test_a_window_left_off_packed_rows_is_found(pair):
    """Planted: the sliding layers attend to whole samples of packed rows."""
    with mock.patch.object(PackedSegments, "with_window", lambda self, window: self):
        rows, _ = find(
            packed_rows(),
            lambda layout: packed_differs(pair[2], *layout),
            settings=settings(max_examples=50, database=None, derandomize=True),
        )
    assert max(n for row in rows for n in row) > WINDOW  # a sample longer than the window


# ---------------------------------------------------------------------- the KV cache


def test_step_by_step_decoding_equals_the_full_forward(pair):
    model = copy.deepcopy(pair[2])
    ids = tokens(2, 3 * WINDOW)
    with torch.no_grad():
        full = model(ids)
        model.setup_caches(2, torch.float32, decoder_max_seq_len=4 * WINDOW)
        prefix = WINDOW - 2
        steps = [model(ids[:, :prefix])] + [
            model(ids[:, i : i + 1]) for i in range(prefix, ids.size(1))
        ]
    assert max_error(torch.cat(steps, dim=1), full) <= 1e-5


def left_padded(lengths: tuple[int, ...], seed: int) -> torch.Tensor:
    rows = [tokens(n, seed=seed + i) for i, n in enumerate(lengths)]
    return torch.stack(
        [torch.cat([torch.zeros(max(lengths) - len(r), dtype=torch.long), r]) for r in rows]
    )


def test_compiled_greedy_decoding_equals_eager_and_never_recompiles(pair):
    model = pair[2]

    def greedy(ids, **kwargs):
        out = generate(model, ids, max_new_tokens=2 * WINDOW, temperature=0, pad_id=0, **kwargs)
        return out[:, ids.size(1) :]

    ids = left_padded((3, WINDOW + 3), seed=5)
    expected = greedy(ids)
    assert len({tuple(row) for row in expected.tolist()}) == len(ids)  # a lively model
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("eager")
    try:
        assert torch.equal(greedy(ids, compile={"backend": counter}), expected)
        frames = counter.frame_count
        assert frames >= 1
        with torch._dynamo.config.patch(error_on_recompile=True):
            greedy(left_padded((WINDOW + 1, 2), seed=9), compile={"backend": counter})
            again = greedy(ids, compile={"backend": counter})
        assert torch.equal(again, expected) and counter.frame_count == frames
    finally:
        torch._dynamo.reset()
    assert not model.caches_are_setup()


def test_the_command_line_generates_as_transformers_and_takes_no_images(pair, capsys):
    from fusion.generation.cli import main

    hf, directory, _ = pair
    prompt = [5, 6, 7, 8, 9, 10, 11]  # longer than the window
    argv = ["--checkpoint", str(directory), "--temperature", "0", "--max-new-tokens", "6"]
    out = io.StringIO()
    assert main([*argv, "--prompt-ids", ",".join(map(str, prompt)), "--ignore-eos"], out=out) == 0
    with torch.no_grad():
        theirs = hf.generate(
            torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=None
        )
    assert out.getvalue() == ",".join(map(str, theirs[0, len(prompt) :].tolist())) + "\n"
    with pytest.raises(SystemExit):
        main([*argv, "--image", "x.png", "--prompt", "hi"])
    assert "holds a text-only model (Gemma 3 text), taking no images" in capsys.readouterr().err


# ---------------------------------------------------------------------- parts


@pytest.mark.parametrize("width", [1152, 2560, 3072])
def test_the_embedding_scale_rounds_as_transformers_in_bfloat16(width):
    from transformers.models.gemma3.modeling_gemma3 import Gemma3TextScaledWordEmbedding

    theirs = Gemma3TextScaledWordEmbedding(16, width, 0, embed_scale=width**0.5)
    ours = ScaledEmbedding(16, width, width**0.5)
    ours.load_state_dict(theirs.state_dict())
    ids = torch.arange(16)
    for module in (theirs, ours):
        module.to(torch.bfloat16)
    assert torch.equal(ours(ids), theirs(ids))
    assert not torch.equal(ours(ids), (ours.weight * width**0.5).to(torch.bfloat16))


def test_a_model_its_config_cannot_describe_is_refused_by_the_saver(pair, tmp_path):
    model = copy.deepcopy(pair[2])
    model.attentions()[2].sliding_window = WINDOW + 1  # two windows: no config says so
    with pytest.raises(ValueError, match="differs from what its config describes"):
        save_hf_model(model, tmp_path)


# ---------------------------------------------------------------------- hostile configs


def values(**changes):
    return lambda config: config.update(changes)


HOSTILE = {
    "layer_types-too-short": (
        values(layer_types=["sliding_attention", "full_attention"]),
        "layer_types",
        "a list of 4 entries",
    ),
    "layer_types-unknown": (
        values(layer_types=["linear_attention", *["full_attention"] * 3]),
        "layer_types",
        r"each one of \['sliding_attention', 'full_attention'\]",
    ),
    "window-0": (values(sliding_window=0), "sliding_window", r"in \[1, max_position_embeddings"),
    "window-past-positions": (
        values(sliding_window=257),
        "sliding_window",
        r"max_position_embeddings=256\], got 257",
    ),
    "pad-outside-vocabulary": (values(pad_token_id=VOCAB), "pad_token_id", "vocab_size=96"),
    "eos-outside-vocabulary": (values(eos_token_id=[1, 10**6]), "eos_token_id", "vocab_size"),
    "attention-softcap": (
        values(attn_logit_softcapping=50.0),
        "attn_logit_softcapping",
        "never applies it",
    ),
    "bidirectional": (
        values(use_bidirectional_attention=True),
        "use_bidirectional_attention",
        "expected False",
    ),
    "activation": (values(hidden_activation="gelu"), "hidden_activation", "gelu_pytorch_tanh"),
    "kv-heads": (values(num_key_value_heads=3), "num_key_value_heads", "divisor"),
    "read-as-the-vision-model": (
        values(model_type="gemma3"),
        "text_config",
        "missing; a Gemma 3 config needs it",
    ),
    "rope-type": (
        lambda config: config["rope_parameters"]["full_attention"].update(rope_type="yarn"),
        "rope_parameters.full_attention.rope_type",
        "expected one of",
    ),
    "sliding-rope-scaled": (
        lambda config: config["rope_parameters"]["sliding_attention"].update(
            rope_type="linear", factor=2.0
        ),
        "rope_parameters.sliding_attention.rope_type",
        r"expected one of \['default'\]",
    ),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_configs_are_refused_before_anything_is_built(pair, tmp_path, case):
    edit, key, message = HOSTILE[case]
    directory = with_config(pair[1], tmp_path / case, edit)
    with mock.patch.object(torch.nn.Module, "__init__", side_effect=AssertionError("built")):
        with pytest.raises(CheckpointError, match=message) as error:
            load_hf_model(directory)
    assert error.value.key == key
    assert error.value.file == directory / "config.json"


def test_the_unedited_directory_loads_under_the_same_watch(pair):
    with mock.patch.object(torch.nn.Module, "__init__", side_effect=AssertionError("built")):
        with pytest.raises(AssertionError, match="built"):
            load_hf_model(pair[1])
