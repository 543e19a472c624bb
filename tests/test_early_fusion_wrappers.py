"""EarlyFusion inside real PyTorch wrappers: they work, and the decoder's keys stay the plain
decoder's under ``decoder.`` (plus the wrapper's own prefix)."""

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    apply_activation_checkpointing,
)
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
)
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from fusion.decoder import TransformerSelfAttentionLayer
from fusion.testing import assert_checkpoint_compatible
from helpers import FEATURES, IMAGE_ID, build_tiny_decoder, build_tiny_fusion, text_tokens

FULL = StateDictOptions(full_state_dict=True)


@pytest.fixture(scope="module")
def process_group(tmp_path_factory):
    """A one-process gloo group: enough for DDP, FSDP2 and distributed state dicts on CPU."""
    store = tmp_path_factory.mktemp("dist") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def batch():
    tokens = text_tokens(2, 8)
    tokens[0, 2:4] = IMAGE_ID
    features = torch.randn(2, 1, FEATURES, generator=torch.Generator().manual_seed(0))
    return tokens, {"image": {"features": features}}


def assert_decoder_keys(state: dict, prefix: str = "") -> None:
    plain = build_tiny_decoder().state_dict()
    decoder_keys = {k for k in state if k.startswith(prefix + "decoder.")}
    assert decoder_keys == {prefix + "decoder." + k for k in plain}
    for key, tensor in plain.items():
        assert torch.equal(state[prefix + "decoder." + key], tensor), key


def test_torch_compile():
    model = build_tiny_fusion()
    tokens, encoder_input = batch()
    expected = model(tokens, encoder_input=encoder_input)
    compiled = torch.compile(model, backend="aot_eager")
    torch.testing.assert_close(compiled(tokens, encoder_input=encoder_input), expected)
    assert_checkpoint_compatible(compiled, model, build_tiny_decoder())
    assert_decoder_keys(compiled.state_dict(), "_orig_mod.")


def test_activation_checkpointing():
    model = build_tiny_fusion(decoder_trainable=True)
    tokens, encoder_input = batch()
    expected = model(tokens, encoder_input=encoder_input)
    apply_activation_checkpointing(
        model, check_fn=lambda m: isinstance(m, TransformerSelfAttentionLayer)
    )
    out = model(tokens, encoder_input=encoder_input)
    torch.testing.assert_close(out, expected)
    out.sum().backward()
    assert model.decoder.tok_embeddings.weight.grad is not None
    assert_checkpoint_compatible(model, model, build_tiny_decoder())


def test_distributed_data_parallel(process_group):
    model = build_tiny_fusion(decoder_trainable=True, encoders_trainable=True)
    tokens, encoder_input = batch()
    expected = model(tokens, encoder_input=encoder_input)
    ddp = DistributedDataParallel(model)
    out = ddp(tokens, encoder_input=encoder_input)
    torch.testing.assert_close(out, expected)
    out.sum().backward()
    assert_checkpoint_compatible(ddp, model, build_tiny_decoder())
    assert_decoder_keys(ddp.state_dict(), "module.")
    assert_decoder_keys(get_model_state_dict(ddp))  # the distributed API strips "module."


def test_fully_shard(process_group):
    model = build_tiny_fusion(decoder_trainable=True)
    tokens, encoder_input = batch()
    expected = model(tokens, encoder_input=encoder_input)
    for layer in model.decoder.layers:
        fully_shard(layer)
    fully_shard(model)
    out = model(tokens, encoder_input=encoder_input)
    torch.testing.assert_close(out, expected)
    out.sum().backward()
    assert {k for k in model.state_dict() if k.startswith("decoder.")} == {
        f"decoder.{k}" for k in build_tiny_decoder().state_dict()
    }
    assert_decoder_keys(get_model_state_dict(model, options=FULL))


def test_distributed_state_dict_api(process_group):
    model = build_tiny_fusion(decoder_trainable=True)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    tokens, encoder_input = batch()
    model(tokens, encoder_input=encoder_input).sum().backward()
    optimizer.step()

    model_state, optim_state = get_state_dict(model, optimizer)
    assert set(model_state) == set(model.state_dict())
    stepped = {name for name, p in model.named_parameters() if p.grad is not None}
    assert set(optim_state["state"]) == stepped  # optimizer state keyed by our names

    fresh = build_tiny_fusion(seed=7)
    set_model_state_dict(fresh, copy.deepcopy(model_state))
    assert torch.equal(
        fresh(tokens, encoder_input=encoder_input), model(tokens, encoder_input=encoder_input)
    )

    plain = build_tiny_decoder(seed=3)
    prefixed = {f"decoder.{k}": v for k, v in plain.state_dict().items()}
    set_model_state_dict(fresh, prefixed, options=StateDictOptions(strict=False))
    for key, tensor in plain.state_dict().items():
        assert torch.equal(fresh.decoder.state_dict()[key], tensor)
