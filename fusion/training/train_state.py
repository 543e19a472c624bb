"""A checkpoint's non-tensor training state as JSON (``train_state.json``), checked on load.

It holds the step, data position, losses, config, scheduler state, the optimizer's
hyper-parameters (its tensors are in the DCP files) and every process's RNG states (bytes as
base64). JSON cannot carry code; on load every key is checked for its type and range, so a
malformed file is a :class:`TrainingError` naming the file and key, never a ``TypeError`` deep
inside the job.
"""

import base64
import binascii
import json
import math
import random
from pathlib import Path
from typing import Any

import torch

from fusion.training.config import TrainConfig, config_from_values
from fusion.training.errors import TrainingError
from fusion.training.safe_dcp import fail, read_regular_file

FORMAT_VERSION = 2
TRAIN_STATE = "train_state.json"
LEGACY_TRAIN_STATE = "train_state.pt"  # format 1: a torch (pickle) file, no longer read
MAX_BYTES = 256 << 20  # the losses of some million steps
# 2**63 has 19 digits; a longer literal is no valid value of any key (and Python's int() of
# thousands of digits is slow or refused outright).
_MAX_INT_DIGITS = 19
_MT_STATE = 625  # Python's Mersenne Twister state: 624 words and a position


class _LongInteger(str):
    """An integer literal too long to be a value of any key; reported with its key."""


def _describe(value: Any) -> str:
    if isinstance(value, _LongInteger):
        return f"an integer of {len(value.lstrip('-'))} digits"
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "a list"
    return f"{value!r:.60}"


class _Schema:
    """Typed reads of parsed JSON; errors name the file and the dotted key."""

    def __init__(self, file: Path):
        self.file = file

    def fail(self, key: str, expected: str, value: Any) -> TrainingError:
        return fail(self.file, f"key {key!r}: expected {expected}, got {_describe(value)}")

    def integer(self, key: str, value: Any, *, low: int = 0, high: int = 2**63 - 1) -> int:
        if type(value) is not int or not low <= value <= high:
            raise self.fail(key, f"an integer in [{low}, {high}]", value)
        return value

    def number(self, key: str, value: Any, *, finite: bool = True) -> float:
        if type(value) not in (int, float) or (finite and not math.isfinite(value)):
            raise self.fail(key, "a finite number" if finite else "a number", value)
        return float(value)

    def string(self, key: str, value: Any, choices: tuple[str, ...]) -> str:
        if type(value) is not str or value not in choices:
            raise self.fail(key, f"one of {list(choices)}", value)
        return value

    def object(self, key: str, value: Any, keys: set[str] | None = None) -> dict[str, Any]:
        if type(value) is not dict:
            raise self.fail(key, "an object", value)
        if keys is not None and set(value) != keys:
            missing, unknown = sorted(keys - set(value)), sorted(set(value) - keys)
            raise fail(self.file, f"key {key!r}: missing keys {missing}, unknown keys {unknown}")
        return value

    def array(self, key: str, value: Any, length: int | None = None) -> list[Any]:
        if type(value) is not list or (length is not None and len(value) != length):
            expected = "a list" if length is None else f"a list of {length}"
            raise self.fail(key, expected, value)
        return value

    def blob(self, key: str, value: Any) -> torch.Tensor:
        """Base64 bytes as a uint8 tensor (an RNG state)."""
        try:
            if type(value) is not str:
                raise ValueError
            data = base64.b64decode(value, validate=True)
        except (ValueError, binascii.Error):
            raise self.fail(key, "base64 bytes", value) from None
        return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0)

    def match(self, key: str, value: Any, template: Any) -> Any:
        """``value`` if it has the structure and types of ``template`` (lists for tuples), as
        the template's types; used for state whose shape the live objects define."""
        if isinstance(template, bool) or template is None or isinstance(template, str):
            if type(value) is not type(template):
                raise self.fail(key, type(template).__name__, value)
            return value
        if isinstance(template, int):
            return self.integer(key, value, low=-(2**63))
        if isinstance(template, float):
            return self.number(key, value)
        if isinstance(template, (list, tuple)):
            items = self.array(key, value, len(template))
            pairs = enumerate(zip(items, template, strict=True))
            matched = [self.match(f"{key}[{i}]", v, t) for i, (v, t) in pairs]
            return type(template)(matched)
        if isinstance(template, dict):
            items = self.object(key, value)
            unknown = sorted(set(items) - set(template))
            if unknown:
                raise fail(self.file, f"key {key!r}: unknown keys {unknown}")
            # A key the saved state lacks keeps the live value (a newer torch may add one).
            return {
                name: self.match(f"{key}.{name}", items[name], t) if name in items else t
                for name, t in template.items()
            }
        raise TypeError(f"no JSON form for {type(template).__name__}")  # a bug, not bad input


_KEYS = {
    "format",
    "step",
    "samples_seen",
    "epoch",
    "world_size",
    "parallel",
    "losses",
    "config",
    "scheduler",
    "optimizer",
    "rng",
}


def _parse(file: Path, data: bytes) -> Any:
    def parse_int(text: str) -> int | str:
        return int(text) if len(text.lstrip("-")) <= _MAX_INT_DIGITS else _LongInteger(text)

    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        result = dict(pairs)
        if len(result) != len(pairs):
            seen: set[str] = set()
            twice = next(k for k, _ in pairs if k in seen or seen.add(k))
            raise fail(file, f"key {twice!r} appears twice")
        return result

    try:
        return json.loads(data.decode("utf-8"), parse_int=parse_int, object_pairs_hook=unique)
    except UnicodeDecodeError:
        raise fail(file, "is not UTF-8 text (corrupt?)") from None
    except json.JSONDecodeError as error:
        raise fail(file, f"is not valid JSON (truncated or corrupt?): {error}") from None
    except RecursionError:
        raise fail(file, "is nested too deeply") from None


def encode_train_state(state: dict[str, Any]) -> bytes:
    """``state`` (with ``rng`` from :func:`rng_state_json`) as the bytes of the file.

    Raises:
        ValueError: ``state`` lacks a key :func:`load_train_state` requires, or has another.
    """
    if set(state) != _KEYS - {"format"}:
        missing, unknown = sorted(_KEYS - {"format"} - set(state)), sorted(set(state) - _KEYS)
        raise ValueError(f"train_state: missing keys {missing}, unknown keys {unknown}")
    return (json.dumps({**state, "format": FORMAT_VERSION}, allow_nan=True) + "\n").encode()


def rng_state_json(device: torch.device) -> dict[str, Any]:
    """This process's RNG states in JSON form."""

    def b64(state: torch.Tensor) -> str:
        return base64.b64encode(state.numpy().tobytes()).decode("ascii")

    version, words, gauss = random.getstate()
    state: dict[str, Any] = {
        "torch": b64(torch.get_rng_state()),
        "python": [version, list(words), gauss],
    }
    if device.type == "cuda":
        state["cuda"] = b64(torch.cuda.get_rng_state(device))
    return state


def _rng(schema: _Schema, key: str, value: Any) -> dict[str, Any]:
    schema.object(key, value)
    value = schema.object(key, value, {"torch", "python"} | ({"cuda"} & set(value)))
    cpu = schema.blob(f"{key}.torch", value["torch"])
    if cpu.numel() != torch.get_rng_state().numel():
        raise schema.fail(f"{key}.torch", f"{torch.get_rng_state().numel()} bytes", value["torch"])
    version, words, gauss = schema.array(f"{key}.python", value["python"], 3)
    if version != 3 or type(version) is not int:
        raise schema.fail(f"{key}.python[0]", "3", version)
    words = schema.array(f"{key}.python[1]", words, _MT_STATE)
    for i, word in enumerate(words):
        schema.integer(f"{key}.python[1][{i}]", word, high=2**32 - 1)
    schema.integer(f"{key}.python[1][{_MT_STATE - 1}]", words[-1], high=_MT_STATE - 1)
    if gauss is not None:
        gauss = schema.number(f"{key}.python[2]", gauss)
    state = {"torch": cpu, "python": (3, tuple(words), gauss)}
    if "cuda" in value:
        state["cuda"] = schema.blob(f"{key}.cuda", value["cuda"])
    return state


def load_train_state(path: Path) -> dict[str, Any]:
    """The checked ``train_state.json`` of checkpoint directory ``path``.

    Returns ``step``, ``samples_seen``, ``epoch``, ``world_size``, ``parallel``, ``losses``
    (floats, one per step), ``config`` (the checked :class:`TrainConfig` fields as a dict),
    ``scheduler`` and ``optimizer`` (JSON objects, checked against the live objects by
    :meth:`_Schema.match` when resuming) and ``rng`` (per process: ``torch`` and possibly
    ``cuda`` as uint8 tensors, ``python`` as ``random.getstate()``).

    Raises:
        TrainingError: the file is missing (or only a format-1 ``train_state.pt`` is there),
            not a regular file, too large, not JSON, or a key is missing, unknown, of the
            wrong type or out of range; the message names the file and the key.
    """
    file = path / TRAIN_STATE
    if not file.exists() and (path / LEGACY_TRAIN_STATE).exists():
        raise fail(
            file,
            f"is missing: this checkpoint has a {LEGACY_TRAIN_STATE} (format 1, written by an "
            "older fusion), which is a pickle and is not loaded",
        )
    raw = _parse(file, read_regular_file(file, limit=MAX_BYTES))
    schema = _Schema(file)
    state = schema.object("<top level>", raw, _KEYS)
    if state["format"] != FORMAT_VERSION or type(state["format"]) is not int:
        raise schema.fail("format", f"{FORMAT_VERSION}", state["format"])
    step = schema.integer("step", state["step"])
    world = schema.integer("world_size", state["world_size"], low=1, high=1 << 20)
    losses = schema.array("losses", state["losses"], step)
    values = schema.object("config", state["config"])
    for key, value in values.items():
        if isinstance(value, _LongInteger):
            raise schema.fail(f"config.{key}", "an integer of at most 19 digits", value)
    config = config_from_values(values, file)
    return {
        "format": FORMAT_VERSION,
        "step": step,
        "samples_seen": schema.integer("samples_seen", state["samples_seen"]),
        "epoch": schema.integer("epoch", state["epoch"]),
        "world_size": world,
        "parallel": schema.string("parallel", state["parallel"], ("none", "ddp", "fsdp")),
        # A diverged run records inf or nan losses; that is history, not damage.
        "losses": [schema.number(f"losses[{i}]", v, finite=False) for i, v in enumerate(losses)],
        "config": vars(config),
        "scheduler": schema.object("scheduler", state["scheduler"]),
        "optimizer": schema.object("optimizer", state["optimizer"], {"param_groups"}),
        "rng": [
            _rng(schema, f"rng[{i}]", v)
            for i, v in enumerate(schema.array("rng", state["rng"], world))
        ],
    }


def match_saved(path: Path, key: str, saved: Any, template: Any) -> Any:
    """``saved`` (the ``key`` of checkpoint ``path``'s train state) checked against the live
    ``template``: same keys, list lengths and value types.

    Raises:
        TrainingError: naming the file and the key that differs.
    """
    return _Schema(path / TRAIN_STATE).match(key, saved, template)


def config_of(state: dict[str, Any]) -> TrainConfig:
    return TrainConfig(**state["config"])
