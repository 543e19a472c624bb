"""``python -m recipes.finetune`` on a text-only Qwen3.5 directory (``Qwen3_5ForCausalLM``,
Qwen3.5's chat template): the first loss packed = padded = transformers' cross-entropy on the
assistant tokens, and the full fine-tune's export loads in transformers with our logits."""

import json

import pytest
import torch

from fusion.checkpoint import load_hf_model
from fusion.data import IGNORE_INDEX, ConversationEncoder, read_conversations
from qwen3_helpers import write_qwen3_5_text_dir
from recipes.finetune import main

RECORDS = [
    {"messages": [{"role": "user", "content": "Why?"}, {"role": "assistant", "content": "sky"}]},
    {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi."},
            {"role": "assistant", "content": "hello", "reasoning_content": "greet"},
            {"role": "user", "content": "And?"},
            {"role": "assistant", "content": "<think>\nend\n</think>\n\nbye"},
        ]
    },
    {"messages": [{"role": "user", "content": "Name?"}, {"role": "assistant", "content": "fox"}]},
]
ARGS = ["--max-seq-len", "128", "--batch-tokens", "512", "--lr", "1e-2", "--warmup-steps", "1"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3_5_text")
    directory = write_qwen3_5_text_dir(root / "model")
    data = root / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    return directory, data, root


def transformers_loss(directory, data, template_variables=None) -> float:
    """transformers' mean cross-entropy over our samples' targets (our ids)."""
    from transformers import Qwen3_5ForCausalLM

    hf = Qwen3_5ForCausalLM.from_pretrained(directory).eval()
    encoder = ConversationEncoder.from_directory(directory, template_variables=template_variables)
    total = count = 0.0
    for conversation in read_conversations(data).conversations:
        sample = encoder.encode_conversation(conversation)
        labels = torch.full_like(sample.tokens, IGNORE_INDEX)  # unshifted: transformers shifts
        labels[1:] = sample.labels[:-1]
        with torch.no_grad():
            loss = hf(input_ids=sample.tokens[None], labels=labels[None]).loss
        total += loss.item() * sample.num_targets
        count += sample.num_targets
    return total / count


def test_first_loss_packed_equals_padded_equals_transformers_and_the_export_loads(setup, ft):
    from transformers import Qwen3_5ForCausalLM

    directory, data, root = setup
    expected = transformers_loss(directory, data)
    for packed in (True, False):
        out = root / f"run-{packed}"
        argv = ft.recipe_args(directory, data, out, *ARGS, "--train", "full", "--steps", "1")
        assert main(argv + ([] if packed else ["--no-packing"])) == 0
        losses = ft.metrics(out)["losses"]
        assert losses[0] == pytest.approx(expected, rel=1e-5), f"packed={packed}"
    final = root / "run-True" / "final"
    hf, ours = Qwen3_5ForCausalLM.from_pretrained(final).eval(), load_hf_model(final).eval()
    sample = ConversationEncoder.from_directory(directory).encode(RECORDS[1]["messages"])
    with torch.no_grad():
        theirs = hf(input_ids=sample.tokens[None]).logits
        torch.testing.assert_close(ours(sample.tokens[None]), theirs, atol=1e-4, rtol=0)
        before = Qwen3_5ForCausalLM.from_pretrained(directory).eval()
        assert (before(input_ids=sample.tokens[None]).logits - theirs).abs().max() > 1e-2


def test_without_thinking_the_first_loss_is_transformers_on_the_answers_alone(setup, ft):
    """``--chat-template-kwargs '{"enable_thinking": false}'``: the empty thinking block is
    prompt, as transformers' template writes it for a prompt without thinking."""
    directory, _, root = setup
    data = root / "no-thinking.jsonl"  # answers without reasoning, as such data sets hold
    plain = [RECORDS[0], RECORDS[2], {"messages": RECORDS[1]["messages"][:3]}]
    plain[2]["messages"][2] = {"role": "assistant", "content": "hello"}
    data.write_text("".join(json.dumps(r) + "\n" for r in plain))
    off = {"enable_thinking": False}
    expected = transformers_loss(directory, data, off)
    assert expected != pytest.approx(transformers_loss(directory, data), rel=1e-3)
    out = root / "run-no-thinking"
    argv = ft.recipe_args(directory, data, out, *ARGS, "--train", "lora", "--steps", "1")
    assert main([*argv, "--chat-template-kwargs", json.dumps(off)]) == 0
    assert ft.metrics(out)["losses"][0] == pytest.approx(expected, rel=1e-5)
