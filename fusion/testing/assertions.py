"""Assertions for users' own fusion models: checkpoint keys and state-dict round trips."""

import copy
import io

import torch
from torch import nn

from fusion._validation import is_dtensor
from fusion.early_fusion import EarlyFusion


def find_prefix(root: nn.Module, module: nn.Module) -> str:
    """The state-dict key prefix of ``module`` inside ``root`` (``""`` for the root itself).

    Raises:
        ValueError: ``module`` is not inside ``root``.
    """
    for name, candidate in root.named_modules(remove_duplicate=False):
        if candidate is module:
            return f"{name}." if name else ""
    raise ValueError(
        f"module: expected a submodule of root, got a {type(module).__name__} outside it"
    )


def assert_checkpoint_compatible(
    root: nn.Module, fusion_model: EarlyFusion, plain_decoder: nn.Module
) -> None:
    """Assert that ``fusion_model``'s decoder checkpoints exactly like ``plain_decoder``.

    ``plain_decoder`` is a decoder of the same kind as ``fusion_model.decoder`` (this
    library's, a torchtune-style one or a Hugging Face model). Sharded tensors (FSDP2's
    DTensors) are compared whole, and the plain state is sharded like the decoder's for the
    strict load (a collective: call it on every rank).

    ``fusion_model`` (an :class:`fusion.EarlyFusion`, somewhere inside ``root``, at any
    wrapping prefix) must hold, for every key ``k`` of ``plain_decoder.state_dict()``, the key
    ``prefix + "decoder." + k`` of ``root.state_dict()`` with a bitwise-identical tensor, and no
    other ``decoder.`` key; and ``plain_decoder``'s state dict must load with ``strict=True``
    into a copy of ``fusion_model.decoder``.

    Raises:
        AssertionError: naming the first key that differs.
    """
    decoder_prefix = find_prefix(root, fusion_model) + "decoder."
    root_state = root.state_dict()
    plain_state = plain_decoder.state_dict()
    expected = {decoder_prefix + key for key in plain_state}
    actual = {key for key in root_state if key.startswith(decoder_prefix)}
    assert actual == expected, (
        f"decoder keys under {decoder_prefix!r} differ from the plain decoder's: "
        f"missing {sorted(expected - actual)[:5]}, unexpected {sorted(actual - expected)[:5]}"
    )
    for key, tensor in plain_state.items():
        assert torch.equal(_whole(root_state[decoder_prefix + key]), tensor), (
            f"{decoder_prefix + key} differs from the plain decoder's {key}"
        )
    decoder = copy.deepcopy(fusion_model.decoder)
    own = decoder.state_dict()
    placed = {key: _placed_like(tensor, own.get(key)) for key, tensor in plain_state.items()}
    decoder.load_state_dict(placed, strict=True)


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if is_dtensor(tensor) else tensor  # type: ignore[attr-defined]


def _placed_like(tensor: torch.Tensor, target: torch.Tensor | None) -> torch.Tensor:
    """``tensor`` sharded as ``target`` is, when that is a DTensor."""
    if target is None or not is_dtensor(target):
        return tensor
    from torch.distributed.tensor import distribute_tensor  # only once something is sharded

    return distribute_tensor(tensor, target.device_mesh, target.placements)  # type: ignore[attr-defined]


def assert_state_dict_round_trip(source: nn.Module, fresh: nn.Module) -> None:
    """Save ``source``'s state dict (``torch.save``), load it with ``weights_only=True`` and
    ``strict=True`` into ``fresh`` (a newly built module of the same structure), and assert
    every tensor is restored bitwise.

    Raises:
        AssertionError: naming the first key that differs.
    """
    buffer = io.BytesIO()
    torch.save(source.state_dict(), buffer)
    buffer.seek(0)
    fresh.load_state_dict(torch.load(buffer, weights_only=True), strict=True)
    restored = fresh.state_dict()
    for key, tensor in source.state_dict().items():
        assert torch.equal(restored[key], tensor), f"{key} was not restored bitwise"
