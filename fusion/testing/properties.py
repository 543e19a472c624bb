"""Properties every early-fusion model keeps, as one-line assertions over drawn inputs.

Each takes the model and a :class:`~fusion.testing.inputs.FusionInputs` (from
:func:`~fusion.testing.inputs.fusion_inputs`), runs the model without gradients, in whatever
mode it is in (``model.eval()`` first: BatchNorm and dropout in training mode make outputs
depend on the batch and on the RNG), and raises ``AssertionError`` naming the sample, the
slot and the difference:

    >>> @given(inputs=fusion_inputs(model, {"audio": (3, tensors(1, 400))}))
    ... def test_properties(inputs):
    ...     assert_text_only_matches_decoder(model, inputs)
    ...     assert_samples_independent(model, inputs)
    ...     assert_padded_matches_packed(model, inputs)
    ...     assert_rows_at_placeholders(model, inputs)
"""

import io
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from fusion.early_fusion import EarlyFusion
from fusion.testing.inputs import FusionInputs
from fusion.testing.strategies import WrappingTree


def _tensors(output: Any) -> list[torch.Tensor]:
    """A model's output as a list of tensors (hidden states, then logits or chunks)."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, list | tuple) and all(isinstance(t, torch.Tensor) for t in output):
        return list(output)
    raise AssertionError(f"the model returned {type(output).__name__}, expected tensors")


def _assert_same(
    actual: Any, expected: Any, what: str, atol: float = 0.0, rtol: float = 0.0
) -> None:
    """Equal (bitwise when both tolerances are 0), or an AssertionError naming ``what``."""
    actual, expected = _tensors(actual), _tensors(expected)
    assert len(actual) == len(expected), f"{what}: {len(actual)} outputs, expected {len(expected)}"
    for k, (a, e) in enumerate(zip(actual, expected, strict=True)):
        where = f"{what}, output {k}" if len(actual) > 1 else what
        assert a.shape == e.shape, f"{where}: shape {list(a.shape)}, expected {list(e.shape)}"
        if atol == 0 and rtol == 0:
            same = torch.equal(a, e)
        else:
            same = bool(torch.isclose(a, e, atol=atol, rtol=rtol, equal_nan=True).all())
        if not same:
            diff = (a.double() - e.double()).abs().nan_to_num(float("inf"))
            index = tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape))
            raise AssertionError(
                f"{where}: differs at {list(index)} by {float(diff.max()):.3g} "
                f"(atol={atol}, rtol={rtol})"
            )


def assert_text_only_matches_decoder(model: EarlyFusion, inputs: FusionInputs) -> None:
    """With every placeholder replaced by text and no encoder input, the model's output is
    bitwise the plain decoder's (``model.decoder``), with the same mask and positions."""
    text = inputs.text_only()
    with torch.no_grad():
        fused = model(text.tokens, mask=text.mask, input_pos=text.input_pos)
        plain = model.decoder(text.tokens, mask=text.mask, input_pos=text.input_pos)
    _assert_same(fused, plain, "text only: the fusion model against its plain decoder")


def assert_samples_independent(
    model: EarlyFusion, inputs: FusionInputs, *, atol: float = 1e-5, rtol: float = 1e-4
) -> None:
    """Each sample's outputs at its real tokens equal those of the sample run alone (its own
    tokens, no padding, its own encoder inputs), within ``atol`` / ``rtol`` (batches of
    other sizes take other kernel paths, so not bitwise). Padding, other samples' encoder
    inputs and the rows' layout change nothing."""
    with torch.no_grad():
        batch = _tensors(inputs.run(model))
        for i in range(inputs.batch_size):
            alone = inputs.sample(i)
            expected = _tensors(alone.run(model))
            slots = inputs.real_slots(i)
            _assert_same(
                [out[i : i + 1, slots] for out in batch],
                expected,
                f"sample {i} of {inputs.batch_size} ({inputs.padding} padding, "
                f"{inputs.layout} rows) against the sample alone",
                atol,
                rtol,
            )


def assert_padded_matches_packed(
    model: EarlyFusion, inputs: FusionInputs, *, atol: float = 0.0, rtol: float = 0.0
) -> None:
    """The encoders' rows passed as :class:`fusion.Padded` per sample (with padding rows
    that must be ignored) give the same output as the encoders run in the forward (packed
    rows); bitwise by default."""
    with torch.no_grad():
        packed = inputs.run(model, "packed")
        padded = inputs.run(model, "padded")
    _assert_same(padded, packed, "padded rows against packed rows", atol, rtol)


def _probe_rows(inputs: FusionInputs, dim: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Random rows per encoder, packed [n_rows, d]: distinct from each other and from every
    text embedding (with overwhelming probability), so each can be recognised where it lands."""
    generator = torch.Generator().manual_seed(0)
    rows = {}
    for name, per_input in inputs.rows_per_input.items():
        count = sum(inputs.inputs_per_sample[name]) * per_input
        rows[name] = (torch.rand(count, dim, generator=generator) + 2).to(dtype)  # in [2, 3)
    return rows


def _describe_row(row: torch.Tensor, rows: dict[str, torch.Tensor]) -> str:
    """Which probe row ``row`` [d] is, for messages."""
    for name, candidates in rows.items():
        found = (candidates == row).all(-1).nonzero().flatten().tolist()
        if found:
            return f"row {found[0]} of {name!r}"
    return "no probe row"


def assert_rows_at_placeholders(model: EarlyFusion, inputs: FusionInputs) -> None:
    """Probe rows (distinct random rows, in ``inputs.layout``) stand in for every encoder's
    output. What the decoder's first layer receives holds each encoder's ``k``-th row (in
    order of appearance over the batch) exactly at that encoder's ``k``-th placeholder, and
    the plain token embedding everywhere else.

    Raises:
        ValueError: the decoder has no layer to observe.
    """
    decoder = model.decoder
    if len(decoder.layers) == 0:
        raise ValueError("model: expected a decoder with at least one layer to observe")
    seen: list[torch.Tensor] = []

    def keep(module: nn.Module, args: tuple, kwargs: dict) -> None:
        seen.append((args[0] if args else next(iter(kwargs.values()))).detach().clone())

    tokens = inputs.tokens
    with torch.no_grad():
        embedded = decoder.tok_embeddings(inputs.text_only().tokens)
        packed = _probe_rows(inputs, embedded.size(-1), embedded.dtype)
        rows: dict[str, Any] = dict(packed)
        if inputs.layout == "padded":
            rows = {name: inputs.to_padded(name, r) for name, r in packed.items()}
        handle = decoder.layers[0].register_forward_pre_hook(keep, with_kwargs=True)
        try:
            model(tokens, mask=inputs.mask, input_pos=inputs.input_pos, encoder_input=rows)
        finally:
            handle.remove()
    assert len(seen) == 1, f"the decoder's first layer ran {len(seen)} times, expected once"
    expected = embedded.clone()
    for name, placeholder in inputs.encoder_tokens.items():
        where = (tokens == placeholder).nonzero()  # row-major: order of appearance
        expected[where[:, 0], where[:, 1]] = packed[name]
    got = seen[0]
    assert got.shape == expected.shape, (
        f"rows at placeholders: the first layer got {list(got.shape)}, expected "
        f"{list(expected.shape)}"
    )
    wrong = (got != expected).any(-1).nonzero()
    if len(wrong):
        i, slot = (int(v) for v in wrong[0])
        token = int(tokens[i, slot])
        names = {v: n for n, v in inputs.encoder_tokens.items()}
        place = f"a placeholder of {names[token]!r}" if token in names else f"text id {token}"
        raise AssertionError(
            f"rows at placeholders: sample {i}, slot {slot} ({place}) holds "
            f"{_describe_row(got[i, slot], packed)}, expected "
            f"{_describe_row(expected[i, slot], packed) if token in names else 'its embedding'}"
            f" ({len(wrong)} slots wrong in {inputs.batch_size} samples)"
        )


def assert_outputs_survive_wrapping(
    model: EarlyFusion,
    fresh: EarlyFusion,
    tree: WrappingTree,
    inputs: FusionInputs,
) -> None:
    """Wrapped in ``tree`` (one model), ``model`` gives the same outputs as before, and its
    wrapped state dict, saved with ``torch.save`` and loaded with ``weights_only=True`` and
    ``strict=True`` into ``fresh`` (another model of the same structure) wrapped alike, makes
    ``fresh`` give bitwise the same outputs.

    Raises:
        ValueError: ``tree`` is not for one model.
    """
    if tree.n_models != 1:
        raise ValueError(f"tree: expected a tree of one model, got {tree.n_models}")
    with torch.no_grad():
        before = inputs.run(model)
        root, _ = tree.build([model])
        _assert_same(inputs.run(model), before, f"outputs once wrapped in {tree.spec}")
        fresh_root, _ = tree.build([fresh])
        buffer = io.BytesIO()
        torch.save(root.state_dict(), buffer)
        buffer.seek(0)
        fresh_root.load_state_dict(torch.load(buffer, weights_only=True), strict=True)
        _assert_same(
            inputs.run(fresh), before, f"outputs after a checkpoint round trip in {tree.spec}"
        )


def check_all(
    model: EarlyFusion,
    inputs: FusionInputs,
    *,
    build: Callable[[], EarlyFusion] | None = None,
    tree: WrappingTree | None = None,
) -> None:
    """Every property above on one drawn batch; the wrapping one when ``build`` (a fresh
    model of the same structure) and ``tree`` are given."""
    assert_text_only_matches_decoder(model, inputs)
    assert_samples_independent(model, inputs)
    assert_padded_matches_packed(model, inputs)
    assert_rows_at_placeholders(model, inputs)
    if build is not None and tree is not None:
        assert_outputs_survive_wrapping(model, build(), tree, inputs)
