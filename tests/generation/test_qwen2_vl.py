"""Qwen2-VL and Qwen2.5-VL generation: greedy tokens equal transformers' ``generate`` on a
left-padded batch with images (KV-cached decoding continues each sample's M-RoPE positions
from its ``rope_deltas``), eager and compiled, and compiled decoding never recompiles."""

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from fusion import generate
from fusion.checkpoint import load_hf_vlm
from qwen_helpers import MODEL_TYPES, PAD, image_prompt, left_pad, mm_token_type_ids, tiny_hf_qwen

NEW = 8
CASES = [([(1, 4, 4), (1, 10, 6)], [2, 3, 4]), ([(1, 6, 10)], [3, 5]), ([], [6])]


@pytest.fixture(scope="module", params=MODEL_TYPES)
def pair(request, tmp_path_factory):
    hf = tiny_hf_qwen(request.param, seed=2)
    directory = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(directory)
    return hf, load_hf_vlm(directory).eval()


def batch(seed: int = 0):
    samples = [image_prompt(*case, seed=seed + i) for i, case in enumerate(CASES)]
    ids, attention = left_pad([s[0] for s in samples])
    pixels = torch.cat([s[1] for s in samples])
    grid = torch.cat([s[2] for s in samples])
    return ids, attention, pixels, grid


def transformers_greedy(hf, ids, attention, pixels, grid) -> torch.Tensor:
    with torch.no_grad():
        out = hf.generate(
            input_ids=ids,
            attention_mask=attention,
            pixel_values=pixels,
            image_grid_thw=grid,
            mm_token_type_ids=mm_token_type_ids(ids),
            max_new_tokens=NEW,
            do_sample=False,
            pad_token_id=PAD,
            eos_token_id=None,
        )
    return out[:, ids.size(1) :]


def ours(model, ids, pixels, grid, **kwargs) -> torch.Tensor:
    images = {"image": {"pixel_values": pixels, "image_grid_thw": grid}}
    out = generate(
        model, ids, encoder_input=images, max_new_tokens=NEW, temperature=0, pad_id=PAD, **kwargs
    )
    return out[:, ids.size(1) :]


def test_greedy_equals_transformers_on_a_left_padded_batch(pair):
    hf, model = pair
    ids, attention, pixels, grid = batch()
    expected = transformers_greedy(hf, ids, attention, pixels, grid)
    assert len({tuple(row) for row in expected.tolist()}) == len(CASES)  # a lively model
    assert torch.equal(ours(model, ids, pixels, grid), expected)
    assert not model.decoder.caches_are_setup() and model.decoder.mrope_deltas is None
    assert torch.equal(ours(model, ids, pixels, grid, compile={"backend": "eager"}), expected)


def test_compiled_decoding_never_recompiles(pair):
    _, model = pair
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("eager")
    compiled = {"backend": counter}
    ids, _, pixels, grid = batch()
    first = ours(model, ids, pixels, grid, compile=compiled)
    frames = counter.frame_count
    with torch._dynamo.config.patch(error_on_recompile=True):
        other_ids, _, other_pixels, other_grid = batch(seed=5)
        ours(model, other_ids, other_pixels, other_grid, compile=compiled)
        assert torch.equal(ours(model, ids, pixels, grid, compile=compiled), first)
    assert counter.frame_count == frames
    torch._dynamo.reset()
