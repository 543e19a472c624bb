"""fusion.masked_token_loss: summed cross-entropy over targets and their count, so that
accumulating micro-batches weighs every target token the same."""

import pytest
import torch
import torch.nn.functional as F

from fusion import masked_token_loss


def test_sum_and_count_match_cross_entropy():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 7, generator=generator)
    labels = torch.tensor([[1, -100, 3, 6, -100], [-100, -100, 0, 2, -100]])
    total, count = masked_token_loss(logits, labels)
    assert count.dtype == torch.int64 and int(count) == 5
    mean = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
    torch.testing.assert_close(total / count, mean)
    # Chunks along the sequence (set_num_output_chunks) give the same sum.
    chunked, _ = masked_token_loss(list(logits.split([2, 3], dim=1)), labels)
    torch.testing.assert_close(chunked, total)
    # bf16 logits are upcast: the sum is float32.
    assert masked_token_loss(logits.bfloat16(), labels)[0].dtype == torch.float32


def test_accumulation_weighs_every_token_equally():
    """Two micro-batches with different target counts, each loss sum divided by the total
    count: the gradient of one batch holding both."""
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(4, 9, generator=generator, requires_grad=True)
    x = torch.randn(3, 6, 4, generator=generator)
    labels = torch.randint(0, 9, (3, 6), generator=generator)
    labels[0, :5] = -100  # micro-batch 1 holds one target, micro-batch 2 many
    whole, count = masked_token_loss(x @ weight, labels)
    (expected,) = torch.autograd.grad(whole / count, weight)
    parts = [(x[:1], labels[:1]), (x[1:], labels[1:])]
    for xs, ys in parts:
        part, _ = masked_token_loss(xs @ weight, ys)
        (part / count).backward()
    torch.testing.assert_close(weight.grad, expected)


def test_bad_arguments():
    logits = torch.randn(2, 5, 7)
    with pytest.raises(ValueError, match=r"labels: expected integer targets \[2, 5\]"):
        masked_token_loss(logits, torch.zeros(2, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match="labels: expected integer targets"):
        masked_token_loss(logits, torch.zeros(2, 5))
    with pytest.raises(ValueError, match=r"logits: expected \[b, s, vocab\]"):
        masked_token_loss(logits[0], torch.zeros(2, 5, dtype=torch.int64))
