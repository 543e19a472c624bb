"""apply_lora: which layers get adapters, what the hook adds, what trains, and what is refused
before anything changes."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fusion.decoder import FewRowsLinear
from fusion.lora import DEFAULT_TARGETS, apply_lora, is_lora_linear, lora_linears, merge_lora
from helpers import FEATURES, IMAGE_ID, build_tiny_decoder, build_tiny_fusion, text_tokens


def images_batch() -> tuple[torch.Tensor, dict]:
    tokens = text_tokens(2, 12, seed=3)
    tokens[0, 2:5] = IMAGE_ID  # one image of 3 rows
    features = torch.randn(1, 3, FEATURES, generator=torch.Generator().manual_seed(4))
    return tokens, {"image": {"features": features}}


def randomize_adapters(model: nn.Module, seed: int = 0) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for linear in lora_linears(model).values():
            for child in (linear.lora_a, linear.lora_b):
                child.weight.copy_(torch.randn(child.weight.shape, generator=generator) * 0.3)


def test_fresh_adapters_change_nothing_and_keep_every_module():
    model = build_tiny_fusion()
    tokens, encoder_input = images_batch()
    before = model(tokens, encoder_input=encoder_input)
    modules = dict(model.named_modules())
    adapted = apply_lora(model, rank=4, alpha=8)
    assert list(adapted) == [
        f"decoder.layers.{i}.attn.{p}" for i in (0, 1) for p in DEFAULT_TARGETS
    ]
    for name, module in modules.items():  # nothing replaced: every module still where it was
        assert model.get_submodule(name) is module
    for linear in adapted.values():
        assert type(linear) is FewRowsLinear and is_lora_linear(linear)
        assert linear.lora_a.weight.shape == (4, linear.in_features)
        assert torch.count_nonzero(linear.lora_b.weight) == 0
        assert linear.lora_a.weight.abs().sum() > 0
    assert torch.equal(model(tokens, encoder_input=encoder_input), before)


def test_hook_adds_the_scaled_low_rank_update():
    decoder = build_tiny_decoder()
    q_proj = decoder.layers[0].attn.q_proj
    weight = q_proj.weight.detach().clone()
    apply_lora(decoder, "layers.0.attn.q_proj", rank=3, alpha=6.0, dropout=0.25)
    randomize_adapters(decoder)
    a, b = q_proj.lora_a.weight.detach(), q_proj.lora_b.weight.detach()
    x = torch.randn(2, 5, weight.shape[1])
    q_proj.eval()  # no dropout
    torch.testing.assert_close(q_proj(x), x @ weight.T + x @ a.T @ b.T * 2.0, atol=1e-6, rtol=0)
    q_proj.train()  # dropout on the adapter's input only, the same mask as a plain Dropout
    torch.manual_seed(5)
    dropped = F.dropout(x, 0.25, training=True)
    torch.manual_seed(5)
    expected = x @ weight.T + dropped @ a.T @ b.T * 2.0
    torch.testing.assert_close(q_proj(x), expected, atol=1e-6, rtol=0)


def test_only_adapters_train_and_get_gradients():
    model = build_tiny_fusion()
    apply_lora(model, ("q_proj", "v_proj", "output_proj", "w1", "w2", "w3"), rank=2)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(n.endswith(("lora_a.weight", "lora_b.weight")) for n in trainable)
    assert len(trainable) == 2 * 6 * 2
    tokens, encoder_input = images_batch()
    base = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    for _ in range(2):  # B is zero at first: A gets gradients from the second step on
        logits = model(tokens, encoder_input=encoder_input)
        F.cross_entropy(logits.flatten(0, 1), tokens.clamp(max=63).flatten()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
    for name, param in model.named_parameters():
        if name in base:
            assert param.grad is None and torch.equal(param, base[name]), name
    assert all(lora_linears(model)[n].lora_b.weight.abs().sum() > 0 for n in lora_linears(model))


def test_bare_names_match_inside_the_decoder_only_dotted_names_anywhere():
    model = build_tiny_fusion()
    with pytest.raises(ValueError, match=r"targets: 'proj' matches no nn.Linear .*q_proj"):
        apply_lora(model, ("proj",))  # the encoders' `proj` layers are not the decoder's
    assert not lora_linears(model)
    chosen = apply_lora(model, ("*_proj", "encoders.image.proj"), freeze_base=False)
    assert sorted(chosen) == sorted(
        [f"decoder.layers.{i}.attn.{p}_proj" for i in (0, 1) for p in "qkv"]
        + [f"decoder.layers.{i}.attn.output_proj" for i in (0, 1)]
        + ["encoders.image.proj"]
    )
    assert not is_lora_linear(model.encoders["audio"].proj)
    assert all(p.requires_grad for p in model.parameters())  # freeze_base=False


def test_untied_output_and_whole_layers_by_pattern():
    decoder = build_tiny_decoder(tie_word_embeddings=False)
    chosen = apply_lora(decoder, ("output", "layers.1.*"))
    assert sorted(chosen) == sorted(
        ["output"]
        + [f"layers.1.attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "output_proj")]
        + [f"layers.1.mlp.{w}" for w in ("w1", "w2", "w3")]
    )
    # A second call may adapt other layers, never an adapter's own linear layers.
    assert list(apply_lora(decoder, "layers.0.mlp.*")) == [f"layers.0.mlp.w{i}" for i in (1, 2, 3)]
    assert decoder.output.lora_a.weight.requires_grad  # the first call's adapters still train
    assert not decoder.output.weight.requires_grad


def test_shared_layer_is_adapted_once():
    shared = nn.Linear(4, 4)
    holder = nn.ModuleDict({"a": nn.Sequential(shared), "b": nn.Sequential(shared)})
    assert list(apply_lora(holder, ("a.0", "b.0"))) == ["a.0"]
    assert len(shared._forward_hooks) == 1


class Scaled(nn.Linear):
    def forward(self, x):
        return super().forward(x) * 2


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rank": 0}, r"rank: expected a positive int, got 0"),
        ({"rank": True}, r"rank: expected a positive int, got True"),
        ({"rank": 2.0}, r"rank: expected a positive int, got 2.0"),
        ({"alpha": -1}, r"alpha: expected a positive finite number, got -1"),
        ({"alpha": float("nan")}, r"alpha: expected a positive finite number, got nan"),
        ({"dropout": 1.0}, r"dropout: expected a probability in \[0, 1\), got 1.0"),
        ({"targets": ()}, r"targets: expected a non-empty sequence of non-empty strings"),
        ({"targets": ("q_proj", "")}, r"targets: expected a non-empty sequence"),
        ({"targets": ("q_proj", "nope")}, r"targets: 'nope' matches no nn.Linear"),
        ({"targets": "tok_embeddings"}, r"'tok_embeddings' matches no nn.Linear"),
    ],
)
def test_bad_arguments_change_nothing(kwargs, message):
    model = build_tiny_fusion()
    state = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=message):
        apply_lora(model, **kwargs)
    assert not lora_linears(model)
    assert model.state_dict().keys() == state.keys()
    assert all(p.requires_grad for p in model.parameters())  # nothing frozen either


def test_refused_layers_change_nothing():
    decoder = build_tiny_decoder()
    with pytest.raises(TypeError, match=r"targets: expected module-name patterns .* got int"):
        apply_lora(decoder, 3)
    with pytest.raises(TypeError, match=r"model: expected an nn.Module, got dict"):
        apply_lora({}, "q_proj")
    apply_lora(decoder, "q_proj")
    with pytest.raises(ValueError, match=r"'\*' matches 'layers.0.attn.q_proj', which already"):
        apply_lora(decoder, "*")
    assert len(lora_linears(decoder)) == 2  # v_proj etc. were not adapted either
    holder = nn.Sequential(nn.Sequential(Scaled(3, 3)))
    with pytest.raises(ValueError, match=r"'0.0' matches '0.0', which is a Scaled, a subclass"):
        apply_lora(holder, "0.0")
    assert not holder[0][0]._forward_hooks


def test_deepcopy_and_meta_device():
    model = build_tiny_decoder()
    apply_lora(model, rank=2)
    randomize_adapters(model)
    clone = copy.deepcopy(model)
    tokens = text_tokens(1, 6)
    adapted = model(tokens)
    assert torch.equal(clone(tokens), adapted)
    assert len(lora_linears(clone)) == 4
    # Merging the copy removes the copy's hooks (a hook left behind would find no adapter and
    # raise) and leaves the original adapted.
    merge_lora(clone)
    torch.testing.assert_close(clone(tokens), adapted, rtol=1e-5, atol=1e-5)
    assert not lora_linears(clone) and len(lora_linears(model)) == 4
    assert torch.equal(model(tokens), adapted)
    with torch.device("meta"):
        meta = build_tiny_decoder()
    apply_lora(meta, rank=2)
    assert all(p.is_meta for p in meta.parameters())


def test_hugging_face_names_and_all_linear_choose_the_decoder_layers():
    """o_proj, gate_proj, up_proj, down_proj are output_proj, w1, w3, w2 (ours stay valid);
    all-linear is every linear layer of the decoder but its output layer, as peft's, and never
    the encoders' (peft's would take them too)."""
    theirs = apply_lora(build_tiny_fusion(), ("q_proj", "o_proj", "gate_proj", "up_proj"))
    ours = apply_lora(build_tiny_fusion(), ("q_proj", "output_proj", "w1", "w3"))
    assert list(theirs) == list(ours)
    assert list(apply_lora(build_tiny_fusion(), "down_proj")) == [
        f"decoder.layers.{i}.mlp.w2" for i in (0, 1)
    ]
    decoder = build_tiny_decoder(tie_word_embeddings=False)
    everything = apply_lora(decoder, "all-linear")
    names = ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.output_proj", "mlp.w1", "mlp.w2")
    assert sorted(everything) == sorted(
        f"layers.{i}.{n}" for i in (0, 1) for n in (*names, "mlp.w3")
    )
    assert "output" not in everything  # the output layer only when named: "output"
    assert list(apply_lora(decoder, "output")) == ["output"]
    model = build_tiny_fusion()
    chosen = apply_lora(model, ("all-linear", "encoders.image.proj"))
    assert "encoders.image.proj" in chosen and len(chosen) == 2 * 7 + 1
    assert not any(name.startswith("encoders.audio") for name in chosen)


def test_an_unknown_name_lists_the_valid_ones():
    model = build_tiny_fusion()
    with pytest.raises(ValueError, match=r"targets: 'gate' matches no nn\.Linear") as error:
        apply_lora(model, ("q_proj", "gate"))
    message = str(error.value)
    for name in ("q_proj", "k_proj", "v_proj", "o_proj (output_proj)", "gate_proj (w1)"):
        assert name in message
    assert "up_proj (w3)" in message and "down_proj (w2)" in message and "all-linear" in message
    assert not lora_linears(model)  # nothing changed
    untied = build_tiny_decoder(tie_word_embeddings=False)
    with pytest.raises(ValueError, match=r"layers of the decoder: k_proj, output, q_proj"):
        apply_lora(untied, "lm_head")
