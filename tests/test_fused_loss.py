"""fusion.fused_token_loss: the fused linear cross-entropy (the output layer's backward made
chunk by chunk in the forward) equals F.cross_entropy over full logits in fp32, loss and
gradients (hidden states and the output module's parameters, tied, untied, with a LoRA
adapter), never holds all the logits, and projects each chunk once."""

import weakref
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from test_chunked_loss import LiveFloats, head, problems, step_grads
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from fusion import chunked_token_loss, fused_token_loss, masked_token_loss
from fusion.lora import apply_lora
from helpers import build_tiny_decoder, text_tokens

RELATIVE = dict(rtol=1e-6, atol=1e-7)  # fp32: the same terms summed in another order


def assert_relative(got: torch.Tensor, want: torch.Tensor, scale: float = 1.0) -> None:
    """Within 1e-6 relative; elements near zero (sums of terms of order ``scale`` that
    cancel, summed in another order: chunk by chunk) within 1e-6 x ``scale``, the tolerance
    of chunked_token_loss's tests."""
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * scale)


def full_logits_loss(hidden: torch.Tensor, labels: torch.Tensor, output) -> torch.Tensor:
    """The reference: F.cross_entropy over every position's logits, summed."""
    logits = output(hidden).float()
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")


@given(problems(), st.sampled_from([1.0, 0.25, 3.0]), st.booleans(), st.booleans())
def test_equals_cross_entropy_over_full_logits(problem, scale, bias, deferred):
    """Random targets, rows without any target, batches without targets, any chunk size: the
    sum, the count and the gradients of the hidden states, the weight and the bias, made in
    the forward or (``defer_output_grad``) at the end of the backward."""
    hidden, labels = problem["hidden"], problem["labels"]
    dim, vocab = problem["output"].in_features, problem["output"].out_features
    torch.manual_seed(vocab)
    output = nn.Linear(dim, vocab, bias=bias)
    params = list(output.parameters())
    total, count = fused_token_loss(
        hidden, labels, output, grad_scale=scale, chunk_size=problem["chunk_size"],
        num_targets=problem["num_targets"], defer_output_grad=deferred,
    )  # fmt: skip
    assert all((p.grad is None) == deferred for p in params)  # made in the forward, or not yet
    fused_grads = torch.autograd.grad(total * scale, [hidden], allow_unused=True)
    fused_params = [p.grad.clone() for p in params]
    expected = full_logits_loss(hidden, labels, output)
    assert total.dtype == torch.float32 and total.shape == ()
    assert int(count) == int((labels != -100).sum())
    torch.testing.assert_close(total, expected.detach(), **RELATIVE)
    want = torch.autograd.grad(expected * scale, [hidden, *params], allow_unused=True)
    for got, reference in zip([*fused_grads, *fused_params], want, strict=True):
        reference = torch.zeros_like(got) if reference is None else reference
        assert torch.isfinite(got).all()
        assert_relative(got, reference, scale)


def test_a_whole_batch_without_targets():
    """Zero sum, zero (not missing) gradients, and the output still called."""
    output = head(4, 9, seed=1)
    calls = []
    output.register_forward_hook(lambda *_: calls.append(1))
    hidden = torch.randn(2, 5, 4, requires_grad=True)
    total, count = fused_token_loss(hidden, torch.full((2, 5), -100), output, num_targets=0)
    total.backward()
    assert float(total.detach()) == 0 and int(count) == 0 and calls == [1]
    assert hidden.grad is not None and not hidden.grad.any()
    assert output.weight.grad is not None and not output.weight.grad.any()


@pytest.mark.parametrize("deferred", [False, True], ids=["now", "deferred"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_through_a_decoder_equals_its_logits_path(tied, deferred):
    """``decoder.unembed``: the untied output module, or the tied embedding's weight. With
    ``defer_output_grad``, the output's gradient is made once the decoder's backward has
    freed every float tensor its forward saved."""
    decoder = build_tiny_decoder(tie_word_embeddings=tied)
    tokens, labels = text_tokens(3, 12, seed=1), text_tokens(3, 12, seed=2)
    labels[0, :7] = -100
    labels[1] = -100  # a row with no target
    total, count = masked_token_loss(decoder(tokens), labels)
    expected = step_grads(decoder, total / count)
    decoder.skip_output_layer = True
    saved: dict[int, int] = {}  # the decoder's saved float tensors still held, by id

    class Saved:  # what autograd holds for a saved tensor: dropped when its node has run
        def __init__(self, tensor: torch.Tensor) -> None:
            self.tensor = tensor
            if tensor.dtype.is_floating_point:
                saved[id(self)] = 1
                weakref.finalize(self, saved.pop, id(self), None)

    with torch.autograd.graph.saved_tensors_hooks(Saved, lambda held: held.tensor):
        hidden = decoder(tokens)
    assert saved
    held_at_output: list[int] = []  # when each gradient of the output's weight is made
    output = decoder.tok_embeddings if tied else decoder.output
    output.weight.register_hook(lambda grad: held_at_output.append(len(saved)))
    fused, _ = fused_token_loss(
        hidden, labels, decoder.unembed, grad_scale=1 / int(count), chunk_size=4,
        num_targets=int(count), defer_output_grad=deferred,
    )  # fmt: skip
    torch.testing.assert_close(fused, total, **RELATIVE)
    assert (held_at_output != []) != deferred  # made in the forward, or not yet
    if not deferred:
        assert all(held_at_output)  # beside the saved activations
        held_at_output.clear()
    actual = step_grads(decoder, fused / count)
    # Deferred, and a tied embedding's lookup: at the end, no saved activation left
    assert (held_at_output != []) == (deferred or tied) and not any(held_at_output)
    assert actual.keys() == expected.keys()
    assert ("output.weight" in actual) != tied
    for name, grad in expected.items():
        assert grad.abs().sum() > 0, name
        assert_relative(actual[name], grad, max(1.0, float(grad.abs().max())))


@pytest.mark.parametrize("deferred", [False, True], ids=["now", "deferred"])
def test_lora_on_the_output_layer(deferred):
    """The output called as a module: its adapter runs and trains, the frozen base does not."""
    decoder = build_tiny_decoder(tie_word_embeddings=False)
    apply_lora(decoder, "output", rank=2)
    with torch.no_grad():  # a nonzero B, so that the adapter changes the logits
        decoder.output.lora_b.weight.normal_()
    tokens, labels = text_tokens(2, 10, seed=3), text_tokens(2, 10, seed=4)
    labels[1, :6] = -100
    total, count = masked_token_loss(decoder(tokens), labels)
    expected = step_grads(decoder, total / count)
    assert {"output.lora_a.weight", "output.lora_b.weight"} <= expected.keys()
    decoder.skip_output_layer = True
    fused, _ = fused_token_loss(
        decoder(tokens), labels, decoder.unembed, grad_scale=1 / int(count), chunk_size=3,
        defer_output_grad=deferred,
    )  # fmt: skip
    torch.testing.assert_close(fused, total, **RELATIVE)
    actual = step_grads(decoder, fused / count)
    assert actual.keys() == expected.keys() and "output.weight" not in actual
    for name, grad in expected.items():
        assert_relative(actual[name], grad, max(1.0, float(grad.abs().max())))


def test_only_the_output_trains():
    """Hidden states without a gradient: the sum still takes its backward (and checks it)."""
    output = head(4, 9, seed=2)
    hidden, labels = torch.randn(2, 6, 4), torch.randint(0, 9, (2, 6))
    total, _ = fused_token_loss(hidden, labels, output)
    total.backward()
    weight = output.weight.detach().requires_grad_()
    reference = F.cross_entropy(hidden.flatten(0, 1) @ weight.T, labels.flatten(), reduction="sum")
    reference.backward()
    assert_relative(output.weight.grad, weight.grad)


def test_eval_under_no_grad():
    output = head(4, 9, seed=3)
    hidden, labels = torch.randn(2, 6, 4), torch.randint(0, 9, (2, 6))
    with torch.no_grad():
        total, _ = fused_token_loss(hidden, labels, output, chunk_size=5)
    torch.testing.assert_close(total, full_logits_loss(hidden, labels, output).detach())
    assert output.weight.grad is None and not total.requires_grad


def test_another_incoming_gradient_is_an_error():
    """The output's gradient was made for ``grad_scale``: a sum scaled otherwise fails in its
    backward (eagerly on CPU) instead of training with a wrong gradient."""
    output = head(4, 9, seed=4)
    hidden = torch.randn(1, 6, 4, requires_grad=True)
    labels = torch.randint(0, 9, (1, 6))
    total, _ = fused_token_loss(hidden, labels, output, grad_scale=0.5)
    with pytest.raises(ValueError, match=r"grad_scale=0.5; pass the factor .* got 1.0"):
        total.backward()
    total, _ = fused_token_loss(hidden, labels, output, grad_scale=1 / 6)
    (total / 6).backward()  # the float32 rounding of 1 / 6 is within the tolerance


@pytest.mark.parametrize("scale", [0, -1.0, float("inf"), float("nan"), True, "1"])
def test_bad_grad_scale(scale):
    output = head(4, 9, seed=5)
    with pytest.raises(ValueError, match="grad_scale: expected a positive finite number"):
        fused_token_loss(torch.randn(1, 3, 4), torch.zeros(1, 3, dtype=torch.int64), output,
                         grad_scale=scale)  # fmt: skip


def test_an_output_whose_backward_reads_its_logits():
    """An output ending in ``tanh``, which keeps its result (the logits) for the backward:
    they are not overwritten in place (autograd would refuse the backward), and loss and
    gradients equal the full logits' cross-entropy."""
    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn(1, 12, 8, generator=generator, requires_grad=True)
    labels = torch.randint(0, 50, (1, 12), generator=generator)
    output = head(8, 50, seed=3)

    def capped(x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(output(x) / 2.0)

    total, _ = fused_token_loss(hidden, labels, capped, chunk_size=5, num_targets=12)
    (grad,) = torch.autograd.grad(total, [hidden])
    fused_weight = output.weight.grad.clone()
    output.weight.grad = None
    expected = full_logits_loss(hidden, labels, capped)
    want = torch.autograd.grad(expected, [hidden, output.weight])
    torch.testing.assert_close(total, expected.detach(), **RELATIVE)
    assert_relative(grad, want[0])
    assert_relative(fused_weight, want[1])


def test_no_tensor_of_all_logits_and_one_projection_per_chunk():
    """Nothing above one chunk's logits is allocated; the step's matrix products are three
    per chunk (logits, their gradient to the rows and to the weight) where the checkpointed
    chunks of chunked_token_loss need four (the logits again in the backward)."""
    batch, seq_len, dim, vocab, chunk = 2, 256, 16, 2048, 32
    tokens = batch * seq_len
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(batch, seq_len, dim, generator=generator, requires_grad=True)
    labels = torch.randint(0, vocab, (batch, seq_len), generator=generator)
    output = head(dim, vocab, seed=0)
    live = LiveFloats()
    with live:
        total, _ = fused_token_loss(hidden, labels, output, chunk_size=chunk, num_targets=tokens)
        total.backward()
    assert live.largest <= max(chunk * vocab, vocab * dim)
    # Live at once: one chunk's logits (which become their log-probabilities, then their
    # gradient, in place), the weight's gradient, the chunk's share of it and its transpose,
    # the rows, their chunks' gradients and their concatenation, a few scalars.
    gradients, scalars = 4 * (3 * tokens * dim + 3 * vocab * dim), 4096
    assert live.peak <= 4 * chunk * vocab + gradients + scalars < 4 * tokens * vocab / 2
    flops = {}
    deferred = partial(fused_token_loss, defer_output_grad=True)
    for name, loss in (("fused", fused_token_loss), ("chunked", chunked_token_loss),
                       ("deferred", deferred)):  # fmt: skip
        with FlopCounterMode(display=False) as counter:
            total, _ = loss(hidden, labels, output, chunk_size=chunk, num_targets=tokens)
            total.backward()
        flops[name] = counter.get_total_flops()
    projection = 2 * tokens * dim * vocab
    assert flops["fused"] == 3 * projection and flops["chunked"] == 4 * projection
    # Deferred: the logits and the rows' gradient now, the logits again and the weight's later
    assert flops["deferred"] == 4 * projection


def deep_step(deferred: bool) -> dict:
    """fused_token_loss after four tanh layers of width 64 over 1024 rows (their saved
    activations: 4 x 2 x 256 KiB), with a trained [1024, 64] output (its gradient: 256 KiB)
    and chunks of 64 targets: loss, gradients, and the peak of live float tensors."""
    torch.manual_seed(0)
    layers = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(4)])
    output = head(64, 1024, seed=1)
    x = torch.randn(1, 1024, 64)
    labels = torch.randint(0, 1024, (1, 1024))
    live = LiveFloats()
    with live:
        total, _ = fused_token_loss(
            layers(x), labels, output, grad_scale=1 / 1024, chunk_size=64, num_targets=1024,
            defer_output_grad=deferred,
        )  # fmt: skip
        (total / 1024).backward()
    grads = {name: p.grad for name, p in [*layers.named_parameters(), ("output", output.weight)]}
    return dict(total=total.detach(), grads=grads, peak=live.peak)


def test_a_deferred_output_gradient_is_not_held_beside_the_activations():
    """``defer_output_grad``: the same loss and gradients, and a lower peak: the output's
    [vocab, d] gradient (and each later chunk's fresh one) is made once the layers' backward
    has freed their saved activations, not at the loss while they are all alive."""
    now, deferred = deep_step(False), deep_step(True)
    torch.testing.assert_close(deferred["total"], now["total"], **RELATIVE)
    for name, grad in now["grads"].items():
        assert_relative(deferred["grads"][name], grad, float(grad.abs().max()))
    weight_grad = 1024 * 64 * 4
    assert deferred["peak"] + weight_grad <= now["peak"]


def test_a_deferred_loss_never_back_propagated_adds_nothing_later():
    """The deferred backward hangs on its own graph's nodes: a loss whose sum takes no
    backward gives a later one's output nothing of its own."""
    output = head(4, 9, seed=6)
    hidden, labels = torch.randn(1, 6, 4, requires_grad=True), torch.randint(0, 9, (1, 6))
    unused, _ = fused_token_loss(hidden * 2, labels, output, defer_output_grad=True)
    total, _ = fused_token_loss(hidden, labels, output, defer_output_grad=True)
    total.backward()
    alone = output.weight.grad.clone()
    output.weight.grad = None
    fused_token_loss(hidden, labels, output)[0].backward()  # made in the forward
    assert_relative(alone, output.weight.grad)
    assert unused.requires_grad


def test_a_deferred_output_projects_again_under_the_forwards_autocast():
    """Under CPU autocast (bfloat16) the deferred projection computes as the forward's did:
    the weight's gradient equals the one made in the forward, bit for bit (the 16 targets in
    one chunk both ways; a float32 projection would differ by bfloat16's rounding)."""
    output = head(16, 64, seed=7)
    hidden, labels = torch.randn(2, 8, 16, requires_grad=True), torch.randint(0, 64, (2, 8))
    grads = []
    for deferred in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            total, _ = fused_token_loss(
                hidden, labels, output, chunk_size=16, defer_output_grad=deferred
            )
        total.backward()
        grads.append(output.weight.grad)
        output.weight.grad = None
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)


@pytest.mark.parametrize("value", [1, None, "yes"])
def test_bad_defer_output_grad(value):
    output = head(4, 9, seed=5)
    with pytest.raises(ValueError, match="defer_output_grad: expected a bool, got"):
        fused_token_loss(torch.randn(1, 3, 4), torch.zeros(1, 3, dtype=torch.int64), output,
                         defer_output_grad=value)  # fmt: skip


def projected_rows(output: nn.Module) -> list[int]:
    """The rows of every call of ``output``, recorded as they come."""
    rows: list[int] = []
    output.register_forward_hook(lambda module, args, out: rows.append(args[0].size(1)))
    return rows


@given(targets=st.integers(0, 40), chunk=st.integers(1, 16))
@pytest.mark.parametrize("loss", [fused_token_loss, chunked_token_loss], ids=["fused", "chunked"])
def test_the_targets_go_in_the_fewest_even_chunks(loss, targets, chunk):
    """Each chunk reads the whole output weight, so the fewest chunks of at most ``chunk_size``
    rows, and even ones: the largest chunk's logits as small as that count allows (1540
    targets in chunks of 1024 are two of 770, not 1024 + 516). The output is frozen here (a
    trained one may take its targets in one chunk: below)."""
    output = head(4, 5, seed=0).requires_grad_(False)
    projected = projected_rows(output)
    hidden = torch.randn(1, targets, 4, requires_grad=True)
    labels = torch.randint(0, 5, (1, targets))
    total, _ = loss(hidden, labels, output, chunk_size=chunk, num_targets=targets)
    fewest = max(1, -(-targets // chunk))
    if loss is fused_token_loss and fewest > 1:
        assert projected.pop(0) == 0  # the call on no rows that finds what the output trains
    forward = list(projected)
    assert len(forward) == fewest and sum(forward) == targets
    assert max(forward) <= chunk and max(forward) - min(forward) <= 1
    total.backward()
    # The checkpointed chunks project again in the backward, the same chunks; the fused loss
    # did its backward in the forward.
    assert projected[len(forward) :] == ([] if loss is fused_token_loss else forward[::-1])


def test_the_default_chunk_is_512_target_rows():
    """The fused loss's default keeps a chunk's logits at 512 x vocab: 1540 targets go as four
    chunks of 385."""
    output = head(4, 5, seed=0).requires_grad_(False)
    projected = projected_rows(output)
    hidden = torch.randn(1, 1540, 4, requires_grad=True)
    fused_token_loss(hidden, torch.randint(0, 5, (1, 1540)), output, num_targets=1540)
    assert projected == [0] + [385] * 4


def biased_head(dim: int, vocab: int, seed: int) -> nn.Linear:
    """A trained output with a bias: no plain projection, so autograd makes each chunk's
    gradient of its weight."""
    torch.manual_seed(seed)
    return nn.Linear(dim, vocab)


def one_chunk_or_not(one_chunk: bool, monkeypatch) -> dict:
    """fused_token_loss over 40 targets in chunks of at most 16 rows with a trained [512, 64]
    output with a bias, its choice of one chunk forced to ``one_chunk``: loss, gradients,
    calls, peak."""
    monkeypatch.setattr("fusion.labels._one_chunk_is_leaner", lambda *args: one_chunk)
    output, generator = biased_head(64, 512, seed=0), torch.Generator().manual_seed(0)
    hidden = torch.randn(1, 40, 64, generator=generator, requires_grad=True)
    labels = torch.randint(0, 512, (1, 40), generator=generator)
    projected, live = projected_rows(output), LiveFloats()
    with live:
        total, _ = fused_token_loss(hidden, labels, output, chunk_size=16, num_targets=40)
        total.backward()
    return dict(total=total, hidden=hidden.grad, weight=output.weight.grad, calls=projected,
                peak=live.peak)  # fmt: skip


def test_a_trained_output_takes_its_targets_in_one_chunk_where_that_is_leaner(monkeypatch):
    """A trained [512, 64] output with a bias and 40 targets in chunks of at most 16 rows
    (three: 14, 13, 13): every chunk after the first makes a fresh [512, 64] gradient of the
    weight (128 KiB) before autograd adds it into ``.grad``, more than the other 26 rows'
    logits take (52 KiB). The rows go as one chunk, which holds less at once, with the same
    loss and gradients."""
    output = biased_head(64, 512, seed=0)
    projected = projected_rows(output)
    hidden = torch.randn(1, 40, 64, requires_grad=True)
    labels = torch.randint(0, 512, (1, 40))
    fused_token_loss(hidden, labels, output, chunk_size=16, num_targets=40)
    assert projected == [0, 40]  # the call on no rows, then one chunk
    one, chunks = one_chunk_or_not(True, monkeypatch), one_chunk_or_not(False, monkeypatch)
    assert one["calls"] == [0, 40] and chunks["calls"] == [0, 14, 13, 13]
    assert one["peak"] < chunks["peak"]
    for key in ("total", "hidden", "weight"):
        assert_relative(one[key], chunks[key])


@pytest.mark.parametrize("trains", ["nothing", "lora"])
def test_an_output_that_trains_little_keeps_its_chunks(trains):
    """A frozen output, or one whose LoRA adapter is all that trains: no fresh gradient as
    large as the extra rows' logits, so the chunks stay at most ``chunk_size`` rows."""
    decoder = build_tiny_decoder(tie_word_embeddings=False)
    decoder.output.requires_grad_(False)
    if trains == "lora":
        apply_lora(decoder, "output", rank=2)
    projected = projected_rows(decoder.output)
    hidden = torch.randn(1, 40, decoder.output.in_features, requires_grad=True)
    labels = torch.randint(0, decoder.output.out_features, (1, 40))
    fused_token_loss(hidden, labels, decoder.unembed, chunk_size=16, num_targets=40)
    assert projected == [0, 14, 13, 13]


def plain_output_step(output, unembed, summed: bool, monkeypatch, accumulate: bool, deferred: bool):
    """fused_token_loss over 40 targets in chunks of at most 16 rows (14, 13, 13) with a
    trained plain projection ``output`` called through ``unembed``, its weight's gradient
    summed by the loss (``summed``) or made by autograd chunk by chunk (its proof of a plain
    projection switched off, and the one-chunk choice with it), in the forward or deferred.
    ``accumulate``: the weight already has a ``.grad``. The loss, gradients, where the
    gradients the weight's hook saw live, the peak of live floats, and whether ``.grad`` is
    the tensor the hook saw or the one it had."""
    if not summed:
        monkeypatch.setattr("fusion.labels._projected_weight", lambda *args: None)
        monkeypatch.setattr("fusion.labels._one_chunk_is_leaner", lambda *args: False)
    weight = output.weight
    weight.grad = torch.ones_like(weight) if accumulate else None
    before = None if weight.grad is None else weight.grad.data_ptr()
    seen: list[int] = []  # where each gradient the hook saw lives (a reference would be copied)
    handle = weight.register_hook(lambda grad: seen.append(grad.data_ptr()))
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, 40, weight.size(1), generator=generator, requires_grad=True)
    labels = torch.randint(0, weight.size(0), (1, 40), generator=generator)
    live = LiveFloats()
    with live:
        total, _ = fused_token_loss(
            hidden, labels, unembed, chunk_size=16, num_targets=40, defer_output_grad=deferred
        )
        total.backward()
    handle.remove()
    assert weight.grad is not None
    kept = weight.grad.data_ptr() == (seen[0] if before is None else before)
    return dict(total=total.detach(), hidden=hidden.grad, weight=weight.grad, seen=seen,
                peak=live.peak, kept=kept, hidden_in=hidden, labels=labels)  # fmt: skip


@pytest.mark.parametrize("deferred", [False, True], ids=["now", "deferred"])
@pytest.mark.parametrize("accumulate", [False, True], ids=["fresh", "accumulated"])
@pytest.mark.parametrize("kind", ["linear", "untied", "tied"])
def test_a_plain_output_sums_its_weight_gradient_over_the_chunks(
    kind, accumulate, deferred, monkeypatch
):
    """A plain projection (``F.linear`` without a bias: an ``nn.Linear``, the decoder's untied
    output or its tied embedding) keeps its chunks: the chunks' gradients of its weight are
    summed in one tensor, which its hook sees once and its ``.grad`` takes without a copy (or
    which is added into the ``.grad`` it had, in place), where autograd would make a fresh
    gradient per chunk. Loss and gradients are autograd's and the full logits', and less is
    live at once (one [512, 64] gradient fewer: 128 KiB)."""

    def build():
        if kind == "linear":
            output = head(64, 512, seed=0)
            return output, output
        decoder = build_tiny_decoder(tie_word_embeddings=kind == "tied")
        output = decoder.tok_embeddings if kind == "tied" else decoder.output
        return output, decoder.unembed

    output, unembed = build()
    calls = projected_rows(output) if kind != "tied" else None
    summed = plain_output_step(output, unembed, True, monkeypatch, accumulate, deferred)
    if calls is not None:
        # The chunks stay (deferred: projected again at the end of the backward)
        assert calls == [0, 14, 13, 13] + [14, 13, 13] * deferred
    assert len(summed["seen"]) == 1 and summed["kept"]
    monkeypatch.undo()
    output, unembed = build()
    chunked = plain_output_step(output, unembed, False, monkeypatch, accumulate, deferred)
    assert len(chunked["seen"]) == 3
    # A fresh .grad is the sum itself: about one [512, 64] gradient fewer at once where the
    # weight is most of what is live (autograd: the .grad and the next chunk's; the two peaks
    # fall at moments a few small tensors apart). Added into a .grad, the sum is that second
    # tensor; the decoders' [64, 32] outputs are smaller than their rows.
    saved = output.weight.numel() * 4 * 3 // 4 if kind == "linear" and not accumulate else 0
    assert summed["peak"] <= chunked["peak"] - saved
    for key in ("total", "hidden", "weight"):
        assert_relative(summed[key], chunked[key])
    output.weight.grad = torch.ones_like(output.weight) if accumulate else None
    hidden = summed["hidden_in"].detach().requires_grad_()
    expected = full_logits_loss(hidden, summed["labels"], unembed)
    expected.backward()
    assert_relative(summed["total"], expected.detach())
    assert_relative(summed["weight"], output.weight.grad, scale=40)
    assert_relative(summed["hidden"], hidden.grad)


@pytest.mark.parametrize(
    "unembed",
    ["bias", "scaled rows", "scaled weight", "detached rows", "soft cap", "lora"],
)
def test_what_is_not_a_plain_projection_keeps_autograds_gradient(unembed, monkeypatch):
    """Outputs whose graph is no ``rows @ W.t()`` (a bias, rows or weight changed before the
    product, rows cut from the graph, a soft cap, a LoRA adapter): the weight's gradient is
    autograd's, chunk by chunk (the hook sees one per chunk), and equals the full logits'."""
    lora = build_tiny_decoder(tie_word_embeddings=False)
    apply_lora(lora, "output", rank=2)
    lora.output.weight.requires_grad_(True)
    vocab, width = lora.output.weight.shape
    weight = nn.Parameter(torch.randn(vocab, width) / 8)
    functions = {
        "bias": partial(F.linear, weight=weight, bias=torch.zeros(vocab, requires_grad=True)),
        "scaled rows": lambda x: F.linear(2 * x, weight),
        "scaled weight": lambda x: F.linear(x, weight * 2),
        "detached rows": lambda x: F.linear(x.detach() + x - x.detach(), weight),
        "soft cap": lambda x: torch.tanh(F.linear(x, weight) / 4) * 4,
        "lora": lora.unembed,
    }
    function = functions[unembed]
    if unembed == "lora":
        weight = lora.output.weight
    seen: list[int] = []
    weight.register_hook(lambda grad: seen.append(grad.data_ptr()))
    monkeypatch.setattr("fusion.labels._one_chunk_is_leaner", lambda *args: False)
    hidden = torch.randn(1, 40, width, requires_grad=True)
    labels = torch.randint(0, vocab, (1, 40))
    fused_token_loss(hidden, labels, function, chunk_size=16, num_targets=40)
    assert len(seen) == 3  # autograd's gradient of each chunk
    fused = weight.grad.clone()
    weight.grad = None
    full_logits_loss(hidden, labels, function).backward()
    assert_relative(fused, weight.grad, scale=40)
