"""What a model family is: the one object the generic loader, saver, exporter and peft
converter look up instead of branching on a family's name.

A family (:class:`Family`) holds its ``config.json`` model types and transformers' class names,
the config mapping both ways (``config.json`` -> :class:`ModelSpec` -> the model, and the model
-> ``config.json``), where its weights sit in a checkpoint (:class:`~fusion.hf.KeyLayout`) and
in transformers' in-memory model (peft's names), and the encoders it builds (so that a model
tells its family). Each family is one module of :mod:`fusion.families`; the registry lists
them.
"""

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fusion._validation import is_int
from fusion.early_fusion import EarlyFusion
from fusion.hf.config import CONFIG_NAME, ConfigReader
from fusion.hf.errors import short_repr
from fusion.hf.layout import KeyLayout


@dataclass
class ModelSpec:
    """What a ``config.json`` describes, every value checked, in this library's terms.

    Attributes:
        family: the family that read it.
        model_type: the config's ``model_type`` (a family may hold several).
        text: the text decoder's :func:`fusion.models.llama3_2` keyword arguments.
        vision: the vision tower's keyword arguments (empty for a text-only family).
        image_token_id: the placeholder id of image rows (None for a text-only family).
        options: the family builder's other keyword arguments.
        text_prefix: where ``config.json`` keeps the text settings (named in errors).
    """

    family: "Family"
    model_type: str
    text: dict[str, Any]
    vision: dict[str, Any] = field(default_factory=dict)
    image_token_id: int | None = None
    options: dict[str, Any] = field(default_factory=dict)
    text_prefix: str = "text_config."

    def build(self) -> nn.Module:
        """The model this spec describes (on the default device; use ``torch.device("meta")``
        to build it without memory)."""
        return self.family.build(self)

    def config_key(self, argument: str) -> str | None:
        """The ``config.json`` key behind the builder argument ``argument`` (named by a
        constructor's error): the tower's arguments are its ``vision_config`` keys; None for
        other names."""
        return f"vision_config.{argument}" if argument in self.vision else None

    def layer_counts(self) -> dict[str, tuple[str, int]]:
        """config key -> (pattern of this library's keys with the layer index in group 1, the
        layers the config claims): checked against the weights before anything is built."""
        counts = {
            f"{self.text_prefix}num_hidden_layers": (
                re.escape(self.family.layout.decoder) + r"layers\.(\d{1,9})\.",
                self.text["num_layers"],
            )
        }
        if self.family.vision_layers is not None:
            pattern, depth = self.family.vision_layers
            counts[f"vision_config.{depth}"] = (pattern, self.vision[depth])
        return counts


class Family:
    """One model family. Subclasses set the attributes and implement :meth:`read`,
    :meth:`build` and :meth:`hf_config`; one instance of each is registered in
    :data:`fusion.families.FAMILIES`.

    Attributes:
        name: the registry's key, named in errors (``"llava"``).
        what: the family's name for people (``"LLaVA"``).
        architectures: ``config.json`` model type -> transformers' class name.
        layout: where the model's weights sit in a Hugging Face checkpoint.
        encoder_types: the ``"image"`` encoder classes the family builds (empty: text only).
        vision_layers: the pattern of this library's vision-layer keys (layer index in group
            1) and the ``vision_config`` key counting them; None for a text-only family.
        peft_text: where transformers' in-memory model keeps the text model's layers (a
            Llama's ``"model."``).
        peft_encoder: (this library's prefix, transformers' in-memory prefix) of the encoder's
            layers.
        processor: the kind of :class:`fusion.preprocessing.VisionLanguageProcessor` that
            makes its inputs (a name preprocessing registers its processors under, so that
            this layer imports none); None for a text-only family.
        processor_defaults: per ``config.json`` model type, what its processor takes for the
            settings a directory leaves out (the keys that processor reads: ids, patch sizes,
            image settings), so that preprocessing holds no table of model types.
        video_marker: what a prompt marks each video with, for a family whose models have a
            ``"video"`` entry (the command line's ``--video``); None: they take no videos.
        refused_model_types: model types of the family's relatives it does not read, each
            with the reason the error gives (Qwen3.5's mixture-of-experts variant).
    """

    name: str
    what: str
    architectures: Mapping[str, str]
    layout: KeyLayout
    encoder_types: tuple[type[nn.Module], ...] = ()
    vision_layers: tuple[str, str] | None = None
    peft_text: str = "model.language_model."
    peft_encoder: tuple[tuple[str, str], ...] = ()
    square_images: bool = False  # the tower takes square images or tiles of one size
    processor: str | None = None
    processor_defaults: Mapping[str, Mapping[str, Any]] = {}
    video_marker: str | None = None
    # Model types of the family's relatives that it does not read, and why (named in errors).
    refused_model_types: Mapping[str, str] = {}

    def rows_per_image(self, spec: ModelSpec, side: int, config_file: Path) -> int:
        """(``square_images`` families) The placeholder rows one image or tile gives, for a
        tower cutting it into ``side`` x ``side`` patches.

        Raises:
            CheckpointError: naming ``config_file`` and the key, a config whose sizes give no
                whole number of rows.
        """
        raise NotImplementedError

    def owns(self, decoder: nn.Module) -> bool:
        """(text-only families) Whether a bare decoder (or the decoder of an ``EarlyFusion``
        without encoders) is one of this family's models (the Llama family, the registry's
        fallback, describes or refuses any other)."""
        return False

    @property
    def takes_videos(self) -> bool:
        """Whether its models take videos (it has a :attr:`video_marker`)."""
        return self.video_marker is not None

    @property
    def model_types(self) -> tuple[str, ...]:
        """The ``config.json`` model types this family reads."""
        return tuple(self.architectures)

    def read(self, config: ConfigReader) -> ModelSpec:
        """The model a ``config.json`` of this family describes, every value checked.

        Raises:
            CheckpointError: naming the file and key of a value no model can be built from.
        """
        raise NotImplementedError

    def build(self, spec: ModelSpec) -> nn.Module:
        """The model ``spec`` describes, freshly initialised."""
        raise NotImplementedError

    def hf_config(self, model: nn.Module) -> dict[str, Any]:
        """The ``config.json`` transformers reads for ``model`` (checked to rebuild it).

        Raises:
            TypeError, ValueError: ``model`` is not a model of this family as its builder
                makes it (named).
        """
        raise NotImplementedError

    def model_type_of(self, model: nn.Module) -> str:
        """The ``config.json`` model type a model of this family is saved as."""
        return next(iter(self.architectures))

    def transformers_module(self, model_type: str) -> str:
        """The transformers module that defines the family's class for ``model_type``
        (peft's ``auto_mapping``)."""
        return f"transformers.models.{model_type}.modeling_{model_type}"

    def __repr__(self) -> str:
        return f"<family {self.name}: {self.what}>"


def check_rebuilds(model: nn.Module, config: Mapping[str, Any], family: Family) -> None:
    """The ``config`` written for ``model`` must rebuild it exactly: same names, shapes and
    sub-layer settings, so that a modified model is refused rather than saved wrongly.

    Raises:
        ValueError: naming the first difference.
    """
    spec = family.read(ConfigReader(config, Path(CONFIG_NAME)))
    with torch.device("meta"):
        rebuilt = spec.build()
    ours = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    theirs = {k: tuple(v.shape) for k, v in rebuilt.state_dict().items()}
    if ours != theirs:
        differing = sorted(set(ours) ^ set(theirs)) or sorted(
            k for k in ours if ours[k] != theirs[k]
        )
        raise ValueError(
            f"model: not a {family.name} model as the builder makes it; differing parameters: "
            f"{differing[:5]}"
        )
    mine, built = list(model.modules()), list(rebuilt.modules())
    if len(mine) != len(built):
        raise ValueError(
            f"model: not a {family.name} model as the builder makes it: {len(mine)} modules, "
            f"expected {len(built)}"
        )
    for a, b in zip(mine, built, strict=True):
        if type(a) is not type(b) or _settings(a) != _settings(b):
            raise ValueError(
                f"model: a {type(a).__name__} differs from what its config describes "
                f"({_settings(a)} vs {_settings(b)})"
            )


def _settings(module: nn.Module) -> tuple:
    """The settings of a module that its parameters' shapes do not show."""
    return tuple(
        getattr(module, name)
        for name in (
            "eps",
            "name",
            "num_heads",
            "position_scheme",
            "scale_factor",
            "base",
            "linear_factor",
            "activation",
            "attn_scale",
            "sliding_window",
            "embed_scale",
            "final_logit_softcap",
        )
        if isinstance(getattr(module, name, None), int | float | str)
    )


def read_token_id(config: ConfigReader, keys: tuple[str, ...], default: int) -> int:
    """The id ``config`` holds under the first of ``keys`` present (each key present must say
    the same), else ``default``.

    Raises:
        CheckpointError: disagreeing values, or a value that is not an id.
    """
    values = {key: config.values[key] for key in keys if config.values.get(key) is not None}
    if len(set(map(repr, values.values()))) > 1:
        raise config.fail(keys[0], f"disagreeing values {values}")
    key, value = next(iter(values.items()), (keys[0], default))
    if not is_int(value, 0, 2**63 - 1):
        raise config.fail(key, f"expected an id, got {short_repr(value)}")
    return value


def check_image_encoder(model: object, family: Family) -> tuple[nn.Module, int]:
    """The one ``"image"`` encoder of an ``EarlyFusion`` of ``family``, and its placeholder id
    (inside the vocabulary, as Hugging Face models embed it).

    Raises:
        TypeError: ``model`` is not an ``EarlyFusion``.
        ValueError: other encoders than one ``"image"`` of the family's classes; an image id
            outside the vocabulary.
    """
    if not isinstance(model, EarlyFusion):
        raise TypeError(f"model: expected an EarlyFusion, got {type(model).__name__}")
    encoder = model.encoders["image"] if set(model.encoders) == {"image"} else None
    if not isinstance(encoder, family.encoder_types):
        got = {k: type(v).__name__ for k, v in model.encoders.items()}
        expected = " or ".join(c.__name__ for c in family.encoder_types)
        raise ValueError(f"model: expected one encoder, 'image', a {expected}; got {got}")
    image_id, vocab = model.encoder_tokens["image"], model.decoder.vocab_size
    if not 0 <= image_id < vocab:
        raise ValueError(
            f"model: the image placeholder id {image_id} lies outside the vocabulary [0, "
            f"{vocab}); Hugging Face models embed it, so it must lie inside"
        )
    return encoder, image_id
