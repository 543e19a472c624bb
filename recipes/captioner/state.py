"""The training state of a checkpoint besides its tensors: :class:`TrainState`, stored as JSON
(``train_state.json``, format 2) and checked on load.

It holds the step, data position, losses, config, scheduler state, the optimizer's
hyper-parameters (its tensors are in the DCP files) and every process's RNG states (bytes as
base64). JSON cannot carry code; on load every key is checked for its type and range, so a
malformed file is a :class:`TrainingError` naming the file and key, never a ``TypeError`` deep
inside the job.
"""

import base64
import binascii
import dataclasses
import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from recipes.captioner.config import TrainConfig, config_from_values
from recipes.captioner.errors import TrainingError
from recipes.captioner.safe_dcp import fail, read_regular_file

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
            fields = self.object(key, value)
            unknown = sorted(set(fields) - set(template))
            if unknown:
                raise fail(self.file, f"key {key!r}: unknown keys {unknown}")
            # A key the saved state lacks keeps the live value (a newer torch may add one).
            return {
                name: self.match(f"{key}.{name}", fields[name], t) if name in fields else t
                for name, t in template.items()
            }
        raise TypeError(f"no JSON form for {type(template).__name__}")  # a bug, not bad input


@dataclass(frozen=True)
class RngState:
    """One process's random number generators: torch's CPU generator (``cpu``, uint8 bytes),
    Python's ``random`` (``random.getstate()``) and, on CUDA, the device's generator."""

    cpu: torch.Tensor
    python: tuple[Any, ...]
    cuda: torch.Tensor | None = None

    @classmethod
    def capture(cls, device: torch.device) -> "RngState":
        cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        return cls(torch.get_rng_state(), random.getstate(), cuda)

    def restore(self, device: torch.device) -> None:
        """Set this process's generators to these states (the CUDA one only on CUDA).

        Raises:
            TrainingError: the CUDA state does not fit this device's generator.
        """
        if device.type == "cuda" and self.cuda is not None:
            expected = torch.cuda.get_rng_state(device).numel()
            if self.cuda.numel() != expected:
                raise TrainingError(
                    f"{TRAIN_STATE}: rng.cuda: expected {expected} bytes, got {self.cuda.numel()}"
                )
        torch.set_rng_state(self.cpu)
        random.setstate(self.python)
        if device.type == "cuda" and self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda, device)

    def to_json(self) -> dict[str, Any]:
        def b64(state: torch.Tensor) -> str:
            return base64.b64encode(state.numpy().tobytes()).decode("ascii")

        version, words, gauss = self.python
        state: dict[str, Any] = {"torch": b64(self.cpu), "python": [version, list(words), gauss]}
        if self.cuda is not None:
            state["cuda"] = b64(self.cuda)
        return state


@dataclass
class TrainState:
    """Where a run stands after ``step`` optimizer steps, as a checkpoint stores it.

    The data position follows from the step: ``samples_seen = step * config.batch_size``
    (:class:`~recipes.captioner.batching.EpochSampler` orders the data by position alone).

    Attributes:
        step: optimizer steps done.
        losses: the loss of every step, from step 1.
        config: the run's configuration.
        world_size: how many processes trained it.
        parallel: ``"none"`` (one process), ``"ddp"`` or ``"fsdp"``.
        scheduler: the learning-rate scheduler's ``state_dict()``.
        param_groups: the optimizer's hyper-parameters (``param_groups`` without ``params``);
            its tensors are in the DCP files. Filled in by ``save_checkpoint``.
        rng: the random number generators of every process, by rank. Filled in by
            ``save_checkpoint``.
    """

    step: int
    losses: list[float]
    config: TrainConfig
    world_size: int
    parallel: str
    scheduler: dict[str, Any]
    param_groups: list[dict[str, Any]] = field(default_factory=list)
    rng: list[RngState] = field(default_factory=list)

    @property
    def samples_seen(self) -> int:
        return self.step * self.config.batch_size

    @property
    def epoch(self) -> int:
        return self.samples_seen // self.config.num_train

    def rng_of(self, rank: int) -> RngState:
        """Process ``rank``'s generators; a rank the checkpoint has none for (more processes
        than when it was saved) takes rank 0's."""
        return self.rng[rank] if rank < len(self.rng) else self.rng[0]

    def encode(self) -> bytes:
        """The bytes of ``train_state.json``."""
        state = {
            "format": FORMAT_VERSION,
            "step": self.step,
            "samples_seen": self.samples_seen,
            "epoch": self.epoch,
            "world_size": self.world_size,
            "parallel": self.parallel,
            "losses": self.losses,
            "config": dataclasses.asdict(self.config),
            "scheduler": self.scheduler,
            "optimizer": {"param_groups": self.param_groups},
            "rng": [r.to_json() for r in self.rng],
        }
        return (json.dumps(state, allow_nan=True) + "\n").encode()


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
            for key, _ in pairs:
                if key in seen:
                    raise fail(file, f"key {key!r} appears twice")
                seen.add(key)
        return result

    try:
        return json.loads(data.decode("utf-8"), parse_int=parse_int, object_pairs_hook=unique)
    except UnicodeDecodeError:
        raise fail(file, "is not UTF-8 text (corrupt?)") from None
    except json.JSONDecodeError as error:
        raise fail(file, f"is not valid JSON (truncated or corrupt?): {error}") from None
    except RecursionError:
        raise fail(file, "is nested too deeply") from None


def _rng(schema: _Schema, key: str, value: Any) -> RngState:
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
    cuda = schema.blob(f"{key}.cuda", value["cuda"]) if "cuda" in value else None
    return RngState(cpu, (3, tuple(words), gauss), cuda)


def load_train_state(path: Path) -> TrainState:
    """The checked ``train_state.json`` of checkpoint directory ``path``.

    ``scheduler`` and ``param_groups`` are checked as JSON objects here, and against the live
    scheduler and optimizer by :func:`match_saved` when resuming.

    Raises:
        TrainingError: the file is missing (or only a format-1 ``train_state.pt`` is there),
            not a regular file, too large, not JSON, or a key is missing, unknown, of the
            wrong type or out of range, or the data position disagrees with the step; the
            message names the file and the key.
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
    stored = schema.object("<top level>", raw, _KEYS)
    if stored["format"] != FORMAT_VERSION or type(stored["format"]) is not int:
        raise schema.fail("format", f"{FORMAT_VERSION}", stored["format"])
    step = schema.integer("step", stored["step"])
    world = schema.integer("world_size", stored["world_size"], low=1, high=1 << 20)
    losses = schema.array("losses", stored["losses"], step)
    values = schema.object("config", stored["config"])
    for key, value in values.items():
        if isinstance(value, _LongInteger):
            raise schema.fail(f"config.{key}", "an integer of at most 19 digits", value)
    optimizer = schema.object("optimizer", stored["optimizer"], {"param_groups"})
    state = TrainState(
        step=step,
        # A diverged run records inf or nan losses; that is history, not damage.
        losses=[schema.number(f"losses[{i}]", v, finite=False) for i, v in enumerate(losses)],
        config=config_from_values(values, file),
        world_size=world,
        parallel=schema.string("parallel", stored["parallel"], ("none", "ddp", "fsdp")),
        scheduler=schema.object("scheduler", stored["scheduler"]),
        param_groups=schema.array("optimizer.param_groups", optimizer["param_groups"]),
        rng=[
            _rng(schema, f"rng[{i}]", v)
            for i, v in enumerate(schema.array("rng", stored["rng"], world))
        ],
    )
    # The data position is a function of the step; a file that says otherwise is damaged.
    batch, num_train = state.config.batch_size, state.config.num_train
    positions = (
        ("samples_seen", state.samples_seen, f"step {step} x config.batch_size {batch}"),
        ("epoch", state.epoch, f"samples_seen // config.num_train {num_train}"),
    )
    for key, expected, why in positions:
        if schema.integer(key, stored[key]) != expected:
            raise schema.fail(key, f"{expected} ({why})", stored[key])
    return state


def match_saved(path: Path, key: str, saved: Any, template: Any) -> Any:
    """``saved`` (the ``key`` of checkpoint ``path``'s train state) checked against the live
    ``template``: same keys, list lengths and value types.

    Raises:
        TrainingError: naming the file and the key that differs.
    """
    return _Schema(path / TRAIN_STATE).match(key, saved, template)
