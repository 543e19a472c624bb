"""PEFT adapters both ways, against peft itself on tiny random transformers models written in
the tests (LLaVA, Idefics3, SmolVLM, Llama, Qwen2-VL, Qwen2.5-VL, Qwen3-VL).

Out: ``save_peft_adapter`` writes the keys, shapes and ``target_modules`` that peft's own
``save_pretrained`` writes for the same layers of transformers' model, and
``PeftModel.from_pretrained`` gives our logits (fp32, 1e-4), merged or not, equal to the merged
export. In: an adapter peft trained (random factors, its own choice of layers) applied by
``load_peft_adapter`` gives peft's logits. What this library cannot compute is refused by name,
and the model is left unchanged."""

import copy
import json
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import fusion.lora.peft as peft_module
from fusion.checkpoint import CheckpointError, export_hf, load_hf_llama, load_hf_vlm
from fusion.checkpoint.keys import interleaved_to_rotate_half
from fusion.lora import (
    apply_lora,
    load_peft_adapter,
    lora_linears,
    merge_lora,
    read_peft_config,
    save_peft_adapter,
)
from fusion.lora.apply import lora_settings
from qwen3_helpers import PATCH_WIDTH as QWEN3_PATCH_WIDTH
from qwen3_helpers import tiny_hf_qwen3
from qwen_helpers import image_prompt, mm_token_type_ids, tiny_hf_qwen
from vlm_helpers import (
    IDEFICS3_TOKENS,
    IMAGE_ID,
    LLAVA_TOKENS,
    TEXT_CONFIG,
    TEXT_VOCAB,
    randomize,
    tiny_hf_idefics3,
    tiny_hf_llava,
)

peft = pytest.importorskip("peft")

FAMILIES = ["llama", "llava", "idefics3", "smolvlm", "qwen2_vl", "qwen2_5_vl", "qwen3_vl"]
# transformers' prefix of the language model's layers, in memory
TEXT_PREFIX = {
    "llama": "model.",
    "llava": "model.language_model.",
    "idefics3": "model.text_model.",
    "smolvlm": "model.text_model.",
    "qwen2_vl": "model.language_model.",
    "qwen2_5_vl": "model.language_model.",
    "qwen3_vl": "model.language_model.",
}
HF_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
KEY = re.compile(r"base_model\.model\.[\w.]+\.lora_[AB]\.weight")


def make_hf(family: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    if family == "llama":
        config = LlamaConfig(**TEXT_CONFIG, tie_word_embeddings=False)
        return randomize(LlamaForCausalLM(config))
    if family == "llava":
        return tiny_hf_llava()
    if family in ("idefics3", "smolvlm"):
        return tiny_hf_idefics3(smolvlm=family == "smolvlm")
    if family == "qwen3_vl":
        return tiny_hf_qwen3()
    return tiny_hf_qwen(family)


@dataclass
class Base:
    family: str
    directory: Path

    def hf(self):
        """transformers' model, as a user loads it."""
        from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

        auto = AutoModelForCausalLM if self.family == "llama" else AutoModelForImageTextToText
        return auto.from_pretrained(self.directory).eval()

    def ours(self):
        load = load_hf_llama if self.family == "llama" else load_hf_vlm
        return load(self.directory).eval()


@pytest.fixture(scope="module")
def base(request, tmp_path_factory) -> Base:
    """transformers' model of the family ``request.param``, written to a directory."""
    directory = tmp_path_factory.mktemp(request.param)
    make_hf(request.param).save_pretrained(directory)
    return Base(request.param, directory)


def batch(family: str) -> dict:
    """The same inputs for both: token ids with images where the model takes them."""
    if family.startswith("qwen"):
        grids, lengths = [(1, 4, 4), (1, 6, 4)], [2, 3, 4]
        ids, pixels, grid = image_prompt(grids, lengths)
        if family == "qwen3_vl":
            patches = int(grid.prod(-1).sum())
            generator = torch.Generator().manual_seed(1)
            pixels = torch.randn(patches, QWEN3_PATCH_WIDTH, generator=generator)
        return {"ids": ids, "pixels": pixels, "grid": grid}
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(8, TEXT_VOCAB, (2, 40), generator=generator)
    if family == "llama":
        return {"ids": tokens}
    rows = LLAVA_TOKENS if family == "llava" else IDEFICS3_TOKENS
    tokens[0, 2 : 2 + rows] = IMAGE_ID
    tokens[1, 10 : 10 + rows] = IMAGE_ID
    return {"ids": tokens, "pixels": torch.randn(2, 3, 16, 16, generator=generator)}


@torch.no_grad()
def hf_logits(model, family: str) -> torch.Tensor:
    inputs = batch(family)
    ids = inputs["ids"]
    if family == "llama":
        return model(input_ids=ids).logits
    if family.startswith("qwen"):
        return model(
            input_ids=ids,
            mm_token_type_ids=mm_token_type_ids(ids),
            pixel_values=inputs["pixels"],
            image_grid_thw=inputs["grid"],
        ).logits
    pixels = inputs["pixels"] if family == "llava" else inputs["pixels"][:, None]
    return model(input_ids=ids, pixel_values=pixels).logits


def forward(model, family: str) -> torch.Tensor:
    inputs = batch(family)
    if family == "llama":
        return model(inputs["ids"])
    image = {"pixel_values": inputs["pixels"]}
    if family.startswith("qwen"):
        image["image_grid_thw"] = inputs["grid"]
    return model(inputs["ids"], encoder_input={"image": image})


our_logits = torch.no_grad()(forward)


def randomize_factors(model: torch.nn.Module, seed: int = 0) -> None:
    """Both factors of every adapter drawn at random (a fresh B is zero: it would hide a
    layout mistake in B)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)


def peft_saves(base: Base, directory: Path, **config) -> dict[str, torch.Tensor]:
    """What peft's own save_pretrained writes for transformers' model with ``config``."""
    model = peft.get_peft_model(base.hf(), peft.LoraConfig(**config))
    model.save_pretrained(directory)
    return load_file(directory / "adapter_model.safetensors")


def max_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


# ---------------------------------------------------------------------- out


@pytest.mark.parametrize("base", FAMILIES, indirect=True)
def test_saved_adapter_gives_our_logits_in_peft_merged_or_not(base, tmp_path):
    model = base.ours()
    apply_lora(model, "all-linear", rank=4, alpha=8, dropout=0.1)
    randomize_factors(model)
    model.eval()
    ours = our_logits(model, base.family)
    written = save_peft_adapter(model, tmp_path / "adapter", base_model_name_or_path=base.directory)
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    assert [p.name for p in written] == ["adapter_model.safetensors", "adapter_config.json"]

    plain = base.hf()
    before = hf_logits(plain, base.family)
    adapted = peft.PeftModel.from_pretrained(plain, tmp_path / "adapter").eval()
    theirs = hf_logits(adapted, base.family)
    assert max_error(theirs, ours) <= 1e-4
    assert max_error(before, ours) > 1e-2  # the adapter matters

    merge_lora(model)
    export_hf(model, base.directory, tmp_path / "merged")
    merged = Base(base.family, tmp_path / "merged").hf()
    assert max_error(hf_logits(merged, base.family), theirs) <= 1e-4
    folded = adapted.merge_and_unload()
    assert max_error(hf_logits(folded, base.family), theirs) <= 1e-4


def target_cases(family: str) -> list[tuple[str, tuple[str, ...] | str]]:
    cases = [
        ("qv", ("q_proj", "v_proj")),
        ("all-linear", "all-linear"),
        ("hf-names", HF_NAMES),
        ("ours-and-output", ("output_proj", "w1", "output")),
        ("one-layer", ("decoder.layers.1.attn.q_proj", "down_proj")),
    ]
    if family != "llama":
        cases.append(("with-encoder", ("k_proj", "encoders.image.*")))
    return cases


@pytest.mark.parametrize(
    ("base", "targets"),
    [pytest.param(f, t, id=f"{f}-{name}") for f in FAMILIES for name, t in target_cases(f)],
    indirect=["base"],
)
def test_keys_and_targets_are_what_peft_writes(base, tmp_path, targets):
    if base.family == "llama" and isinstance(targets, tuple):  # a bare decoder's names
        targets = tuple(t.removeprefix("decoder.") for t in targets)
    model = base.ours()
    apply_lora(model, targets, rank=4, alpha=16)
    save_peft_adapter(model, tmp_path / "ours", base_model_name_or_path=str(base.directory))
    ours = load_file(tmp_path / "ours" / "adapter_model.safetensors")
    config = json.loads((tmp_path / "ours" / "adapter_config.json").read_text())

    # vLLM-style checks: peft's key form, no adapter name, no base weights, no extras.
    assert ours and all(KEY.fullmatch(key) for key in ours), sorted(ours)[:4]
    assert not any(".default." in key for key in ours)
    assert config["modules_to_save"] is None and config["bias"] == "none"
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 16, "LORA")

    # peft given our target_modules writes the same keys, shapes and dtypes, and the same
    # config (our fields are peft's, with peft's values).
    theirs = peft_saves(
        base,
        tmp_path / "peft",
        r=4,
        lora_alpha=16,
        target_modules=config["target_modules"],
    )
    # (peft also saves the output layer's base weight when it is adapted, in case the
    # vocabulary was resized: a base weight, which we never write.)
    copies = {k for k in theirs if k.endswith(".base_layer.weight")}
    assert copies == (
        {"base_model.model.lm_head.base_layer.weight"} if "output" in targets else set()
    )
    assert {k: (v.shape, v.dtype) for k, v in ours.items()} == {
        k: (v.shape, v.dtype) for k, v in theirs.items() if k not in copies
    }
    peft_config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    for key, value in config.items():
        if key != "target_modules":
            assert peft_config.get(key) == value, key
    if isinstance(config["target_modules"], list):
        assert sorted(peft_config["target_modules"]) == config["target_modules"]
    else:
        assert peft_config["target_modules"] == config["target_modules"]

    # ... and the same as peft given the Hugging Face names, restricted to the language model
    # for a vision-language model (peft's own list would take the vision tower's too).
    if targets in (("q_proj", "v_proj"), "all-linear", HF_NAMES):
        names = HF_NAMES if targets != ("q_proj", "v_proj") else targets
        prefix = re.escape(TEXT_PREFIX[base.family])
        restricted = (
            list(names)
            if base.family == "llama"
            else rf"{prefix}layers\.\d+\.\w+\.(?:{'|'.join(names)})"
        )
        plain = peft_saves(base, tmp_path / "names", r=4, lora_alpha=16, target_modules=restricted)
        assert set(plain) == set(ours)
        if base.family != "llama":  # peft's list takes the vision tower's layers of those names
            listed = peft_saves(base, tmp_path / "listed", r=4, target_modules=list(names))
            assert set(ours) <= set(listed)
            assert set(ours) < set(listed) or base.family.startswith("qwen")


@pytest.mark.parametrize("base", FAMILIES, indirect=True)
def test_round_trip_is_exact_and_q_k_rows_are_unpermuted(base, tmp_path):
    model = base.ours()
    apply_lora(model, ("q_proj", "k_proj", "v_proj"), rank=2, alpha=4)
    randomize_factors(model, seed=3)
    save_peft_adapter(model, tmp_path / "adapter")
    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    # B of q and k in transformers' rotate-half row order, A as it is: transformers' q_proj
    # weight plus B @ A * alpha / r is our merged q_proj with its rows permuted back.
    decoder = model if base.family == "llama" else model.decoder
    attention = decoder.layers[0].attn
    name = TEXT_PREFIX[base.family] + "layers.0.self_attn.{}_proj"
    for p, heads in (("q", attention.num_heads), ("k", attention.num_kv_heads)):
        a, b = (saved[f"base_model.model.{name.format(p)}.lora_{f}.weight"] for f in "AB")
        theirs = base.hf().state_dict()[f"{name.format(p)}.weight"] + b @ a * 2.0
        ours = merge_lora(copy.deepcopy(decoder)).layers[0].attn.get_submodule(f"{p}_proj")
        assert torch.allclose(interleaved_to_rotate_half(ours.weight, heads), theirs, atol=1e-6)
        assert torch.equal(a, lora_settings(attention.get_submodule(f"{p}_proj")).lora_a.weight)

    again = base.ours()
    adapted = load_peft_adapter(again, tmp_path / "adapter")
    assert sorted(adapted) == sorted(lora_linears(model))
    for name, linear in lora_linears(model).items():
        mine, back = lora_settings(linear), lora_settings(adapted[name])
        assert torch.equal(mine.lora_a.weight, back.lora_a.weight)
        assert torch.equal(mine.lora_b.weight, back.lora_b.weight)
        assert (back.rank, back.alpha) == (2, 4.0)
    assert torch.equal(our_logits(again, base.family), our_logits(model, base.family))


# ---------------------------------------------------------------------- in


def peft_cases(family: str) -> list[dict]:
    cases = [
        {"target_modules": ["q_proj", "v_proj"], "lora_alpha": 16, "lora_dropout": 0.1},
        {"target_modules": "all-linear", "lora_alpha": 8},  # vision tower and connector too
        {"target_modules": ["o_proj", "down_proj"], "use_rslora": True, "lora_alpha": 6},
    ]
    if family == "llama":  # the output layer: peft saves a copy of its base weight too
        cases.append({"target_modules": ["q_proj", "lm_head"], "lora_alpha": 4})
    if family == "llava":  # a regular expression, and an exclusion
        prefix = re.escape(TEXT_PREFIX[family])
        cases.append({"target_modules": rf"{prefix}.*\.(up_proj|k_proj)", "lora_alpha": 4})
        excluded = ["model.vision_tower.encoder.layers.1.self_attn.q_proj", "v_proj"]
        cases.append({"target_modules": ["q_proj", "v_proj"], "exclude_modules": excluded})
    return cases


@pytest.mark.parametrize(
    ("base", "case", "settings"),
    [
        pytest.param(f, i, settings, id=f"{f}-{i}")
        for f in FAMILIES
        for i, settings in enumerate(peft_cases(f))
    ],
    indirect=["base"],
)
def test_adapter_peft_trained_gives_peft_logits(base, tmp_path, case, settings):
    trained = peft.get_peft_model(base.hf(), peft.LoraConfig(r=4, **settings))
    randomize_factors(trained, seed=case)
    trained.eval()
    theirs = hf_logits(trained, base.family)
    trained.save_pretrained(tmp_path / "adapter")
    model = base.ours()
    before = our_logits(model, base.family)
    adapted = load_peft_adapter(model, tmp_path / "adapter")
    model.eval()
    assert max_error(our_logits(model, base.family), theirs) <= 1e-4
    assert max_error(before, theirs) > 1e-2
    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert len(adapted) == len(saved) // 2
    settings_of = {lora_settings(linear) for linear in adapted.values()}
    assert {s.rank for s in settings_of} == {4}
    assert all(p.requires_grad == ("lora_" in n) for n, p in model.named_parameters())
    config = read_peft_config(tmp_path / "adapter")
    assert config.scale == pytest.approx(
        settings.get("lora_alpha", 8) / (2.0 if settings.get("use_rslora") else 4.0)
    )
    # Written back by us, peft reads the same function.
    save_peft_adapter(model, tmp_path / "back")
    again = peft.PeftModel.from_pretrained(base.hf(), tmp_path / "back").eval()
    assert max_error(hf_logits(again, base.family), theirs) <= 1e-4


def test_a_peft_adapter_continues_training(tmp_path):
    """Loaded adapters train: a step lowers the loss; base weights stay frozen."""
    family = "llava"
    directory = tmp_path / "base"
    make_hf(family).save_pretrained(directory)
    base = Base(family, directory)
    trained = peft.get_peft_model(base.hf(), peft.LoraConfig(r=4, target_modules=["q_proj"]))
    randomize_factors(trained)
    trained.save_pretrained(tmp_path / "adapter")
    model = base.ours()
    load_peft_adapter(model, tmp_path / "adapter")
    frozen = {n: p.clone() for n, p in model.named_parameters() if not p.requires_grad}
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)
    ids = batch(family)["ids"]
    losses = []
    for _ in range(3):
        logits = forward(model, family)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if n in frozen)


# ---------------------------------------------------------------------- refused


@pytest.fixture(scope="module")
def llava_adapter(tmp_path_factory) -> tuple[Base, Path]:
    """A LLaVA base and an adapter peft wrote for it (q_proj, v_proj: vision tower too)."""
    root = tmp_path_factory.mktemp("refusals")
    make_hf("llava").save_pretrained(root / "base")
    base = Base("llava", root / "base")
    trained = peft.get_peft_model(
        base.hf(), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    )
    randomize_factors(trained)
    trained.save_pretrained(root / "adapter")
    return base, root / "adapter"


def edited(source: Path, target: Path, config=None, tensors=None, raw: bytes | None = None) -> Path:
    target.mkdir()
    content = json.loads((source / "adapter_config.json").read_text())
    weights = load_file(source / "adapter_model.safetensors")
    if config is not None:
        config(content)
    if tensors is not None:
        tensors(weights)
    text = raw if raw is not None else json.dumps(content).encode()
    (target / "adapter_config.json").write_bytes(text)
    save_file(weights, target / "adapter_model.safetensors", metadata={"format": "pt"})
    return target


Q0 = "base_model.model.model.language_model.layers.0.self_attn.q_proj"


def _set(key, value):
    return lambda content: content.__setitem__(key, value)


CONFIG_REFUSALS = [
    (_set("use_dora", True), r"key 'use_dora': True: not supported \(DoRA"),
    (_set("modules_to_save", ["lm_head"]), r"key 'modules_to_save': \['lm_head'\]: not supported"),
    (_set("rank_pattern", {"q_proj": 8}), "key 'rank_pattern': .*per-layer ranks"),
    (_set("alpha_pattern", {"q_proj": 8}), "key 'alpha_pattern': .*per-layer alphas"),
    (_set("bias", "all"), "key 'bias': 'all': trained biases are not supported"),
    (_set("lora_bias", True), "key 'lora_bias': True: not supported"),
    (_set("layers_to_transform", [0]), "key 'layers_to_transform': \\[0\\]: not supported"),
    (_set("init_lora_weights", "pissa"), "key 'init_lora_weights': 'pissa' is not supported"),
    (_set("future_option", {"on": 1}), "key 'future_option': .*not supported"),
    (_set("peft_type", "IA3"), "key 'peft_type': expected 'LORA'"),
    (_set("r", "4"), "key 'r': expected a positive int"),
    (_set("r", True), "key 'r': expected a positive int"),
    (_set("lora_alpha", -1), "key 'lora_alpha': expected a positive finite number"),
    (_set("lora_dropout", 1.5), "key 'lora_dropout': expected a probability"),
    (_set("use_rslora", "yes"), "key 'use_rslora': expected true or false"),
    (_set("target_modules", [1]), "key 'target_modules': expected null, a string or a list"),
    (_set("target_modules", ["k_proj"]), "key 'target_modules': names other layers"),
    (_set("r", 2), "lora_A.weight': expected a floating tensor of shape \\(2, "),
]


@pytest.mark.parametrize(("change", "match"), CONFIG_REFUSALS)
def test_unsupported_or_malformed_configs_are_refused_by_name(
    llava_adapter, tmp_path, change, match
):
    base, adapter = llava_adapter
    directory = edited(adapter, tmp_path / "a", config=change)
    model = base.ours()
    with pytest.raises(CheckpointError, match=match):
        load_peft_adapter(model, directory)
    assert not lora_linears(model)  # nothing changed


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        (b'{"peft_type": "LORA", "r": NaN}', "unreadable JSON: NaN is not JSON"),
        (b'{"peft_type": "LORA", "r": 4, "r": 8}', "unreadable JSON: duplicate key 'r'"),
        (b'{"peft_type": "LORA", "r": 1' + b"0" * 60 + b"}", "an integer of 61 digits"),
        (b"[" * 100_000 + b"]" * 100_000, "unreadable JSON: nested too deeply"),
        (b'["LORA"]', "expected a JSON object"),
        (b"\xff{}", "unreadable JSON"),
        (b'{"peft_type": "LORA", "pad": "' + b"x" * (1 << 20) + b'"}', "larger than 1048576"),
    ],
    ids=["nan", "duplicate", "huge-int", "deep", "list", "utf8", "large"],
)
def test_the_config_is_read_bounded_and_strictly(llava_adapter, tmp_path, raw, match):
    base, adapter = llava_adapter
    directory = edited(adapter, tmp_path / "a", raw=raw)
    with pytest.raises(CheckpointError, match=match) as error:
        load_peft_adapter(base.ours(), directory)
    assert error.value.file == directory / "adapter_config.json"


def _rename(old: str, new: str):
    return lambda weights: weights.__setitem__(new, weights.pop(old))


def _add(key: str, shape=(4, 32)):
    return lambda weights: weights.__setitem__(key, torch.zeros(shape))


KEY_REFUSALS = [
    (
        _rename(f"{Q0}.lora_A.weight", f"{Q0}.lora_A.default.weight"),
        "lora_A.default.weight': names the adapter",
    ),
    (
        _add("base_model.model.model.language_model.layers.9.self_attn.q_proj.lora_A.weight"),
        "a layer",
    ),
    (_add("base_model.model.model.language_model.embed_tokens.lora_embedding_A"), "an embedding"),
    (_add(f"{Q0}.lora_magnitude_vector", (32,)), "a DoRA magnitude"),
    (_add(f"{Q0}.weight", (32, 32)), "not a LoRA factor"),
    (_add("model.language_model.layers.0.self_attn.o_proj.lora_A.weight"), "peft's key form"),
    (lambda weights: weights.pop(f"{Q0}.lora_B.weight"), "lora_A.weight': has no lora_B"),
    (_add(f"{Q0}.base_layer.weight", (32, 32)), "a copy of the base layer's weight that differs"),
    (_add("base_model.model.lm_head.base_layer.weight", (128, 32)), "without an adapter"),
    (
        lambda weights: weights.__setitem__(f"{Q0}.lora_B.weight", torch.zeros(32, 4).int()),
        "expected a floating tensor",
    ),
]


@pytest.mark.parametrize(("change", "match"), KEY_REFUSALS)
def test_keys_peft_does_not_write_or_we_cannot_apply_are_refused(
    llava_adapter, tmp_path, change, match
):
    base, adapter = llava_adapter
    directory = edited(adapter, tmp_path / "a", tensors=change)
    model = base.ours()
    with pytest.raises(CheckpointError, match=match) as error:
        load_peft_adapter(model, directory)
    assert error.value.file == directory / "adapter_model.safetensors"
    assert not lora_linears(model)


def test_a_layer_already_adapted_and_wrong_models_are_refused(llava_adapter):
    base, adapter = llava_adapter
    model = base.ours()
    apply_lora(model, "q_proj")
    with pytest.raises(ValueError, match="already has a LoRA adapter"):
        load_peft_adapter(model, adapter)
    with pytest.raises(TypeError, match="expected an EarlyFusion or a TransformerDecoder"):
        load_peft_adapter(torch.nn.Linear(2, 2), adapter)
    with pytest.raises(CheckpointError, match=r"adapter_config\.json: missing"):
        load_peft_adapter(base.ours(), adapter.parent)


# ---------------------------------------------------------------------- writing


def test_save_refusals_and_overwrite(tmp_path):
    from helpers import build_tiny_decoder

    decoder = build_tiny_decoder()
    with pytest.raises(ValueError, match="has no LoRA adapters"):
        save_peft_adapter(decoder, tmp_path / "a")
    apply_lora(decoder, "q_proj", rank=2)
    apply_lora(decoder, "v_proj", rank=4)
    with pytest.raises(ValueError, match=r"different \(rank, alpha, dropout\) \(2, 16.0, 0.0\)"):
        save_peft_adapter(decoder, tmp_path / "a")
    assert not (tmp_path / "a").exists()
    decoder = build_tiny_decoder()
    apply_lora(decoder, ("q_proj", "down_proj"), rank=2, alpha=3)
    save_peft_adapter(decoder, tmp_path / "a", base_model_name_or_path="org/model")
    config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert config["target_modules"] == ["down_proj", "q_proj"]
    assert config["base_model_name_or_path"] == "org/model"
    assert config["auto_mapping"]["base_model_class"] == "LlamaForCausalLM"
    with pytest.raises(CheckpointError, match="already holds an adapter"):
        save_peft_adapter(decoder, tmp_path / "a")
    (tmp_path / "a" / "adapter_model.bin").write_bytes(b"stale")
    (tmp_path / "a" / "README.md").write_text("kept")
    save_peft_adapter(decoder, tmp_path / "a", overwrite=True)
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == [
        "README.md",
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    (tmp_path / "file").write_text("")
    with pytest.raises(CheckpointError, match="exists and is not a directory"):
        save_peft_adapter(decoder, tmp_path / "file")
    with pytest.raises(TypeError, match="base_model_name_or_path: expected a str"):
        save_peft_adapter(decoder, tmp_path / "b", base_model_name_or_path=3)


def test_a_failed_write_leaves_the_old_adapter_whole(tmp_path, monkeypatch):
    from helpers import build_tiny_decoder

    decoder = build_tiny_decoder()
    apply_lora(decoder, "q_proj", rank=2)
    save_peft_adapter(decoder, tmp_path / "a")
    old = {p.name: p.read_bytes() for p in (tmp_path / "a").iterdir()}
    randomize_factors(decoder)

    def crash(tensors, file, metadata=None):
        Path(file).write_bytes(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(peft_module, "save_file", crash)
    with pytest.raises(OSError, match="disk full"):
        save_peft_adapter(decoder, tmp_path / "a", overwrite=True)
    assert {p.name: p.read_bytes() for p in (tmp_path / "a").iterdir()} == old


def test_a_torch_file_adapter_is_read_with_weights_only(llava_adapter, tmp_path):
    """peft's ``safe_serialization=False`` writes ``adapter_model.bin``: read with
    ``torch.load(weights_only=True)`` when there is no safetensors file."""
    base, adapter = llava_adapter
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "adapter_config.json").write_bytes(
        (adapter / "adapter_config.json").read_bytes()
    )
    torch.save(
        load_file(adapter / "adapter_model.safetensors"), tmp_path / "a" / "adapter_model.bin"
    )
    from_bin, from_safetensors = base.ours(), base.ours()
    load_peft_adapter(from_bin, tmp_path / "a")
    load_peft_adapter(from_safetensors, adapter)
    assert torch.equal(our_logits(from_bin, "llava"), our_logits(from_safetensors, "llava"))
