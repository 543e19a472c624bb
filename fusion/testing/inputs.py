"""Hypothesis strategies that draw complete inputs for a user's own fusion model.

An encoder is described by :class:`EncoderSpec` (its name, placeholder id, rows per input and
a strategy for one of its inputs), or read from an :class:`fusion.EarlyFusion`. Then
:func:`fusion_inputs` draws token batches with placeholders at random places and in random
numbers per sample (none at all; nothing but placeholders), the matching encoder inputs, a
layout for the encoder rows (packed or padded) and the batch's padding (none, left or right,
with the mask and positions that go with it):

    >>> audio = {"audio": (3, tensors(1, 400))}  # 3 rows per clip; one clip is [1, 400]
    >>> @given(inputs=fusion_inputs(model, audio))
    ... def test_my_model(inputs):
    ...     logits = inputs.run(model)
"""

import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from hypothesis import strategies as st
from torch import nn

from fusion._validation import is_int
from fusion.early_fusion import EarlyFusion
from fusion.merge import Packed, Padded

PADDINGS = ("none", "left", "right")
LAYOUTS = ("packed", "padded")
# What fills padded rows past a sample's placeholders: any finite value must be ignored.
PADDING_ROW_VALUE = 1e3


def tensors(
    *shape: int, dtype: torch.dtype = torch.float32, scale: float = 1.0
) -> st.SearchStrategy[torch.Tensor]:
    """Random tensors of ``shape``: ``scale`` times standard normal values from a drawn seed
    (so an example shrinks to seed 0), cast to ``dtype``.

    Raises:
        ValueError: a negative or non-integer dimension, a non-floating ``dtype``, or a
            ``scale`` that is not a finite number.
    """
    if not all(is_int(n, 0) for n in shape):
        raise ValueError(f"shape: expected non-negative integers, got {shape!r}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype: expected a floating torch dtype, got {dtype!r}")
    if isinstance(scale, bool) or not isinstance(scale, int | float) or not abs(scale) < 1e30:
        raise ValueError(f"scale: expected a finite number, got {scale!r}")

    def make(seed: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(seed)
        return (torch.randn(shape, generator=generator) * scale).to(dtype)

    return st.integers(0, 2**32 - 1).map(make)


@dataclass(frozen=True)
class EncoderSpec:
    """How to draw inputs for one encoder.

    Args:
        name: the encoder's name (its key in ``EarlyFusion.encoders``).
        placeholder_id: the token id its rows replace.
        rows_per_input: rows the encoder returns per input (e.g. 3 per audio clip).
        one_input: a strategy for ONE input, without a batch dimension: a tensor (passed as
            ``argument``) or a mapping of keyword arguments to tensors. Inputs of a batch are
            stacked along a new first dimension, in order of appearance over the batch.
        argument: the encoder's keyword argument when ``one_input`` draws tensors.

    Raises:
        ValueError: an empty ``name``, a ``placeholder_id`` or ``rows_per_input`` that is
            not a non-negative (positive) integer, ``one_input`` not a strategy, or a bad
            ``argument``.
    """

    name: str
    placeholder_id: int
    rows_per_input: int
    one_input: st.SearchStrategy
    argument: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name: expected a non-empty string, got {self.name!r}")
        for field, value, low in (
            ("placeholder_id", self.placeholder_id, 0),
            ("rows_per_input", self.rows_per_input, 1),
        ):
            if not is_int(value, low):
                raise ValueError(
                    f"{field}: expected an integer >= {low} for encoder {self.name!r}, "
                    f"got {value!r}"
                )
        if not isinstance(self.one_input, st.SearchStrategy):
            raise ValueError(
                f"one_input: expected a Hypothesis strategy for encoder {self.name!r}, got "
                f"{type(self.one_input).__name__}"
            )
        if self.argument is not None and (
            not isinstance(self.argument, str) or not self.argument.isidentifier()
        ):
            raise ValueError(
                f"argument: expected a keyword argument name for encoder {self.name!r}, "
                f"got {self.argument!r}"
            )


def _single_argument(encoder: nn.Module, name: str) -> str | None:
    """The name of the encoder's only required argument, or None."""
    try:
        parameters = inspect.signature(encoder.forward).parameters.values()
    except (TypeError, ValueError):
        return None
    required = [
        p.name
        for p in parameters
        if p.default is inspect.Parameter.empty
        and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]
    return required[0] if len(required) == 1 else None


def encoder_specs(
    model: EarlyFusion, inputs: Mapping[str, tuple[int, st.SearchStrategy]]
) -> list[EncoderSpec]:
    """:class:`EncoderSpec` s of ``model``'s encoders: names and placeholder ids from the
    model, ``inputs[name] = (rows_per_input, one_input)`` from the caller. A ``one_input``
    that draws tensors goes to the encoder's only required argument.

    Raises:
        TypeError: ``model`` is not an :class:`fusion.EarlyFusion`.
        ValueError: ``inputs`` names other encoders than the model's, or an entry is not a
            pair ``(rows_per_input, strategy)``.
    """
    if not isinstance(model, EarlyFusion):
        raise TypeError(f"model: expected an EarlyFusion, got {type(model).__name__}")
    if not isinstance(inputs, Mapping) or set(inputs) != set(model.encoders):
        got = sorted(inputs) if isinstance(inputs, Mapping) else type(inputs).__name__
        raise ValueError(
            f"inputs: expected one entry per encoder of the model {sorted(model.encoders)}, "
            f"got {got}"
        )
    specs = []
    for name, entry in inputs.items():
        if not isinstance(entry, tuple) or len(entry) != 2:
            raise ValueError(
                f"inputs[{name!r}]: expected (rows_per_input, strategy of one input), "
                f"got {entry!r:.80}"
            )
        rows, one_input = entry
        argument = _single_argument(model.encoders[name], name)
        specs.append(EncoderSpec(name, model.encoder_tokens[name], rows, one_input, argument))
    return specs


@dataclass(frozen=True)
class FusionInputs:
    """One drawn batch for a fusion model.

    Attributes:
        tokens: ids [b, s], padded with ``pad_id`` where ``padding`` says.
        starts: [b] slot of each sample's first real token (> 0 only with left padding).
        lengths: [b] real tokens per sample (at least 1).
        padding: ``"none"``, ``"left"`` or ``"right"``.
        layout: ``"packed"`` (the encoders run inside the model's forward) or ``"padded"``
            (their rows are computed first and passed as :class:`fusion.Padded`).
        encoder_input: encoder name -> keyword arguments, each input batched along the first
            dimension in order of appearance over the batch (encoders with no input in this
            batch are absent).
        inputs_per_sample: encoder name -> inputs of each sample (b counts).
        rows_per_input: encoder name -> rows the encoder returns per input.
        encoder_tokens: encoder name -> placeholder id.
        extra_width: padded layout only: padding rows beyond the sample with most rows.
        pad_id: the id in padding slots.
    """

    tokens: torch.Tensor
    starts: torch.Tensor
    lengths: torch.Tensor
    padding: str
    layout: str
    encoder_input: dict[str, dict[str, torch.Tensor]]
    inputs_per_sample: dict[str, tuple[int, ...]]
    rows_per_input: dict[str, int]
    encoder_tokens: dict[str, int]
    extra_width: int = 0
    pad_id: int = 0

    @property
    def batch_size(self) -> int:
        return self.tokens.size(0)

    @property
    def mask(self) -> torch.Tensor | None:
        """Boolean [b, s, s] (True: may attend): each real token attends to the real tokens
        of its sample up to itself; a pad slot to itself only (never read, and attending to
        nothing would give NaN). None without padding (causal)."""
        if self.padding == "none":
            return None
        seq_len = self.tokens.size(1)
        queries = torch.arange(seq_len)[:, None]
        keys = torch.arange(seq_len)[None, :]
        start, end = self.starts[:, None, None], (self.starts + self.lengths)[:, None, None]
        real_keys, real_queries = (
            (keys >= start) & (keys < end),
            (queries >= start) & (queries < end),
        )
        return ((keys <= queries) & real_keys & real_queries) | (keys == queries)

    @property
    def input_pos(self) -> torch.Tensor | None:
        """Positions [b, s]: 0 at each sample's first real token (pad slots 0); None without
        padding."""
        if self.padding == "none":
            return None
        slots = torch.arange(self.tokens.size(1))[None, :]
        return (slots - self.starts[:, None]).clamp_min(0)

    def real_slots(self, i: int) -> slice:
        """The slots of sample ``i``'s real tokens."""
        start = int(self.starts[i])
        return slice(start, start + int(self.lengths[i]))

    def rows(self, model: EarlyFusion, layout: str | None = None) -> dict[str, Any]:
        """``encoder_input`` for ``model`` in ``layout`` (default: the drawn one): the encoders'
        keyword arguments (packed: the encoders run in the forward), or their rows computed
        by ``model.encode`` and laid out per sample as :class:`fusion.Padded`, with
        ``extra_width`` rows of padding."""
        layout = self.layout if layout is None else layout
        if layout not in LAYOUTS:
            raise ValueError(f"layout: expected one of {list(LAYOUTS)}, got {layout!r}")
        if layout == "packed":
            return dict(self.encoder_input)
        encoded = model.encode(self.encoder_input)
        return {name: self.to_padded(name, rows) for name, rows in encoded.items()}

    def to_padded(self, name: str, rows: torch.Tensor | Packed | Padded) -> Padded:
        """Encoder ``name``'s rows (packed over the batch, as an encoder returns them) as
        :class:`fusion.Padded` [b, widest + extra_width, d]; padding rows hold
        :data:`PADDING_ROW_VALUE`.

        Raises:
            ValueError: the number of rows is not the placeholders' count.
        """
        if isinstance(rows, Padded):
            return rows
        tensor = rows.rows if isinstance(rows, Packed) else rows
        flat = tensor.reshape(-1, tensor.size(-1))  # [n_inputs, rows, d] or [n_rows, d]
        per_input = self.rows_per_input[name]
        counts = [n * per_input for n in self.inputs_per_sample[name]]
        if flat.size(0) != sum(counts):
            raise ValueError(
                f"rows[{name!r}]: expected {sum(counts)} rows ({per_input} per input), got "
                f"{flat.size(0)}"
            )
        width = max(counts) + self.extra_width
        padded = flat.new_full((self.batch_size, width, flat.size(-1)), PADDING_ROW_VALUE)
        for i, chunk in enumerate(flat.split(counts)):
            padded[i, : chunk.size(0)] = chunk
        return Padded(padded)

    def kwargs(self, model: EarlyFusion, layout: str | None = None) -> dict[str, Any]:
        """Keyword arguments of ``model(...)``: tokens, mask, positions and encoder input."""
        return {
            "tokens": self.tokens,
            "mask": self.mask,
            "input_pos": self.input_pos,
            "encoder_input": self.rows(model, layout),
        }

    def run(self, model: EarlyFusion, layout: str | None = None) -> Any:
        """``model(**self.kwargs(model, layout))``."""
        return model(**self.kwargs(model, layout))

    def sample(self, i: int) -> "FusionInputs":
        """Sample ``i`` alone: its real tokens only (no padding) and its own encoder inputs."""
        if not 0 <= i < self.batch_size:
            raise ValueError(f"i: expected a sample index in [0, {self.batch_size}), got {i}")
        encoder_input: dict[str, dict[str, torch.Tensor]] = {}
        per_sample: dict[str, tuple[int, ...]] = {}
        for name, count in self.inputs_per_sample.items():
            before, mine = sum(count[:i]), count[i]
            per_sample[name] = (mine,)
            if mine and name in self.encoder_input:
                encoder_input[name] = {
                    key: value[before : before + mine]
                    for key, value in self.encoder_input[name].items()
                }
        return replace(
            self,
            tokens=self.tokens[i : i + 1, self.real_slots(i)],
            starts=torch.zeros(1, dtype=torch.long),
            lengths=self.lengths[i : i + 1],
            padding="none",
            encoder_input=encoder_input,
            inputs_per_sample=per_sample,
        )

    def text_only(self) -> "FusionInputs":
        """The same batch with every placeholder replaced by a text id (the smallest id that
        is no placeholder) and no encoder input."""
        text_id = min(set(range(len(self.encoder_tokens) + 1)) - set(self.encoder_tokens.values()))
        tokens = self.tokens.clone()
        for placeholder in self.encoder_tokens.values():
            tokens[tokens == placeholder] = text_id
        return replace(
            self,
            tokens=tokens,
            encoder_input={},
            inputs_per_sample={name: (0,) * self.batch_size for name in self.inputs_per_sample},
        )


def fusion_inputs(
    encoders: EarlyFusion | Sequence[EncoderSpec],
    inputs: Mapping[str, tuple[int, st.SearchStrategy]] | None = None,
    *,
    vocab_size: int | None = None,
    max_batch: int = 3,
    max_seq_len: int | None = None,
    max_inputs_per_sample: int = 2,
    paddings: Sequence[str] = PADDINGS,
    layouts: Sequence[str] = LAYOUTS,
    pad_id: int = 0,
) -> st.SearchStrategy[FusionInputs]:
    """Complete inputs for a fusion model, as :class:`FusionInputs`.

    Each sample is a random sequence of text runs and encoder inputs (each input's
    ``rows_per_input`` placeholders in a row): samples without placeholders, samples of
    placeholders only, several inputs of several encoders. Text ids are drawn below
    ``vocab_size``, never equal to a placeholder id. With padding ``"none"`` every sample
    has the same length; ``"left"`` / ``"right"`` pad shorter samples with ``pad_id``.
    Examples shrink towards one short sample of text with few placeholders.

    Args:
        encoders: an :class:`fusion.EarlyFusion` (then ``inputs`` gives, per encoder,
            ``(rows_per_input, strategy of one input)``) or a list of :class:`EncoderSpec`.
        vocab_size: text ids are below it (default: the model decoder's vocabulary).
        max_batch: most samples in a batch.
        max_seq_len: longest sample (default: ``min(24, decoder.max_seq_len)`` for a model,
            else 24).
        max_inputs_per_sample: most encoder inputs per sample.
        paddings: which paddings to draw from (``"none"``, ``"left"``, ``"right"``).
        layouts: which row layouts to draw from (``"packed"``, ``"padded"``).
        pad_id: the id in padding slots.

    Raises:
        TypeError: ``encoders`` is neither a model nor a list of :class:`EncoderSpec`.
        ValueError: naming the argument: sizes that are not positive integers, no text id
            left below ``vocab_size``, repeated encoder names or placeholder ids, an encoder
            whose rows do not fit in ``max_seq_len``, unknown paddings or layouts; raised when
            the strategy is built, not when it is drawn from.
    """
    if isinstance(encoders, EarlyFusion):
        model = encoders
        specs = encoder_specs(model, inputs or {})
        vocab_size = model.decoder.vocab_size if vocab_size is None else vocab_size
        if max_seq_len is None:
            max_seq_len = min(24, model.decoder.max_seq_len)
    else:
        if inputs is not None:
            raise ValueError("inputs: only with a model; EncoderSpecs carry their own inputs")
        if isinstance(encoders, str | bytes) or not all(
            isinstance(s, EncoderSpec) for s in encoders
        ):
            raise TypeError(
                f"encoders: expected an EarlyFusion or a list of EncoderSpec, got "
                f"{type(encoders).__name__}"
            )
        specs = list(encoders)
        if vocab_size is None:
            raise ValueError("vocab_size: expected the decoder's vocabulary size, got None")
    max_seq_len = 24 if max_seq_len is None else max_seq_len
    for name, value in (
        ("vocab_size", vocab_size),
        ("max_batch", max_batch),
        ("max_seq_len", max_seq_len),
        ("max_inputs_per_sample", max_inputs_per_sample),
    ):
        if not is_int(value, 1):
            raise ValueError(f"{name}: expected a positive integer, got {value!r}")
    if not is_int(pad_id, 0):
        raise ValueError(f"pad_id: expected an integer >= 0, got {pad_id!r}")
    names = [s.name for s in specs]
    ids = [s.placeholder_id for s in specs]
    if len(set(names)) != len(names) or len(set(ids)) != len(ids):
        raise ValueError(f"encoders: expected distinct names and placeholder ids, got {specs!r}")
    text_ids = vocab_size - len({i for i in ids if i < vocab_size})
    if text_ids < 1:
        raise ValueError(
            f"vocab_size: expected text ids besides the placeholders, got {vocab_size}"
        )
    for spec in specs:
        if spec.rows_per_input > max_seq_len:
            raise ValueError(
                f"max_seq_len: expected room for one input of encoder {spec.name!r} "
                f"({spec.rows_per_input} rows), got {max_seq_len}"
            )
    # Without an argument name, one input must be a mapping of keyword arguments.
    specs = [
        s if s.argument is not None else replace(s, one_input=s.one_input.map(_checker(s)))
        for s in specs
    ]
    for arg, values, allowed in (("paddings", paddings, PADDINGS), ("layouts", layouts, LAYOUTS)):
        values = tuple(values)
        if not values or not set(values) <= set(allowed):
            raise ValueError(f"{arg}: expected some of {list(allowed)}, got {values!r}")
    return _fusion_inputs(
        tuple(specs),
        vocab_size,
        max_batch,
        max_seq_len,
        max_inputs_per_sample,
        tuple(paddings),
        tuple(layouts),
        pad_id,
    )


def _checker(spec: EncoderSpec) -> Any:
    def check(value: Any) -> Any:
        if not isinstance(value, Mapping):
            raise ValueError(
                f"one_input: encoder {spec.name!r} drew a {type(value).__name__}; give "
                "`argument` (the encoder's keyword) or draw a mapping of keyword arguments"
            )
        return value

    return check


def _text_id(index: int, placeholders: list[int]) -> int:
    """The ``index``-th id that is not a placeholder."""
    for placeholder in placeholders:  # sorted
        if index >= placeholder:
            index += 1
    return index


@st.composite
def _fusion_inputs(
    draw: st.DrawFn,
    specs: tuple[EncoderSpec, ...],
    vocab_size: int,
    max_batch: int,
    max_seq_len: int,
    max_inputs: int,
    paddings: tuple[str, ...],
    layouts: tuple[str, ...],
    pad_id: int,
) -> FusionInputs:
    placeholders = sorted(s.placeholder_id for s in specs if s.placeholder_id < vocab_size)
    n_text = vocab_size - len(placeholders)
    text = st.integers(0, n_text - 1).map(lambda i: _text_id(i, placeholders))
    batch = draw(st.integers(1, max_batch))
    padding = draw(st.sampled_from(paddings))
    layout = draw(st.sampled_from(layouts))

    samples: list[list[int]] = []
    media: list[list[int]] = []  # per sample: spec indices of its inputs, in order
    for _ in range(batch):
        tokens: list[int] = []
        mine: list[int] = []
        while True:
            room = max_seq_len - len(tokens)
            fits = [k for k, s in enumerate(specs) if s.rows_per_input <= room]
            kinds = ["end"] if tokens else []  # every sample has at least one token
            kinds += ["text"] if room > 0 else []
            kinds += ["input"] if fits and len(mine) < max_inputs else []
            kind = draw(st.sampled_from(kinds))
            if kind == "end":
                break
            if kind == "input":
                k = draw(st.sampled_from(fits))
                mine.append(k)
                tokens += [specs[k].placeholder_id] * specs[k].rows_per_input
            else:
                run = draw(st.integers(1, max(1, min(room, 6))))
                tokens += [draw(text) for _ in range(run)]
        samples.append(tokens)
        media.append(mine)

    width = max(len(t) for t in samples)
    if padding == "none":  # every sample as long as the longest: more text at the end
        for tokens in samples:
            tokens += [draw(text) for _ in range(width - len(tokens))]
    padded = torch.full((batch, width), pad_id, dtype=torch.long)
    starts = torch.zeros(batch, dtype=torch.long)
    lengths = torch.tensor([len(t) for t in samples], dtype=torch.long)
    for i, tokens in enumerate(samples):
        start = width - len(tokens) if padding == "left" else 0
        starts[i] = start
        padded[i, start : start + len(tokens)] = torch.tensor(tokens, dtype=torch.long)

    encoder_input: dict[str, dict[str, torch.Tensor]] = {}
    for k, spec in enumerate(specs):
        drawn = [draw(spec.one_input) for mine in media for j in mine if j == k]
        if not drawn:
            continue
        if spec.argument is not None and not isinstance(drawn[0], Mapping):
            drawn = [{spec.argument: value} for value in drawn]
        encoder_input[spec.name] = {
            key: torch.stack([value[key] for value in drawn]) for key in drawn[0]
        }
    return FusionInputs(
        tokens=padded,
        starts=starts,
        lengths=lengths,
        padding=padding,
        layout=layout,
        encoder_input=encoder_input,
        inputs_per_sample={
            s.name: tuple(mine.count(k) for mine in media) for k, s in enumerate(specs)
        },
        rows_per_input={s.name: s.rows_per_input for s in specs},
        encoder_tokens={s.name: s.placeholder_id for s in specs},
        extra_width=draw(st.integers(0, 2)) if layout == "padded" else 0,
        pad_id=pad_id,
    )
