"""One suite over every registered family (:data:`fusion.families.FAMILIES`), parametrized by
the fixture table of ``fixtures.py`` (one tiny random directory per model type, written by
transformers' own classes): the registry finds the family of a config and of a model; the
loaded model's logits (fp32, 1e-4) and greedy tokens equal transformers'; ``save_hf_model``
round-trips bit for bit and transformers loads what it writes; ``export_hf``'s output loads
in transformers with our logits; peft adapters go both ways; hostile configs are refused by
name (the recipe's first loss: ``test_recipe.py``). What is one family's own (M-RoPE
positions, DeepStack, LLaVA's feature layers) stays in ``tests/models``."""

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from families.fixtures import FIXTURES, FamilyFixture
from fusion import EarlyFusion, TransformerDecoder, generate
from fusion.checkpoint import (
    CheckpointError,
    export_hf,
    load_hf_model,
    save_hf_model,
)
from fusion.checkpoint.hf_config import ConfigReader
from fusion.families import FAMILIES, Family, family_named, family_of

MODEL_TYPES = list(FIXTURES)
CASES = [pytest.param(t, c, id=f"{t}-{c}") for t, f in FIXTURES.items() for c in f.cases]
NEW_TOKENS = 8


@dataclass
class Built:
    """A model type's directory, transformers' model written there, and ours loaded from it
    (shared by the module's tests: none may change them)."""

    model_type: str
    fixture: FamilyFixture
    directory: Path
    hf: nn.Module
    model: nn.Module

    @property
    def family(self) -> Family:
        return family_named(self.fixture.family)

    @property
    def saved_as(self) -> str:
        return self.fixture.saved_as or self.model_type

    def first_case(self):
        return next(iter(self.fixture.cases.values()))()


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """model type -> :class:`Built`, each directory written once."""
    cache: dict[str, Built] = {}

    def get(model_type: str) -> Built:
        if model_type not in cache:
            fixture = FIXTURES[model_type]
            directory = tmp_path_factory.mktemp(model_type)
            hf = fixture.write(directory)
            model = load_hf_model(directory).eval()
            cache[model_type] = Built(model_type, fixture, directory, hf, model)
        return cache[model_type]

    return get


def same_state(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


def max_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def copy_with_config(source: Path, target: Path, config: dict) -> Path:
    """``target`` holding ``config`` as config.json and links to ``source``'s weights."""
    target.mkdir()
    (target / "config.json").write_text(json.dumps(config))
    for weights in source.glob("*.safetensors*"):
        (target / weights.name).symlink_to(weights)
    return target


# ---------------------------------------------------------------------- the registry


def test_every_registered_model_type_has_a_fixture():
    registered = {t: family.name for family in FAMILIES for t in family.model_types}
    assert {t: fixture.family for t, fixture in FIXTURES.items()} == registered


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_family_of_config_and_model(built, model_type):
    b = built(model_type)
    config_file = b.directory / "config.json"
    config = json.loads(config_file.read_text())
    assert config["model_type"] == model_type
    family = b.family
    assert family_of(config) is family
    spec = family.read(ConfigReader(config, config_file))
    assert spec.family is family and spec.model_type == model_type
    assert family_of(b.model) is family
    assert family.model_type_of(b.model) == b.saved_as
    if family.encoder_types:
        assert type(b.model) is EarlyFusion and set(b.model.encoders) == {"image"}
        assert isinstance(b.model.encoders["image"], family.encoder_types)
        # a video entry shares the image tower (Qwen2-VL, Qwen2.5-VL): no module of its own
        videos = {"video": spec.options["video_token_id"]} if b.model.shared_encoders else {}
        assert b.model.encoder_tokens == {"image": spec.image_token_id, **videos}
    else:
        assert type(b.model) is TransformerDecoder


# ---------------------------------------------------------------------- against transformers


@pytest.mark.parametrize(("model_type", "case"), CASES)
def test_logits_equal_transformers(built, model_type, case):
    b = built(model_type)
    batch = b.fixture.cases[case]()
    theirs = batch.their_logits(b.hf)
    assert max_error(batch.our_logits(b.model), theirs) <= 1e-4
    if batch.has_images:  # the images matter: without them (placeholders as text) far off
        text_only = type(batch)(batch.ids).their_logits(b.hf)
        assert max_error(text_only, theirs) > 1e-2


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_greedy_generation_equals_transformers(built, model_type):
    b = built(model_type)
    batch = b.fixture.prompts()
    pad = b.fixture.pad_id
    with torch.no_grad():
        theirs = b.hf.generate(
            input_ids=batch.ids,
            attention_mask=batch.attention_mask,
            **batch.theirs,
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=pad,
            eos_token_id=None,
        )
    ours = generate(
        b.model,
        batch.ids,
        encoder_input=batch.ours or None,
        max_new_tokens=NEW_TOKENS,
        temperature=0,
        pad_id=pad,
    )
    assert ours.tolist() == theirs.tolist()
    new = ours[:, batch.ids.size(1) :].tolist()
    assert len(new[0]) == NEW_TOKENS
    # a lively model: the samples differ, and not every one repeats one token
    assert len({tuple(row) for row in new}) == len(new)
    assert any(len(set(row)) > 1 for row in new)


# ---------------------------------------------------------------------- save, load, export


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_save_load_round_trip_is_bitwise_and_loads_in_transformers(built, model_type, tmp_path):
    b = built(model_type)
    written = save_hf_model(b.model, tmp_path)
    assert tmp_path / "config.json" in written
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == b.saved_as
    assert config["architectures"] == [b.family.architectures[b.saved_as]]
    again = load_hf_model(tmp_path)
    assert type(again) is type(b.model)
    same_state(again, b.model)

    hf = b.fixture.auto_class().from_pretrained(tmp_path).eval()
    assert type(hf).__name__ == b.family.architectures[b.saved_as]
    same_state(hf, b.hf)  # the checkpoint's bits, in transformers' names
    batch = b.first_case()
    assert max_error(batch.their_logits(hf), batch.our_logits(b.model)) <= 1e-4


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_export_loads_in_transformers_with_our_logits(built, model_type, tmp_path):
    b = built(model_type)
    out = tmp_path / "out"
    written = export_hf(b.model, b.directory, out)
    assert {p.name for p in written} >= {"config.json", "model.safetensors"}
    hf = b.fixture.auto_class().from_pretrained(out).eval()
    assert type(hf).__name__ == b.family.architectures[b.saved_as]
    same_state(hf, b.hf)
    batch = b.first_case()
    assert max_error(batch.their_logits(hf), batch.our_logits(b.model)) <= 1e-4


# ---------------------------------------------------------------------- peft


def randomize_factors(model: nn.Module, seed: int = 0) -> None:
    """Both factors of every adapter drawn at random (a fresh B is zero: it would hide a
    layout mistake in B)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_peft_adapters_both_ways(built, model_type, tmp_path):
    peft = pytest.importorskip("peft")
    from fusion.lora import apply_lora, load_peft_adapter, save_peft_adapter

    b = built(model_type)
    batch = b.first_case()

    def hf():
        return b.fixture.auto_class().from_pretrained(b.directory).eval()

    # out: our adapter, read by peft onto transformers' model
    ours = load_hf_model(b.directory)
    apply_lora(ours, "all-linear", rank=4, alpha=8)
    randomize_factors(ours)
    ours.eval()
    save_peft_adapter(ours, tmp_path / "ours", base_model_name_or_path=b.directory)
    adapted = peft.PeftModel.from_pretrained(hf(), tmp_path / "ours").eval()
    theirs = batch.their_logits(adapted)
    assert max_error(batch.our_logits(ours), theirs) <= 1e-4
    assert max_error(batch.our_logits(b.model), theirs) > 1e-2  # the adapter matters

    # in: an adapter peft trained (its own choice of layers, the tower's too), applied by us
    trained = peft.get_peft_model(hf(), peft.LoraConfig(r=4, target_modules="all-linear"))
    randomize_factors(trained, seed=1)
    trained.eval()
    theirs = batch.their_logits(trained)
    trained.save_pretrained(tmp_path / "peft")
    model = load_hf_model(b.directory)
    adapted_layers = load_peft_adapter(model, tmp_path / "peft")
    model.eval()
    saved = load_file(tmp_path / "peft" / "adapter_model.safetensors")
    assert len(adapted_layers) == len(saved) // 2
    assert max_error(batch.our_logits(model), theirs) <= 1e-4
    assert max_error(batch.our_logits(b.model), theirs) > 1e-2


# ---------------------------------------------------------------------- hostile configs


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_a_model_type_no_family_reads_is_refused(built, model_type, tmp_path):
    b = built(model_type)
    config = json.loads((b.directory / "config.json").read_text())
    directory = copy_with_config(b.directory, tmp_path / "other", config | {"model_type": "x9"})
    with pytest.raises(CheckpointError, match=r"model_type.*expected one of .*got 'x9'") as error:
        load_hf_model(directory)
    assert error.value.key == "model_type"
    assert error.value.file == directory / "config.json"


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_more_layers_than_the_weights_hold_are_refused(built, model_type, tmp_path):
    b = built(model_type)
    config_file = b.directory / "config.json"
    config = json.loads(config_file.read_text())
    counts = b.family.read(ConfigReader(config, config_file)).layer_counts()
    assert len(counts) == (2 if b.family.encoder_types else 1)  # the text's and the tower's
    for i, (key, (_, layers)) in enumerate(counts.items()):
        edited = json.loads(json.dumps(config))
        *path, last = key.split(".")
        part = edited
        for name in path:
            part = part[name]
        assert part[last] == layers
        part[last] = layers + 1
        if isinstance(part.get("layer_types"), list):  # a per-layer list follows the count
            part["layer_types"].append(part["layer_types"][-1])
        directory = copy_with_config(b.directory, tmp_path / str(i), edited)
        with pytest.raises(
            CheckpointError,
            match=rf"{layers + 1}, but the checkpoint holds weights for {layers} layers",
        ) as error:
            load_hf_model(directory)
        assert error.value.key == key


@pytest.mark.parametrize(
    "model_type", [t for t, f in FIXTURES.items() if family_named(f.family).encoder_types]
)
def test_a_tower_no_model_can_have_is_refused_naming_its_key(built, model_type, tmp_path):
    """The tower's constructor finds the head count no divisor of the width; the loader names
    the ``vision_config`` key behind the argument it names."""
    b = built(model_type)
    config = json.loads((b.directory / "config.json").read_text())
    vision = config["vision_config"]
    heads = next(key for key in ("num_heads", "num_attention_heads") if key in vision)
    vision[heads] = vision["hidden_size"] + 1
    directory = copy_with_config(b.directory, tmp_path / "heads", config)
    with pytest.raises(CheckpointError, match=rf"key 'vision_config\.{heads}': describes no "):
        load_hf_model(directory)
