"""Hugging Face config files read strictly: ``config.json`` itself (:func:`read_hf_config`), and
the values of any config object, each checked and each refusal naming the file and the key
(:class:`ConfigReader`): a model's ``config.json`` and its sections, and image processor
configs (``preprocessor_config.json``, or the ``image_processor`` object of
``processor_config.json``), every image size bounded (:data:`MAX_SIDE`)."""

import math
import os
from collections.abc import Callable, Collection, Mapping
from functools import partial
from typing import Any

from fusion._validation import is_int
from fusion.hf.errors import CheckpointError, as_path, short_repr
from fusion.hf.files import read_json

CONFIG_NAME = "config.json"
# The largest side a processor config may resize or crop to. Idefics3's processor caps images
# at 4096 pixels a side itself; CLIP-style towers take a few hundred.
MAX_SIDE = 4096

# The error a ConfigReader raises for a refused value: from its key (the reader's prefix
# included) and a message.
ErrorFactory = Callable[[str, str], Exception]


def read_hf_config(path: str | bytes | os.PathLike) -> dict[str, Any]:
    """Read ``config.json`` (``path`` is the file or its directory).

    Raises:
        TypeError, ValueError: ``path`` is not a path.
        CheckpointError: missing, not a regular file, larger than
            :data:`~fusion.hf.files.MAX_JSON_BYTES`, unreadable or not a JSON object.
    """
    path = as_path(path, "path")
    file = path / CONFIG_NAME if path.is_dir() else path
    config = read_json(file, "config")
    if not isinstance(config, dict):
        raise CheckpointError(file, None, "expected a JSON object")
    return config


class ConfigReader:
    """Checked reads of a config object, ``values``, found at ``prefix`` (e.g.
    ``"text_config."``) in ``source`` (its file, or words saying where it is).

    A value refused raises ``error(prefix + key, message)``; without ``error``, a
    :class:`CheckpointError` naming ``source``, the key and the value. A null value is refused
    as any value of the wrong type is, unless ``null_is_default``: then it reads as the
    default, as transformers reads image processor settings (see
    :meth:`for_image_processor`).

    Raises:
        TypeError: ``values`` is not a mapping.
    """

    def __init__(
        self,
        values: Mapping[str, Any],
        source: str | os.PathLike[str],
        prefix: str = "",
        *,
        error: ErrorFactory | None = None,
        null_is_default: bool = False,
    ) -> None:
        if not isinstance(values, Mapping):
            raise TypeError(f"{source}: expected a mapping, got {type(values).__name__}")
        self.values, self.source, self.prefix = values, source, prefix
        self.error: ErrorFactory = error or partial(CheckpointError, source)
        self.null_is_default = null_is_default

    @classmethod
    def for_image_processor(cls, config: Mapping[str, Any], where: str) -> "ConfigReader":
        """The reader of an image processor config, which ``where`` names (e.g.
        ``"preprocessor_config.json"``): a value refused is a ``ValueError``
        ``"{where}: {key}: {message}"``, and a null value reads as the default.

        Raises:
            TypeError: ``config`` is not a mapping.
        """

        def error(key: str, message: str) -> ValueError:
            return ValueError(f"{where}: {key}: {message}")

        return cls(config, where, error=error, null_is_default=True)

    def fail(self, key: str, message: str) -> Exception:
        """The error refusing the value at ``key`` (below ``prefix``), to be raised."""
        return self.error(self.prefix + key, message)

    def _value(self, key: str, default: Any) -> Any:
        value = self.values.get(key, default)
        return default if value is None and self.null_is_default else value

    def get(self, key: str, default: Any, valid: Callable[[Any], bool], expected: str) -> Any:
        """``values[key]`` (or ``default``) if ``valid``; refused as not ``expected`` if not."""
        value = self._value(key, default)
        if not valid(value):
            raise self.fail(key, f"expected {expected}, got {short_repr(value)}")
        return value

    def integer(self, key: str, default: int | None = None, *, low: int | None = 1) -> int:
        """An integer in [low, 2**31); with ``low=None``, any integer (its range is checked
        where it is used)."""
        if self._value(key, default) is None:
            raise self.fail(key, "missing; expected a positive integer")
        if low is None:
            return self.get(key, default, is_int, "an integer")
        return self.get(
            key, default, lambda v: is_int(v, low, 2**31 - 1), f"an integer in [{low}, 2**31)"
        )

    def number(
        self,
        key: str,
        default: float | None,
        low: float = -math.inf,
        *,
        closed: bool = False,
        high: float = math.inf,
    ) -> float:
        """A finite number in (low, high], or in [low, high] with ``closed``; without bounds,
        any finite number."""

        def valid(v: Any) -> bool:
            is_number = isinstance(v, int | float) and not isinstance(v, bool)
            return (
                is_number and math.isfinite(v) and (low <= v if closed else low < v) and v <= high
            )

        bounds = [f"{'>=' if closed else '>'} {low:g}"] if low > -math.inf else []
        bounds += [f"<= {high:g}"] if high < math.inf else []
        expected = "a finite number" + (" " + ", ".join(bounds) if bounds else "")
        return float(self.get(key, default, valid, expected))

    def flag(self, key: str, default: bool = False) -> bool:
        return self.get(key, default, lambda v: isinstance(v, bool), "true or false")

    def choice(self, key: str, default: str | None, choices: Collection[str]) -> str:
        expected = f"one of {sorted(choices)}"
        return self.get(key, default, lambda v: isinstance(v, str) and v in choices, expected)

    def section(
        self, key: str, what: str, defaults: Mapping[str, Any] | None = None
    ) -> "ConfigReader":
        """The object under ``key`` (required), over ``defaults``, read as this one is."""
        value = self.values.get(key)
        if value is None:
            raise self.fail(key, f"missing; a {what} config needs it")
        if not isinstance(value, Mapping):
            raise self.fail(key, f"expected an object, got {short_repr(value)}")
        return ConfigReader(
            {**(defaults or {}), **value},
            self.source,
            f"{self.prefix}{key}.",
            error=self.error,
            null_is_default=self.null_is_default,
        )

    def triple(
        self, key: str, default: tuple[float, ...], positive: bool = False
    ) -> tuple[float, ...]:
        """Three finite numbers (an image's R, G, B: a mean, a std), or one for all three."""
        value = self._value(key, default)
        if isinstance(value, int | float) and not isinstance(value, bool):
            value = [value] * 3
        if (
            not isinstance(value, list | tuple)
            or len(value) != 3
            or not all(isinstance(v, int | float) and not isinstance(v, bool) for v in value)
            or not all(math.isfinite(v) and (v > 0 or not positive) for v in value)
        ):
            kind = "positive " if positive else ""
            raise self.fail(key, f"expected three finite {kind}numbers (R, G, B), got {value!r}")
        return tuple(float(v) for v in value)

    def resample(self, key: str, default: int, filters: Mapping[int, str]) -> int:
        """A resampling filter's number, one of ``filters`` (number -> name)."""
        value = self._value(key, default)
        if not is_int(value) or value not in filters:
            names = ", ".join(f"{n} ({filters[n]})" for n in sorted(filters))
            raise self.fail(key, f"expected one of {names}, got {value!r}")
        return int(value)  # Pillow's Resampling enum is an int

    def size(self, key: str, value: object) -> dict[str, int]:
        """A size entry: an int, or an object of positive ints (at most :data:`MAX_SIDE`)."""
        if is_int(value):
            value = {"shortest_edge": value}
        if not isinstance(value, Mapping) or not value:
            raise self.fail(key, f"expected an object of sizes, got {value!r}")
        out = {}
        for name, v in value.items():
            if v is None:
                continue
            if not is_int(v, 1, MAX_SIDE):
                raise self.fail(
                    f"{key}.{name}", f"expected a positive integer <= {MAX_SIDE}, got {v!r}"
                )
            out[name] = v
        return out
