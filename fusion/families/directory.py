"""A Hugging Face model directory read once (:class:`HfDirectory`), and what its ``config.json``
says before any weight is read: its family's name (:func:`hf_model_kind`) and, for a family whose
tower takes square images, the image layout preprocessing needs (:func:`read_hf_vlm_layout`).

The registry (:mod:`fusion.families`) is looked up when a directory's family is first asked
for, not when this module is imported: the families' processors stand on this module, and the
registry on them.
"""

import os
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from fusion.families.base import Family, ModelSpec
from fusion.hf.config import CONFIG_NAME, ConfigReader, read_hf_config
from fusion.hf.errors import CheckpointError, as_path

# Bounds on what a config.json may ask preprocessing for (published towers: 224 to 512 pixels,
# at most a few thousand patches).
MAX_VISION_IMAGE_SIZE = 4096
MAX_VISION_PATCHES = 1 << 16


class HfDirectory:
    """A Hugging Face model directory, its ``config.json`` read (bounded, strictly) and
    parsed at most once: :attr:`config` when first asked for, then :attr:`family` and
    :attr:`spec` from it. Nothing is read when it is made, so errors come in the order the
    functions it is handed to raise them.

    Raises (from its attributes):
        CheckpointError: ``config.json`` missing or unreadable (:attr:`config`), a
            ``model_type`` no family reads (:attr:`family`), a value no model can be built
            from (:attr:`spec`), each naming the file and key.
    """

    def __init__(self, path: str | bytes | os.PathLike) -> None:
        self.path = as_path(path, "path")
        self.config_file = self.path / CONFIG_NAME

    @classmethod
    def of(cls, path: "str | bytes | os.PathLike | HfDirectory", argument: str) -> "HfDirectory":
        """``path`` itself if it is an :class:`HfDirectory`, else one for it (``argument``
        names it in a ``TypeError`` or ``ValueError`` for a value that is not a path)."""
        return path if isinstance(path, HfDirectory) else cls(as_path(path, argument))

    def __fspath__(self) -> str:
        return os.fspath(self.path)

    def __repr__(self) -> str:
        return f"HfDirectory({os.fspath(self.path)!r})"

    @cached_property
    def config(self) -> dict[str, Any]:
        """The parsed ``config.json`` (:func:`~fusion.hf.read_hf_config`)."""
        return read_hf_config(self.config_file)

    @cached_property
    def family(self) -> Family:
        """The registered family of :attr:`config` (:func:`~fusion.families.family_of`)."""
        from fusion.families import family_of

        return family_of(self.config, source=self.config_file)

    @cached_property
    def spec(self) -> ModelSpec:
        """The model :attr:`config` describes, every value checked (:meth:`Family.read`)."""
        return self.family.read(ConfigReader(self.config, self.config_file))

    def spec_among(self, among: tuple[Family, ...]) -> ModelSpec:
        """:attr:`spec`, for a directory of one of the families ``among`` (refused otherwise,
        as :func:`~fusion.families.family_of` refuses it, naming their model types)."""
        from fusion.families import family_of

        family_of(self.config, source=self.config_file, among=among)
        return self.spec


def hf_model_kind(path: "str | bytes | os.PathLike | HfDirectory") -> str:
    """The name of the family ``config.json`` describes (a :data:`fusion.families.FAMILIES`
    entry's ``name``), from its ``model_type`` (a config without one is a Llama's).

    Args:
        path: a model directory (or its :class:`HfDirectory`), or its ``config.json``.

    Raises:
        TypeError, ValueError: ``path`` is not a path.
        CheckpointError: ``config.json`` missing or unreadable, or a ``model_type`` no family
            reads (named, with the ones they do).
    """
    if isinstance(path, HfDirectory):
        return path.family.name
    path = as_path(path, "path")
    file = path / CONFIG_NAME if path.is_dir() else path
    from fusion.families import family_of

    return family_of(read_hf_config(file), source=file).name


@dataclass(frozen=True)
class VlmImageLayout:
    """What preprocessing needs to know of a model whose tower takes square images or tiles
    of one size (a family's ``square_images``): its family's ``kind``, the placeholder id of
    image rows, the rows one image or tile gives, and the side of the images its tower takes."""

    kind: str
    image_token_id: int
    tokens_per_image: int
    image_size: int


def read_hf_vlm_layout(path: "str | bytes | os.PathLike | HfDirectory") -> VlmImageLayout:
    """The :class:`VlmImageLayout` a directory's ``config.json`` describes, without reading
    the weights, for a family whose tower takes square images of one size.

    Raises:
        TypeError, ValueError: ``path`` is not a path.
        CheckpointError: as :func:`load_hf_model` for ``config.json``; and naming the key, a
            ``vision_config.image_size`` above :data:`MAX_VISION_IMAGE_SIZE` or not a multiple
            of ``patch_size``, more than :data:`MAX_VISION_PATCHES` patches, a
            ``scale_factor`` that does not divide the patch grid.
    """
    directory = HfDirectory.of(path, "path")
    config_file = directory.config_file
    from fusion.families import FAMILIES

    spec = directory.spec_among(tuple(family for family in FAMILIES if family.square_images))
    # Arithmetic only: nothing is built, so no config can make this slow; every size bounded
    # before preprocessing allocates images, tiles or rows from it.
    size, patch = spec.vision["image_size"], spec.vision["patch_size"]
    if not 0 < size <= MAX_VISION_IMAGE_SIZE:
        raise CheckpointError(
            config_file,
            "vision_config.image_size",
            f"expected a positive integer <= {MAX_VISION_IMAGE_SIZE}, got {size}",
        )
    if patch == 0 or size % patch:
        raise CheckpointError(
            config_file,
            "vision_config.image_size",
            f"expected a positive multiple of patch_size={patch}, got {size}",
        )
    side = size // patch
    if side * side > MAX_VISION_PATCHES:
        raise CheckpointError(
            config_file,
            "vision_config.patch_size",
            f"{patch} cuts {size} x {size} images into {side * side} patches, more than "
            f"{MAX_VISION_PATCHES}",
        )
    rows = spec.family.rows_per_image(spec, side, config_file)
    return VlmImageLayout(spec.family.name, spec.image_token_id or 0, rows, size)
