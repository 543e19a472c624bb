"""Layer names both ways between this library's models and transformers' classes as peft sees
them (:class:`_Model`), and peft's ``target_modules`` rule over them: the list or pattern
written for the layers adapted (:func:`_target_modules`), and the check of a file's list
against its weights (:func:`_check_targets`)."""

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from torch import nn

from fusion._wrappers import unwrap
from fusion.checkpoint.errors import CheckpointError
from fusion.checkpoint.hf_model import HfDirectory
from fusion.checkpoint.keys import fusion_key_to_hf, hf_key_to_fusion, rope_heads
from fusion.decoder import MultiHeadAttention, TransformerDecoder
from fusion.decoder.few_rows import is_plain_linear
from fusion.early_fusion import EarlyFusion
from fusion.families import Family, family_of
from fusion.lora.apply import ADAPTER_CHILDREN, lora_linears
from fusion.lora.peft_config import ADAPTER_WEIGHTS, PeftLoraConfig

_PREFIX = "base_model.model."  # peft's prefix of every saved key (PeftModel -> LoraModel)


@dataclass(frozen=True)
class _Family:
    """A model family as peft sees it: transformers' class of one of its model types, and
    where that class keeps its layers in memory (peft's names)."""

    family: Family
    model_type: str

    @property
    def kind(self) -> str:
        return self.family.name

    @property
    def architecture(self) -> str:  # transformers' class
        return self.family.architectures[self.model_type]

    @property
    def library(self) -> str:  # the module defining it (peft's auto_mapping)
        return self.family.transformers_module(self.model_type)

    @property
    def text_only(self) -> bool:  # a decoder alone (Llama, Qwen3.5's or Gemma 3's text stack)
        return not self.family.encoder_types

    @property
    def text(self) -> str:  # the prefix of the text model's layers, where a Llama has "model."
        return self.family.peft_text

    @property
    def encoder(self) -> tuple[tuple[str, str], ...]:  # our prefix -> transformers' prefix
        return self.family.peft_encoder

    def named_by(self, base: str | HfDirectory | None) -> "_Family":
        """This family as the base directory's ``config.json`` names it, when that is another
        model type of the same family with a class of its own in transformers (SmolVLM is an
        Idefics3 to this library; same layer names); an :class:`HfDirectory`'s parsed config
        is used as it is."""
        if base is None or not os.path.isdir(base):
            return self
        try:
            model_type = HfDirectory.of(base, "base_model_name_or_path").config.get("model_type")
        except CheckpointError:  # not ours to judge here: the class stays the model's
            return self
        if model_type == self.model_type or model_type not in self.family.model_types:
            return self
        return replace(self, model_type=model_type)


@dataclass(frozen=True)
class _Model:
    """A model of this library, unwrapped, with transformers' class it corresponds to."""

    module: nn.Module  # the model inside torch.compile / DDP wrappers
    family: _Family
    decoder: str  # the decoder's prefix in ``module``: "" (a bare decoder) or "decoder."

    def hf_name(self, ours: str) -> str | None:
        """transformers' in-memory name of our linear layer ``ours``; None if it has none."""
        if self.family.text_only or ours.startswith("decoder."):
            if not ours.startswith(self.decoder):
                return None
            try:
                name = fusion_key_to_hf(ours.removeprefix(self.decoder) + ".weight")
            except KeyError:
                return None
            name = name.removesuffix(".weight")
            return self.family.text + name.removeprefix("model.") if name != "lm_head" else name
        for mine, theirs in self.family.encoder:
            if ours.startswith(mine):
                return theirs + ours.removeprefix(mine)
        return None

    def our_name(self, hf: str) -> str | None:
        """Our name of the layer transformers names ``hf`` (any layout the checkpoint loaders
        read); None for a layer this library has no name for."""
        try:
            if self.family.text_only:
                key: str | None = self.decoder + hf_key_to_fusion(hf + ".weight")
            else:
                key = self.family.family.layout.ours(hf + ".weight")
        except KeyError:
            return None
        return None if key is None else key.removesuffix(".weight")

    def rope_rows(self, ours: str) -> int | None:
        """The head count whose rows the decoder permutes in layer ``ours`` (q_proj, k_proj);
        None for another layer."""
        if not self.family.family.layout.permute_rope:  # rotates in transformers' layout
            return None
        if not ours.startswith(self.decoder) or "." not in ours:
            return None
        parent = self.module.get_submodule(ours.rsplit(".", 1)[0])
        if not isinstance(parent, MultiHeadAttention):
            return None
        key = ours.removeprefix(self.decoder) + ".weight"
        return rope_heads(key, parent.num_heads, parent.num_kv_heads)

    def linears(self) -> dict[str, nn.Linear]:
        """Our plain linear layers (not adapters' own) that transformers has a name for."""
        adapters = {
            id(getattr(linear, child))
            for linear in lora_linears(self.module).values()
            for child in ADAPTER_CHILDREN
        }
        return {
            name: module
            for name, module in self.module.named_modules()
            if is_plain_linear(module)
            and id(module) not in adapters
            and self.hf_name(name) is not None
        }


def _describe(model: object) -> _Model:
    inner = unwrap(model)
    if isinstance(inner, TransformerDecoder | EarlyFusion):
        family = family_of(inner)  # a TypeError naming the families and the encoders
        peft = _Family(family, family.model_type_of(inner))
        return _Model(inner, peft, "" if isinstance(inner, TransformerDecoder) else "decoder.")
    raise TypeError(
        "model: expected an EarlyFusion or a TransformerDecoder (possibly wrapped by "
        f"torch.compile or DDP), got {type(model).__name__}"
    )


def _listed(names: tuple[str, ...], module: str) -> bool:
    """peft's rule for a list of names: the module's whole name, or its last names."""
    return module in names or any(module.endswith(f".{name}") for name in names)


def _linear(target: _Model, ours: str) -> nn.Linear:
    linear = target.module.get_submodule(ours)
    assert isinstance(linear, nn.Linear)
    return linear


def _get_linear(model: nn.Module, name: str | None) -> nn.Linear | None:
    if name is None:
        return None
    try:
        module = model.get_submodule(name)
    except AttributeError:
        return None
    return module if is_plain_linear(module) else None


def _literal(name: str) -> str:
    """A pattern for :func:`apply_lora` that matches the layer ``name`` only (module names
    hold no ``fnmatch`` wildcards; ``[`` is escaped anyway)."""
    return re.sub(r"([*?\[])", r"[\1]", name)


def _check_targets(
    config: PeftLoraConfig, target: _Model, adapted: Mapping[str, str], file: Path
) -> None:
    """A list of ``target_modules`` (or ``"all-linear"``) names exactly the layers the weights
    adapt (``adapted``: our name -> the file's), by peft's rule over our model's linear layers;
    a regular expression is not evaluated."""
    targets, excluded = config.target_modules, config.exclude_modules
    if isinstance(excluded, str) or not (isinstance(targets, tuple) or targets == "all-linear"):
        return

    listed = targets if isinstance(targets, tuple) else ()

    def chosen(names: set[str]) -> bool:  # a layer's names: the file's, and transformers' now
        if targets == "all-linear":  # peft's: every linear layer but the output layer
            hit = "lm_head" not in names
        else:
            hit = any(_listed(listed, name) for name in names)
        return hit and not (excluded and any(_listed(excluded, name) for name in names))

    layers = set(target.linears()) | set(adapted)
    expected = {
        ours
        for ours in layers
        if chosen({n for n in (target.hf_name(ours), adapted.get(ours)) if n is not None})
    }
    if expected != set(adapted):
        extra = sorted(filter(None, map(target.hf_name, expected - set(adapted))))
        missing = sorted(adapted[ours] for ours in set(adapted) - expected)
        raise CheckpointError(
            file,
            "target_modules",
            f"names other layers than {ADAPTER_WEIGHTS} adapts: targeted without weights "
            f"{extra[:4]}, weights not targeted {missing[:4]}",
        )


def _target_modules(target: _Model, adapted: set[str]) -> list[str] | str:
    """peft's ``target_modules`` for exactly the layers ``adapted`` (transformers' names):
    checked against peft's matching rule over every layer of the model."""
    everything = {
        hf for ours in target.linears() if (hf := target.hf_name(ours)) is not None
    } | adapted
    text = target.family.text
    layer = re.compile(re.escape(text) + r"layers\.\d+\.(.+)")
    tails = {m.group(1) for name in adapted if (m := layer.fullmatch(name))}
    per_layer = {name for name in everything if (m := layer.fullmatch(name)) and m[1] in tails}
    if not per_layer <= adapted:  # some decoder layers only: every layer by name
        tails, per_layer = set(), set()
    one_by_one = sorted(adapted - per_layer)
    if target.family.text_only:
        listed = sorted({tail.rsplit(".", 1)[-1] for tail in tails} | set(one_by_one))
        if {name for name in everything if _listed(tuple(listed), name)} == adapted:
            return listed
        return sorted(adapted)  # exact names match themselves only
    parts = []
    if tails:
        choices = "|".join(re.escape(tail) for tail in sorted(tails))
        parts.append(re.escape(text) + rf"layers\.\d+\.(?:{choices})")
    parts += [re.escape(name) for name in one_by_one]
    pattern = parts[0] if len(parts) == 1 else "|".join(f"(?:{part})" for part in parts)
    if {name for name in everything if re.fullmatch(pattern, name)} == adapted:
        return pattern
    return "|".join(re.escape(name) for name in sorted(adapted))
