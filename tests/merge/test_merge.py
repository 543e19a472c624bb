"""Merge properties against an obviously-correct Python loop over samples and positions."""

import dataclasses

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from fusion.merge import IMPLEMENTATIONS, Packed, Padded, merge_embeddings
from fusion.testing import MergeCase, merge_inputs

# "fused" runs on CPU only under Triton's interpreter and reads tables only;
# tests/merge/test_differential.py checks it bitwise against "reference", which these tests
# check against the loop.
IMPLS = sorted(set(IMPLEMENTATIONS) - {"fused"})


def loop_merge(case: MergeCase) -> torch.Tensor:
    """Sample by sample, position by position: the k-th placeholder of an encoder takes the
    next packed row (counted over the whole batch) or padded row [i, k] (counted per sample)."""
    batch, seq_len = case.tokens.shape
    out = torch.empty(batch, seq_len, case.weight.size(1), dtype=case.weight.dtype)
    name_of = {token_id: name for name, token_id in case.encoder_tokens.items()}
    packed_used = dict.fromkeys(case.encoder_tokens, 0)
    for i in range(batch):
        sample_used = dict.fromkeys(case.encoder_tokens, 0)
        for j in range(seq_len):
            token = int(case.tokens[i, j])
            if token not in name_of:
                out[i, j] = case.weight[token]
                continue
            name = name_of[token]
            layout = case.encoder_rows[name]
            if isinstance(layout, Packed):
                out[i, j] = layout.rows.reshape(-1, out.size(-1))[packed_used[name]]
                packed_used[name] += 1
            else:
                out[i, j] = layout.rows[i, sample_used[name]]
                sample_used[name] += 1
    return out


@pytest.mark.parametrize("as_module", [False, True], ids=["table", "module"])
@pytest.mark.parametrize("impl", IMPLS)
@given(case=merge_inputs())
def test_equals_loop(impl, as_module, case):
    embedding = case.weight
    if as_module:  # called like the decoder calls it, whatever module it is
        embedding = torch.nn.Embedding.from_pretrained(case.weight)
        embedding.register_forward_hook(lambda module, args, out: out.clone())
    merged = merge_embeddings(
        case.tokens, embedding, case.encoder_rows, case.encoder_tokens, impl=impl
    )
    assert merged.dtype == case.weight.dtype
    assert torch.equal(merged, loop_merge(case))


def _with_rows(case: MergeCase, name: str, rows) -> MergeCase:
    return dataclasses.replace(case, encoder_rows={**case.encoder_rows, name: rows})


@pytest.mark.parametrize("impl", IMPLS)
@given(case=merge_inputs(), data=st.data())
def test_every_count_mismatch_raises(impl, case, data):
    name = data.draw(st.sampled_from(sorted(case.encoder_rows)))
    layout = case.encoder_rows[name]
    counts = (case.tokens == case.encoder_tokens[name]).sum(1)
    rows = layout.rows
    if isinstance(layout, Packed):
        flat = rows.reshape(-1, rows.size(-1))
        extra = data.draw(st.integers(-len(flat), 3).filter(lambda k: k != 0))
        if extra > 0:
            bad = Packed(torch.cat([flat, flat.new_zeros(extra, flat.size(1))]))
        else:
            bad = Packed(flat[: len(flat) + extra])
        match = rf"encoder '{name}': the tokens' placeholder count .* equal the {len(bad.rows)} "
    else:
        assume(counts.numel() > 0 and int(counts.max()) > 0)
        width = data.draw(st.integers(0, int(counts.max()) - 1))
        bad = Padded(rows[:, :width])
        match = (
            rf"encoder '{name}': a sample holds more placeholders .* than the padded width {width}"
        )
    with pytest.raises(ValueError, match=match):
        merge_embeddings(
            case.tokens,
            case.weight,
            _with_rows(case, name, bad).encoder_rows,
            case.encoder_tokens,
            impl=impl,
        )


def test_padding_never_moves_across_samples():
    """torchtune's flattening bug: sample 0 has 1 placeholder, sample 1 has 2, padded width 2."""
    weight = torch.zeros(8, 2)
    tokens = torch.tensor([[9, 1, 1], [9, 9, 1]])
    rows = torch.tensor([[[1.0, 1.0], [-1.0, -1.0]], [[2.0, 2.0], [3.0, 3.0]]])
    merged = merge_embeddings(tokens, weight, {"image": Padded(rows)}, {"image": 9})
    assert merged[1, :2].tolist() == [[2.0, 2.0], [3.0, 3.0]]
    assert merged[0, 0].tolist() == [1.0, 1.0]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"tokens": torch.zeros(4, dtype=torch.long)}, r"tokens: expected integer ids \[b, s\]"),
        (
            {"encoder_rows": {"video": torch.zeros(0, 2)}},
            r"encoder_rows: names \['video'\] have no",
        ),
        ({"encoder_tokens": {"image": 9, "audio": 9}}, r"encoder_tokens: expected distinct"),
        ({"impl": "magic"}, r"impl: expected 'auto' or one of .* got 'magic'"),
        (
            {"encoder_rows": {"image": Padded(torch.zeros(3, 1, 2))}},
            r"expected padded rows \[2, max_tokens, d\]",
        ),
        (
            {"tokens": torch.tensor([[9, 8], [1, 2]])},
            r"tokens \(text positions\): expected values in \[0, 8\), got values from 0 to 8",
        ),
    ],
)
def test_bad_input(kwargs, match):
    args = {
        "tokens": torch.tensor([[9, 1], [1, 2]]),
        "embedding": torch.zeros(8, 2),
        "encoder_rows": {"image": torch.zeros(1, 2)},
        "encoder_tokens": {"image": 9},
    }
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        merge_embeddings(**args)


def test_device_side_checks_do_not_raise_eagerly_but_fail():
    """``eager_checks=False`` turns count checks into ``torch._assert_async`` (sync-free on
    accelerators); on CPU the assertion still fires, as a RuntimeError."""
    tokens = torch.tensor([[9, 9, 1]])
    with pytest.raises(RuntimeError, match="must equal the 1 packed rows given"):
        merge_embeddings(
            tokens,
            torch.zeros(4, 2),
            {"image": torch.zeros(1, 2)},
            {"image": 9},
            eager_checks=False,
        )


def _args(**changes) -> dict:
    args = {
        "tokens": torch.tensor([[9, 1], [1, 2]]),
        "embedding": torch.zeros(8, 2),
        "encoder_rows": {"image": torch.zeros(1, 2)},
        "encoder_tokens": {"image": 9},
    }
    return {**args, **changes}


@pytest.mark.parametrize(
    ("changes", "error", "match"),
    [
        ({"embedding": 3}, TypeError, r"embedding: expected a module mapping ids to rows"),
        ({"embedding": torch.zeros(8)}, ValueError, r"embedding: expected a floating table"),
        ({"embedding": torch.zeros(8, 2, device="meta")}, ValueError, r"embedding: expected dev"),
        (
            {"embedding": lambda ids: [ids]},
            ValueError,
            r"embedding: expected floating rows \[2, 2, d\]",
        ),
        ({"embedding": lambda ids: ids[..., None]}, ValueError, r"embedding: expected floating"),
        ({"encoder_rows": {"image": [0.0, 1.0]}}, TypeError, r"encoder 'image' rows: expected a t"),
        ({"encoder_rows": [torch.zeros(1, 2)]}, TypeError, r"encoder_rows: expected a mapping"),
        ({"encoder_tokens": {"image": 9.0}}, TypeError, r"encoder_tokens: expected str names"),
        ({"encoder_tokens": [9]}, TypeError, r"encoder_tokens: expected a mapping"),
        ({"encoder_rows": {"image": torch.zeros(1, 3)}}, ValueError, r"expected width 2"),
        ({"tokens": torch.tensor([[9, 1], [1, 2]], dtype=torch.uint8)}, ValueError, r"tokens: "),
        ({"tokens": [[9, 1]]}, TypeError, r"tokens: expected a tensor of integer ids"),
        (
            {"encoder_rows": {"image": torch.zeros(1, 2, device="meta")}},
            ValueError,
            r"encoder 'image' rows: expected device cpu \(the tokens'\), got meta",
        ),
        (
            {"encoder_rows": {"image": torch.zeros(1, 2, dtype=torch.float64)}},
            ValueError,
            r"encoder 'image' rows: expected dtype torch.float32 \(the text embeddings'\)",
        ),
    ],
)
def test_bad_arguments_are_named(changes, error, match):
    with pytest.raises(error, match=match):
        merge_embeddings(**_args(**changes))


def test_rows_are_cast_under_autocast_only():
    args = _args(encoder_rows={"image": torch.ones(1, 2, dtype=torch.bfloat16)})
    with torch.autocast("cpu", dtype=torch.bfloat16):
        merged = merge_embeddings(**args)
    assert merged.dtype == torch.float32 and merged[0, 0].tolist() == [1.0, 1.0]


def test_vocab_size_of_a_module_is_checked():
    embedding = torch.nn.Embedding(8, 2)
    tokens = torch.tensor([[1, 8]])
    with pytest.raises(ValueError, match=r"tokens \(text positions\): expected values in \[0, 8\)"):
        merge_embeddings(**_args(tokens=tokens, embedding=embedding, encoder_rows={}))
    with pytest.raises(ValueError, match=r"expected values in \[0, 4\)"):
        merge_embeddings(**_args(tokens=tokens, embedding=embedding, encoder_rows={}, vocab_size=4))


def test_an_embedding_that_returns_a_view_is_not_written_through():
    """Rows are written into a copy when the embedding returns a view (DTensor.to_local under
    tensor parallelism does): its base stays untouched and autograd stays valid."""
    table = torch.randn(8, 2)
    base = torch.nn.functional.embedding(torch.tensor([[1, 1, 2]]), table).detach()
    view_embedding = lambda ids: base[:, : ids.size(1)]  # noqa: E731
    before = base.clone()
    rows = torch.ones(1, 2, requires_grad=True)
    merged = merge_embeddings(torch.tensor([[9, 1]]), view_embedding, {"image": rows}, {"image": 9})
    merged.sum().backward()
    assert torch.equal(base, before) and merged[0, 0].tolist() == [1.0, 1.0]
    assert rows.grad.tolist() == [[1.0, 1.0]]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("shape", [(0, 3), (2, 0)])
def test_empty_batches_and_sequences(impl, shape):
    tokens = torch.zeros(shape, dtype=torch.long)
    merged = merge_embeddings(tokens, torch.randn(8, 4), {}, {"image": 9}, impl=impl)
    assert merged.shape == (*shape, 4)


def test_an_embedding_on_another_device_is_named():
    meta_embedding = torch.nn.Embedding(8, 2, device="meta")
    with pytest.raises(ValueError, match=r"embedding: expected rows on cpu .* got them on meta"):
        merge_embeddings(
            **_args(tokens=torch.tensor([[1, 2]]), embedding=meta_embedding, encoder_rows={})
        )
