"""A recipe's configuration as one dataclass whose fields are its command-line flags, in
groups that say what ``--resume`` does with them (the recipes' shared machinery).

Each field is an :func:`option` with a help text, a group and what it must be (``positive``,
``non_negative``, a ``path``). The groups are the recipe's (``GROUP_TITLES``);
by convention ``data``, ``model`` and ``optim`` are fixed for the life of a run, ``run``
settings are stored and may change when resuming, ``session`` settings belong to one
invocation. :func:`build_parser` makes one flag per field (absent from the parsed namespace
unless given, so a resumed run tells the flags given from its stored ones), :func:`parse_args`
checks them, :func:`config_from_values` reads a checkpoint's stored settings back, every key
checked, and :func:`resumed_config` merges the two; :func:`check_ranges` is where a recipe's
``check_config`` starts. A :class:`ConfigSpec` declares all of it once for a recipe;
:data:`FIXED_GROUPS` and :func:`group_titles` word the convention.
"""

import argparse
import dataclasses
import math
import os
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Generic, NoReturn, TypeVar, cast

from fusion._validation import is_int
from fusion.training.errors import TrainingError, one_line

C = TypeVar("C")
# No count or size of a recipe comes near it; above it products of sizes could overflow int64.
MAX_INT = 2**31 - 1
# The groups that define what a checkpoint continues, by convention: resuming with other
# values would train another model on other data.
FIXED_GROUPS = ("data", "model", "optim")


def group_titles(*, model: str = "model", extend: str = "--steps") -> dict[str, str]:
    """The ``--help`` titles of the conventional groups, in order, each saying what
    ``--resume`` does with its settings: ``model`` names the model group, ``extend`` the flags
    that may extend a resumed run."""
    fixed = "(restored by --resume; a different value is refused)"
    return {
        "data": f"data {fixed}",
        "model": f"{model} {fixed}",
        "optim": f"optimisation {fixed}",
        "run": f"run (restored by --resume unless given; {extend} may extend the run)",
        "session": "this invocation (never restored)",
    }


def option(
    default: Any,
    help: str,
    group: str,
    *,
    positive: bool = False,
    non_negative: bool = False,
    path: bool = False,
    **kwargs: Any,
) -> Any:
    """A config field: its default, its ``--help`` text, its group, and e.g. ``choices``;
    what it must be, checked by :func:`check_ranges`: ``positive`` (> 0), ``non_negative``
    (>= 0), a ``path`` (not empty when set; :func:`parse_args` makes it absolute, so that
    ``--resume`` works from any working directory)."""
    checks = {"positive": positive, "non_negative": non_negative, "path": path}
    return field(default=default, metadata={"help": help, "group": group, **checks, **kwargs})


def flag_name(name: str) -> str:
    """The command-line flag of config field ``name``."""
    return "--" + name.replace("_", "-")


def config_group(config: Any, name: str) -> dict[str, Any]:
    """The fields of ``config`` in group ``name``, as a dict."""
    return {
        f.name: getattr(config, f.name)
        for f in dataclasses.fields(config)
        if f.metadata["group"] == name
    }


def fields_with(config: Any, check: str) -> list[str]:
    """The names of the fields of ``config`` (a dataclass or its class) whose :func:`option`
    asks for ``check`` (``positive``, ``non_negative`` or ``path``), in order."""
    return [f.name for f in dataclasses.fields(config) if f.metadata.get(check)]


def refuse(
    config: Any, field_name: str, expected: str, name: Callable[[str], str] = flag_name
) -> NoReturn:
    """Raise a config check's ``ValueError``: ``"<name>: expected <expected>, got <value>"``
    for field ``field_name`` of ``config`` (``name`` words it: its flag, or a checkpoint key)."""
    got = getattr(config, field_name)
    raise ValueError(f"{name(field_name)}: expected {expected}, got {got!r}")


def check_ranges(
    config: Any, name: Callable[[str], str] = flag_name, *, no_nul: bool = False
) -> None:
    """The checks every recipe's config starts with: each float finite, each int at most
    :data:`MAX_INT` in magnitude (and, with ``no_nul``, each str free of NUL characters), field
    by field; then what each field's :func:`option` asks for, in field order: the
    ``positive`` fields above 0, the ``non_negative`` ones at least 0, and the ``path`` ones
    not empty when set.

    Args:
        config: a config dataclass instance.
        name: how a message names a field (default: its flag, :func:`flag_name`).
        no_nul: refuse a NUL character in any str field.

    Raises:
        ValueError: ``"<name>: expected <what>, got <value>"`` for the first field at fault.
    """

    fail = partial(refuse, config, name=name)
    for field_name, value in vars(config).items():
        if isinstance(value, float) and not math.isfinite(value):
            fail(field_name, "a finite number")
        if is_int(value) and abs(value) > MAX_INT:
            fail(field_name, f"at most {MAX_INT} in magnitude")
        if no_nul and isinstance(value, str) and "\0" in value:
            fail(field_name, "no NUL character")
    for field_name in fields_with(config, "positive"):
        if getattr(config, field_name) <= 0:
            fail(field_name, "a positive value")
    for field_name in fields_with(config, "non_negative"):
        if getattr(config, field_name) < 0:
            fail(field_name, "a value >= 0")
    for field_name in fields_with(config, "path"):
        if getattr(config, field_name) == "":
            fail(field_name, "a path")


@contextmanager
def flag_errors(flag: str, *errors: type[BaseException]) -> Iterator[None]:
    """Turn an error of the types ``errors`` raised in the ``with`` block into a one-line
    :class:`TrainingError` naming ``flag``: ``"<flag>: <first line of its message>"`` (the
    error a library call raises about a file or setting the flag gave)."""
    try:
        yield
    except errors as error:
        raise TrainingError(f"{flag}: {one_line(error)}") from None


class OneLineParser(argparse.ArgumentParser):
    """Reports a bad command line in one line (argparse's usage text is many lines)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def positive_int(text: str) -> int:
    """An argparse ``type``: an integer >= 1 (argparse reports a ``ValueError`` as an invalid
    value of the flag, this message as its reason)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def check_argv(argv: Any) -> None:
    """Refuse a recipe's ``main(argv)`` that is neither None nor a list of str (a string would
    be parsed letter by letter).

    Raises:
        TypeError: naming ``argv``.
    """
    if argv is not None and (
        not isinstance(argv, (list, tuple)) or not all(isinstance(a, str) for a in argv)
    ):
        raise TypeError(f"argv: expected None or a list of str, got {argv!r:.80}")


def build_parser(
    config_class: type, *, prog: str, description: str, group_titles: Mapping[str, str]
) -> argparse.ArgumentParser:
    """One flag per field of ``config_class``, in the argument groups ``group_titles``
    names. Flags not given are absent from the parsed namespace (their defaults are the
    dataclass's); booleans are ``--flag`` (default False) or ``--flag/--no-flag``."""
    parser = OneLineParser(prog=prog, description=description, argument_default=argparse.SUPPRESS)
    groups = {name: parser.add_argument_group(title) for name, title in group_titles.items()}
    for f in dataclasses.fields(config_class):
        flag = flag_name(f.name)
        group = groups[f.metadata["group"]]
        shown = "unset" if f.default is None else f.default
        help = f"{f.metadata['help']} (default: {shown})"
        if f.type is bool:
            action = "store_true" if f.default is False else argparse.BooleanOptionalAction
            group.add_argument(flag, action=action, help=help)
            continue
        kind = f.type if f.type in (int, float) else str
        group.add_argument(
            flag,
            type=kind,
            help=help,
            choices=f.metadata.get("choices"),
            metavar=None if f.metadata.get("choices") else f.name.upper(),
        )
    return parser


def parse_args(
    parser: argparse.ArgumentParser,
    config_class: Callable[..., C],
    argv: list[str] | None,
    check: Callable[[C], None],
    *,
    required: Collection[str] = (),
) -> tuple[C, frozenset[str]]:
    """Parse ``argv`` with ``parser`` (:func:`build_parser`'s) into a ``config_class`` checked
    by ``check`` (raising ``ValueError``), and the names of the fields given as flags.

    Then the fields named in ``required`` must be set (in that order), unless the config's
    ``resume`` is (the checkpoint has them); a ``--threads`` field may not exceed the CPUs
    here (far more threads than CPUs crashes torch's thread pool); the ``path`` fields
    (:func:`option`) set are made absolute, so that a resumed run finds them from any working
    directory.

    Exits with status 2 (argparse's) and one line naming the flag on unknown flags or bad
    values.
    """
    given = vars(parser.parse_args(argv))
    config = config_class(**given)
    try:
        check(config)
    except ValueError as error:
        parser.error(str(error))
    if not getattr(config, "resume", False):
        for name in required:
            if getattr(config, name) is None:
                parser.error(f"{flag_name(name)}: required")
    cpus = os.cpu_count() or 1
    threads = getattr(config, "threads", 0)
    if threads > cpus:
        parser.error(f"--threads: expected at most the {cpus} CPUs here, got {threads}")
    paths = {
        f: os.path.abspath(v) for f in fields_with(config, "path") if (v := getattr(config, f))
    }
    return dataclasses.replace(config, **paths), frozenset(given)  # type: ignore[type-var]


def config_from_values(
    config_class: Callable[..., C],
    values: Any,
    file: Path,
    *,
    check: Callable[[C, Callable[[str], str]], None],
    stored_groups: Collection[str] | None = None,
) -> C:
    """A config from the JSON object ``values`` (the ``config`` of checkpoint file ``file``),
    checked before use: every field of ``stored_groups`` (None: every field) present, of its
    type (an integer for a float is taken; ``str | None`` takes null), within its
    ``choices``, then ``check(config, name)`` (raising ``ValueError``; ``name`` words a field
    as the file's key).

    Raises:
        TrainingError: naming ``file`` and the key.
    """

    def fail(message: str) -> TrainingError:
        return TrainingError(f"checkpoint {file.parent}: {file.name}: {message}")

    if not isinstance(values, dict):
        raise fail("key 'config': expected an object")
    fields = {
        f.name: f
        for f in dataclasses.fields(config_class)  # type: ignore[arg-type]
        if stored_groups is None or f.metadata["group"] in stored_groups
    }
    missing, unknown = sorted(set(fields) - set(values)), sorted(set(values) - set(fields))
    if missing or unknown:
        raise fail(f"key 'config': missing keys {missing}, unknown keys {unknown}")
    checked: dict[str, Any] = {}
    for key, f in fields.items():
        value = values[key]
        if f.type is float and type(value) is int:
            value = float(value)
        allowed: tuple[type, ...] = (str, type(None)) if f.type == str | None else (f.type,)  # type: ignore[assignment]
        if type(value) not in allowed:
            scalar = isinstance(value, (bool, int, float, str))
            shown = f"{value!r:.60}" if scalar else f"a value of type {type(value).__name__}"
            expected = " or ".join("null" if t is type(None) else t.__name__ for t in allowed)
            raise fail(f"key 'config.{key}': expected {expected}, got {shown}")
        choices = f.metadata.get("choices")
        if choices and value not in choices:
            raise fail(f"key 'config.{key}': expected one of {list(choices)}, got {value!r:.60}")
        checked[key] = value
    config = config_class(**checked)
    try:
        check(config, lambda n: f"key 'config.{n}'")
    except ValueError as error:
        raise fail(str(error)) from None
    return config


def resumed_config(
    config: C,
    given: Collection[str],
    stored: C,
    step: int,
    *,
    fixed_groups: Collection[str],
) -> C:
    """The configuration of a run resumed from a checkpoint at ``step`` that stores
    ``stored``: the stored one, with this invocation's ``session`` settings (from ``config``)
    and the ``run`` settings named in ``given`` (the flags given).

    A flag of ``fixed_groups`` may be given only with the stored value: another would train
    another model, or on other data, than the checkpoint continues.

    Raises:
        TrainingError: naming each flag given with another value than the checkpoint's, or
            a positive ``--steps`` below the checkpoint's step.
    """
    fixed = {name for group in fixed_groups for name in config_group(stored, group)}
    changed = [
        f.name
        for f in dataclasses.fields(stored)  # type: ignore[arg-type]
        if f.name in given
        and f.name in fixed
        and getattr(config, f.name) != getattr(stored, f.name)
    ]
    if changed:
        reasons = "; ".join(
            f"{flag_name(name)}: the checkpoint was trained with {getattr(stored, name)}, "
            f"not {getattr(config, name)}"
            for name in changed
        )
        flags = "the flag" if len(changed) == 1 else "these flags"
        raise TrainingError(
            f"{reasons}; drop {flags} to resume (a different run needs another --output-dir)"
        )
    steps = getattr(config, "steps", 0)
    if "steps" in given and 0 < steps < step:
        raise TrainingError(f"--steps: expected at least the checkpoint's step {step}, got {steps}")
    ours = set(config_group(config, "session")) | (set(given) & set(config_group(config, "run")))
    restored = {f.name: getattr(stored, f.name) for f in dataclasses.fields(stored)}  # type: ignore[arg-type]
    return dataclasses.replace(config, **{k: v for k, v in restored.items() if k not in ours})  # type: ignore[type-var]


@dataclass(frozen=True)
class ConfigSpec(Generic[C]):
    """A recipe's configuration declared once: its config dataclass, what its command line
    says about it, how its fields are checked and what a checkpoint stores of it; the
    functions of this module bound to them.

    Attributes:
        config_class: the config dataclass (fields made with :func:`option`).
        prog: the recipe's command (``--help``, error lines).
        description: its ``--help`` description.
        group_titles: each group's title in ``--help``, in order.
        check: ``check(config, name)`` raising ``ValueError`` (``name`` words a field: a flag
            on the command line, a key in a checkpoint).
        fixed_groups: the groups a resumed run may not change (:func:`resumed_config`).
        stored_groups: the groups a checkpoint stores, in order (None: every field).
        required: the fields a new run must be given, in the order they are checked
            (:func:`parse_args`).
        added: the settings added since the recipe's first checkpoints, with the value a
            checkpoint without them was trained with.
    """

    config_class: Callable[..., C]
    prog: str
    description: str
    group_titles: Mapping[str, str]
    check: Callable[[C, Callable[[str], str]], None]
    fixed_groups: Collection[str]
    stored_groups: Collection[str] | None = None
    required: Collection[str] = ()
    added: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def build_parser(self) -> argparse.ArgumentParser:
        """One flag per field (:func:`build_parser`)."""
        return build_parser(
            cast(type, self.config_class), prog=self.prog, description=self.description,
            group_titles=self.group_titles,
        )  # fmt: skip

    def parse_args(self, argv: list[str] | None = None) -> tuple[C, frozenset[str]]:
        """A checked config from ``argv`` and the names of the fields given
        (:func:`parse_args`); exits with status 2 and one line naming the flag on unknown
        flags or bad values."""
        parser, check = self.build_parser(), self.check
        return parse_args(
            parser, self.config_class, argv, lambda c: check(c, flag_name), required=self.required
        )

    def to_json(self, config: C) -> dict[str, Any]:
        """What a checkpoint stores of ``config``: its ``stored_groups``, in order."""
        groups = self.stored_groups or self.group_titles
        return {k: v for group in groups for k, v in config_group(config, group).items()}

    def from_json(self, values: Any, file: Path) -> C:
        """The config a checkpoint file ``file`` stores as ``values`` (:func:`to_json`'s),
        every key present (those of ``added`` may be missing), of its type and in range
        (:func:`config_from_values`).

        Raises:
            TrainingError: naming ``file`` and the key.
        """
        if isinstance(values, dict):
            values = {**self.added, **values}
        return config_from_values(
            self.config_class, values, file, check=self.check, stored_groups=self.stored_groups
        )

    def resumed(self, config: C, given: Collection[str], stored: C, step: int) -> C:
        """The configuration of a run resumed at ``step`` from a checkpoint storing ``stored``
        (:func:`resumed_config` with ``fixed_groups``).

        Raises:
            TrainingError: naming each fixed flag given with another value than the stored.
        """
        return resumed_config(config, given, stored, step, fixed_groups=self.fixed_groups)
