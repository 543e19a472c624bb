"""The recipe on tiny Qwen2-VL and Qwen2.5-VL directories as the Hub carries them (Qwen's chat
template in ``chat_template.json``, a legacy ``preprocessor_config.json``), in every ``--train``
mode, packed (M-RoPE) and padded: the first loss equals transformers' cross-entropy on the
assistant tokens; exports keep the input's weight keys, change only what trains, and load in
transformers with our logits and greedy answers."""

import json

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from fusion import generate
from fusion.checkpoint import load_hf_vlm
from fusion.data import read_conversations
from qwen_helpers import (
    PAD,
    fusion_inputs,
    hf_inputs,
    hf_model,
    hf_processor,
    transformers_first_loss,
    write_qwen_dir,
)
from recipes.finetune import main

# (model type, --train): packed or not. Each family runs packed and padded.
RUNS = {
    ("qwen2_5_vl", "full"): True,
    ("qwen2_5_vl", "lora"): False,
    ("qwen2_5_vl", "projector"): True,
    ("qwen2_vl", "full"): False,
    ("qwen2_vl", "lora"): True,
    ("qwen2_vl", "projector"): False,
}
# What each mode may change, by Hugging Face key (LoRA merged into q_proj and v_proj).
TRAINED = {
    "full": lambda key: not key.startswith("visual.") or key.startswith("visual.merger."),
    "lora": lambda key: key.endswith(("self_attn.q_proj.weight", "self_attn.v_proj.weight")),
    "projector": lambda key: key.startswith("visual.merger."),
}
ARGS = ["--max-seq-len", "256", "--batch-tokens", "2048", "--lr", "1e-2", "--warmup-steps", "1"]
# Sizes (height, width) that give grids of 2 x 4 to 6 x 8 patches (several windows).
IMAGES = {"wide.png": (40, 60), "tall.png": (90, 70), "big.png": (120, 150), "gray.png": (50, 50)}


def user(*content) -> dict:
    return {"role": "user", "content": list(content)}


def image(name: str) -> dict:
    return {"type": "image", "path": name}


def text(value: str) -> dict:
    return {"type": "text", "text": value}


def answer(value: str) -> dict:
    return {"role": "assistant", "content": [text(value)]}


RECORDS = [
    {"messages": [user(image("wide.png"), text("What is it?")), answer("red fox")]},
    {"messages": [user(image("tall.png"), image("big.png"), text("Compare.")), answer("two cats")]},
    {"messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "hi"}]},
    {
        "messages": [
            user(text("Hello.")),
            answer("hello"),
            user(image("gray.png"), text("And this?")),
            answer("a gray owl"),
        ]
    },
    {
        "image": "big.png",
        "conversations": [
            {"from": "human", "value": "<image>\nWhat?"},
            {"from": "gpt", "value": "big dog"},
            {"from": "human", "value": "Sure?"},
            {"from": "gpt", "value": "yes"},
        ],
    },
]


@pytest.fixture(scope="module")
def qwen_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen")
    # Qwen2-VL-2B ties its output layer to the embeddings; Qwen2.5-VL-7B does not.
    return {
        t: write_qwen_dir(root / t, t, tied=t == "qwen2_vl") for t in ("qwen2_vl", "qwen2_5_vl")
    }


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    rng = np.random.default_rng(0)
    for name, (height, width) in IMAGES.items():
        pixels = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
        (pixels.convert("L") if name == "gray.png" else pixels).save(root / name)
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    return root / "train.jsonl"


@pytest.fixture(scope="module")
def run(qwen_dirs, data, tmp_path_factory, ft):
    """The output directory of RUNS' run (run once): 3 steps, each over the whole data."""
    done = {}

    def get(model_type: str, mode: str):
        if (model_type, mode) not in done:
            out = tmp_path_factory.mktemp(f"{model_type}-{mode}") / "run"
            argv = ft.recipe_args(qwen_dirs[model_type], data, out, *ARGS, "--train", mode)
            argv += ["--steps", "3"] + ([] if RUNS[model_type, mode] else ["--no-packing"])
            assert main(argv) == 0
            done[model_type, mode] = out
        return done[model_type, mode]

    return get


@pytest.mark.parametrize("model_type", ["qwen2_vl", "qwen2_5_vl"])
def test_first_loss_packed_equals_padded_equals_transformers(model_type, run, qwen_dirs, data):
    directory = qwen_dirs[model_type]
    hf, processor = hf_model(directory), hf_processor(directory)
    expected = transformers_first_loss(hf, processor, directory, data)
    for (kind, mode), packed in RUNS.items():  # each family runs packed and padded
        if kind == model_type:
            loss = json.loads((run(kind, mode) / "metrics.json").read_text())["losses"][0]
            assert loss == pytest.approx(expected, rel=1e-5), f"{mode}, packed={packed}"


@pytest.mark.parametrize("model_type, mode", list(RUNS), ids=[f"{t}-{m}" for t, m in RUNS])
def test_export_keeps_keys_changes_what_trains_and_loads_in_transformers(
    model_type, mode, run, qwen_dirs, data
):
    final = run(model_type, mode) / "final"
    base = load_file(qwen_dirs[model_type] / "model.safetensors")
    tuned = load_file(final / "model.safetensors")
    assert tuned.keys() == base.keys()  # the input directory's keys (lm_head tied or not)
    assert all(tuned[k].shape == base[k].shape for k in base)
    changed = {k for k in base if not torch.equal(base[k], tuned[k])}
    assert changed and all(TRAINED[mode](k) for k in changed)
    if mode == "lora":  # every adapter learned something
        assert changed == {k for k in base if TRAINED["lora"](k)}
    if mode == "full":  # the decoder and the merger, not the tower
        assert any(k.startswith("model.layers.") for k in changed)
        assert any(k.startswith("visual.merger.") for k in changed)

    # transformers loads the export and gives our logits on a conversation with two images.
    conversation = read_conversations(data).conversations[1]
    hf, ours = hf_model(final), load_hf_vlm(final).eval()
    inputs = hf_inputs(hf_processor(final), conversation.messages)
    # Preprocessed with the input directory's files, which final/ copies: its config.json
    # names transformers' default <|vision_start|> / <|vision_end|> ids, outside this tiny
    # vocabulary (the model holds no such ids; real Qwen checkpoints use the defaults).
    source = qwen_dirs[model_type]
    tokens, encoder_input = fusion_inputs(source, conversation.messages, conversation.images)
    assert tokens.tolist() == inputs["input_ids"].tolist()
    with torch.no_grad():
        expected = hf(**inputs).logits
        got = ours(tokens, encoder_input=encoder_input)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    if mode != "full":
        return
    # ... and answers: its greedy tokens are fusion's.
    prompt = conversation.messages[:-1]
    inputs = hf_inputs(hf_processor(final), prompt, add_generation_prompt=True)
    tokens, encoder_input = fusion_inputs(
        source, prompt, conversation.images, add_generation_prompt=True
    )
    with torch.no_grad():
        theirs = hf.generate(
            **inputs, max_new_tokens=6, do_sample=False, pad_token_id=PAD, eos_token_id=None
        )
    mine = generate(
        ours, tokens, encoder_input=encoder_input, max_new_tokens=6, temperature=0, pad_id=PAD
    )
    assert torch.equal(mine, theirs)


def test_markers_that_do_not_match_the_images_name_file_and_line(
    qwen_dirs, data, tmp_path, ft, capsys
):
    marker = "<|vision_start|><|image_pad|><|vision_end|>"
    llava = [{"from": "human", "value": "<image>\nWhat?"}, {"from": "gpt", "value": "no"}]
    cases: list[tuple[str, dict]] = [  # the marker typed in the text too; a stray placeholder
        ("2 image marker(s)", {"messages": [user(image("wide.png"), text(f"{marker}?"))]}),
        ("holds 3 placeholder ids (152), but the images give 2 rows",
         {"messages": [user(image("wide.png"), text("<|image_pad|>?"))]}),
        ("1 image marker(s)", {"image": ["wide.png", "big.png"], "conversations": llava}),
    ]  # fmt: skip
    for i, (problem, record) in enumerate(cases):
        if "messages" in record:
            record["messages"].append(answer("no"))
        file = data.parent / "bad.jsonl"
        file.write_text(json.dumps(RECORDS[0]) + "\n" + json.dumps(record) + "\n")
        capsys.readouterr()
        assert main(ft.recipe_args(qwen_dirs["qwen2_5_vl"], file, tmp_path / str(i), *ARGS)) == 1
        err = capsys.readouterr().err
        assert f"{file}:2: " in err and problem in err, err
