"""Gemma 3's vision model beyond the family suite (``tests/families``: logits with one and two
images and text only, greedy tokens on a left-padded image batch, save, export, peft):

- the bidirectional rule matters: transformers attending causally over the images (no
  ``token_type_ids``) is far from both; a left-padded batch (no cache) equals transformers
  and each sample alone;
- the packing property: each sample's logits and loss in a packed row equal the sample alone
  (1e-5), the gradients their sum; planted bugs found and shrunk: image blocks looked up by
  position instead of by index (transformers' sliding-mask bug), the window not applied to
  the image blocks, blocks crossing samples; an image seeing a later one found against
  transformers' logits (packed and alone alike would have it);
- compiled greedy decoding with images equals eager and never recompiles; the CLI says that
  images need transformers' processor;
- hostile configs are refused before anything is built, naming the file and key; FlexAttention
  and varlen refuse image blocks.
"""

import copy
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, find, given, settings
from hypothesis import strategies as st
from torch._dynamo.testing import CompileCounterWithBackend

import fusion.decoder.transformer as transformer
from families.fixtures import FIXTURES
from fusion import EarlyFusion, generate, masked_token_loss
from fusion.checkpoint import CheckpointError, load_hf_model
from fusion.data import IGNORE_INDEX, Sample, collate_packed, pack_samples
from fusion.decoder import PackedSegments, masks
from fusion.hooks import ImageBlocks, placeholder_blocks
from fusion.padding import leading_pad_counts, prefill_mask, prompt_positions
from gemma3_helpers import (
    BOI,
    IMAGE,
    IMAGE_ROWS,
    IMAGE_SIZE,
    VOCAB,
    WINDOW,
    image_text,
    max_error,
    with_config,
)

PAD = 0
SETTINGS = settings(
    max_examples=10,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
# A bug turns the property into a counterexample found, then shrunk, within these examples.
BUG_SETTINGS = settings(SETTINGS, max_examples=20, database=None, derandomize=True)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """transformers' tiny Gemma 3 (the family suite's fixture), its directory and ours."""
    directory = tmp_path_factory.mktemp("gemma3")
    hf = FIXTURES["gemma3"].write(directory)
    return hf, directory, load_hf_model(directory).eval()


def test_the_bidirectional_rule_matters(pair):
    assert WINDOW < IMAGE_ROWS  # the window's clamp matters to every image
    hf, _, model = pair
    batch = FIXTURES["gemma3"].cases["images"]()
    with torch.no_grad():
        theirs = batch.their_logits(hf)
        causal = hf(input_ids=batch.ids, pixel_values=batch.theirs["pixel_values"]).logits
        ours = batch.our_logits(model)
    assert max_error(ours, theirs) <= 1e-4
    assert max_error(causal, theirs) > 1e-2


def test_placeholder_blocks_number_each_run_along_its_row():
    tokens = torch.tensor([[1, IMAGE, IMAGE, 2, IMAGE, 3], [IMAGE, 4, 5, IMAGE, IMAGE, IMAGE]])
    expected = torch.tensor([[0, 1, 1, 0, 2, 0], [1, 0, 0, 2, 2, 2]])
    assert torch.equal(placeholder_blocks(tokens, IMAGE), expected)


def test_a_left_padded_batch_equals_transformers_and_each_sample_alone(pair):
    """No cache: the padding mask [b, s, s] and positions from the first real token, the
    image blocks added to that mask."""
    hf, _, model = pair
    batch = FIXTURES["gemma3"].prompts()
    pads = leading_pad_counts(batch.ids, PAD)
    assert int(pads.min()) == 0 < int(pads.max())
    seq_len = batch.ids.size(1)
    with torch.no_grad():
        theirs = batch.their_logits(hf)
        ours = model(
            batch.ids,
            mask=prefill_mask(pads, seq_len, seq_len),
            input_pos=prompt_positions(pads, seq_len),
            encoder_input=batch.ours,
        )
        real = batch.attention_mask.bool()
        assert max_error(ours[real], theirs[real]) <= 1e-4
        pixels, first = batch.ours["image"]["pixel_values"], 0
        for i, row in enumerate(batch.ids):
            own_ids = row[int(pads[i]) :][None]
            images = int((own_ids == BOI).sum())
            own = model(
                own_ids, encoder_input={"image": {"pixel_values": pixels[first : first + images]}}
            )
            first += images
            assert max_error(ours[i, int(pads[i]) :], own[0]) <= 1e-5


# ---------------------------------------------------------------------- packed rows


@st.composite
def sample(draw, max_images: int = 2) -> Sample:
    """BOS, text, then up to ``max_images`` images each followed by text; the last third are
    targets."""
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))

    def text(n: int) -> list[int]:
        return torch.randint(3, BOI, (n,), generator=generator).tolist()

    images = draw(st.integers(0, max_images))
    tokens = [2, *text(draw(st.integers(0, 3)))]
    for _ in range(images):
        tokens += image_text(1) + text(draw(st.integers(0, 3)))
    ids = torch.tensor(tokens)
    labels = torch.full_like(ids, IGNORE_INDEX)
    answer = len(ids) - max(len(ids) // 3, 1)
    labels[answer:-1] = ids[answer + 1 :]
    pixels = torch.randn(images, 3, IMAGE_SIZE, IMAGE_SIZE, generator=generator)
    return Sample(ids, labels, pixels)


@st.composite
def packed_layouts(draw):
    """Samples, a row length (from one sample per row to all in one) and trailing padding."""
    samples = draw(st.lists(sample(), min_size=1, max_size=4))
    longest, total = max(len(s) for s in samples), sum(len(s) for s in samples)
    row = longest + round(draw(st.floats(0, 1)) * (total - longest))
    return samples, row, draw(st.sampled_from([0, 0, 3]))


def inputs(batch, dtype: torch.dtype) -> dict:
    given = batch.model_inputs()
    if "encoder_input" in given:
        image = dict(given["encoder_input"]["image"])
        image["pixel_values"] = image["pixel_values"].to(dtype)
        given["encoder_input"] = {"image": image}
    return given


def alone(model: EarlyFusion, sample: Sample) -> torch.Tensor:
    pixels = sample.pixel_values.to(model.decoder.tok_embeddings.weight.dtype)
    images = {"image": {"pixel_values": pixels}} if len(pixels) else {}
    return model(sample.tokens[None], encoder_input=images)[0]


def packed(samples: list[Sample], row: int, padding: int):
    """The collated batch and, per sample, its (row, start)."""
    rows = pack_samples(samples, row)
    batch = collate_packed(rows, pad_id=PAD, seq_len=row + padding, attention="sdpa")
    placed = [
        (s, r, sum(len(t) for t in rows[r][:k]))
        for r in range(len(rows))
        for k, s in enumerate(rows[r])
    ]
    return batch, placed


@torch.no_grad()
def packed_differs(model: EarlyFusion, samples: list[Sample], row: int, padding: int) -> bool:
    batch, placed = packed(samples, row, padding)
    logits = model(**inputs(batch, torch.float32))
    return any(
        max_error(logits[r, start : start + len(s)], alone(model, s)) > 1e-5
        for s, r, start in placed
    )


@SETTINGS
@given(layout=packed_layouts())
def test_each_packed_sample_equals_itself_alone(pair, layout):
    assert not packed_differs(pair[2], *layout)


def test_packed_loss_and_gradients_are_the_samples_sums(pair):
    model = copy.deepcopy(pair[2]).double()  # the norms and rotary still compute in float32
    samples = find(
        st.lists(sample(), min_size=3, max_size=3),
        lambda ss: sum(len(s.pixel_values) for s in ss) >= 3,
        settings=BUG_SETTINGS,
    )
    batch, _ = packed(samples, sum(len(s) for s in samples), 2)
    loss, _ = masked_token_loss(model(**inputs(batch, torch.float64)), batch.labels)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    total = sum(masked_token_loss(alone(model, s)[None], s.labels[None])[0] for s in samples)
    torch.testing.assert_close(loss, total)
    expected = torch.autograd.grad(total, list(model.parameters()))
    for grad, theirs in zip(grads, expected, strict=True):
        torch.testing.assert_close(grad, theirs, atol=1e-5, rtol=1e-5)


class Planted:
    """Bugs of the kinds other implementations shipped, patched into the model's path."""

    @staticmethod
    def blocks_by_position():
        """The blocks read at each token's position in its sample instead of its index in
        the row (transformers' sliding mask with packed position_ids)."""
        right = ImageBlocks.before_decoder

        def before(self, decoder, tokens, placeholders, rows, encoder_input, input_pos, kw):
            out = right(self, decoder, tokens, placeholders, rows, encoder_input, input_pos, kw)
            if "bidirectional" in kw and input_pos is not None and input_pos.dim() == 2:
                kw["bidirectional"] = kw["bidirectional"].gather(1, input_pos)
            return out

        return mock.patch.object(ImageBlocks, "before_decoder", before)

    @staticmethod
    def window_left_off_the_blocks():
        """The sliding layers' window not applied where blocks are."""
        right = transformer.TransformerDecoder._layer_mask

        def layer_mask(self, mask, window, h, slots, seq_len):
            if isinstance(mask, PackedSegments) and mask.blocks is not None:
                window = None
            return right(self, mask, window, h, slots, seq_len)

        return mock.patch.object(transformer.TransformerDecoder, "_layer_mask", layer_mask)

    @staticmethod
    def blocks_across_samples():
        """Packed rows attended through one dense mask of the row, the blocks numbered per
        sample (1, 2, ... in each): a sample's k-th image attends to the next sample's."""
        right = masks.with_blocks

        def with_blocks(mask, blocks, slots, seq_len):
            if not isinstance(mask, PackedSegments):
                return right(mask, blocks, slots, seq_len)
            renumbered = blocks.clone()
            for r, row in enumerate(mask.lengths):
                start = 0
                for n in row:
                    part = renumbered[r, start : start + n]
                    images = part > 0
                    if bool(images.any()):
                        part[images] -= int(part[images].min()) - 1
                    start += n
            same = (renumbered[:, :, None] == renumbered[:, None, :]) & (renumbered[:, :, None] > 0)
            return (mask.dense_mask() | same)[:, None]

        return mock.patch.object(masks, "with_blocks", with_blocks)


@st.composite
def one_row(draw):
    """One or two samples in one row, no padding: where the planted bugs show (kept small,
    so that finding and shrinking take seconds)."""
    samples = draw(st.lists(sample(max_images=1), min_size=1, max_size=2))
    return samples, sum(len(s) for s in samples), 0


def counterexample(model, bug):
    def broken(layout) -> bool:
        with bug():
            return packed_differs(model, *layout)

    return find(one_row(), broken, settings=BUG_SETTINGS)


def images_in(samples) -> int:
    return sum(len(s.pixel_values) for s in samples)


def test_planted_blocks_by_position_are_found_and_shrunk(pair):
    samples, row, _ = counterexample(pair[2], Planted.blocks_by_position)
    # a sample with an image after another sample in its row
    assert images_in(samples) >= 1 and any(len(r) > 1 for r in pack_samples(samples, row))
    assert not packed_differs(pair[2], samples, row, 0)


def test_a_planted_later_image_seen_is_found_against_transformers(pair):
    """Every image of a row one block: the second image attends to the first's later rows
    and the first to the second's; transformers' logits with two images tell."""
    hf, _, model = pair
    batch = FIXTURES["gemma3"].cases["images"]()
    theirs = batch.their_logits(hf)
    with mock.patch("fusion.hooks.placeholder_blocks", lambda t, i: (t == i).long()):
        assert max_error(batch.our_logits(model), theirs) > 1e-3
    assert max_error(batch.our_logits(model), theirs) <= 1e-4


def test_planted_window_left_off_the_blocks_is_found_and_shrunk(pair):
    samples, row, _ = counterexample(pair[2], Planted.window_left_off_the_blocks)
    assert images_in(samples) >= 1 and len(samples) == 1
    assert not packed_differs(pair[2], samples, row, 0)


def test_planted_blocks_across_samples_are_found_and_shrunk(pair):
    samples, row, _ = counterexample(pair[2], Planted.blocks_across_samples)
    # two samples in one row, each with an image
    assert len(samples) == 2 and all(len(s.pixel_values) for s in samples)
    assert not packed_differs(pair[2], samples, row, 0)


# ---------------------------------------------------------------------- generation


def test_compiled_greedy_decoding_equals_eager_and_never_recompiles(pair):
    model = pair[2]
    batch = FIXTURES["gemma3"].prompts()

    def greedy(ids, images, **kwargs):
        out = generate(
            model, ids, encoder_input=images, max_new_tokens=6, temperature=0, pad_id=PAD, **kwargs
        )
        return out[:, ids.size(1) :]

    expected = greedy(batch.ids, batch.ours)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("eager")
    try:
        assert torch.equal(greedy(batch.ids, batch.ours, compile={"backend": counter}), expected)
        frames = counter.frame_count
        assert frames >= 1
        with torch._dynamo.config.patch(error_on_recompile=True):
            # the same shapes, other prompts: the rows swapped, their images with them
            pixels = batch.ours["image"]["pixel_values"]
            swapped = {"image": {"pixel_values": torch.cat([pixels[1:], pixels[:1]])}}
            greedy(batch.ids.flip(0), swapped, compile={"backend": counter})
            again = greedy(batch.ids, batch.ours, compile={"backend": counter})
        assert torch.equal(again, expected) and counter.frame_count == frames
    finally:
        torch._dynamo.reset()


def test_the_command_line_generates_transformers_greedy_tokens_from_an_image(tmp_path):
    """``python -m fusion.generation --image`` on a whole Gemma 3 directory: the prompt's
    ``<start_of_image>`` expanded and the image processed by this library's processor, and
    the new tokens transformers' greedy ones on its processor's inputs."""
    import io
    import json

    import numpy as np
    from PIL import Image

    from fusion.generation.cli import main
    from gemma3_helpers import hf_gemma3_processor, tiny_hf_gemma3, write_gemma3_dir

    directory = write_gemma3_dir(tmp_path / "model", seed=5)  # tokens that change
    picture = Image.fromarray(np.random.default_rng(0).integers(0, 256, (30, 44, 3), np.uint8))
    picture.save(tmp_path / "x.png")
    prompt = "Look <start_of_image> now"
    out = io.StringIO()
    argv = ["--checkpoint", str(directory), "--image", str(tmp_path / "x.png")]
    argv += ["--prompt", prompt, "--print-ids", "--max-new-tokens", "6", "--ignore-eos"]
    argv += ["--temperature", "0"]
    assert main(argv, out=out) == 0
    printed = json.loads(out.getvalue())
    theirs = hf_gemma3_processor()(text=[prompt], images=[[picture]], return_tensors="pt")
    assert printed["prompt_ids"] == theirs["input_ids"][0].tolist()
    hf = tiny_hf_gemma3(5)
    with torch.no_grad():
        expected = hf.generate(**theirs, max_new_tokens=6, do_sample=False, eos_token_id=None)
    assert printed["new_ids"] == expected[0, theirs["input_ids"].size(1) :].tolist()


# ---------------------------------------------------------------------- hostile configs


def top(**values):
    return lambda config: config.update(values)


def text(**values):
    return lambda config: config["text_config"].update(values)


HOSTILE = {
    "tokens-not-square": (
        top(mm_tokens_per_image=15),
        "mm_tokens_per_image",
        "expected a square whose side divides the tower's 8 patches per side",
    ),
    "tokens-not-dividing": (top(mm_tokens_per_image=9), "mm_tokens_per_image", "got 9"),
    "image-id-outside-vocabulary": (
        top(image_token_index=VOCAB),
        "image_token_index",
        rf"\[0, text_config.vocab_size={VOCAB}\), got {VOCAB}",
    ),
    "final-softcap": (
        text(final_logit_softcapping=30.0),
        "text_config.final_logit_softcapping",
        "never applies it",
    ),
    "window-0": (text(sliding_window=0), "text_config.sliding_window", "got 0"),
    "layer_types-too-long": (
        text(layer_types=["full_attention"] * 5),
        "text_config.layer_types",
        "a list of 4 entries",
    ),
    "image-size": (
        lambda config: config["vision_config"].update(image_size=30),
        "vision_config.image_size",
        "a positive multiple of patch_size=4, got 30",
    ),
    "tower": (
        lambda config: config["vision_config"].update(model_type="clip_vision_model"),
        "vision_config.model_type",
        "siglip_vision_model",
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


def test_image_blocks_take_per_sample_sdpa():
    """``"auto"`` picks per-sample SDPA for segments with blocks; FlexAttention and varlen,
    which have no bidirectional blocks, refuse them."""
    from fusion.decoder.packed_attention import prepare, resolve_backend

    segments = PackedSegments.from_lengths([[IMAGE_ROWS + 4]], IMAGE_ROWS + 4)
    blocks = torch.zeros(1, IMAGE_ROWS + 4, dtype=torch.long)
    assert prepare(segments, torch.float32).backend == "sdpa"  # no blocks: as before
    assert prepare(segments.with_blocks(blocks), torch.float32).backend == "sdpa"
    cuda = torch.device("cuda")
    assert resolve_backend("auto", cuda, torch.bfloat16, blocks=True) == "sdpa"
    for backend in ("flex", "varlen"):
        with pytest.raises(ValueError, match=f"'{backend}' backend has no bidirectional blocks"):
            resolve_backend(backend, cuda, torch.bfloat16, blocks=True)
