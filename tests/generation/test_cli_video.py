"""``python -m fusion.generation --video`` on Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3.5
directories as the Hub carries them (their videos sized by ``preprocessor_config.json``, as
transformers sizes them): the prompt's ids are transformers' processor's (Qwen3-VL's and
Qwen3.5's per-frame timestamps in place of the template's start / end pair, as 5.25 writes
them),
and the greedy tokens transformers' ``generate``'s on the same clip; a directory whose model
takes no videos is refused by name."""

import io
import json

import pytest
import torch
from video_helpers import drawn_frames, hf_video_outputs, hf_video_settings, write_clip

from fusion.generation.cli import main
from fusion.preprocessing import load_video
from qwen3_helpers import (
    QWEN3_PREPROCESSOR,
    write_qwen3_5_dir,
    write_qwen3_5_text_dir,
    write_qwen3_dir,
)
from qwen_helpers import PAD, QWEN_PIXELS, hf_media_kwargs, media_token_type_ids, write_qwen_dir

NEW = 6
MARKER = "<|vision_start|><|video_pad|><|vision_end|>"
PROMPT = f"<|im_start|>user\n{MARKER}What?<|im_end|>\n"
PROCESSORS = {
    "qwen2_vl": "Qwen2VLProcessor",
    "qwen2_5_vl": "Qwen2_5_VLProcessor",
    "qwen3_vl": "Qwen3VLProcessor",
    "qwen3_5": "Qwen3VLProcessor",
}
# What the directories' preprocessor_config.json say, as transformers' video processors take
# them (Qwen3-VL's samples frames at 2 a second).
QWEN2_SETTINGS = {
    **QWEN_PIXELS,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
}
QWEN3_SETTINGS = {
    key: QWEN3_PREPROCESSOR[key]
    for key in (
        "size",
        "patch_size",
        "temporal_patch_size",
        "merge_size",
        "image_mean",
        "image_std",
    )
}


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    """7 frames at 3 frames a second (second_per_grid_ts 2/3), of an odd size."""
    folder = tmp_path_factory.mktemp("clip")
    return write_clip(folder / "clip.mp4", drawn_frames(7, 38, 54, seed=4), 3.0)


@pytest.mark.parametrize("model_type", list(PROCESSORS))
def test_ids_and_tokens_equal_transformers(model_type, clip, tmp_path):
    from transformers import AutoModelForImageTextToText

    if model_type.startswith("qwen3"):
        write = write_qwen3_dir if model_type == "qwen3_vl" else write_qwen3_5_dir
        directory = write(tmp_path / model_type, seed=7)  # greedy tokens that vary
        video_class, settings = "Qwen3VLVideoProcessor", hf_video_settings(QWEN3_SETTINGS, True)
    else:
        directory = write_qwen_dir(tmp_path / model_type, model_type, seed=5)
        video_class, settings = "Qwen2VLVideoProcessor", hf_video_settings(QWEN2_SETTINGS, False)
    video = load_video(clip)
    (reference,) = hf_video_outputs(
        [
            {
                "processor": PROCESSORS[model_type],
                "class": video_class,
                "settings": settings,
                "tokenizer": str(directory),
                "prompts": [PROMPT],
                "videos": [video.frames],
                "kwargs": {"video_metadata": [video.metadata.as_transformers()]},
            }
        ],
        tmp_path,
    )
    ids = torch.tensor(reference["input_ids"])
    hf = AutoModelForImageTextToText.from_pretrained(directory).eval()
    videos = {k: reference[k] for k in ("pixel_values_videos", "video_grid_thw")}
    if reference["second_per_grid_ts"] is not None:  # Qwen2.5-VL's processor gives them
        videos["second_per_grid_ts"] = torch.as_tensor(reference["second_per_grid_ts"])
    with torch.no_grad():
        expected = hf.generate(
            input_ids=ids,
            mm_token_type_ids=media_token_type_ids(ids),
            **hf_media_kwargs(hf, {}, videos),
            max_new_tokens=NEW,
            do_sample=False,
            pad_token_id=PAD,
            eos_token_id=None,
        )[0, ids.size(1) :]
    assert len(set(expected.tolist())) > 1  # not one token over and over
    argv = ["--checkpoint", str(directory), "--max-new-tokens", str(NEW), "--temperature", "0"]
    argv += ["--ignore-eos", "--prompt", PROMPT, "--video", str(clip), "--print-ids"]
    out = io.StringIO()
    assert main(argv, out=out) == 0
    (line,) = [json.loads(text) for text in out.getvalue().splitlines()]
    assert line["prompt_ids"] == ids[0].tolist()
    assert line["new_ids"] == expected.tolist()


def test_a_model_without_videos_is_refused(clip, tmp_path, capsys):
    directory = write_qwen3_5_text_dir(tmp_path / "qwen3_5_text", seed=0)
    argv = ["--checkpoint", str(directory), "--prompt", PROMPT, "--video", str(clip)]
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    error = capsys.readouterr().err
    assert "--video:" in error and "takes no videos" in error and "qwen2_5_vl" in error


def test_clips_past_the_positions_are_refused_before_decoding(clip, tmp_path, capsys):
    """The rows a clip brings are counted from its container: past --max-seq-len, the command
    fails in one line naming them, and no frame is decoded."""
    import fusion.generation.cli as cli

    directory = write_qwen_dir(tmp_path / "qwen2_vl", "qwen2_vl", seed=0)
    capsys.readouterr()  # what writing the directory printed
    argv = ["--checkpoint", str(directory), "--prompt", PROMPT, "--video", str(clip)]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cli, "load_video", lambda *a, **k: pytest.fail("a frame was decoded"))
        assert main([*argv, "--max-seq-len", "7"]) == 1  # the clip brings 8
    error = capsys.readouterr().err
    assert error.startswith("error: --video: the clips bring 8 placeholder rows, more than")
    assert error.rstrip().endswith("nothing was decoded") and error.count("\n") == 1
