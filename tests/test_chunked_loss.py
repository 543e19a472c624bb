"""fusion.chunked_token_loss: the summed cross-entropy over target positions without full
logits, equal to masked_token_loss over them (sum, count, gradients), and never holding a
[tokens, vocab] tensor in the forward or the backward."""

import weakref

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from fusion import chunked_token_loss, masked_token_loss
from helpers import FEATURES, IMAGE_ID, build_tiny_decoder, build_tiny_fusion, text_tokens

# Float32 sums of the same terms in another order (chunks, then their total).
EXACT = dict(rtol=1e-6, atol=1e-6)


def grads(loss: torch.Tensor, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return torch.autograd.grad(loss, tensors)


def head(dim: int, vocab: int, seed: int) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(dim, vocab, bias=False)


@st.composite
def problems(draw) -> dict:
    """Hidden states [b, s, d], labels with a random set of targets (rows without any, no
    target at all, empty batches) and a chunk size below, at or above their count."""
    batch, seq_len = draw(st.integers(0, 3)), draw(st.integers(0, 7))
    dim, vocab = draw(st.integers(1, 6)), draw(st.integers(1, 11))
    seed = draw(st.integers(0, 2**16))
    generator = torch.Generator().manual_seed(seed)
    targeted = torch.rand(batch, seq_len, generator=generator) < draw(st.sampled_from([0, 0.3, 1]))
    if batch and draw(st.booleans()):
        targeted[draw(st.integers(0, batch - 1))] = False  # one row with no target at all
    labels = torch.randint(0, vocab, (batch, seq_len), generator=generator)
    count = int(targeted.sum())
    return dict(
        hidden=torch.randn(batch, seq_len, dim, generator=generator).requires_grad_(),
        labels=labels.masked_fill(~targeted, -100),
        output=head(dim, vocab, seed),
        chunk_size=draw(st.sampled_from([1, 2, max(count, 1), count + 3])),
        num_targets=count if draw(st.booleans()) else None,
    )


@given(problems())
def test_equals_masked_token_loss_over_full_logits(problem):
    hidden, labels, output = problem["hidden"], problem["labels"], problem["output"]
    total, count = chunked_token_loss(
        hidden,
        labels,
        output,
        chunk_size=problem["chunk_size"],
        num_targets=problem["num_targets"],
    )
    expected_total, expected_count = masked_token_loss(output(hidden), labels)
    assert total.dtype == torch.float32 and total.shape == ()
    assert count.dtype == torch.int64 and int(count) == int(expected_count)
    torch.testing.assert_close(total, expected_total, **EXACT)
    actual = grads(total, hidden, output.weight)
    expected = grads(expected_total, hidden, output.weight)
    for got, want in zip(actual, expected, strict=True):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, **EXACT)


def step_grads(model: nn.Module, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    loss.backward()
    result = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return result


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_through_a_decoder_equals_its_logits_path(tied):
    decoder = build_tiny_decoder(tie_word_embeddings=tied)
    tokens = text_tokens(3, 12, seed=1)
    labels = text_tokens(3, 12, seed=2)
    labels[0, :7] = -100  # a prompt
    labels[1] = -100  # a row with no target
    total, count = masked_token_loss(decoder(tokens), labels)
    expected = step_grads(decoder, total / count)
    decoder.skip_output_layer = True
    hidden = decoder(tokens)
    assert hidden.shape == (3, 12, decoder.embed_dim)
    chunked, chunked_count = chunked_token_loss(
        hidden, labels, decoder.unembed, chunk_size=4, num_targets=int(count)
    )
    torch.testing.assert_close(chunked, total, **EXACT)
    assert int(chunked_count) == int(count) == 17
    actual = step_grads(decoder, chunked / count)
    assert actual.keys() == expected.keys()
    assert ("output.weight" in actual) != tied  # the tied output's gradient is the embedding's
    for name, grad in expected.items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(actual[name], grad, **EXACT, msg=name)


def test_through_an_early_fusion_model_with_images():
    model = build_tiny_fusion(decoder_trainable=True, encoders_trainable=True)
    tokens = text_tokens(2, 10, seed=3)
    tokens[:, 1:4] = IMAGE_ID
    encoder_input = {
        "image": {"features": torch.randn(2, 3, FEATURES, generator=torch.Generator())}
    }
    labels = text_tokens(2, 10, seed=4)
    labels[:, :4] = -100
    total, count = masked_token_loss(model(tokens, encoder_input=encoder_input), labels)
    expected = step_grads(model, total / count)
    model.skip_output_layer = True
    hidden = model(tokens, encoder_input=encoder_input)
    chunked, _ = chunked_token_loss(hidden, labels, model.decoder.unembed, chunk_size=5)
    torch.testing.assert_close(chunked, total, **EXACT)
    actual = step_grads(model, chunked / count)
    assert any(name.startswith("encoders.image") for name in actual)
    for name, grad in expected.items():
        torch.testing.assert_close(actual[name], grad, **EXACT, msg=name)


# ------------------------------------------------------------------------------------ memory


class LiveFloats(TorchDispatchMode):
    """Every op's floating outputs: the largest one (elements), and the peak bytes of the
    storages they allocated that are alive at once (each tracked until freed). Backward ops
    are seen too: on CPU the autograd engine runs them on this thread."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.largest = 0
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and tensor.dtype.is_floating_point:
                self.largest = max(self.largest, tensor.numel())
                storage = tensor.untyped_storage()
                key = storage.data_ptr()
                if storage.nbytes() and key not in self.live:
                    self.live[key] = storage.nbytes()
                    weakref.finalize(storage, self.live.pop, key, None)
        self.peak = max(self.peak, sum(self.live.values()))
        return out


def traced_step(loss_fn) -> dict[str, int]:
    """The largest float tensor allocated in the forward and in the backward, the peak bytes
    of live float tensors over both, and the largest float tensor saved for backward."""
    saved = [0]

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dtype.is_floating_point:
            saved[0] = max(saved[0], tensor.numel())
        return tensor

    forward, backward = LiveFloats(), LiveFloats()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        with forward:
            loss = loss_fn()
    with backward:
        loss.backward()
    return dict(
        forward=forward.largest,
        backward=backward.largest,
        peak=max(forward.peak, backward.peak),
        saved=saved[0],
    )


def test_no_tensor_of_all_logits_exists_forward_or_backward():
    batch, seq_len, dim, vocab, chunk = 2, 512, 16, 2048, 32
    tokens = batch * seq_len  # every position a target: 32 chunks
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(batch, seq_len, dim, generator=generator, requires_grad=True)
    labels = torch.randint(0, vocab, (batch, seq_len), generator=generator)
    output = head(dim, vocab, seed=0)
    all_logits = tokens * vocab  # elements
    full = traced_step(lambda: masked_token_loss(output(hidden), labels)[0])
    chunked = traced_step(
        lambda: chunked_token_loss(hidden, labels, output, chunk_size=chunk, num_targets=tokens)[0]
    )
    # The check fails on the full-logits path: it allocates, saves and holds all the logits.
    assert full["forward"] >= all_logits and full["backward"] >= all_logits
    assert full["saved"] >= all_logits and full["peak"] >= 4 * all_logits
    # Chunked: nothing above one chunk's logits; saved for backward (outside the chunks,
    # which recompute theirs) only the gathered rows; live at once a few chunks' worth plus
    # the gradients of the hidden states and the weight. (Chunks without the checkpoint save
    # every chunk's log-probabilities: all the logits again, failing the last two.)
    assert chunked["forward"] <= chunk * vocab and chunked["backward"] <= chunk * vocab
    assert chunked["saved"] <= tokens * dim
    gradients = 4 * (tokens * dim + vocab * dim)
    assert chunked["peak"] <= 4 * (6 * chunk * vocab) + gradients < 4 * all_logits / 4


def test_a_chunks_backward_holds_two_logits_tensors_at_most():
    # The recomputed logits and their log-probabilities, which become the gradient in place;
    # autograd's own cross-entropy backward holds a third (the likelihood's gradient, then the
    # log-softmax's): 3.25x the logits, failing this.
    tokens, dim, vocab = 64, 16, 4096
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(1, tokens, dim, generator=generator, requires_grad=True)
    labels = torch.randint(0, vocab, (1, tokens), generator=generator)
    output = head(dim, vocab, seed=1)
    total, _ = chunked_token_loss(hidden, labels, output, chunk_size=tokens, num_targets=tokens)
    backward = LiveFloats()
    with backward:
        total.backward()
    logits, gradients = 4 * tokens * vocab, 4 * (tokens * dim + vocab * dim)
    scalars = 4096  # the loss and its gradient, the rows' indices
    assert 2 * logits <= backward.peak <= 2 * logits + gradients + scalars


# ------------------------------------------------------------------------ dtypes and devices


def test_bfloat16_is_summed_in_float32():
    generator = torch.Generator().manual_seed(5)
    output = head(8, 40, seed=5).bfloat16()
    hidden = torch.randn(2, 9, 8, generator=generator).bfloat16().requires_grad_()
    labels = torch.randint(0, 40, (2, 9), generator=generator)
    labels[1] = -100
    total, _ = chunked_token_loss(hidden, labels, output, chunk_size=4)
    assert total.dtype == torch.float32
    expected, _ = masked_token_loss(output(hidden), labels)
    torch.testing.assert_close(total, expected, rtol=1e-3, atol=1e-3)
    got, want = grads(total, hidden), grads(expected, hidden)
    assert got[0].dtype == torch.bfloat16
    torch.testing.assert_close(got[0], want[0], rtol=2e-2, atol=2e-3)


def test_autocast_is_kept_when_chunks_are_recomputed():
    # The recipe's bf16 autocast: the backward recomputes each chunk under it too (else the
    # checkpoint would refuse recomputed tensors of another dtype), so the gradients are those
    # of the bf16 logits path: to the bit below the output, whose weight's gradient sums bf16
    # products per chunk instead of all at once.
    decoder = build_tiny_decoder(tie_word_embeddings=False)
    tokens, labels = text_tokens(2, 8, seed=6), text_tokens(2, 8, seed=7)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        total, count = masked_token_loss(decoder(tokens), labels)
    expected = step_grads(decoder, total / count)
    decoder.skip_output_layer = True
    with torch.autocast("cpu", dtype=torch.bfloat16):
        chunked, _ = chunked_token_loss(decoder(tokens), labels, decoder.unembed, chunk_size=5)
    assert chunked.dtype == torch.float32
    torch.testing.assert_close(chunked, total, **EXACT)
    actual = step_grads(decoder, chunked / count)
    for name, grad in expected.items():
        bf16 = dict(rtol=1e-2, atol=1e-2 * float(grad.abs().max()))
        tolerance = bf16 if name == "output.weight" else dict(rtol=0, atol=0)
        torch.testing.assert_close(actual[name], grad, **tolerance, msg=name)


def test_without_targets_the_sum_is_zero_and_gradients_are_zeros():
    output = head(4, 9, seed=8)
    for shape in [(2, 5), (2, 0), (0, 3)]:  # no target; empty batches
        hidden = torch.randn(*shape, 4, requires_grad=True)
        labels = torch.full(shape, -100)
        total, count = chunked_token_loss(hidden, labels, output, num_targets=0)
        assert float(total.detach()) == 0 and int(count) == 0
        hidden_grad, weight_grad = grads(total, hidden, output.weight)
        assert not hidden_grad.any() and not weight_grad.any()  # zeros, not missing
        assert hidden_grad.shape == hidden.shape


def test_eval_under_no_grad_and_on_the_meta_device():
    output = head(4, 9, seed=9)
    hidden, labels = torch.randn(2, 6, 4), torch.randint(0, 9, (2, 6))
    with torch.no_grad():
        total, _ = chunked_token_loss(hidden, labels, output, chunk_size=5)
        torch.testing.assert_close(total, masked_token_loss(output(hidden), labels)[0], **EXACT)
    with torch.device("meta"):
        meta_output = nn.Linear(4, 9)
        meta_hidden = torch.empty(2, 6, 4, requires_grad=True)
        meta_labels = torch.zeros(2, 6, dtype=torch.int64)
    total, count = chunked_token_loss(meta_hidden, meta_labels, meta_output, num_targets=12)
    assert total.device.type == count.device.type == "meta"
    total.backward()
    assert meta_hidden.grad.shape == (2, 6, 4)
    with pytest.raises(ValueError, match="num_targets: expected an int on the meta device"):
        chunked_token_loss(meta_hidden, meta_labels, meta_output)


# ------------------------------------------------------------------------------ bad arguments


def test_bad_arguments():
    output = head(4, 9, seed=10)
    hidden, labels = torch.randn(2, 5, 4), torch.randint(0, 9, (2, 5))
    labels[0, 0] = -100  # 9 targets

    def call(**changes):
        arguments = dict(hidden=hidden, labels=labels, unembed=output)
        arguments.update(changes)
        return chunked_token_loss(
            arguments.pop("hidden"), arguments.pop("labels"), arguments.pop("unembed"),
            **arguments,
        )  # fmt: skip

    cases = [
        (dict(hidden=hidden[0]), r"hidden: expected floating hidden states \[b, s, d\], got "
         r"shape \[5, 4\]"),
        (dict(hidden=hidden.long()), "hidden: expected floating .* dtype torch.int64"),
        (dict(labels=labels[:, :4]), r"labels: expected integer targets \[2, 5\] .* got shape "
         r"\[2, 4\]"),
        (dict(labels=labels.float()), "labels: expected integer targets .* torch.float32"),
        (dict(labels=labels > 0), "labels: expected integer targets .* torch.bool"),
        (dict(chunk_size=0), "chunk_size: expected an int >= 1, got 0"),
        (dict(chunk_size=2.0), "chunk_size: expected an int >= 1, got 2.0"),
        (dict(chunk_size=True), "chunk_size: expected an int >= 1, got True"),
        (dict(ignore_index=-100.0), "ignore_index: expected a Python int, got -100.0"),
        (dict(num_targets=11), r"num_targets: expected None or an int in \[0, 10\] .* got 11"),
        (dict(num_targets=-1), r"num_targets: expected None or an int in \[0, 10\]"),
        (dict(num_targets=9.0), r"num_targets: expected None or an int .* got 9.0"),
        (dict(num_targets=torch.tensor(9)), "num_targets: expected None or an int"),
        (dict(num_targets=8), "num_targets: expected the number of labels that are not -100, "
         "got 8 for 9 targets"),
        (dict(unembed=lambda rows: rows[:, :1]), r"unembed: expected logits \[1, 5, vocab\], "
         r"got shape \[1, 1, 4\]"),
        (dict(unembed=lambda rows: rows[0] @ output.weight.T), r"unembed: expected logits "
         r"\[1, 5, vocab\], got shape \[5, 9\]"),
    ]  # fmt: skip
    for changes, message in cases:
        with pytest.raises(ValueError, match=message):
            call(chunk_size=5, **changes) if "chunk_size" not in changes else call(**changes)
    with pytest.raises(TypeError, match=r"hidden: expected a plain tensor .* got list"):
        call(hidden=[[[0.0]]])
    with pytest.raises(TypeError, match=r"unembed: expected a callable .* got Parameter"):
        call(unembed=output.weight)
    assert int(call(num_targets=9)[1]) == 9  # the valid call the cases alter
