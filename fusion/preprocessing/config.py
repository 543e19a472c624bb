"""Reading the values of an image processor config (``preprocessor_config.json``, or the
``image_processor`` object of ``processor_config.json``), each error naming the key, every size
bounded (:data:`MAX_SIDE`)."""

import math
from collections.abc import Mapping
from typing import Any

from fusion.preprocessing.resize import FILTER_NAMES

# The largest side a processor config may resize or crop to. Idefics3's processor caps images
# at 4096 pixels a side itself; CLIP-style towers take a few hundred.
MAX_SIDE = 4096


class ConfigReader:
    """Typed access to a config mapping; ``where`` names it in errors (e.g. a file)."""

    def __init__(self, config: Mapping[str, Any], where: str) -> None:
        if not isinstance(config, Mapping):
            raise TypeError(f"{where}: expected a mapping, got {type(config).__name__}")
        self.config = config
        self.where = where

    def fail(self, key: str, message: str) -> ValueError:
        return ValueError(f"{self.where}: {key}: {message}")

    def flag(self, key: str, default: bool) -> bool:
        value = self.config.get(key, default)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.fail(key, f"expected true or false, got {value!r}")
        return value

    def integer(self, key: str, default: int) -> int:
        """An integer (its range is checked where it is used)."""
        value = self.config.get(key, default)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(key, f"expected an integer, got {value!r:.200}")
        return value

    def number(self, key: str, default: float) -> float:
        value = self.config.get(key, default)
        if value is None:
            return default
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
        ):
            raise self.fail(key, f"expected a finite number, got {value!r}")
        return float(value)

    def triple(
        self, key: str, default: tuple[float, ...], positive: bool = False
    ) -> tuple[float, ...]:
        value = self.config.get(key, default)
        if value is None:
            return default
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

    def resample(self, key: str, default: int) -> int:
        value = self.config.get(key, default)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int) or value not in FILTER_NAMES:
            names = ", ".join(f"{n} ({FILTER_NAMES[n]})" for n in sorted(FILTER_NAMES))
            raise self.fail(key, f"expected one of {names}, got {value!r}")
        return int(value)  # Pillow's Resampling enum is an int

    def size(self, key: str, value: object) -> dict[str, int]:
        """A size entry: an int, or an object of positive ints."""
        if isinstance(value, int) and not isinstance(value, bool):
            value = {"shortest_edge": value}
        if not isinstance(value, Mapping) or not value:
            raise self.fail(key, f"expected an object of sizes, got {value!r}")
        out = {}
        for name, v in value.items():
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, int) or not 0 < v <= MAX_SIDE:
                raise self.fail(
                    f"{key}.{name}", f"expected a positive integer <= {MAX_SIDE}, got {v!r}"
                )
            out[name] = v
        return out
