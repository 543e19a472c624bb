"""LoRA added to a model's linear layers from outside, without replacing a module.

Each chosen ``nn.Linear`` stays where it is (so ``layers.0.attn.q_proj.weight`` keeps its key)
and gains three children and a forward hook:

- ``lora_a``: ``nn.Linear(in_features, rank, bias=False)``, Kaiming-uniform as ``nn.Linear``;
- ``lora_b``: ``nn.Linear(rank, out_features, bias=False)``, zero, so that a fresh adapter
  changes nothing;
- ``lora_dropout``: ``nn.Dropout(dropout)`` (``nn.Identity`` for 0);
- a forward hook that adds ``lora_b(lora_a(lora_dropout(x))) * alpha / rank`` to the layer's
  output: ``y = x W^T + b + dropout(x) A^T B^T * alpha / rank``.

The adapter's keys are the layer's own plus ``lora_a.weight`` / ``lora_b.weight``, the names
torchtune's ``LoRALinear`` gives them. The hook calls the adapter's modules (never reads their
weights), so FSDP2's per-module plan (the adapter sits in its layer's unit), ``torch.compile``
(hooks are traced), autocast and activation checkpointing see an ordinary module call.
"""

import math
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

import torch
from torch import nn

from fusion._adapters import LORA_MARK
from fusion._validation import check_int
from fusion.decoder import TransformerDecoder
from fusion.decoder.few_rows import is_plain_linear

ADAPTER_CHILDREN = ("lora_a", "lora_b", "lora_dropout")
# The layer's attribute holding the adapter hook's handle (torch.utils.hooks.RemovableHandle).
LORA_HOOK = "lora_hook"
DEFAULT_TARGETS = ("q_proj", "v_proj")
# Hugging Face's names of the decoder's layers that this library names otherwise (q_proj,
# k_proj and v_proj are the same in both).
HF_LAYER_NAMES = {"o_proj": "output_proj", "gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
# peft's name for every linear layer of the language model but its output layer.
ALL_LINEAR = "all-linear"


def _lora_hook(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: torch.Tensor
) -> torch.Tensor:
    """``output + lora_b(lora_a(lora_dropout(x))) * scale``: output ``[..., out_features]``."""
    x = args[0] if args else kwargs["input"]
    a, b, dropout = module.lora_a, module.lora_b, module.lora_dropout
    assert isinstance(a, nn.Module) and isinstance(b, nn.Module) and isinstance(dropout, nn.Module)
    return output + b(a(dropout(x))) * module.__dict__[LORA_MARK]


@dataclass(frozen=True)
class LoRASettings:
    """One adapted layer's adapter: its modules and hyperparameters."""

    lora_a: nn.Linear  # weight [rank, in_features]
    lora_b: nn.Linear  # weight [out_features, rank]
    rank: int
    alpha: float

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def lora_settings(linear: nn.Linear) -> LoRASettings:
    """The adapter of a layer :func:`apply_lora` adapted.

    Raises:
        ValueError: ``linear`` carries no adapter.
    """
    if not is_lora_linear(linear):
        raise ValueError(f"linear: expected a layer with a LoRA adapter, got {linear!r}")
    a, b = linear.get_submodule("lora_a"), linear.get_submodule("lora_b")
    assert isinstance(a, nn.Linear) and isinstance(b, nn.Linear)
    return LoRASettings(a, b, linear.__dict__["lora_rank"], linear.__dict__["lora_alpha"])


def is_lora_linear(module: nn.Module) -> bool:
    """Whether ``module`` is a linear layer :func:`apply_lora` gave an adapter (and
    :func:`~fusion.lora.merge_lora` has not merged yet)."""
    return isinstance(module, nn.Linear) and LORA_HOOK in module.__dict__


def lora_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """The linear layers of ``model`` that carry an adapter: qualified name -> module (the first
    name of a module reachable under several).

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
    found: dict[str, nn.Linear] = {}
    seen: set[int] = set()
    for name, module in model.named_modules():
        if is_lora_linear(module) and id(module) not in seen:
            seen.add(id(module))
            assert isinstance(module, nn.Linear)
            found[name] = module
    return found


def _adapter_modules(model: nn.Module) -> set[int]:
    """ids of the modules that belong to adapters (``lora_a``, ``lora_b``, ``lora_dropout``)."""
    return {
        id(getattr(linear, child))
        for linear in lora_linears(model).values()
        for child in ADAPTER_CHILDREN
    }


def _decoder_scopes(model: nn.Module) -> list[str]:
    """Qualified-name prefixes of the outermost ``TransformerDecoder`` modules in ``model``."""
    scopes: list[str] = []
    for name, module in model.named_modules():
        if isinstance(module, TransformerDecoder):
            prefix = f"{name}." if name else ""
            if not any(prefix.startswith(scope) for scope in scopes):
                scopes.append(prefix)
    return scopes


def _check_targets(targets: object) -> tuple[str, ...]:
    if isinstance(targets, str):
        targets = (targets,)
    if not isinstance(targets, Iterable):
        raise TypeError(
            f"targets: expected module-name patterns (a sequence of str), got "
            f"{type(targets).__name__}"
        )
    patterns = tuple(targets)
    if not patterns or not all(isinstance(p, str) and p for p in patterns):
        raise ValueError(
            f"targets: expected a non-empty sequence of non-empty strings, got {patterns!r}"
        )
    return patterns


def _check_hyperparameters(rank: object, alpha: object, dropout: object) -> None:
    check_int(rank, "rank", low=1, expected="a positive int")
    if (
        isinstance(alpha, bool)
        or not isinstance(alpha, int | float)
        or not math.isfinite(alpha)
        or alpha <= 0
    ):
        raise ValueError(f"alpha: expected a positive finite number, got {alpha!r}")
    if isinstance(dropout, bool) or not isinstance(dropout, int | float) or not 0 <= dropout < 1:
        raise ValueError(f"dropout: expected a probability in [0, 1), got {dropout!r}")


def _output_layers(model: nn.Module) -> set[int]:
    """ids of the output layers (``output``) of the decoders in ``model``."""
    return {
        id(module.output)
        for module in model.modules()
        if isinstance(module, TransformerDecoder) and module.output is not None
    }


def _matches(model: nn.Module, patterns: tuple[str, ...]) -> Iterator[tuple[str, str, nn.Module]]:
    """(pattern, qualified name, module) for every module a pattern matches (see
    :func:`apply_lora` for the rules); adapter modules are never candidates."""
    scopes = _decoder_scopes(model)
    adapters = _adapter_modules(model)
    outputs = _output_layers(model)
    for name, module in model.named_modules(remove_duplicate=False):
        if not name or id(module) in adapters:
            continue
        in_decoder = any(name.startswith(scope) for scope in scopes)
        last = name.rsplit(".", 1)[-1]
        for pattern in patterns:
            if pattern == ALL_LINEAR:
                hit = in_decoder and isinstance(module, nn.Linear) and id(module) not in outputs
            elif "." in pattern:
                hit = fnmatchcase(name, pattern)
            else:
                hit = in_decoder and (
                    fnmatchcase(last, pattern) or last == HF_LAYER_NAMES.get(pattern)
                )
            if hit:
                yield pattern, name, module


def _valid_names(model: nn.Module) -> str:
    """The names a pattern without a dot may take for ``model``, for errors."""
    scopes = _decoder_scopes(model)
    adapters = _adapter_modules(model)
    ours = {
        name.rsplit(".", 1)[-1]
        for name, module in model.named_modules()
        if is_plain_linear(module)
        and id(module) not in adapters
        and any(name.startswith(scope) for scope in scopes)
    }
    theirs = {alias: name for alias, name in HF_LAYER_NAMES.items() if name in ours}
    named = [f"{alias} ({name})" for alias, name in theirs.items()]
    rest = sorted(ours - set(theirs.values()))
    return ", ".join([*rest, *named, ALL_LINEAR]) if ours else "none (no decoder)"


def apply_lora(
    model: nn.Module,
    targets: Iterable[str] | str = DEFAULT_TARGETS,
    *,
    rank: int = 8,
    alpha: float = 16.0,
    dropout: float = 0.0,
    freeze_base: bool = True,
) -> dict[str, nn.Linear]:
    """Give the linear layers ``targets`` name a LoRA adapter, in place (see the module
    docstring for what is added). Apply it before sharding (FSDP2) or compiling; after
    tensor parallelism it is refused.

    Which layers: a pattern without a dot (``"q_proj"``, ``"w*"``, ``"output"``) is matched
    (``fnmatch``, case-sensitive) against the last name of every ``nn.Linear`` inside a
    :class:`~fusion.decoder.TransformerDecoder` of ``model`` (the decoder of an
    ``EarlyFusion``); encoders (vision tower, connector) are never matched by one. A pattern
    with a dot is matched against the whole qualified name within ``model``, anywhere:
    ``"decoder.layers.0.*"``, ``"encoders.image.connector.*"``. Layers of the decoder:
    ``attn.q_proj``, ``attn.k_proj``, ``attn.v_proj``, ``attn.output_proj``, ``mlp.w1``,
    ``mlp.w2``, ``mlp.w3``, and ``output`` when untied.

    Hugging Face's names of the decoder's layers work too (:data:`HF_LAYER_NAMES`):
    ``o_proj`` is ``output_proj``, ``gate_proj`` ``w1``, ``up_proj`` ``w3`` and ``down_proj``
    ``w2``. ``"all-linear"`` is peft's: every ``nn.Linear`` of the decoder except its output
    layer (the language model's only: unlike peft's, never the vision tower or connector).

    Args:
        model: any module holding the layers (a decoder, an ``EarlyFusion``, a container).
        targets: module-name patterns; a single string is one pattern. Default: q and v.
        rank: the adapter's inner width ``r`` (a positive int).
        alpha: the scale numerator: the adapter's output is multiplied by ``alpha / rank``.
        dropout: dropout probability on the adapter's input, in training mode only.
        freeze_base: set ``requires_grad=False`` on every parameter of ``model`` that is not an
            adapter's (encoders included; unfreeze what else should train afterwards).
            New adapters always train; those of earlier calls keep their setting.

    Returns:
        the layers given adapters now: qualified name -> module (each once).

    Raises:
        TypeError: ``model`` not an ``nn.Module``; ``targets`` not a sequence of strings.
        ValueError, before anything changes: ``rank``, ``alpha`` or ``dropout`` out of range;
            a pattern that matches no ``nn.Linear`` (the layers it could match are listed); a
            matched layer that already has an adapter, is a subclass of ``nn.Linear`` other
            than the decoder's ``FewRowsLinear`` (whose ``forward`` may not be ``F.linear``),
            or holds a sharded weight (a ``DTensor``: tensor parallelism or FSDP2 applied
            already).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
    patterns = _check_targets(targets)
    _check_hyperparameters(rank, alpha, dropout)
    if not isinstance(freeze_base, bool):
        raise TypeError(f"freeze_base: expected a bool, got {type(freeze_base).__name__}")
    chosen = _select(model, patterns)
    if freeze_base:  # everything but adapters, those of earlier calls included
        adapters = {
            id(param)
            for linear in lora_linears(model).values()
            for child in ("lora_a", "lora_b")
            for param in linear.get_submodule(child).parameters()
        }
        for param in model.parameters():
            if id(param) not in adapters:
                param.requires_grad_(False)
    for module in chosen.values():
        _add_adapter(module, rank, float(alpha), float(dropout))
    return chosen


def select_lora_layers(model: nn.Module, targets: Iterable[str] | str) -> dict[str, nn.Linear]:
    """The layers :func:`apply_lora` would give adapters for ``targets`` (same rules, same
    errors), without changing anything: qualified name -> module, each once.

    Raises:
        TypeError, ValueError: as :func:`apply_lora` does for ``model`` and ``targets``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
    return _select(model, _check_targets(targets))


def _select(model: nn.Module, patterns: tuple[str, ...]) -> dict[str, nn.Linear]:
    """The layers ``patterns`` name (see :func:`apply_lora`), checked: each pattern matches a
    plain (:func:`~fusion.decoder.few_rows.is_plain_linear`), unadapted, unsharded
    ``nn.Linear``."""
    chosen: dict[str, nn.Linear] = {}
    hit: set[str] = set()
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    for pattern, name, module in _matches(model, patterns):
        if not isinstance(module, nn.Linear):
            continue  # "decoder.layers.0.*" also matches the layer, its attention, ...
        problem = None
        if not is_plain_linear(module):
            problem = f"is a {type(module).__name__}, a subclass of nn.Linear"
        elif is_lora_linear(module):
            problem = "already has a LoRA adapter"
        elif dtensor is not None and isinstance(module.weight, dtensor):
            problem = (
                "holds a sharded weight (DTensor): apply LoRA before FSDP2 or tensor parallelism"
            )
        if problem is not None:
            raise ValueError(f"targets: {pattern!r} matches {name!r}, which {problem}")
        hit.add(pattern)
        if all(module is not other for other in chosen.values()):
            chosen[name] = module
    missing = [p for p in patterns if p not in hit]
    if missing:
        available = [
            name
            for name, m in model.named_modules()
            if is_plain_linear(m) and id(m) not in _adapter_modules(model)
        ]
        raise ValueError(
            f"targets: {missing[0]!r} matches no nn.Linear of the model. A name without a dot "
            f"names layers of the decoder: {_valid_names(model)}; one with a dot is matched "
            f"against the whole name, e.g. 'encoders.image.*'. Linear layers: "
            f"{available[:8]}{' ...' if len(available) > 8 else ''}"
        )
    return chosen


def _add_adapter(linear: nn.Linear, rank: int, alpha: float, dropout: float) -> None:
    weight = linear.weight
    factory = {"device": weight.device, "dtype": weight.dtype}
    linear.lora_a = nn.Linear(linear.in_features, rank, bias=False, **factory)
    linear.lora_b = nn.Linear(rank, linear.out_features, bias=False, **factory)
    nn.init.zeros_(linear.lora_b.weight)  # a fresh adapter leaves the output unchanged
    linear.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
    hook = linear.register_forward_hook(_lora_hook, with_kwargs=True)
    # Plain attributes (not state): read by the hook, save_adapter and merge_lora. The hook's
    # handle lives in the layer, so a deep copy's handle removes the copy's hook.
    linear.__dict__.update(
        {"lora_rank": rank, "lora_alpha": alpha, LORA_MARK: alpha / rank, LORA_HOOK: hook}
    )
