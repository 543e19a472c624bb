import pytest
import torch

from fusion import next_token_labels


def test_shift_and_ignores():
    tokens = torch.tensor([[7, 99, 99, 5, 6, 2], [7, 8, 9, 99, 4, 0]])
    labels = next_token_labels(tokens, ignore_ids=[99, 0], loss_start=torch.tensor([3, 1]))
    assert labels.tolist() == [
        [-100, -100, 5, 6, 2, -100],  # predicts tokens from index 3 on; placeholders: never
        [8, 9, -100, 4, -100, -100],  # from index 1; padding (0) ignored; last: nothing follows
    ]


def test_cross_entropy_with_out_of_vocabulary_placeholders():
    tokens = torch.tensor([[1, 512, 512, 3]])  # 512: placeholder outside a 16-word vocabulary
    logits = torch.randn(1, 4, 16)
    labels = next_token_labels(tokens, ignore_ids=[512])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
    assert torch.isfinite(loss)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"tokens": torch.zeros(3, dtype=torch.long)}, r"tokens: expected integer ids \[b, s\]"),
        ({"ignore_ids": [1.0]}, r"ignore_ids, ignore_index: expected Python ints, got 1.0"),
        ({"ignore_index": True}, r"expected Python ints, got True"),
        ({"loss_start": torch.tensor([1.0, 2.0])}, r"loss_start: expected integer indices \[2\]"),
        ({"loss_start": torch.tensor([1])}, r"loss_start: expected integer indices \[2\]"),
        (
            {"loss_start": [1, 2]},
            r"loss_start: expected integer indices \[2\] on cpu, got \[1, 2\]",
        ),
    ],
)
def test_bad_arguments(kwargs, match):
    args = {"tokens": torch.zeros(2, 3, dtype=torch.long), **kwargs}
    with pytest.raises(ValueError, match=match):
        next_token_labels(**args)
