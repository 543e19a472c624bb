"""merge_lora folds adapters into the weights (same logits, the plain model's keys again); the
hook works under torch.compile and bfloat16 autocast."""

import pytest
import torch
import torch.nn.functional as F
from lora.test_apply import images_batch, randomize_adapters

from fusion.lora import apply_lora, is_lora_linear, lora_linears, merge_lora
from helpers import build_tiny_decoder, build_tiny_fusion

TARGETS = ("q_proj", "v_proj", "output_proj", "w1", "w2", "w3", "encoders.image.proj")


def adapted_fusion():
    model = build_tiny_fusion()
    apply_lora(model, TARGETS, rank=4, alpha=8.0, dropout=0.1)
    randomize_adapters(model)
    return model.eval()


def test_merge_keeps_the_logits_and_restores_the_plain_model():
    model = adapted_fusion()
    tokens, encoder_input = images_batch()
    before = model(tokens, encoder_input=encoder_input)
    plain_keys = list(build_tiny_fusion().state_dict())
    assert merge_lora(model) is model
    assert not lora_linears(model)
    assert list(model.state_dict()) == plain_keys
    for module in model.modules():
        assert not module._forward_hooks and not hasattr(module, "lora_scale")
    torch.testing.assert_close(
        model(tokens, encoder_input=encoder_input), before, atol=1e-5, rtol=0
    )
    assert merge_lora(model) is model  # nothing left to merge: no change


def test_merge_in_bfloat16_and_refusals():
    decoder = build_tiny_decoder()
    apply_lora(decoder, "q_proj", rank=2)
    randomize_adapters(decoder)
    q_proj = decoder.layers[0].attn.q_proj
    expected = q_proj.weight.float() + q_proj.lora_b.weight @ q_proj.lora_a.weight * 8.0
    decoder.to(torch.bfloat16)
    merge_lora(decoder)
    assert q_proj.weight.dtype == torch.bfloat16
    torch.testing.assert_close(q_proj.weight.float(), expected, atol=2e-2, rtol=1e-2)
    with torch.device("meta"):
        meta = build_tiny_decoder()
    apply_lora(meta, "q_proj")
    with pytest.raises(ValueError, match=r"model: 'layers.0.attn.q_proj' is on the meta device"):
        merge_lora(meta)
    assert len(lora_linears(meta)) == 2  # nothing merged
    with pytest.raises(TypeError, match=r"model: expected an nn.Module, got str"):
        merge_lora("model")


def test_compiled_forward_and_backward_match_eager():
    # One decoder layer (attention and MLP adapted) keeps the compile short; the hooks are
    # traced into the graph (fullgraph: no graph break).
    decoder = build_tiny_decoder()
    apply_lora(decoder, TARGETS[:-1], rank=4, alpha=8.0)
    randomize_adapters(decoder)
    model = decoder.layers[0]
    x = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(0))
    positions = torch.arange(6)
    eager = model(x, mask=None, input_pos=positions)
    eager.square().mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    out = compiled(x, mask=None, input_pos=positions)
    out.square().mean().backward()
    torch.testing.assert_close(out, eager, atol=1e-5, rtol=1e-5)
    assert grads.keys() == {n for n, p in model.named_parameters() if p.requires_grad}
    for name, param in model.named_parameters():
        if name in grads:
            torch.testing.assert_close(param.grad, grads[name], atol=1e-5, rtol=1e-4, msg=name)


def test_autocast_bfloat16_trains_the_adapters():
    model = build_tiny_fusion()
    apply_lora(model, ("q_proj", "v_proj"), rank=2)
    randomize_adapters(model)
    tokens, encoder_input = images_batch()
    reference = model(tokens, encoder_input=encoder_input)
    dtypes = []
    model.decoder.layers[0].attn.q_proj.register_forward_hook(
        lambda module, args, output: dtypes.append(output.dtype)  # after the adapter's hook
    )
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(tokens, encoder_input=encoder_input)
    assert dtypes == [torch.bfloat16]  # the adapted output, under autocast
    assert (logits.float() - reference).norm() < 0.05 * reference.norm()  # bf16 rounding
    F.cross_entropy(logits.float().flatten(0, 1), tokens.clamp(max=63).flatten()).backward()
    for linear in lora_linears(model).values():
        assert is_lora_linear(linear)
        assert linear.lora_a.weight.grad.dtype == torch.float32
        assert linear.lora_a.weight.grad.abs().sum() > 0
