"""A model directory's chat template, rendered in Jinja's sandbox.

A template comes from a model directory, so it is untrusted code: it renders in
``jinja2.sandbox.ImmutableSandboxedEnvironment`` (no attribute starting with ``_``, no
mutation of lists or dicts, ``range`` capped at 100,000 items, no loader: ``include``,
``import`` and ``extends`` fail), with the names transformers gives templates
(``raise_exception``, ``strftime_now``, the ``loopcontrols`` extension, a ``tojson`` that
does not escape HTML, ``namespace`` without underscore attributes, the ``{% generation %}``
tag) and nothing else. Rendering stops once the output passes ``max_chars``, and single
steps that would build a huge value are refused before they allocate it (``'x' * 10**10``,
``center(10**10)``, ``'%0999999999d'``, ``10 ** 10**9``). What a sandbox cannot bound:
a template that loops long without output (two nested ``range(100000)`` loops) or doubles a
string with ``~`` many times over, as with transformers'; render untrusted templates under
an OS memory and time limit if that matters.

Which file holds the template follows transformers: the processor's
(``processor_config.json``'s ``chat_template``, else ``chat_template.json``, else
``chat_template.jinja``), else the tokenizer's (``chat_template.jinja``, else
``tokenizer_config.json``'s ``chat_template``); of several named templates, ``"default"``.
"""

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from fusion._validation import check_int, is_int
from fusion.errors import FusionError
from fusion.hf.errors import CheckpointError, as_path
from fusion.hf.files import read_bounded, read_json

MAX_TEMPLATE_BYTES = 2**20  # real templates are a few kilobytes
MAX_OUTPUT_CHARS = 2**22
#: The names every render sets itself, which no template variable may take.
RESERVED_VARIABLES = frozenset({"messages", "add_generation_prompt", "tools", "documents"})
SPECIAL_TOKEN_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
# Private-use characters wrap what a {% generation %} block renders; messages holding them
# are refused, so the markers found in the output are the template's.
GENERATION_START, GENERATION_END = "\ue000", "\ue001"
# What replaces an assistant message's content to find where a template renders it.
_PROBES = ("0", "1")


class ChatTemplateError(FusionError, ValueError):
    """A chat template that cannot be read or rendered (a syntax error, a sandbox violation,
    ``raise_exception``, output over the limit, no assistant turn)."""


def load_chat_template(directory: str | os.PathLike) -> str:
    """The chat template of a model directory, found as the module docstring says.

    Raises:
        TypeError, ValueError: ``directory`` is not a path.
        CheckpointError: a template file that is not a regular file, larger than
            :data:`MAX_TEMPLATE_BYTES`, not UTF-8 or not JSON where JSON is expected.
        ChatTemplateError: no template in the directory, or several without a ``"default"``.
    """
    directory = as_path(directory, "directory")
    processor = directory / "processor_config.json"
    if processor.is_file():
        value = read_json(processor, "processor config")
        if isinstance(value, dict) and value.get("chat_template") is not None:
            return _pick(value["chat_template"], processor)
    legacy = directory / "chat_template.json"
    if legacy.exists():
        value = read_json(legacy, "chat template")
        if not isinstance(value, dict) or "chat_template" not in value:
            raise CheckpointError(legacy, "chat_template", "missing")
        return _pick(value["chat_template"], legacy)
    raw = directory / "chat_template.jinja"
    if raw.exists():
        return _read_text(raw)
    tokenizer = directory / "tokenizer_config.json"
    if tokenizer.is_file():
        value = read_json(tokenizer, "tokenizer config")
        if isinstance(value, dict) and value.get("chat_template") is not None:
            return _pick(value["chat_template"], tokenizer)
    raise ChatTemplateError(
        f"{directory}: no chat template (looked for processor_config.json's and "
        "tokenizer_config.json's 'chat_template', chat_template.json and chat_template.jinja)"
    )


def load_special_tokens(directory: str | os.PathLike) -> dict[str, str]:
    """The special tokens a template sees (``bos_token``, ``eos_token``, ...) as strings,
    from ``tokenizer_config.json``, completed by ``special_tokens_map.json``; ``{}`` without
    either file.

    Raises:
        CheckpointError: a file that cannot be read as a JSON object.
    """
    directory = as_path(directory, "directory")
    tokens: dict[str, str] = {}
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        file = directory / name
        if not file.exists():
            continue
        values = read_json(file, name)
        if not isinstance(values, dict):
            raise CheckpointError(file, None, "expected a JSON object")
        for key in SPECIAL_TOKEN_KEYS:
            value = values.get(key)
            if isinstance(value, dict):  # an AddedToken written out
                value = value.get("content")
            if isinstance(value, str) and key not in tokens:
                tokens[key] = value
    return tokens


def _pick(value: object, file: Path) -> str:
    """A template value: a string, ``{name: template}`` or ``[{"name", "template"}]``."""
    if isinstance(value, list):
        named = {item.get("name"): item.get("template") for item in value if isinstance(item, dict)}
        value = named
    if isinstance(value, dict):
        if "default" not in value:
            raise ChatTemplateError(
                f"{file}: several chat templates ({sorted(map(str, value))[:10]}) and none is "
                "named 'default'"
            )
        value = value["default"]
    if not isinstance(value, str):
        raise CheckpointError(
            file, "chat_template", f"expected a string, got {type(value).__name__}"
        )
    if len(value) > MAX_TEMPLATE_BYTES:
        raise CheckpointError(file, "chat_template", f"longer than {MAX_TEMPLATE_BYTES}: refused")
    return value


def _read_text(file: Path) -> str:
    raw = read_bounded(file, MAX_TEMPLATE_BYTES)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise CheckpointError(file, None, f"not UTF-8: {error}") from None


@dataclass(frozen=True)
class RenderedChat:
    """A rendered conversation.

    Attributes:
        text: the prompt text, image markers not yet expanded.
        spans: ``[start, end)`` character ranges of ``text`` the loss covers, in order.
    """

    text: str
    spans: list[tuple[int, int]]


class ChatTemplate:
    """A chat template compiled in the sandbox.

    Args:
        source: the Jinja source (e.g. from :func:`load_chat_template`).
        special_tokens: variables every render sees (``bos_token`` and the like, as
            transformers passes its tokenizer's ``special_tokens_map``).
        max_chars: the most characters a render may produce.
        variables: more variables every render sees, over the special tokens: what
            transformers' ``apply_chat_template(..., **kwargs)`` passes on to the template
            (Qwen3's and Qwen3.5's ``{"enable_thinking": False}``). JSON data, under names
            that are identifiers other than those the render sets itself
            (:data:`RESERVED_VARIABLES`).

    Raises:
        TypeError: ``source`` not a string; ``variables`` not a mapping.
        ValueError: a variable's name reserved or not an identifier, or its value not JSON
            data.
        ChatTemplateError: a syntax error (with its line) or a template over
            :data:`MAX_TEMPLATE_BYTES` characters.
    """

    def __init__(
        self,
        source: str,
        *,
        special_tokens: Mapping[str, str] | None = None,
        max_chars: int = MAX_OUTPUT_CHARS,
        variables: Mapping[str, Any] | None = None,
    ) -> None:
        import jinja2

        if not isinstance(source, str):
            raise TypeError(f"source: expected the template text, got {type(source).__name__}")
        if len(source) > MAX_TEMPLATE_BYTES:
            raise ChatTemplateError(f"template longer than {MAX_TEMPLATE_BYTES} characters")
        check_int(max_chars, "max_chars", low=1)
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        self.max_chars = max_chars
        self.variables = check_template_variables(variables)
        self.has_generation_tags = False
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as error:
            raise ChatTemplateError(
                f"chat template: syntax error at line {error.lineno}: {error.message}"
            ) from None
        except jinja2.TemplateError as error:  # e.g. a sandbox violation found while compiling
            raise ChatTemplateError(f"chat template: {error}") from None
        self.has_generation_tags = _uses_generation(source)

    @classmethod
    def from_directory(
        cls,
        directory: str | os.PathLike,
        *,
        max_chars: int = MAX_OUTPUT_CHARS,
        variables: Mapping[str, Any] | None = None,
    ) -> "ChatTemplate":
        """The directory's template (:func:`load_chat_template`) with its special tokens
        (:func:`load_special_tokens`) and ``variables``. Raises as those and the constructor
        do."""
        variables = check_template_variables(variables)  # before any file is read
        return cls(
            load_chat_template(directory),
            special_tokens=load_special_tokens(directory),
            max_chars=max_chars,
            variables=variables,
        )

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = False,
        **variables: Any,
    ) -> str:
        """The conversation as the template writes it (``{% generation %}`` blocks kept,
        their tags dropped), as transformers' ``apply_chat_template(tokenize=False)``.

        Args:
            messages: Hugging Face messages; only JSON data (str, int, float, bool, None,
                lists, dicts) reaches the template.
            add_generation_prompt: end with the header of an assistant turn.
            variables: more template variables (over the special tokens and the template's
                own :attr:`variables`).

        Raises:
            ChatTemplateError: the template fails (``raise_exception``, a sandbox violation,
                a type error, ...), or its output would pass ``max_chars``.
            ValueError: messages that are not JSON data or hold the private-use characters
                U+E000 / U+E001.
        """
        text, _ = self._render(messages, add_generation_prompt, variables)
        return text

    def render_with_spans(
        self, messages: Sequence[Mapping[str, Any]], **variables: Any
    ) -> RenderedChat:
        """The whole conversation and the character spans its loss covers.

        The rule: with ``{% generation %}`` tags in the template, what those blocks render
        (transformers' ``return_assistant_tokens_mask``). Otherwise, for each assistant
        message ``k``, from the end of ``render(messages[:k], add_generation_prompt=True)``
        to the end of ``render(messages[:k + 1])``, trailing whitespace left out: the
        assistant's text and what the template closes its turn with (the end-of-turn token),
        never the header the prompt already ends with. Where those renders are not prefixes
        of the whole conversation's (a template that rewrites earlier turns: Qwen3's and
        Qwen3.5's drop the reasoning of assistant turns before the last user message), the
        turn's content as the whole conversation renders it (:meth:`_content_span`) and the
        text the template closes it with in ``render(messages[:k + 1])``, where the whole
        conversation has that text next.

        Raises:
            ChatTemplateError: as :meth:`render`; a template without generation tags whose
                partial renders are not prefixes of the whole and that renders a turn's
                content elsewhere too, or changed; no span (the template renders no
                assistant turn).
        """
        text, spans = self._render(messages, False, variables)
        if not self.has_generation_tags:
            spans = []
            for k, message in enumerate(messages):
                if message.get("role") != "assistant":
                    continue
                # Rendered even for k = 0: what a template writes before any message (BOS, a
                # default system prompt) is prompt too.
                before = self._render(messages[:k], True, variables)[0]
                through = self._render(messages[: k + 1], False, variables)[0]
                if text.startswith(before) and text.startswith(through):
                    start, end = len(before), len(through.rstrip())
                else:  # a rewritten turn: its content, then how the template closes it
                    start, end = self._content_span(messages, k, variables, text)
                    closing = self._closing(messages[: k + 1], variables)
                    if text.startswith(closing, end):
                        end += len(closing)
                if end > start:
                    spans.append((start, end))
        if not spans:
            raise ChatTemplateError(
                "chat template: renders no assistant turn for this conversation, so there is "
                "nothing to train on"
            )
        return RenderedChat(text, spans)

    def _probed(
        self, messages: Sequence[Mapping[str, Any]], k: int, variables: Mapping[str, Any]
    ) -> list[str]:
        """Renders of ``messages`` with message ``k``'s content replaced by each of
        :data:`_PROBES` (in its form: a string, or one text part)."""
        content = messages[k].get("content")
        renders = []
        for probe in _PROBES:
            value = [{"type": "text", "text": probe}] if isinstance(content, list) else probe
            swapped = [*messages[:k], {**messages[k], "content": value}, *messages[k + 1 :]]
            renders.append(self._render(swapped, False, variables)[0])
        return renders

    def _content_span(
        self,
        messages: Sequence[Mapping[str, Any]],
        k: int,
        variables: Mapping[str, Any],
        text: str,
    ) -> tuple[int, int]:
        """Where ``text``, the render of ``messages``, holds message ``k``'s content: what
        differs from the renders with that content replaced by each of :data:`_PROBES`
        (which differ in their first and last characters, so that the content's own edges
        never pass for the text around it), each of which must hold its probe exactly there.

        Raises:
            ChatTemplateError: the template renders the content elsewhere too, or changed.
        """
        renders = self._probed(messages, k, variables)
        start = min(_common_prefix(text, other) for other in renders)
        tail = min(_common_prefix(text[start:][::-1], other[start:][::-1]) for other in renders)
        if any(
            other[start : len(other) - tail] != probe
            for other, probe in zip(renders, _PROBES, strict=True)
        ):
            raise ChatTemplateError(
                f"chat template: rendering the conversation up to assistant message {k} "
                "does not give a prefix of the whole conversation, and the template renders "
                "that message's content elsewhere too or changes it, so the assistant's tokens "
                "cannot be found; add {% generation %} tags around the assistant's text in "
                "the template"
            )
        return start, len(text) - tail

    def _closing(self, messages: Sequence[Mapping[str, Any]], variables: Mapping[str, Any]) -> str:
        """What the template writes after the content of the last message, an assistant's
        (its end-of-turn token), trailing whitespace left out: where the renders with that
        content replaced by each of :data:`_PROBES` end alike; empty if a probe is not just
        before it."""
        renders = self._probed(messages, len(messages) - 1, variables)
        tail = _common_prefix(renders[0][::-1], renders[1][::-1])
        if not all(
            other[: len(other) - tail].endswith(probe)
            for other, probe in zip(renders, _PROBES, strict=True)
        ):
            return ""
        return renders[0][len(renders[0]) - tail :].rstrip()

    def _render(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool,
        variables: Mapping[str, Any],
    ) -> tuple[str, list[tuple[int, int]]]:
        import jinja2

        context = {
            **self.special_tokens,
            **self.variables,
            **_plain(dict(variables), "variables"),
            "messages": _plain(list(messages), "messages"),
            "tools": None,
            "documents": None,
            "add_generation_prompt": bool(add_generation_prompt),
        }
        pieces, size = [], 0
        try:
            for piece in self._template.generate(context):
                size += len(piece)
                if size > self.max_chars:
                    raise ChatTemplateError(
                        f"chat template: output longer than {self.max_chars} characters: refused"
                    )
                pieces.append(piece)
        except ChatTemplateError:
            raise
        except jinja2.exceptions.SecurityError as error:
            raise ChatTemplateError(f"chat template: refused by the sandbox: {error}") from None
        except jinja2.TemplateError as error:  # raise_exception, undefined names, includes
            raise ChatTemplateError(f"chat template: {type(error).__name__}: {error}") from None
        except TypeError as error:
            if "no loader" in str(error):  # include, import, extends, from
                raise ChatTemplateError(
                    "chat template: include, import and extends are refused (a template cannot "
                    "read files)"
                ) from None
            raise ChatTemplateError(f"chat template: TypeError: {error}") from None
        except (ValueError, ArithmeticError, LookupError, AttributeError) as error:
            raise ChatTemplateError(f"chat template: {type(error).__name__}: {error}") from None
        except RecursionError:
            raise ChatTemplateError("chat template: recursion too deep") from None
        return _take_spans("".join(pieces))


def _take_spans(marked: str) -> tuple[str, list[tuple[int, int]]]:
    """Remove the generation markers from a render; their spans in the clean text."""
    out, spans, start, length = [], [], None, 0
    for index, part in enumerate(marked.split(GENERATION_START)):
        if index and start is not None:
            raise ChatTemplateError("chat template: nested {% generation %} blocks")
        if index:
            start = length
        ends = part.split(GENERATION_END)
        if len(ends) > 2 or (len(ends) == 2 and start is None):
            raise ChatTemplateError("chat template: unbalanced {% generation %} blocks")
        out.append(ends[0])
        length += len(ends[0])
        if len(ends) == 2:
            assert start is not None
            if length > start:
                spans.append((start, length))
            start = None
            out.append(ends[1])
            length += len(ends[1])
    if start is not None:
        raise ChatTemplateError("chat template: unbalanced {% generation %} blocks")
    return "".join(out), spans


def _common_prefix(a: str, b: str) -> int:
    """The length of the longest common prefix of ``a`` and ``b``."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def check_template_variables(variables: Mapping[str, Any] | None) -> dict[str, Any]:
    """``variables`` as a template sees them (plain JSON data), every name checked (see
    :class:`ChatTemplate`'s ``variables``).

    Raises:
        TypeError: ``variables`` not a mapping.
        ValueError: a name reserved or not an identifier; a value that is not JSON data.
    """
    if variables is None:
        return {}
    if not isinstance(variables, Mapping):
        raise TypeError(
            f"variables: expected a mapping of names to JSON data, got {type(variables).__name__}"
        )
    for name in variables:
        if not isinstance(name, str) or not name.isidentifier() or name in RESERVED_VARIABLES:
            raise ValueError(
                f"variables: expected names that are identifiers other than "
                f"{sorted(RESERVED_VARIABLES)}, got {name!r}"
            )
    return {name: _plain(value, f"variables.{name}") for name, value in variables.items()}


def _plain(value: Any, where: str) -> Any:
    """JSON data rebuilt from plain types (subclasses and other objects refused), so the
    template sees no method beyond those of str, int, float, list and dict."""
    if value is None or type(value) in (int, float, bool):
        return value
    if isinstance(value, str):
        if GENERATION_START in value or GENERATION_END in value:
            raise ValueError(f"{where}: holds U+E000 or U+E001, reserved for generation markers")
        return str.__str__(value)
    if isinstance(value, int):  # subclasses (enums, numpy ints) carry more methods
        return bool(value) if isinstance(value, bool) else int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k, where): _plain(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(item, f"{where}[{i}]") for i, item in enumerate(value)]
    raise ValueError(f"{where}: expected JSON data, got {type(value).__name__}")


def _uses_generation(source: str) -> bool:
    import re

    return re.search(r"\{%-?\s*generation\s*-?%\}", source) is not None


_ENVIRONMENT: Any = None


def _environment() -> Any:
    """The one sandboxed environment (built on first use: jinja2 is imported lazily)."""
    global _ENVIRONMENT
    if _ENVIRONMENT is None:
        _ENVIRONMENT = _build_environment()
    return _ENVIRONMENT


def _build_environment() -> Any:
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}``: marks what the assistant writes."""

        tags = {"generation"}  # noqa: RUF012 (Jinja reads the class attribute)

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = self.call_method("_mark")
            return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        def _mark(self, caller: Any) -> str:
            return f"{GENERATION_START}{caller()}{GENERATION_END}"

    def raise_exception(message: object) -> None:
        raise jinja2.TemplateError(str(message))

    def tojson(
        value: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: tuple[str, str] | None = None,
        sort_keys: bool = False,
    ) -> str:
        # Jinja's own tojson escapes HTML characters; transformers' writes plain JSON.
        return json.dumps(
            value,
            ensure_ascii=ensure_ascii,
            indent=indent,
            separators=separators,
            sort_keys=sort_keys,
        )

    def strftime_now(format: str) -> str:
        return datetime.now().strftime(format)

    class Namespace(jinja2.utils.Namespace):
        """Jinja's ``namespace``, refusing attribute names starting with ``_``."""

        def __init__(*args: Any, **kwargs: Any) -> None:  # Jinja's signature: self in args
            self, rest = args[0], args[1:]
            attributes = dict(*rest, **kwargs)
            for name in attributes:
                _check_name(name)
            jinja2.utils.Namespace.__init__(self, attributes)

        def __setitem__(self, name: str, value: Any) -> None:
            _check_name(name)
            if isinstance(value, str | list | tuple) and len(value) > MAX_OUTPUT_CHARS:
                _refuse(f"a value of {len(value)} items is too large to keep")
            jinja2.utils.Namespace.__setitem__(self, name, value)

    def _check_name(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"a namespace attribute may not start with '_', got {name!r}"
            )

    class Dict:
        """``dict(...)`` and ``dict.fromkeys(...)``, without the type itself to climb from."""

        def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any) -> dict[Any, Any]:
            return dict.fromkeys(*args)

    class Sandbox(ImmutableSandboxedEnvironment):
        """The immutable sandbox, also refusing single steps that would build a huge value
        (a repeated string, a wide format, a huge power, a huge count passed to a call or a
        filter) before they allocate it, and unsafe attributes at the first access."""

        intercepted_binops = frozenset({"*", "**", "%", "+"})

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            _check_binop(operator, left, right)
            return super().call_binop(context, operator, left, right)

        def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
            _check_arguments(args, kwargs)
            target = getattr(__obj, "__wrapped__", __obj)  # the sandbox wraps str.format
            if getattr(target, "__name__", "") in ("format", "format_map"):
                if isinstance(getattr(target, "__self__", None), str):
                    _check_format(target.__self__)
            return super().call(__context, __obj, *args, **kwargs)

        def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
            raise jinja2.exceptions.SecurityError(
                f"access to attribute {attribute!r} of a {type(obj).__name__!r} object is unsafe"
            )

    environment = Sandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[Generation, jinja2.ext.loopcontrols],
        autoescape=False,
        loader=None,
    )
    environment.filters.update(
        {name: _bounded(function) for name, function in environment.filters.items()}
    )
    environment.filters["tojson"] = tojson
    environment.globals.update(
        raise_exception=raise_exception,
        strftime_now=strftime_now,
        namespace=Namespace,
        dict=Dict(),
    )
    return environment


def _refuse(message: str) -> None:
    import jinja2

    raise jinja2.exceptions.SecurityError(message)


def _check_arguments(args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    """No call or filter gets a count above :data:`MAX_OUTPUT_CHARS` (``center(10**10)``,
    ``lipsum(10**9)``): no template needs one, and it could allocate that much."""
    for value in (*args, *kwargs.values()):
        if is_int(value) and abs(value) > MAX_OUTPUT_CHARS:
            _refuse(f"the number {value} is too large (at most {MAX_OUTPUT_CHARS})")


def _check_binop(operator: str, left: Any, right: Any) -> None:
    sized = (str, list, tuple)
    if operator == "**" and is_int(left) and is_int(right) and abs(left) > 1 and right > 256:
        _refuse(f"{left} ** {right} is too large")
    if operator == "*":
        for items, count in ((left, right), (right, left)):
            if isinstance(items, sized) and is_int(count) and len(items) * count > MAX_OUTPUT_CHARS:
                _refuse(f"repeating {len(items)} items {count} times is too large")
    if operator == "+" and isinstance(left, sized) and isinstance(right, sized):
        if len(left) + len(right) > MAX_OUTPUT_CHARS:
            _refuse(f"a concatenation of {len(left) + len(right)} items is too large")
    if operator == "%" and isinstance(left, str):
        _check_format(left)


def _check_format(text: str) -> None:
    """Widths and precisions of ``%`` and ``str.format`` fields stay below 7 digits."""
    import re

    if re.search(r"%[-+ #0*]*\d{7,}|%[^a-zA-Z%]*\.\d{7,}|\{[^{}]*:[^{}]*\d{7,}[^{}]*\}", text):
        _refuse("a format field wider than 999,999 characters")


def _bounded(function: Any) -> Any:
    """A Jinja filter that refuses huge counts (:func:`_check_arguments`); Jinja's
    ``pass_context`` / ``pass_environment`` marks are kept (``functools.wraps`` copies them)."""
    import functools

    @functools.wraps(function)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        _check_arguments(args, kwargs)
        return function(*args, **kwargs)

    return bounded
