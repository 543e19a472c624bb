import pytest
import torch

from fusion.generation import check_sampling_args, sample_next_token

DRAWS = 20_000  # frequency tolerance 0.02 is > 5 standard deviations at this count


def frequencies(logits: torch.Tensor, **kwargs) -> torch.Tensor:
    """Empirical distribution of DRAWS samples from one row of logits [vocab]."""
    generator = torch.Generator().manual_seed(0)
    batch = logits.expand(DRAWS, -1)
    ids = sample_next_token(batch, generator=generator, **kwargs)
    return torch.bincount(ids, minlength=logits.numel()).float() / DRAWS


LOGITS = torch.tensor([2.0, 1.5, 0.3, -0.5, 1.0, -2.0])


class TestDistribution:
    def test_greedy(self):
        logits = torch.randn(5, 11, generator=torch.Generator().manual_seed(3))
        assert torch.equal(sample_next_token(logits, temperature=0), logits.argmax(-1))
        assert torch.equal(sample_next_token(logits, temperature=0.7, top_k=1), logits.argmax(-1))
        assert torch.equal(sample_next_token(logits, top_p=1e-6), logits.argmax(-1))

    @pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
    def test_matches_softmax(self, temperature):
        expected = torch.softmax(LOGITS / temperature, -1)
        actual = frequencies(LOGITS, temperature=temperature)
        torch.testing.assert_close(actual, expected, atol=0.02, rtol=0)

    def test_top_k(self):
        actual = frequencies(LOGITS, top_k=3)
        kept = LOGITS.topk(3).indices
        expected = torch.zeros_like(LOGITS)
        expected[kept] = torch.softmax(LOGITS[kept], -1)
        assert actual[expected == 0].sum() == 0
        torch.testing.assert_close(actual, expected, atol=0.02, rtol=0)

    def test_top_p(self):
        probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
        # 0.5 + 0.3 reaches 0.8: the nucleus is {0, 1}, renormalised.
        actual = frequencies(probs.log(), top_p=0.8)
        torch.testing.assert_close(actual, torch.tensor([0.625, 0.375, 0, 0]), atol=0.02, rtol=0)
        actual = frequencies(probs.log(), top_p=0.81)
        assert actual[2] > 0 and actual[3] == 0

    def test_generator_reproducible(self):
        logits = torch.randn(4, 50)
        draw = [
            sample_next_token(logits, top_k=20, generator=torch.Generator().manual_seed(5))
            for _ in range(2)
        ]
        assert torch.equal(*draw)


class TestArguments:
    @pytest.mark.parametrize(
        ("kwargs", "name"),
        [
            ({"temperature": -0.1}, "temperature"),
            ({"temperature": float("nan")}, "temperature"),
            ({"top_k": 0}, "top_k"),
            ({"top_k": -3}, "top_k"),
            ({"top_k": 11}, "top_k"),
            ({"top_k": 2.0}, "top_k"),
            ({"top_p": 0.0}, "top_p"),
            ({"top_p": 1.5}, "top_p"),
            ({"top_p": -0.2}, "top_p"),
        ],
    )
    def test_bad_values(self, kwargs, name):
        args = {"temperature": 1.0, "top_k": None, "top_p": None} | kwargs
        with pytest.raises(ValueError, match=f"^{name}: expected"):
            check_sampling_args(**args, vocab_size=10)
        with pytest.raises(ValueError, match=f"^{name}: expected"):
            sample_next_token(torch.zeros(2, 10), **args)

    def test_bad_logits(self):
        with pytest.raises(ValueError, match="logits"):
            sample_next_token(torch.zeros(10))
