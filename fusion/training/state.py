"""The state of a training run besides its tensors: :class:`TrainState`, stored as JSON
(``train_state.json``, format 2) in each checkpoint directory and checked on load.

It holds the step, the data position (samples seen, epoch), the per-step losses and optional
eval losses, the recipe's configuration (a JSON object: a dict, or a dataclass stored as its
fields), the learning-rate scheduler's state, the optimizer's hyper-parameters (its tensors are
in the DCP files, :mod:`fusion.training.checkpoint`) and every process's RNG states (bytes as
base64). JSON cannot carry code; on load every key is checked for its type and range, so a
malformed file is a :class:`~fusion.training.TrainingError` naming the file and the key, never
a ``TypeError`` deep inside the job. What the recipe's configuration means is the recipe's to
check: :func:`load_train_state` hands the JSON object to its ``parse_config``.
"""

import base64
import binascii
import dataclasses
import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

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


PARALLEL = ("none", "ddp", "fsdp")


@dataclass(kw_only=True)
class TrainState:
    """Where a run stands after ``step`` optimizer steps, as a checkpoint stores it.

    Attributes:
        step: optimizer steps done.
        samples_seen: the data position: samples consumed so far, in the recipe's data order
            (the recipe checks it against ``step`` and its config on load).
        epoch: passes over the training data started before this position (0 in the first).
        losses: the training loss of every step, from step 1 (``len(losses) == step``); a
            diverged run's inf or nan losses are history, stored as such.
        config: the recipe's configuration: a JSON object (``dict``) or a dataclass, stored as
            its fields (``dataclasses.asdict``). :func:`load_train_state` gives the stored
            object to the recipe's ``parse_config``, or returns it as a dict.
        world_size: how many processes trained it.
        parallel: ``"none"`` (one process), ``"ddp"`` or ``"fsdp"``.
        scheduler: the learning-rate scheduler's ``state_dict()`` (JSON values only).
        eval_losses: ``(step, loss)`` of each evaluation so far, steps increasing; stored only
            when there is one (a file without the key has none).
        param_groups: the optimizer's hyper-parameters (``param_groups`` without ``params``);
            its tensors are in the DCP files. Filled in by
            :func:`~fusion.training.checkpoint.save_checkpoint`.
        rng: the random number generators of every process, by rank. Filled in by
            :func:`~fusion.training.checkpoint.save_checkpoint`.
        trainable_only: the checkpoint holds only the parameters that train (and buffers,
            and the optimizer state): the frozen base is the recipe's to load again
            (``save_checkpoint(trainable_only=True)``).
        base_model: what the frozen base was, for the recipe to check on resume (e.g.
            :func:`~fusion.training.fingerprint.model_fingerprint` of its directory: file
            name -> ``{"size", "sha256"}``); stored only when given.

    Raises:
        ValueError: ``step``, ``samples_seen`` or ``epoch`` is negative, ``losses`` does not
            hold one loss per step, ``world_size`` is below 1 or ``parallel`` is not one of
            :data:`PARALLEL` (a state that could not be loaded again).
    """

    step: int
    samples_seen: int
    epoch: int
    losses: list[float]
    config: Any
    world_size: int
    parallel: str
    scheduler: dict[str, Any]
    eval_losses: list[tuple[int, float]] = field(default_factory=list)
    param_groups: list[dict[str, Any]] = field(default_factory=list)
    rng: list[RngState] = field(default_factory=list)
    trainable_only: bool = False
    base_model: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        for name in ("step", "samples_seen", "epoch"):
            value = getattr(self, name)
            if type(value) is not int or value < 0:
                raise ValueError(f"{name}: expected an integer >= 0, got {value!r:.60}")
        if len(self.losses) != self.step:
            raise ValueError(
                f"losses: expected one loss per step ({self.step}), got {len(self.losses)}"
            )
        if type(self.world_size) is not int or self.world_size < 1:
            raise ValueError(f"world_size: expected an integer >= 1, got {self.world_size!r:.60}")
        if self.parallel not in PARALLEL:
            expected = f"one of {list(PARALLEL)}"
            raise ValueError(f"parallel: expected {expected}, got {self.parallel!r:.60}")

    def rng_of(self, rank: int) -> RngState:
        """Process ``rank``'s generators; a rank the checkpoint has none for (more processes
        than when it was saved) takes rank 0's."""
        return self.rng[rank] if rank < len(self.rng) else self.rng[0]

    def config_json(self) -> dict[str, Any]:
        """``config`` as the JSON object stored.

        Raises:
            TypeError: ``config`` is neither a dict nor a dataclass instance.
        """
        config = self.config
        if dataclasses.is_dataclass(config) and not isinstance(config, type):
            return dataclasses.asdict(config)
        if not isinstance(config, dict):
            raise TypeError(
                f"config: expected a dict or a dataclass instance, got {type(config).__name__}"
            )
        return config

    def encode(self) -> bytes:
        """The bytes of ``train_state.json``.

        Raises:
            TypeError: ``config`` or ``scheduler`` holds a value JSON cannot store.
        """
        state = {
            "format": FORMAT_VERSION,
            "step": self.step,
            "samples_seen": self.samples_seen,
            "epoch": self.epoch,
            "world_size": self.world_size,
            "parallel": self.parallel,
            "losses": self.losses,
            "config": self.config_json(),
            "scheduler": self.scheduler,
            "optimizer": {"param_groups": self.param_groups},
            "rng": [r.to_json() for r in self.rng],
        }
        if self.eval_losses:
            state["eval_losses"] = [[step, loss] for step, loss in self.eval_losses]
        if self.trainable_only:
            state["trainable_only"] = True
        if self.base_model is not None:
            state["base_model"] = self.base_model
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
_OPTIONAL_KEYS = {"eval_losses", "trainable_only", "base_model"}


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


def _check_integers(schema: _Schema, key: str, value: Any) -> None:
    """Refuse integer literals too long for any value anywhere in ``value``."""
    if isinstance(value, _LongInteger):
        raise schema.fail(key, "an integer of at most 19 digits", value)
    if isinstance(value, dict):
        for name, item in value.items():
            _check_integers(schema, f"{key}.{name}", item)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_integers(schema, f"{key}[{i}]", item)


def _base_model(schema: _Schema, value: Any) -> dict[str, Any]:
    for name, entry in schema.object("base_model", value).items():
        entry = schema.object(f"base_model.{name}", entry, {"size", "sha256"})
        schema.integer(f"base_model.{name}.size", entry["size"])
        digest = entry["sha256"]
        if type(digest) is not str or len(digest) != 64:
            raise schema.fail(f"base_model.{name}.sha256", "64 hex digits", digest)
    return dict(value)


def _eval_losses(schema: _Schema, value: Any, step: int) -> list[tuple[int, float]]:
    pairs = []
    last = 0
    for i, item in enumerate(schema.array("eval_losses", value)):
        at, loss = schema.array(f"eval_losses[{i}]", item, 2)
        at = schema.integer(f"eval_losses[{i}][0]", at, low=last + 1 if i else 0, high=step)
        pairs.append((at, schema.number(f"eval_losses[{i}][1]", loss, finite=False)))
        last = at
    return pairs


def load_train_state(
    path: Path, parse_config: Callable[[dict[str, Any], Path], Any] | None = None
) -> TrainState:
    """The checked ``train_state.json`` of checkpoint directory ``path``.

    ``scheduler`` and ``param_groups`` are checked as JSON objects here, and against the live
    scheduler and optimizer by :func:`match_saved` when resuming. The data position is the
    recipe's to check against the step and its config (:func:`key_error` words it alike).

    Args:
        path: the checkpoint directory.
        parse_config: turns the stored ``config`` object into the recipe's config, checking
            every key; called with the object and the file, it raises ``TrainingError``
            naming the file and key. Without it ``config`` is the JSON object (a dict).

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
    stored = schema.object("<top level>", raw)
    schema.object("<top level>", stored, _KEYS | (_OPTIONAL_KEYS & set(stored)))
    if stored["format"] != FORMAT_VERSION or type(stored["format"]) is not int:
        raise schema.fail("format", f"{FORMAT_VERSION}", stored["format"])
    step = schema.integer("step", stored["step"])
    world = schema.integer("world_size", stored["world_size"], low=1, high=1 << 20)
    losses = schema.array("losses", stored["losses"], step)
    values = schema.object("config", stored["config"])
    _check_integers(schema, "config", values)
    optimizer = schema.object("optimizer", stored["optimizer"], {"param_groups"})
    return TrainState(
        step=step,
        # A diverged run records inf or nan losses; that is history, not damage.
        losses=[schema.number(f"losses[{i}]", v, finite=False) for i, v in enumerate(losses)],
        config=values if parse_config is None else parse_config(values, file),
        world_size=world,
        parallel=schema.string("parallel", stored["parallel"], PARALLEL),
        scheduler=schema.object("scheduler", stored["scheduler"]),
        param_groups=schema.array("optimizer.param_groups", optimizer["param_groups"]),
        rng=[
            _rng(schema, f"rng[{i}]", v)
            for i, v in enumerate(schema.array("rng", stored["rng"], world))
        ],
        samples_seen=schema.integer("samples_seen", stored["samples_seen"]),
        epoch=schema.integer("epoch", stored["epoch"]),
        eval_losses=_eval_losses(schema, stored.get("eval_losses", []), step),
        trainable_only=_flag(schema, "trainable_only", stored.get("trainable_only", False)),
        base_model=_base_model(schema, stored["base_model"]) if "base_model" in stored else None,
    )


def _flag(schema: _Schema, key: str, value: Any) -> bool:
    if type(value) is not bool:
        raise schema.fail(key, "true or false", value)
    return value


def key_error(path: Path, key: str, expected: str, value: Any) -> TrainingError:
    """The error for key ``key`` of checkpoint ``path``'s train state, holding ``value`` where
    ``expected`` was wanted: for the recipe's own checks (the data position against the step),
    worded as this module's."""
    return _Schema(path / TRAIN_STATE).fail(key, expected, value)


# How an optimizer computes its step, not what it computes: a checkpoint's flags are replaced by
# the live optimizer's, so that checkpoints written before the recipes' AdamW became fused
# resume (torch's own load_state_dict would restore the saved flags, and the run would go on
# with the slower kernel without a word).
IMPLEMENTATION_FLAGS = frozenset({"foreach", "fused", "capturable", "differentiable"})


def match_param_groups(path: Path, saved: Any, live: list[dict[str, Any]]) -> Any:
    """The optimizer hyper-parameters ``saved`` in checkpoint ``path`` checked against the live
    ones (``live``: the optimizer's ``param_groups`` without their ``params``) by
    :func:`match_saved`, each group's :data:`IMPLEMENTATION_FLAGS` first migrated to the live
    optimizer's.

    Raises:
        TrainingError: naming the file and the key that differs.
    """
    if isinstance(saved, list) and len(saved) == len(live):
        saved = [
            _with_flags_of(group, template) if isinstance(group, dict) else group
            for group, template in zip(saved, live, strict=True)
        ]
    return match_saved(path, "optimizer.param_groups", saved, live)


def _with_flags_of(group: dict[str, Any], template: dict[str, Any]) -> dict[str, Any]:
    kept = {key: value for key, value in group.items() if key not in IMPLEMENTATION_FLAGS}
    return kept | {key: value for key, value in template.items() if key in IMPLEMENTATION_FLAGS}


def match_saved(path: Path, key: str, saved: Any, template: Any) -> Any:
    """``saved`` (the ``key`` of checkpoint ``path``'s train state) checked against the live
    ``template``: same keys, list lengths and value types.

    Raises:
        TrainingError: naming the file and the key that differs.
    """
    return _Schema(path / TRAIN_STATE).match(key, saved, template)
