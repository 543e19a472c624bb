"""Moving state dicts between an ``EarlyFusion`` model and its plain decoder.

``EarlyFusion`` keeps the decoder as ``self.decoder``, so its checkpoint holds the decoder's
keys unchanged under ``decoder.``. Both directions are one line::

    decoder.load_state_dict(select_prefix(fusion_model.state_dict(), "decoder."))
    fusion_model.decoder.load_state_dict(decoder_state_dict)
"""

from collections.abc import Mapping

import torch


def select_prefix(state_dict: Mapping[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The entries whose key starts with ``prefix``, with the prefix removed.

    Keys outside ``prefix`` (e.g. the encoders' ``encoders.*``) are not part of the result, by
    design: this selects a sub-model's checkpoint.

    Raises:
        TypeError: ``state_dict`` not a mapping or ``prefix`` not a string.
        ValueError: a key that is not a string; ``prefix`` does not end with ``"."``, or no key
            starts with it.
    """
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict: expected a mapping, got {type(state_dict).__name__}")
    if not isinstance(prefix, str):
        raise TypeError(f"prefix: expected a str, got {type(prefix).__name__}")
    for key in state_dict:
        if not isinstance(key, str):
            raise ValueError(f"state_dict: expected string keys, got {key!r}")
    if not prefix.endswith("."):
        raise ValueError(f"prefix: expected a module path ending with '.', got {prefix!r}")
    selected = {k.removeprefix(prefix): v for k, v in state_dict.items() if k.startswith(prefix)}
    if not selected:
        first = sorted(state_dict)[:3]
        raise ValueError(f"state_dict: no key starts with {prefix!r} (keys begin {first})")
    return selected
