"""The recipe on a tiny Qwen3-VL directory as the Hub carries one (Qwen3-VL's chat template in
``chat_template.json``, its ``preprocessor_config.json``; two DeepStack layers), and on a tiny
Qwen3.5 one (the same files; Gated DeltaNet and gated attention layers, its tower without
DeepStack, its byte-level tokenizer), in every ``--train`` mode, packed and padded: the first
loss equals transformers' cross-entropy on the assistant tokens; exports keep the input's
weight keys, change only what trains (LoRA: its targets), and load in transformers with our
logits and greedy answers."""

import json

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from fusion import generate
from fusion.checkpoint import load_hf_model
from fusion.data import read_conversations
from qwen3_helpers import write_qwen3_5_dir, write_qwen3_dir
from qwen_helpers import (
    PAD,
    fusion_inputs,
    hf_inputs,
    hf_model,
    hf_processor,
    transformers_first_loss,
)
from recipes.finetune import main

# --train mode: packed or not. Packed and padded runs both give the first loss.
RUNS = {"full": True, "lora": False, "projector": True}
VISUAL = "model.visual."
MERGERS = (VISUAL + "merger.", VISUAL + "deepstack_merger_list.")
# model type -> (its directory, transformers' class, DeepStack mergers)
FAMILIES = {
    "qwen3_vl": (write_qwen3_dir, "Qwen3VLForConditionalGeneration", 2),
    "qwen3_5": (write_qwen3_5_dir, "Qwen3_5ForConditionalGeneration", 0),
}
# What each mode may change, by Hugging Face key (LoRA merged into q_proj and v_proj).
TRAINED = {
    "full": lambda key: not key.startswith(VISUAL) or key.startswith(MERGERS),
    "lora": lambda key: key.endswith(("self_attn.q_proj.weight", "self_attn.v_proj.weight")),
    "projector": lambda key: key.startswith(MERGERS),
}
ARGS = ["--max-seq-len", "256", "--batch-tokens", "2048", "--lr", "1e-2", "--warmup-steps", "1"]
# (height, width) -> grids of 2 x 4 to 8 x 10 patches of 16 pixels (sides multiples of 32).
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
    {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Say hi."},
            {"role": "assistant", "content": "hi"},
        ]
    },
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
        ],
    },
]


@pytest.fixture(scope="module", params=list(FAMILIES))
def model_type(request):
    return request.param


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory, model_type):
    write = FAMILIES[model_type][0]
    return write(tmp_path_factory.mktemp(model_type) / model_type)


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
def run(qwen3_dir, data, tmp_path_factory, ft):
    """The output directory of a RUNS mode (run once): 3 steps, each over the whole data."""
    done = {}

    def get(mode: str):
        if mode not in done:
            out = tmp_path_factory.mktemp(f"qwen3-{mode}") / "run"
            argv = ft.recipe_args(qwen3_dir, data, out, *ARGS, "--train", mode, "--steps", "3")
            assert main(argv + ([] if RUNS[mode] else ["--no-packing"])) == 0
            done[mode] = out
        return done[mode]

    return get


def test_first_loss_packed_equals_padded_equals_transformers(run, qwen3_dir, data, model_type):
    hf, processor = hf_model(qwen3_dir), hf_processor(qwen3_dir)
    assert type(hf).__name__ == FAMILIES[model_type][1]
    assert type(processor).__name__ == "Qwen3VLProcessor"
    thinking = model_type == "qwen3_5"  # Qwen3.5's template opens a thinking block
    expected = transformers_first_loss(hf, processor, qwen3_dir, data, thinking=thinking)
    for mode, packed in RUNS.items():
        loss = json.loads((run(mode) / "metrics.json").read_text())["losses"][0]
        print(f"first loss, {mode} (packed={packed}): {loss!r}; transformers: {expected!r}")
        assert loss == pytest.approx(expected, rel=1e-5), f"{mode}, packed={packed}"


@pytest.mark.parametrize("mode", list(RUNS))
def test_export_keeps_keys_changes_what_trains_and_loads_in_transformers(
    mode, run, qwen3_dir, data, model_type
):
    final = run(mode) / "final"
    base = load_file(qwen3_dir / "model.safetensors")
    tuned = load_file(final / "model.safetensors")
    assert tuned.keys() == base.keys()  # the input directory's keys, lm_head untied
    assert all(tuned[k].shape == base[k].shape for k in base)
    changed = {k for k in base if not torch.equal(base[k], tuned[k])}
    assert changed and all(TRAINED[mode](k) for k in changed), sorted(changed)
    if mode == "lora":  # every adapter learned something, nothing else changed
        assert changed == {k for k in base if TRAINED["lora"](k)}
    else:  # the main merger and the DeepStack mergers trained; full: the decoder too
        deepstack = FAMILIES[model_type][2]
        for prefix in (VISUAL + "merger.", *(f"{MERGERS[1]}{i}." for i in range(deepstack))):
            assert any(k.startswith(prefix) for k in changed), prefix
        if mode == "full":
            assert any(k.startswith("model.language_model.layers.") for k in changed)

    # transformers loads the export and gives our logits on a conversation with two images.
    conversation = read_conversations(data).conversations[1]
    hf, ours = hf_model(final), load_hf_model(final).eval()
    inputs = hf_inputs(hf_processor(final), conversation.messages)
    # Preprocessed with the input directory's files, which final/ copies.
    tokens, encoder_input = fusion_inputs(qwen3_dir, conversation.messages, conversation.images)
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
        qwen3_dir, prompt, conversation.images, add_generation_prompt=True
    )
    with torch.no_grad():
        theirs = hf.generate(
            **inputs, max_new_tokens=6, do_sample=False, pad_token_id=PAD, eos_token_id=None
        )
    mine = generate(
        ours, tokens, encoder_input=encoder_input, max_new_tokens=6, temperature=0, pad_id=PAD
    )
    assert torch.equal(mine, theirs)
