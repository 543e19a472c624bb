"""End to end in this process: fine-tuning tiny LLaVA, SmolVLM and Llama directories lowers
the loss, overfits 8 conversations so that greedy generation answers them exactly, exports a
directory transformers loads with our logits, and resumes bit for bit."""

import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

from fusion import generate
from fusion.checkpoint import load_hf_llama, load_hf_vlm
from fusion.data import ChatTemplate, read_conversations
from fusion.preprocessing import load_image, prepare_inputs
from fusion.training import latest_checkpoint, load_train_state
from fusion.training.safe_dcp import read_metadata
from recipes.finetune import main
from vlm_helpers import PAD


@pytest.fixture(scope="module")
def overfit(model_dirs, tmp_path_factory, ft):
    """LLaVA, fully fine-tuned 40 steps on 8 conversations (one step each: all 8 packed)."""
    root = tmp_path_factory.mktemp("overfit")
    data = ft.write_data(root / "data")
    out = root / "run"
    argv = ft.recipe_args(model_dirs["llava"], data, out, "--train", "full", "--steps", "40")
    assert main([*argv, "--lr", "1e-2", "--checkpoint-every", "20", "--eval-data", str(data)]) == 0
    return data, out


def answer_ids(final, data, kind: str, end_of_turn: str) -> list[tuple[list[int], list[int]]]:
    """(greedy answer, expected answer) ids of every conversation of ``data``."""
    model = (load_hf_llama(final) if kind == "llama" else load_hf_vlm(final)).eval()
    template = ChatTemplate.from_directory(final)
    tokenizer = Tokenizer.from_file(str(final / "tokenizer.json"))
    end = tokenizer.token_to_id(end_of_turn)
    pairs = []
    for conversation in read_conversations(data).conversations:
        prompt = template.render(conversation.messages[:-1], add_generation_prompt=True)
        if kind == "llama":
            tokens = torch.tensor([tokenizer.encode(prompt, add_special_tokens=False).ids])
            encoder_input = None
        else:
            images = [load_image(path) for path in conversation.images]
            inputs = prepare_inputs(final, prompt, images)
            tokens, encoder_input = inputs.tokens(PAD), inputs.encoder_input()
        out = generate(
            model, tokens, encoder_input=encoder_input, max_new_tokens=12, temperature=0,
            stop_tokens=[end], pad_id=PAD,
        )  # fmt: skip
        answer = conversation.messages[-1]["content"][0]["text"]
        expected = [*tokenizer.encode(answer, add_special_tokens=False).ids, end]
        pairs.append((out[0, tokens.size(1) :].tolist()[: len(expected)], expected))
    return pairs


def test_overfitting_8_conversations_answers_them_exactly(overfit, ft):
    data, out = overfit
    losses = ft.metrics(out)["losses"]
    assert len(losses) == 40 and losses[-1] < losses[0] / 10
    pairs = answer_ids(out / "final", data, "llava", ft.END_OF_TURN)
    assert len(pairs) == len(ft.ANSWERS)
    for got, expected in pairs:
        assert got == expected


def test_metrics_and_plot(overfit, ft):
    _, out = overfit
    report = ft.metrics(out)
    assert [step for step, _ in report["eval_losses"]] == [20, 40]
    assert report["eval_losses"][-1][1] < report["losses"][0]
    assert report["tokens_per_second"] > 0 and 0 <= report["padding_fraction"] < 0.5
    assert report["peak_memory"]["bytes"] > 0 and report["conversations"] == 8
    assert (out / "loss.png").read_bytes()[:4] == b"\x89PNG"


def hf_class(kind: str):
    import transformers

    names = {
        "llava": "LlavaForConditionalGeneration",
        "idefics3": "Idefics3ForConditionalGeneration",
        "smolvlm": "SmolVLMForConditionalGeneration",
        "llama": "LlamaForCausalLM",
    }
    return getattr(transformers, names[kind])


def assert_transformers_logits(final, kind: str, data) -> None:
    """transformers' own class loads ``final`` and gives our logits (fp32, 1e-4)."""
    theirs = hf_class(kind).from_pretrained(final).eval()
    conversation = read_conversations(data).conversations[0]
    text = ChatTemplate.from_directory(final).render(conversation.messages)
    with torch.no_grad():
        if kind == "llama":
            tokens = torch.tensor(
                [Tokenizer.from_file(str(final / "tokenizer.json")).encode(text).ids]
            )
            ours = load_hf_llama(final).eval()(tokens)
            expected = theirs(input_ids=tokens).logits
        else:
            inputs = prepare_inputs(final, text, [load_image(p) for p in conversation.images])
            tokens = inputs.tokens(PAD)
            ours = load_hf_vlm(final).eval()(tokens, encoder_input=inputs.encoder_input())
            pixels = inputs.pixel_values if kind == "llava" else inputs.pixel_values[None]
            expected = theirs(input_ids=tokens, pixel_values=pixels).logits
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=0)


def test_full_export_loads_in_transformers(overfit):
    data, out = overfit
    assert not (out / "final" / "adapter").exists()
    assert_transformers_logits(out / "final", "llava", data)


@pytest.fixture(scope="module")
def lora_run(model_dirs, tmp_path_factory, ft):
    """SmolVLM with LoRA (dropout, so resuming must restore the RNG), 6 steps of 2
    micro-batches, unpacked; checkpoints at 3 and 6."""
    root = tmp_path_factory.mktemp("lora")
    data = ft.write_data(root / "data")
    out = root / "run"
    argv = ft.recipe_args(model_dirs["smolvlm"], data, out, "--steps", "6", "--batch-tokens", "256")
    argv += ["--lr", "1e-2", "--lora-dropout", "0.1", "--lora-targets", "q_proj,v_proj,w2"]
    argv += ["--grad-accum", "2", "--no-packing", "--checkpoint-every", "3"]
    assert main(argv) == 0
    return data, out, argv


def test_lora_export_and_adapter(lora_run, ft):
    data, out, _ = lora_run
    losses = ft.metrics(out)["losses"]
    assert losses[-1] < losses[0]
    final = out / "final"
    assert not (final / "adapter.safetensors").exists()  # one adapter: PEFT's, final/adapter/
    adapter = load_file(final / "adapter" / "adapter_model.safetensors")
    assert adapter and all(k.endswith((".lora_A.weight", ".lora_B.weight")) for k in adapter)
    assert any(torch.count_nonzero(v) for k, v in adapter.items() if ".lora_B." in k)
    base = load_hf_vlm(model_dirs_of(lora_run)).state_dict()
    merged = load_hf_vlm(final).state_dict()
    assert merged.keys() == base.keys()  # the plain model's keys: the adapters are merged
    changed = [k for k in base if not torch.equal(base[k], merged[k])]
    assert changed and all(k.rsplit(".", 2)[-2] in ("q_proj", "v_proj", "w2") for k in changed)
    assert_transformers_logits(final, "smolvlm", data)
    # final/adapter/ on the base in peft: the merged final/'s logits.
    peft = pytest.importorskip("peft")
    theirs = hf_class("smolvlm")
    adapted = peft.PeftModel.from_pretrained(
        theirs.from_pretrained(model_dirs_of(lora_run)), final / "adapter"
    ).eval()
    conversation = read_conversations(data).conversations[0]
    text = ChatTemplate.from_directory(final).render(conversation.messages)
    inputs = prepare_inputs(final, text, [load_image(p) for p in conversation.images])
    args = {"input_ids": inputs.tokens(PAD), "pixel_values": inputs.pixel_values[None]}
    with torch.no_grad():
        merged = theirs.from_pretrained(final).eval()(**args).logits
        torch.testing.assert_close(adapted(**args).logits, merged, atol=1e-4, rtol=0)


def model_dirs_of(run) -> str:
    _, _, argv = run
    return argv[argv.index("--model") + 1]


def test_resume_is_bitwise(lora_run, tmp_path, ft):
    _, out, _ = lora_run
    copy = tmp_path / "run"
    shutil.copytree(out, copy)
    shutil.rmtree(copy / "final")
    shutil.rmtree(copy / "checkpoints" / "step_00000006")
    (copy / "metrics.json").unlink()
    assert main(["--resume", "--output-dir", str(copy), "--threads", "1", "--no-progress"]) == 0
    assert ft.metrics(copy)["losses"] == ft.metrics(out)["losses"]
    for name in ("adapter/adapter_model.safetensors", "model.safetensors"):
        expected, resumed = load_file(out / "final" / name), load_file(copy / "final" / name)
        assert expected.keys() == resumed.keys()
        assert all(torch.equal(expected[k], resumed[k]) for k in expected)
    assert latest_checkpoint(copy / "checkpoints").name == "step_00000006"


def test_lora_checkpoints_hold_only_what_trains(lora_run, tmp_path, capsys):
    """A LoRA run's checkpoints hold the adapters and optimizer state, not the frozen base;
    resuming on a base whose weights changed is refused, naming the file."""
    _, out, _ = lora_run
    checkpoint = out / "checkpoints" / "step_00000006"
    stored = read_metadata(checkpoint).tensors("model.")
    base = load_hf_vlm(model_dirs_of(lora_run)).state_dict()
    assert stored and all(".lora_a." in k or ".lora_b." in k for k in stored)
    weights = sum(v.numel() for v in base.values())
    assert sum(math.prod(shape) for shape, _ in stored.values()) < weights / 10
    state = load_train_state(checkpoint)
    assert state.trainable_only and set(state.base_model) == {"config.json", "model.safetensors"}

    copy = tmp_path / "run"
    shutil.copytree(out, copy)
    shutil.rmtree(copy / "checkpoints" / "step_00000006")
    file = copy / "checkpoints" / "step_00000003" / "train_state.json"
    saved = json.loads(file.read_text())
    saved["base_model"]["model.safetensors"]["sha256"] = "0" * 64  # as if the weights changed
    file.write_text(json.dumps(saved))
    capsys.readouterr()
    assert main(["--resume", "--output-dir", str(copy), "--threads", "1", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "step_00000003 holds only the trained tensors of a run on another base model" in err
    assert "model.safetensors changed (content)" in err
    assert latest_checkpoint(copy / "checkpoints").name == "step_00000003"  # nothing lost


def test_text_only_llama(model_dirs, tmp_path, ft):
    data = ft.write_data(tmp_path / "data", images=False)
    out = tmp_path / "run"
    argv = ft.recipe_args(model_dirs["llama"], data, out, "--steps", "3", "--lr", "1e-2")
    assert main([*argv, "--activation-checkpointing", "--dtype", "bfloat16"]) == 0
    losses = ft.metrics(out)["losses"]
    assert len(losses) == 3 and losses[-1] < losses[0]
    assert_transformers_logits(out / "final", "llama", data)


def test_resume_from_another_working_directory(model_dirs, tmp_path, monkeypatch, ft):
    """Paths given relative on the first run are stored absolute: a run started in one
    directory resumes from another, to the same losses."""
    first = tmp_path / "first"
    data = ft.write_data(first / "data", images=False, count=4)
    monkeypatch.chdir(first)
    model = ft.write_model("llama", first / "model")
    argv = ft.recipe_args(model.relative_to(first), data.relative_to(first), "run", "--steps", "4")
    assert main([*argv, "--checkpoint-every", "2", "--train", "lora"]) == 0
    done = ft.metrics(first / "run")["losses"]
    shutil.rmtree(first / "run" / "final")
    shutil.rmtree(first / "run" / "checkpoints" / "step_00000004")
    (first / "run" / "metrics.json").unlink()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    args = ["--resume", "--output-dir", str(first / "run"), "--threads", "1", "--no-progress"]
    assert main(args) == 0
    assert ft.metrics(first / "run")["losses"] == done


@pytest.mark.parametrize("train", ["full", "lora"])
def test_fused_loss_trains_as_the_chunked_loss(model_dirs, tmp_path, ft, train):
    """The default on CPU (fusion.fused_token_loss) and --no-fused-loss (the checkpointed
    chunked loss): the same losses, step after step, fully fine-tuned and with LoRA."""
    data = ft.write_data(tmp_path / "data")
    losses = {}
    for flag in ("--fused-loss", "--no-fused-loss"):
        out = tmp_path / flag
        argv = ft.recipe_args(model_dirs["llava"], data, out, "--train", train, "--steps", "3")
        assert main([*argv, "--lr", "1e-2", flag]) == 0
        losses[flag] = ft.metrics(out)["losses"]
    assert len(losses["--fused-loss"]) == 3
    assert losses["--fused-loss"] == pytest.approx(losses["--no-fused-loss"], rel=1e-5)
