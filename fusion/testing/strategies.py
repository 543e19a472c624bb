"""Hypothesis strategies for property-testing early-fusion models and merges.

Wrapping trees:
    >>> @given(tree=wrapping_trees(n_models=2))
    ... def test_keys(tree):
    ...     root, prefixes = tree.build([fusion_a, fusion_b])

Merges:
    >>> @given(case=merge_inputs())
    ... def test_merge(case):
    ...     merge_embeddings(case.tokens, case.weight, case.encoder_rows, case.encoder_tokens)
"""

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

import torch
from hypothesis import strategies as st
from torch import nn

from fusion._validation import is_int
from fusion.merge import Packed, Padded

# Attribute names that collide with what wrappers and fusion models use themselves.
ADVERSARIAL_NAMES = ("decoder", "tok_embeddings", "module", "_orig_mod", "encoders", "layers")


_FIRST = "abcdefghijklmnopqrstuvwxyz_"
_DIGITS = "0123456789"


def module_names() -> st.SearchStrategy[str]:
    """Valid ``nn.Module`` attribute names, biased towards adversarial ones (``decoder``,
    ``module``, ``_orig_mod``, ...) and names with digits.

    Built from small explicit alphabets (not regular expressions, whose first use builds
    Hypothesis' unicode tables: seconds on a cold start)."""
    plain = st.builds(str.__add__, st.sampled_from(_FIRST), st.text(_FIRST + _DIGITS, max_size=7))
    with_digits = st.builds(
        str.__add__,
        st.text(_FIRST, min_size=1, max_size=4),
        st.text(_DIGITS, min_size=1, max_size=3),
    )
    # Attributes of the containers themselves (`training`, `pop`, `keys`, dunder names) are not
    # valid child names.
    return st.one_of(st.sampled_from(ADVERSARIAL_NAMES), plain, with_digits).filter(
        lambda name: (
            not name.startswith("__")
            and not any(
                hasattr(kind, name) for kind in (nn.ModuleDict, nn.Sequential, nn.ModuleList)
            )
        )
    )


class _Custom(nn.Module):
    """A user-style wrapper whose children sit under arbitrary attribute names."""

    def __init__(self, children: dict[str, nn.Module]) -> None:
        super().__init__()
        for name, child in children.items():
            setattr(self, name, child)


@dataclass(frozen=True)
class WrappingTree:
    """A description of a module tree with ``n_models`` leaves; build it around any models.

    ``spec`` is nested: ``("leaf", i)``, ``("sequential", [spec, ...])``,
    ``("list", [spec, ...])``, ``("dict", {name: spec})`` or ``("custom", {name: spec})``.
    """

    spec: tuple
    n_models: int

    def build(self, models: Sequence[nn.Module]) -> tuple[nn.Module, list[str]]:
        """Wrap ``models`` (one per leaf). Returns the root and each model's key prefix
        (``""`` at depth 0, otherwise ending in ``"."``)."""
        if len(models) != self.n_models:
            raise ValueError(f"models: expected {self.n_models} models, got {len(models)}")
        prefixes = [""] * self.n_models
        return self._build(self.spec, models, prefixes, ""), prefixes

    def _build(self, spec: tuple, models, prefixes: list[str], prefix: str) -> nn.Module:
        kind, children = spec
        if kind == "leaf":
            prefixes[children] = prefix
            return models[children]
        if kind in ("sequential", "list"):
            items = [
                self._build(c, models, prefixes, f"{prefix}{i}.") for i, c in enumerate(children)
            ]
            return nn.Sequential(*items) if kind == "sequential" else nn.ModuleList(items)
        named = {n: self._build(c, models, prefixes, f"{prefix}{n}.") for n, c in children.items()}
        return nn.ModuleDict(named) if kind == "dict" else _Custom(named)


@st.composite
def _tree_spec(draw: st.DrawFn, leaves: list[int], depth: int) -> tuple:
    """A spec of exactly ``depth`` levels above its deepest leaf (callers give ``depth >= 1``
    whenever ``leaves`` holds several models)."""
    if depth == 0:
        return ("leaf", leaves[0])
    kind = draw(st.sampled_from(["sequential", "list", "dict", "custom"]))
    if depth == 1:
        groups = [[leaf] for leaf in leaves]
    else:
        cuts = draw(st.sets(st.integers(1, len(leaves) - 1), max_size=2)) if len(leaves) > 1 else ()
        bounds = [0, *sorted(cuts), len(leaves)]
        groups = [leaves[a:b] for a, b in pairwise(bounds)]
    children = [
        draw(_tree_spec(group, draw(st.integers(1 if len(group) > 1 else 0, depth - 1))))
        for group in groups
    ]
    if draw(st.booleans()):  # an empty sibling container shifts integer prefixes
        children.insert(draw(st.integers(0, len(children))), ("list", []))
    if kind in ("sequential", "list"):
        return (kind, children)
    names = draw(
        st.lists(module_names(), min_size=len(children), max_size=len(children), unique=True)
    )
    return (kind, dict(zip(names, children, strict=True)))


def wrapping_trees(n_models: int = 1, max_depth: int = 4) -> st.SearchStrategy[WrappingTree]:
    """Trees of ``nn.Sequential`` (integer prefixes), ``nn.ModuleList``, ``nn.ModuleDict`` and
    custom modules with random (often adversarial) attribute names, nesting depth 0 to
    ``max_depth``, holding ``n_models`` models (e.g. policy and reference)."""
    for name, value in (("n_models", n_models), ("max_depth", max_depth)):
        if not is_int(value):
            raise ValueError(f"{name}: expected an integer, got {value!r}")
    if n_models < 1 or max_depth < (0 if n_models == 1 else 1):
        raise ValueError(
            f"n_models, max_depth: expected n_models >= 1 and room for a container around "
            f"several models, got n_models={n_models}, max_depth={max_depth}"
        )
    depths = st.integers(0 if n_models == 1 else 1, max_depth)
    return depths.flatmap(
        lambda depth: _tree_spec(list(range(n_models)), depth).map(
            lambda spec: WrappingTree(spec, n_models)
        )
    )


@dataclass(frozen=True)
class MergeCase:
    """Inputs of :func:`fusion.merge_embeddings` with a valid placeholder/row correspondence."""

    tokens: torch.Tensor  # [b, s]
    weight: torch.Tensor  # [vocab, d]
    encoder_rows: dict[str, Packed | Padded]
    encoder_tokens: dict[str, int]


def merge_inputs(
    max_batch: int = 4,
    max_seq_len: int = 24,
    vocab_size: int = 32,
    dims: Sequence[int] = (1, 4, 8),
    max_encoders: int = 3,
    dtypes: Sequence[torch.dtype] = (torch.float32, torch.bfloat16),
) -> st.SearchStrategy[MergeCase]:
    """Random merges: batch sizes, lengths, placeholder positions and densities (0% to 100%),
    uneven per-sample counts, several encoders, placeholder ids inside and outside the
    vocabulary, packed and padded layouts (padding wider than needed), non-contiguous rows.

    Raises:
        ValueError: ``max_batch``, ``vocab_size``, ``max_encoders`` not positive integers,
            ``max_seq_len`` negative, ``vocab_size <= max_encoders`` (text ids must never equal
            a placeholder id), ``dims`` not positive integers, ``dtypes`` not floating dtypes;
            raised when the strategy is built, not when it is drawn from.
    """
    for name, value, low in (
        ("max_batch", max_batch, 1),
        ("max_seq_len", max_seq_len, 0),
        ("vocab_size", vocab_size, 1),
        ("max_encoders", max_encoders, 1),
    ):
        if not is_int(value, low):
            raise ValueError(f"{name}: expected an integer >= {low}, got {value!r}")
    if vocab_size <= max_encoders:
        raise ValueError(
            f"vocab_size: expected more than max_encoders={max_encoders} ids, got {vocab_size}"
        )
    dims, dtypes = tuple(dims), tuple(dtypes)
    if not dims or not all(is_int(d) and d > 0 for d in dims):
        raise ValueError(f"dims: expected positive integers, got {dims!r}")
    if not dtypes or not all(isinstance(t, torch.dtype) and t.is_floating_point for t in dtypes):
        raise ValueError(f"dtypes: expected floating torch dtypes, got {dtypes!r}")
    return _merge_inputs(max_batch, max_seq_len, vocab_size, dims, max_encoders, dtypes)


@st.composite
def _merge_inputs(
    draw: st.DrawFn,
    max_batch: int,
    max_seq_len: int,
    vocab_size: int,
    dims: Sequence[int],
    max_encoders: int,
    dtypes: Sequence[torch.dtype],
) -> MergeCase:
    batch = draw(st.integers(1, max_batch))
    seq_len = draw(st.integers(0, max_seq_len))
    dim = draw(st.sampled_from(dims))
    dtype = draw(st.sampled_from(dtypes))
    n_encoders = draw(st.integers(1, max_encoders))
    # Ids beyond vocab_size are out of the table; ids below it are reserved text ids.
    ids = draw(
        st.lists(
            st.integers(0, vocab_size + 8), min_size=n_encoders, max_size=n_encoders, unique=True
        )
    )
    names = [f"enc{i}" for i in range(n_encoders)]
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)

    density = draw(st.sampled_from([0.0, 0.1, 0.5, 0.9, 1.0]))
    is_placeholder = torch.rand(batch, seq_len, generator=gen) < density
    which = torch.randint(0, n_encoders, (batch, seq_len), generator=gen)
    text_ids = torch.tensor([v for v in range(vocab_size) if v not in ids])
    text = text_ids[torch.randint(0, len(text_ids), (batch, seq_len), generator=gen)]
    tokens = torch.where(is_placeholder, torch.tensor(ids)[which], text)
    weight = torch.randn(vocab_size, dim, generator=gen).to(dtype)

    rows: dict[str, Packed | Padded] = {}
    for i, name in enumerate(names):
        counts = (tokens == ids[i]).sum(1)
        if draw(st.booleans()):
            width = (
                int(counts.max()) + draw(st.integers(0, 2)) if seq_len else draw(st.integers(0, 2))
            )
            data = _maybe_strided(draw, torch.randn(batch, width, dim, generator=gen).to(dtype))
            rows[name] = Padded(data)
        else:
            data = _maybe_strided(
                draw, torch.randn(int(counts.sum()), dim, generator=gen).to(dtype)
            )
            rows[name] = Packed(data)
    return MergeCase(tokens, weight, rows, dict(zip(names, ids, strict=True)))


def _maybe_strided(draw: st.DrawFn, rows: torch.Tensor) -> torch.Tensor:
    """The same values, sometimes as a non-contiguous view (every other column of a wider
    tensor)."""
    if not draw(st.booleans()):
        return rows
    wide = rows.new_empty(*rows.shape[:-1], rows.shape[-1] * 2)
    view = wide[..., ::2]
    view.copy_(rows)
    return view
