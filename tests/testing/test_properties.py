"""``fusion.testing``'s properties hold for EarlyFusion, and find planted bugs, shrunk to a
minimal batch."""

import pytest
from hypothesis import HealthCheck, find, given, settings
from testing.fusion_models import AUDIO, RestartingRows, ShiftedRows, build

from fusion.testing import (
    assert_outputs_survive_wrapping,
    assert_padded_matches_packed,
    assert_rows_at_placeholders,
    assert_samples_independent,
    assert_text_only_matches_decoder,
    check_all,
    fusion_inputs,
    tensors,
    wrapping_trees,
)

DRAWN = {"audio": (3, tensors(1, 48)), "image": (2, tensors(2, 12))}
MODEL = build()


@settings(max_examples=8, deadline=None)
@given(inputs=fusion_inputs(MODEL, DRAWN), tree=wrapping_trees(max_depth=2))
def test_early_fusion_keeps_every_property(inputs, tree):
    check_all(MODEL, inputs, build=lambda: build(seed=1), tree=tree)


def _failing(check, model):
    """A condition for ``find``: ``check`` fails on ``model``."""

    def fails(inputs) -> bool:
        try:
            check(model, inputs)
        except AssertionError:
            return True
        return False

    return fails


def _shrunk(check, model, **kwargs):
    """The minimal example ``find`` shrinks a failure of ``check`` to (audio only, so the
    smallest failing batch is easy to state)."""
    strategy = fusion_inputs(build(images=False), {"audio": DRAWN["audio"]}, **kwargs)
    quiet = settings(
        max_examples=200,
        database=None,
        derandomize=True,  # the same shrunk example on every run
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    return find(strategy, _failing(check, model), settings=quiet)


def test_rows_shifted_within_a_sample_are_found_and_shrunk():
    model = build(cls=ShiftedRows, images=False)
    example = _shrunk(assert_rows_at_placeholders, model)
    # One sample holding one clip's 3 placeholders and nothing else: rows rotate among them.
    assert example.tokens.tolist() == [[AUDIO] * 3]
    assert example.padding == "none" and example.layout == "packed"
    with pytest.raises(AssertionError, match=r"sample 0, slot 0 \(a placeholder of 'audio'\) "):
        assert_rows_at_placeholders(model, example)
    assert_rows_at_placeholders(build(images=False), example)  # the real model is right


def test_a_batch_dependent_merge_is_found_and_shrunk(two_clips):
    model = build(cls=RestartingRows, images=False)
    example = two_clips
    # Two samples of one clip each (the second reads the first one's rows), at most one text
    # token besides (the shrinker need not reach the global minimum, 2 samples of 3 slots).
    assert example.inputs_per_sample == {"audio": (1, 1)}
    assert example.lengths.max() <= 4
    with pytest.raises(AssertionError, match=r"sample 1 of 2 \(\w+ padding, packed rows\)"):
        assert_samples_independent(model, example)
    with pytest.raises(
        AssertionError, match=r"sample 1, slot \d+ .* holds row 0 of 'audio', expected row 3"
    ):
        assert_rows_at_placeholders(model, example)
    assert_samples_independent(build(images=False), example)


@pytest.fixture(scope="module")
def two_clips():
    """The shrunk batch of the batch-dependent merge: two samples of one clip each."""
    return _shrunk(assert_samples_independent, build(cls=RestartingRows, images=False))


def test_each_property_fails_on_what_it_guards(monkeypatch, two_clips):
    """Each assertion fails, naming what differs, when its promise is broken."""
    example = two_clips
    model = build(images=False)
    with pytest.raises(AssertionError, match=r"padded rows against packed rows: differs at"):
        assert_padded_matches_packed(build(cls=RestartingRows, images=False), example)
    # A fusion model whose text-only output is not its decoder's.
    monkeypatch.setattr(model, "forward", lambda *a, **kw: type(model).forward(model, *a, **kw) + 1)
    with pytest.raises(AssertionError, match=r"text only: the fusion model against its plain"):
        assert_text_only_matches_decoder(model, example)
    # State outside the state dict (a non-persistent buffer) does not survive the checkpoint.
    fresh = build(seed=1, images=False, offset=1.0)
    tree = find(wrapping_trees(max_depth=1), lambda t: t.spec[0] == "custom")
    assert_outputs_survive_wrapping(
        build(seed=2, images=False), build(seed=1, images=False), tree, example
    )
    with pytest.raises(AssertionError, match=r"outputs after a checkpoint round trip in"):
        assert_outputs_survive_wrapping(build(seed=2, images=False), fresh, tree, example)


def test_bad_arguments(two_clips):
    example = two_clips
    with pytest.raises(ValueError, match=r"tree: expected a tree of one model, got 2"):
        tree = find(wrapping_trees(n_models=2), lambda t: True)
        assert_outputs_survive_wrapping(MODEL, MODEL, tree, example)
    with pytest.raises(ValueError, match=r"i: expected a sample index in \[0, 2\), got 2"):
        example.sample(2)
    with pytest.raises(ValueError, match=r"layout: expected one of \['packed', 'padded'\]"):
        example.rows(MODEL, "ragged")
