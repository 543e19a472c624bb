"""What each --train mode trains, and activation checkpointing that changes no key, output or
gradient."""

import torch

from fusion import EarlyFusion
from fusion.training.modules import checkpoint_activations, trainable_parameters
from recipes.finetune.config import FinetuneConfig
from recipes.finetune.model import build_model


def trained(model_dir, **settings) -> tuple[torch.nn.Module, set[str]]:
    config = FinetuneConfig(
        model=str(model_dir), data="d", output_dir="o", max_seq_len=128, **settings
    )
    model = build_model(config)
    return model, {n for n, p in model.named_parameters() if p.requires_grad}


def test_what_each_mode_trains(model_dirs):
    plain = {n for n, _ in trained(model_dirs["llava"], train="full")[0].named_parameters()}
    _, lora = trained(model_dirs["llava"], train="lora", lora_targets="q_proj,w2")
    assert lora and all(".lora_a." in n or ".lora_b." in n for n in lora)
    assert {n.split(".")[-3] for n in lora} == {"q_proj", "w2"}
    assert all(n.startswith("decoder.") for n in lora)

    _, projector = trained(model_dirs["llava"], train="projector")
    assert projector and all(".multi_modal_projector." in n for n in projector)

    _, full = trained(model_dirs["llava"], train="full")
    assert {n for n in plain if n.startswith("decoder.")} <= full
    assert projector <= full and not any(".vision_tower." in n for n in full)
    _, everything = trained(model_dirs["llava"], train="full", train_vision=True)
    assert everything == plain


def test_activation_checkpointing_changes_no_key_output_or_gradient(model_dirs):
    model, _ = trained(model_dirs["llava"], train="full")
    assert isinstance(model, EarlyFusion)
    keys = list(model.state_dict())
    tokens = torch.randint(5, 60, (2, 10))

    def run() -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        model.zero_grad(set_to_none=True)
        logits = model(tokens)
        logits.square().mean().backward()
        return logits.detach(), [
            p.grad for p in trainable_parameters(model)
        ]  # text only: no grad for the projector

    expected, grads = run()
    checkpoint_activations(model)
    got, checkpointed = run()
    assert list(model.state_dict()) == keys
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert sum(g is not None for g in grads) > len(grads) // 2
    for a, b in zip(checkpointed, grads, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def saved_for_backward(model: EarlyFusion, module: torch.nn.Module) -> tuple[int, torch.Tensor]:
    """How many tensors autograd keeps from ``module``'s forward (inside the model's forward on
    one 16 x 16 image), and the image's rows the merge receives."""
    inside, saved = [0], [0]  # the tower's modules running now (the encoder may call its parts)
    for part in module.modules():
        part.register_forward_pre_hook(lambda *_: inside.__setitem__(0, inside[0] + 1))
        part.register_forward_hook(lambda *_: inside.__setitem__(0, inside[0] - 1))

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved[0] += inside[0] > 0
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        rows = model.encode({"image": {"pixel_values": torch.randn(1, 3, 16, 16)}})["image"]
    assert isinstance(rows, torch.Tensor)
    return saved[0], rows


def test_frozen_parts_cost_only_their_forward(model_dirs):
    """A frozen vision tower keeps no activation for backward in any --train mode that
    freezes it, and an encoder with nothing to train (lora) hands the merge rows without a
    graph; training the tower (--train-vision) does keep them, so the count can fail."""
    for settings in ({"train": "lora"}, {"train": "projector"}, {"train": "full"}):
        model, _ = trained(model_dirs["llava"], **settings)
        assert isinstance(model, EarlyFusion)
        encoder = model.encoders["image"]
        count, rows = saved_for_backward(model, encoder.vision_tower)
        assert count == 0, settings
        assert rows.requires_grad == (settings["train"] != "lora"), settings
    model, _ = trained(model_dirs["llava"], train="full", train_vision=True)
    assert isinstance(model, EarlyFusion)
    assert saved_for_backward(model, model.encoders["image"].vision_tower)[0] > 0
