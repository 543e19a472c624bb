"""Qwen3.5's text stack alone (``qwen3_5_text``, transformers' ``Qwen3_5ForCausalLM``) beyond
the family suite (``tests/families``: logits, greedy generation on a left-padded batch, save,
export, peft):

- plain 1-D RoPE, as transformers' text model rotates (its t, h, w rows all text positions);
- a left-padded batch and packed rows equal to transformers' logits on each sample alone
  (1e-4), lengths around the conv kernel and the 64-token chunk;
- tied embeddings and ``mtp.*`` weights; an ``EarlyFusion`` without encoders saved as the
  text model;
- hostile configs refused by name before anything is built, the mixture-of-experts text
  model type among them.
"""

import json
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

from families.fixtures import FIXTURES
from fusion import EarlyFusion, TransformerDecoder
from fusion.checkpoint import CheckpointError, load_hf_model, save_hf_model
from fusion.data import IGNORE_INDEX, Sample, collate_packed, pack_samples
from fusion.families import family_named, family_of
from fusion.padding import leading_pad_counts, prefill_mask, prompt_positions
from qwen3_helpers import check_refused_unbuilt, tiny_hf_qwen3_5_text, with_config
from qwen_helpers import PAD, VOCAB

LENGTHS = [3, 64, 70, 5]  # shorter than the kernel, one chunk exactly, over one


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models run faster on one thread than on two shared, busy cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """transformers' tiny text model (the family suite's fixture), its directory and ours."""
    directory = tmp_path_factory.mktemp("qwen3_5_text")
    hf = FIXTURES["qwen3_5_text"].write(directory)
    return hf, directory, load_hf_model(directory).eval()


def samples(lengths: list[int] = LENGTHS) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    return [torch.randint(3, VOCAB, (n,), generator=generator) for n in lengths]


@torch.no_grad()
def theirs_alone(hf, ids: torch.Tensor) -> torch.Tensor:
    return hf(input_ids=ids[None]).logits[0]


@pytest.fixture(scope="module")
def alone(pair) -> list[torch.Tensor]:
    """transformers' logits of each of :func:`samples` alone."""
    return [theirs_alone(pair[0], ids) for ids in samples()]


def max_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def test_the_decoder_rotates_with_plain_1d_rope(pair):
    hf, directory, model = pair
    assert type(model) is TransformerDecoder
    rope = model.attentions()[0].pos_embeddings
    assert rope.mrope_section is None and not rope.is_multimodal
    assert rope.dim == 8  # a quarter of the 32-wide heads
    config = json.loads((directory / "config.json").read_text())
    assert "mrope_section" not in config["rope_parameters"]
    assert config["architectures"] == ["Qwen3_5ForCausalLM"]
    # transformers' text model puts the text positions on every M-RoPE row: shifted, they
    # move its logits as they move ours
    ids = samples([9])[0]
    with torch.no_grad():
        moved = hf(input_ids=ids[None], position_ids=torch.arange(9)[None] + 3).logits[0]
    assert max_error(model(ids[None], input_pos=torch.arange(9)[None] + 3)[0], moved) <= 1e-4


def test_left_padded_batch_equals_transformers_alone(pair, alone):
    hf, _, model = pair
    rows = samples()
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), PAD)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :] = row
    pads = leading_pad_counts(ids, PAD)
    with torch.no_grad():
        ours = model(
            ids, mask=prefill_mask(pads, width, width), input_pos=prompt_positions(pads, width)
        )
        attention = (torch.arange(width)[None] >= pads[:, None]).long()
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        padded = hf(input_ids=ids, attention_mask=attention, position_ids=positions).logits
    for i, own in enumerate(alone):
        assert max_error(ours[i, int(pads[i]) :], own) <= 1e-4, f"sample {i}"
        assert max_error(padded[i, int(pads[i]) :], own) <= 1e-4, f"transformers {i}"


@pytest.mark.parametrize("row", [75, 142])
def test_packed_rows_keep_samples_apart(pair, alone, row):
    model = pair[2]
    packed_samples = []
    for i, ids in enumerate(samples()):
        labels = torch.full_like(ids, IGNORE_INDEX)
        labels[:-1] = ids[1:]
        packed_samples.append(Sample(ids, labels, torch.empty(0), source=str(i)))
    rows = pack_samples(packed_samples, row)
    assert any(len(r) > 1 for r in rows)
    batch = collate_packed(rows, pad_id=PAD, seq_len=row + 3)
    with torch.no_grad():
        logits = model(**batch.model_inputs())
    for r, placed in enumerate(rows):
        start = 0
        for sample in placed:
            end = start + len(sample)
            own = alone[int(sample.source)]
            assert max_error(logits[r, start:end], own) <= 1e-4, (r, start)
            start = end


def test_tied_embeddings_and_mtp_weights(tmp_path):
    hf = tiny_hf_qwen3_5_text(tied=True)
    source = tmp_path / "tied"
    hf.save_pretrained(source)
    weights = load_file(source / "model.safetensors")
    assert "lm_head.weight" not in weights
    save_file(weights | {"mtp.fc.weight": torch.randn(32, 64)}, source / "model.safetensors")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = load_hf_model(source).eval()
    assert sum("mtp" in str(w.message) for w in caught) == 1
    assert model.output is None
    ids = samples([11])[0]
    with torch.no_grad():
        ours = model(ids[None])[0]
    assert max_error(ours, theirs_alone(hf, ids)) <= 1e-4

    from transformers import Qwen3_5ForCausalLM

    save_hf_model(model, tmp_path / "saved")
    config = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert config["tie_word_embeddings"] is True
    again = Qwen3_5ForCausalLM.from_pretrained(tmp_path / "saved").eval()
    assert max_error(theirs_alone(again, ids), ours) <= 1e-4


def test_an_early_fusion_without_encoders_is_saved_as_the_text_model(pair, tmp_path):
    _, _, model = pair
    fusion = EarlyFusion(model, {}, {})
    assert family_of(fusion) is family_named("qwen3_5_text") is family_of(model)
    save_hf_model(fusion, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "qwen3_5_text"
    again = load_hf_model(tmp_path)
    assert type(again) is TransformerDecoder
    theirs = model.state_dict()
    assert all(torch.equal(value, theirs[key]) for key, value in again.state_dict().items())
    assert again.state_dict().keys() == theirs.keys()


# ---------------------------------------------------------------------- hostile configs


def top(**values):
    return lambda config: config.update(values)


def without(key: str):
    return lambda config: config.pop(key)


HOSTILE = {
    "moe-model-type": (
        top(model_type="qwen3_5_moe_text"),
        "model_type",
        r"'qwen3_5_moe_text': Qwen3\.5's mixture-of-experts models are not supported",
    ),
    "moe-field": (top(num_experts=8), "num_experts", "mixture-of-experts"),
    "layer_types": (
        top(layer_types=["linear_attention", "full_attention"]),
        "layer_types",
        "a list of 4 entries",
    ),
    "kernel-huge": (top(linear_conv_kernel_dim=10**6), "linear_conv_kernel_dim", "at most 256"),
    "kv-heads": (top(num_key_value_heads=3), "num_key_value_heads", "divisor"),
    "no-hidden-size": (without("hidden_size"), "hidden_size", "missing"),
    "odd-rotary": (
        top(rope_parameters={"rope_type": "default", "partial_rotary_factor": 3 / 32}),
        "rope_parameters.partial_rotary_factor",
        "gives 3 rotary channels",
    ),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_configs_are_refused_before_anything_is_built(pair, tmp_path, case):
    edit, key, message = HOSTILE[case]
    check_refused_unbuilt(with_config(pair[1], tmp_path / case, edit), key, message)


def test_the_vision_language_moe_model_type_stays_refused(pair, tmp_path):
    directory = with_config(pair[1], tmp_path / "moe", top(model_type="qwen3_5_moe"))
    with pytest.raises(CheckpointError, match=r"'qwen3_5_moe': .*mixture-of-experts"):
        load_hf_model(directory)


def test_an_mrope_section_in_a_text_config_changes_nothing(pair, tmp_path):
    """A ``qwen3_5_text`` config holding its VLM's ``mrope_section`` (e.g. a text stack cut
    out of a Qwen3.5 directory): transformers puts text positions on every row, so the
    section changes nothing; we read the same model."""
    from transformers import Qwen3_5ForCausalLM

    rope = {"rope_type": "default", "partial_rotary_factor": 0.25, "rope_theta": 10_000.0}
    rope |= {"mrope_section": [2, 1, 1], "mrope_interleaved": True}
    directory = with_config(pair[1], tmp_path / "mrope", top(rope_parameters=rope))
    ids = samples([13])[0]
    hf = Qwen3_5ForCausalLM.from_pretrained(directory).eval()
    model = load_hf_model(directory).eval()
    with torch.no_grad():
        assert max_error(model(ids[None])[0], theirs_alone(hf, ids)) <= 1e-4
        assert torch.equal(model(ids[None]), pair[2](ids[None]))


def test_a_qwen3_5_decoder_saved_alone_loads_as_the_text_model(tmp_path):
    """The text stack of a Qwen3.5 vision-language model (interleaved M-RoPE) saved alone is
    a ``Qwen3_5ForCausalLM`` with its logits on text (1-D positions are text on every row)."""
    from transformers import Qwen3_5ForCausalLM

    from qwen3_helpers import tiny_qwen3_5

    decoder = tiny_qwen3_5().decoder
    assert decoder.attentions()[0].pos_embeddings.mrope_section is not None
    save_hf_model(decoder, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "qwen3_5_text"
    hf = Qwen3_5ForCausalLM.from_pretrained(tmp_path).eval()
    ids = samples([13])[0]
    with torch.no_grad():
        ours = decoder(ids[None])[0]
        assert max_error(ours, theirs_alone(hf, ids)) <= 1e-4
        assert max_error(load_hf_model(tmp_path).eval()(ids[None])[0], ours) <= 1e-5
