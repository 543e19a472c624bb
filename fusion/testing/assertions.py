"""Assertions for users' own fusion models: checkpoint keys and state-dict round trips."""

import copy
import io

import torch
from torch import nn

from fusion.decoder import TransformerDecoder
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
    root: nn.Module, fusion_model: EarlyFusion, plain_decoder: TransformerDecoder
) -> None:
    """Assert that ``fusion_model``'s decoder checkpoints exactly like ``plain_decoder``.

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
        assert torch.equal(root_state[decoder_prefix + key], tensor), (
            f"{decoder_prefix + key} differs from the plain decoder's {key}"
        )
    copy.deepcopy(fusion_model.decoder).load_state_dict(plain_state, strict=True)


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
