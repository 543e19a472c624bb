"""PEFT adapters out of and into the recipe, against peft itself on tiny random LLaVA
directories transformers writes in the tests: a LoRA run's ``final/adapter/`` loads in
``PeftModel.from_pretrained`` with the logits of fusion's LoRA model and of the merged
``final/``; ``--init-adapter`` starts from an adapter peft trained (its first loss is the one
peft computes on the same batch), continues it, resumes, and refuses conflicting flags and
unsupported adapters by name."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from fusion.data import IGNORE_INDEX, ConversationEncoder, read_conversations
from fusion.training import load_train_state, read_model_state_dict
from recipes.finetune import main
from recipes.finetune.config import config_from_json
from recipes.finetune.model import build_model

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")


def hf_model(directory):
    return transformers.AutoModelForImageTextToText.from_pretrained(directory).eval()


def batch(model_dir, data):
    """Every conversation of ``data`` as (tokens [1, n], labels [n], pixels), by the recipe's
    encoder (whose ids, labels and pixels equal transformers' processor: tests/data)."""
    encoder = ConversationEncoder.from_directory(model_dir)
    samples = [encoder.encode_conversation(c) for c in read_conversations(data).conversations]
    return [(s.tokens[None], s.labels, s.pixel_values) for s in samples]


@torch.no_grad()
def hf_logits(model, tokens, pixels):
    return model(input_ids=tokens, pixel_values=pixels).logits[0]


@torch.no_grad()
def hf_loss(model, samples) -> float:
    """Mean cross-entropy over every target of ``samples``, one forward each."""
    total, count = 0.0, 0
    for tokens, labels, pixels in samples:
        logits = hf_logits(model, tokens, pixels)
        total += torch.nn.functional.cross_entropy(
            logits.double(), labels, ignore_index=IGNORE_INDEX, reduction="sum"
        ).item()
        count += int((labels != IGNORE_INDEX).sum())
    return total / count


def fusion_lora_model(out):
    """fusion's LoRA model as the run left it (the last checkpoint, adapters unmerged)."""
    checkpoint = max((out / "checkpoints").iterdir())
    config = load_train_state(checkpoint, config_from_json).config
    model = build_model(config)
    model.load_state_dict(read_model_state_dict(checkpoint), strict=False)
    return model.eval()


def max_error(a, b) -> float:
    return (a - b).abs().max().item()


@pytest.fixture(scope="module")
def lora_run(model_dirs, tmp_path_factory, ft):
    """LLaVA, LoRA on every linear layer of the language model, 3 steps at a high rate."""
    root = tmp_path_factory.mktemp("peft_out")
    data = ft.write_data(root / "data", count=3)
    out = root / "run"
    argv = ft.recipe_args(model_dirs["llava"], data, out, "--steps", "3", "--lr", "5e-2")
    assert main([*argv, "--lora-targets", "all-linear", "--lora-rank", "4"]) == 0
    return data, out


def test_final_adapter_loads_in_peft_with_our_and_the_merged_logits(lora_run, model_dirs):
    data, out = lora_run
    base = model_dirs["llava"]
    adapter = out / "final" / "adapter"
    assert sorted(p.name for p in adapter.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    assert not (out / "final" / "adapter.safetensors").exists()
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(base) and config["r"] == 4
    keys = load_file(adapter / "adapter_model.safetensors")
    assert len(keys) == 2 * 2 * 7  # 2 layers, 7 linear layers each, A and B
    assert all(".default." not in k and ".base_layer." not in k for k in keys)

    ours = fusion_lora_model(out)
    adapted = peft.PeftModel.from_pretrained(hf_model(base), adapter).eval()
    merged = hf_model(out / "final")
    plain = hf_model(base)
    errors = []
    for tokens, _, pixels in batch(base, data):
        with torch.no_grad():
            mine = ours(tokens, encoder_input={"image": {"pixel_values": pixels}})[0]
        theirs = hf_logits(adapted, tokens, pixels)
        errors.append(
            (max_error(theirs, mine), max_error(theirs, hf_logits(merged, tokens, pixels)))
        )
        assert max_error(hf_logits(plain, tokens, pixels), mine) > 1e-2  # the adapter matters
    print(f"max |peft - fusion LoRA|, |peft - merged final/|: {errors}")
    assert max(e for pair in errors for e in pair) <= 1e-4


def randomize_factors(model, seed: int = 0) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)


@pytest.fixture(scope="module")
def peft_adapter(model_dirs, tmp_path_factory):
    """An adapter peft trained for LLaVA (q, v, o of every layer, vision tower included, as
    peft's list of names takes it), factors random."""
    directory = tmp_path_factory.mktemp("peft_in") / "adapter"
    settings = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "o_proj"]}
    trained = peft.get_peft_model(hf_model(model_dirs["llava"]), peft.LoraConfig(**settings))
    randomize_factors(trained)
    trained.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def init_run(model_dirs, peft_adapter, tmp_path_factory, ft):
    """4 steps from ``peft_adapter``, each over all 3 conversations (one step per epoch)."""
    root = tmp_path_factory.mktemp("init_run")
    data = ft.write_data(root / "data", count=3)
    out = root / "run"
    argv = ft.recipe_args(model_dirs["llava"], data, out, "--steps", "4", "--lr", "1e-2")
    argv += ["--init-adapter", str(peft_adapter), "--checkpoint-every", "2"]
    assert main(argv) == 0
    return data, out


def test_init_adapter_first_loss_is_peft_s_and_training_lowers_it(
    init_run, peft_adapter, model_dirs, ft
):
    data, out = init_run
    base = model_dirs["llava"]
    samples = batch(base, data)
    adapted = peft.PeftModel.from_pretrained(hf_model(base), peft_adapter).eval()
    expected = hf_loss(adapted, samples)
    plain = hf_loss(hf_model(base), samples)
    losses = ft.metrics(out)["losses"]
    print(f"first loss: recipe {losses[0]:.7f}, peft {expected:.7f}, base model {plain:.7f}")
    assert losses[0] == pytest.approx(expected, abs=1e-5)
    assert abs(plain - expected) > 1e-2  # the adapter was loaded, not a fresh one
    assert losses[-1] < losses[0]
    state = load_train_state(max((out / "checkpoints").iterdir()), config_from_json)
    assert state.config.init_adapter == str(peft_adapter)
    assert (state.config.lora_rank, state.config.lora_alpha) == (4, 8.0)  # the adapter's
    # The export holds the adapter's layers (the vision tower's q/v too), trained.
    saved = load_file(out / "final" / "adapter" / "adapter_model.safetensors")
    assert saved.keys() == load_file(peft_adapter / "adapter_model.safetensors").keys()


def test_init_adapter_run_resumes_bitwise(init_run, tmp_path, ft):
    _, out = init_run
    copy = tmp_path / "run"
    shutil.copytree(out, copy)
    shutil.rmtree(copy / "final")
    shutil.rmtree(copy / "checkpoints" / "step_00000004")
    (copy / "metrics.json").unlink()
    assert main(["--resume", "--output-dir", str(copy), "--threads", "1", "--no-progress"]) == 0
    assert ft.metrics(copy)["losses"] == ft.metrics(out)["losses"]


def test_continuing_a_run_s_own_final_adapter(lora_run, model_dirs, tmp_path, ft):
    """final/adapter/ goes back in: the first loss is the merged final/'s on the batch."""
    data, out = lora_run
    again = tmp_path / "again"
    argv = ft.recipe_args(model_dirs["llava"], data, again, "--steps", "1")
    assert main([*argv, "--init-adapter", str(out / "final" / "adapter")]) == 0
    expected = hf_loss(hf_model(out / "final"), batch(model_dirs["llava"], data))
    assert ft.metrics(again)["losses"][0] == pytest.approx(expected, abs=1e-5)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--lora-rank", "8"],
            "--lora-rank: 8 conflicts with r=4 in {adapter}/adapter_config.json",
        ),
        (["--lora-alpha", "32"], "--lora-alpha: 32.0 conflicts with lora_alpha=8.0 in {adapter}"),
        (["--lora-targets", "q_proj,v_proj"], "--lora-targets: 'q_proj,v_proj' conflicts with"),
    ],
)
def test_conflicting_lora_flags_are_refused_by_name(
    flags, message, model_dirs, peft_adapter, tmp_path, ft, capsys
):
    data = ft.write_data(tmp_path / "data", count=2)
    argv = ft.recipe_args(model_dirs["llava"], data, tmp_path / "run", "--steps", "1")
    capsys.readouterr()
    assert main([*argv, "--init-adapter", str(peft_adapter), *flags]) == 1
    err = capsys.readouterr().err
    assert message.format(adapter=peft_adapter) in err and len(err.splitlines()) == 1
    assert not (tmp_path / "run" / "checkpoints").exists() or not any(
        (tmp_path / "run" / "checkpoints").iterdir()
    )


def test_the_adapter_s_own_values_given_again_are_accepted(model_dirs, peft_adapter, tmp_path, ft):
    data = ft.write_data(tmp_path / "data", count=2)
    argv = ft.recipe_args(model_dirs["llava"], data, tmp_path / "run", "--steps", "1")
    # peft's list of names took the vision tower's q/v too: named here by a dotted pattern
    targets = "q_proj,v_proj,o_proj,encoders.image.vision_tower.*.[qv]_proj"
    flags = ["--lora-rank", "4", "--lora-alpha", "8", "--lora-targets", targets]
    assert main([*argv, "--init-adapter", str(peft_adapter), *flags]) == 0


def edited_adapter(source, target, change):
    shutil.copytree(source, target)
    config = json.loads((target / "adapter_config.json").read_text())
    change(config)
    (target / "adapter_config.json").write_text(json.dumps(config))
    return target


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda c: c.update(use_dora=True), "adapter_config.json, key 'use_dora': True"),
        (
            lambda c: c.update(modules_to_save=["lm_head"]),
            "adapter_config.json, key 'modules_to_save'",
        ),
        (lambda c: c.update(rank_pattern={"q_proj": 8}), "adapter_config.json, key 'rank_pattern'"),
    ],
)
def test_unsupported_adapters_are_refused_naming_the_file(
    change, message, model_dirs, peft_adapter, tmp_path, ft, capsys
):
    adapter = edited_adapter(peft_adapter, tmp_path / "adapter", change)
    data = ft.write_data(tmp_path / "data", count=2)
    argv = ft.recipe_args(model_dirs["llava"], data, tmp_path / "run", "--steps", "1")
    capsys.readouterr()
    assert main([*argv, "--init-adapter", str(adapter)]) == 1
    err = capsys.readouterr().err
    assert f"error: --init-adapter: {adapter}/{message}" in err and len(err.splitlines()) == 1


def test_an_adapter_for_layers_we_lack_is_refused_naming_the_file(
    model_dirs, peft_adapter, tmp_path, ft, capsys
):
    from safetensors.torch import save_file

    adapter = tmp_path / "adapter"
    shutil.copytree(peft_adapter, adapter)
    tensors = load_file(adapter / "adapter_model.safetensors")
    renamed = {k.replace(".layers.1.", ".layers.7."): v for k, v in tensors.items()}
    save_file(renamed, adapter / "adapter_model.safetensors", metadata={"format": "pt"})
    data = ft.write_data(tmp_path / "data", count=2)
    argv = ft.recipe_args(model_dirs["llava"], data, tmp_path / "run", "--steps", "1")
    capsys.readouterr()
    assert main([*argv, "--init-adapter", str(adapter)]) == 1
    err = capsys.readouterr().err
    assert f"--init-adapter: {adapter}/adapter_model.safetensors, key " in err
    assert "layers.7" in err and "refused, not dropped" in err
