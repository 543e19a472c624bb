"""What each --train mode trains, and activation checkpointing that changes no key, output or
gradient."""

import torch

from fusion import EarlyFusion
from fusion.training.modules import checkpoint_activations, trainable_parameters
from recipes.finetune.config import FinetuneConfig
from recipes.finetune.trainer import build_model


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
