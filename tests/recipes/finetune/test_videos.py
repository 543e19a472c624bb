"""The recipe on video conversations (a clip file, a list of frame files, videos and images
mixed in one conversation) with tiny Qwen2-VL, Qwen2.5-VL (the temporal row scaled by each
video's seconds), Qwen3-VL and Qwen3.5 directories (timestamps in the text, 2 frames a second
kept), packed and padded: the first loss equals transformers' cross-entropy on the assistant
tokens of the same samples (their ids and patches are transformers' processor's:
tests/data/test_videos.py); the clips are decoded in the data loader's worker processes."""

import json

import pytest
import torch
from video_helpers import RECORDS, write_media

from fusion.data import IGNORE_INDEX, ConversationEncoder, read_conversations
from qwen3_helpers import write_qwen3_5_dir, write_qwen3_dir
from qwen_helpers import hf_model, write_qwen_dir
from recipes.finetune import main

ARGS = ["--max-seq-len", "512", "--batch-tokens", "2048", "--lr", "1e-2", "--steps", "1"]


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5"])
def qwen_dir(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen") / request.param
    if request.param == "qwen3_vl":
        return write_qwen3_dir(directory)
    if request.param == "qwen3_5":
        return write_qwen3_5_dir(directory)
    return write_qwen_dir(directory, request.param)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    write_media(root)
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    return root / "train.jsonl"


def token_types(config, ids: torch.Tensor) -> torch.Tensor:
    """transformers' ``mm_token_type_ids``: 1 at the config's image placeholders, 2 at its
    video ones (each directory's own ids)."""
    images, videos = ids == config.image_token_id, ids == config.video_token_id
    return images.to(torch.int32) + 2 * videos.to(torch.int32)


def transformers_loss(directory, data) -> float:
    """transformers' mean cross-entropy over the assistant tokens of ``data``'s samples (each
    decoded at once), the model given their ids, patches, grids and seconds."""
    hf, encoder = hf_model(directory), ConversationEncoder.from_directory(directory)
    total = targets = 0.0
    for conversation in read_conversations(data).conversations:
        sample = encoder.encode_conversation(conversation)
        ids = sample.tokens[None]
        media = {"mm_token_type_ids": token_types(hf.config, ids)}
        if sample.has_images:
            media |= {"pixel_values": sample.pixel_values, "image_grid_thw": sample.image_grid_thw}
        if sample.has_videos:
            media |= {
                "pixel_values_videos": sample.pixel_values_videos,
                "video_grid_thw": sample.video_grid_thw,
            }
            if hf.config.model_type == "qwen2_5_vl":  # the only one taking the seconds
                media["second_per_grid_ts"] = sample.second_per_grid_ts
        labels = torch.full_like(sample.tokens, IGNORE_INDEX)  # unshifted: transformers shifts
        labels[1:] = sample.labels[:-1]
        with torch.no_grad():
            loss = hf(input_ids=ids, labels=labels[None], **media).loss
        total += loss.item() * sample.num_targets
        targets += sample.num_targets
    return total / targets


def test_first_loss_packed_equals_padded_equals_transformers(qwen_dir, data, tmp_path, ft):
    expected = transformers_loss(qwen_dir, data)
    for packed, workers in ((True, 2), (False, 0)):  # clips decoded in 2 workers, or here
        out = tmp_path / f"run-{packed}"
        argv = ft.recipe_args(qwen_dir, data, out, *ARGS, "--num-workers", str(workers))
        assert main(argv + ([] if packed else ["--no-packing"])) == 0
        loss = ft.metrics(out)["losses"][0]
        assert loss == pytest.approx(expected, rel=1e-5), f"packed={packed}"
