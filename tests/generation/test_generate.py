import pytest
import torch
from torch import nn

from fusion import EarlyFusion, generate
from fusion.generation import generate_stream, left_pad, sample_next_token
from helpers import EMBED_DIM, VOCAB, lively_decoder

IMAGE = VOCAB + 1  # placeholder outside the vocabulary: it can never be generated
# Different lengths; the 4th has real 0s (= pad_id) that are not leading, so not padding.
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 4], [12, 13, 14, 15], [7, 0, 9, 0]]
NEW = 12


class CountingEncoder(nn.Module):
    """Images [n, 6] -> packed rows [n, 3, d]; counts its calls."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(6, 3 * EMBED_DIM)
        with torch.no_grad():
            self.proj.weight.mul_(3)
        self.calls = 0

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.proj(images).view(images.size(0), 3, EMBED_DIM)


def tiny_fusion() -> EarlyFusion:
    decoder = lively_decoder()
    torch.manual_seed(1)
    return EarlyFusion(decoder, {"image": CountingEncoder()}, {"image": IMAGE}).eval()


def greedy_by_recomputation(model, prompt: list[int], steps: int, **kwargs) -> list[int]:
    """The oracle: no cache, no padding, the whole sequence through the model at every step."""
    sequence = torch.tensor([prompt])
    for _ in range(steps):
        with torch.no_grad():
            logits = model(sequence, **kwargs)[:, -1]
        sequence = torch.cat([sequence, logits.argmax(-1, keepdim=True)], dim=1)
    return sequence[0, len(prompt) :].tolist()


class TestAgainstRecomputation:
    def test_greedy_decoder(self):
        decoder = lively_decoder()
        out = generate(decoder, left_pad(PROMPTS, pad_id=0), max_new_tokens=NEW, temperature=0)
        assert out.shape == (len(PROMPTS), 7 + NEW)
        assert torch.equal(out[:, :7], left_pad(PROMPTS, pad_id=0))
        for i, prompt in enumerate(PROMPTS):
            assert out[i, 7:].tolist() == greedy_by_recomputation(decoder, prompt, NEW), i
        assert len({tuple(row) for row in out[:, 7:].tolist()}) == len(PROMPTS)

    def test_sampling_decoder(self):
        decoder, prompt = lively_decoder(seed=4), PROMPTS[0]
        out = generate(
            decoder,
            torch.tensor([prompt]),
            max_new_tokens=NEW,
            temperature=0.8,
            top_k=20,
            top_p=0.95,
            generator=torch.Generator().manual_seed(7),
        )
        generator, sequence = torch.Generator().manual_seed(7), torch.tensor([prompt])
        for _ in range(NEW):
            with torch.no_grad():
                logits = decoder(sequence)[:, -1]
            token = sample_next_token(
                logits, temperature=0.8, top_k=20, top_p=0.95, generator=generator
            )
            sequence = torch.cat([sequence, token[:, None]], dim=1)
        assert torch.equal(out, sequence)

    def test_greedy_early_fusion_runs_encoders_once(self):
        model = tiny_fusion()
        encoder = model.encoders["image"]
        prompts = [
            [5, IMAGE, IMAGE, IMAGE, 7, 8],
            [9, IMAGE, IMAGE, IMAGE, 10, IMAGE, IMAGE, IMAGE, 11],
            [12, 13],
        ]
        images = torch.randn(3, 6, generator=torch.Generator().manual_seed(3))
        out = generate(
            model,
            left_pad(prompts, pad_id=0),
            encoder_input={"image": {"images": images}},
            max_new_tokens=NEW,
            temperature=0,
        )
        assert encoder.calls == 1
        per_sample_images = [images[:1], images[1:], None]
        for i, (prompt, own) in enumerate(zip(prompts, per_sample_images, strict=True)):
            kwargs = {} if own is None else {"encoder_input": {"image": {"images": own}}}
            assert out[i, 9:].tolist() == greedy_by_recomputation(model, prompt, NEW, **kwargs)
        # The images matter, so the comparison above is not only about text.
        other = generate(
            model,
            left_pad(prompts, pad_id=0),
            encoder_input={"image": {"images": -images}},
            max_new_tokens=NEW,
            temperature=0,
        )
        assert not torch.equal(other[:2], out[:2])
        assert torch.equal(other[2], out[2])


class TestStreaming:
    def test_yields_each_step_as_it_is_computed(self):
        decoder = lively_decoder()
        forwards = []
        decoder.register_forward_hook(lambda *_: forwards.append(1))
        tokens = left_pad(PROMPTS, pad_id=0)
        stream = generate_stream(decoder, tokens, max_new_tokens=4, temperature=0)
        assert forwards == [] and not decoder.caches_are_setup()  # lazy
        first = next(stream)
        assert first.shape == (len(PROMPTS),) and len(forwards) == 1  # the prefill
        assert decoder.caches_are_setup()
        second = next(stream)
        assert len(forwards) == 2
        rest = list(stream)
        assert len(rest) == 2 and len(forwards) == 4  # the last token is never fed back
        assert not decoder.caches_are_setup()
        expected = generate(decoder, tokens, max_new_tokens=4, temperature=0)[:, -4:]
        assert torch.equal(torch.stack([first, second, *rest], dim=1), expected)

    def test_closing_early_removes_the_caches(self):
        decoder = lively_decoder()
        stream = generate_stream(decoder, torch.tensor([PROMPTS[0]]), max_new_tokens=8)
        next(stream)
        stream.close()
        assert not decoder.caches_are_setup()


class TestStopTokensAndCaches:
    def test_stop_tokens(self):
        decoder = lively_decoder()
        tokens = left_pad(PROMPTS, pad_id=0)
        free = generate(decoder, tokens, max_new_tokens=NEW, temperature=0)[:, 7:]
        stop = int(free[0, 3])
        out = generate(decoder, tokens, max_new_tokens=NEW, temperature=0, stop_tokens=[stop])
        for i, row in enumerate(free.tolist()):
            end = row.index(stop) + 1 if stop in row else NEW
            assert out[i, 7 : 7 + end].tolist() == row[:end]
            assert (out[i, 7 + end :] == 0).all()
        # One prompt that stops: generation ends there.
        alone = generate(decoder, tokens[:1], max_new_tokens=NEW, temperature=0, stop_tokens=[stop])
        assert alone.shape[1] == 7 + free[0].tolist().index(stop) + 1 < 7 + NEW

    def test_existing_caches_are_reused(self):
        decoder = lively_decoder()
        tokens = left_pad(PROMPTS, pad_id=0)
        expected = generate(decoder, tokens, max_new_tokens=NEW, temperature=0)
        decoder.setup_caches(len(PROMPTS), torch.float32, decoder_max_seq_len=40)
        for _ in range(2):  # reset between calls
            out = generate(decoder, tokens, max_new_tokens=NEW, temperature=0)
            assert torch.equal(out, expected)
        assert decoder.caches_are_setup()


class TestBadInput:
    @pytest.mark.parametrize(
        ("kwargs", "match"),
        [
            ({"max_new_tokens": 0}, "max_new_tokens"),
            ({"max_new_tokens": -2}, "max_new_tokens"),
            ({"max_new_tokens": 2.5}, "max_new_tokens"),
            ({"temperature": -0.5}, "temperature"),
            ({"top_k": 0}, "top_k"),
            ({"top_p": 0.0}, "top_p"),
            ({"top_p": 1.2}, "top_p"),
            ({"stop_tokens": [VOCAB]}, "stop_tokens"),
            ({"stop_tokens": 2}, "stop_tokens: expected a sequence"),
            ({"pad_id": -1}, "pad_id"),
            ({"max_new_tokens": 59}, r"7 plus max_new_tokens=59 need 65 .* max_seq_len \(64\)"),
            ({"encoder_input": {"image": torch.zeros(3, EMBED_DIM)}}, "encoder_input"),
        ],
    )
    def test_decoder(self, kwargs, match):
        decoder = lively_decoder()
        args = {"max_new_tokens": 4} | kwargs
        with pytest.raises(ValueError, match=match):
            generate(decoder, left_pad(PROMPTS, pad_id=0), **args)
        assert not decoder.caches_are_setup()

    def test_prompt_longer_than_existing_cache(self):
        decoder = lively_decoder()
        decoder.setup_caches(1, torch.float32, decoder_max_seq_len=10)
        with pytest.raises(ValueError, match=r"need 11 .* the KV cache's length \(10\)"):
            generate(decoder, torch.tensor([PROMPTS[0]]), max_new_tokens=5)
        with pytest.raises(ValueError, match="batch size 1, got 4 prompts"):
            generate(decoder, left_pad(PROMPTS, pad_id=0), max_new_tokens=2)
        with decoder.caches_disabled(), pytest.raises(ValueError, match="disabled"):
            generate(decoder, torch.tensor([PROMPTS[0]]), max_new_tokens=2)

    def test_tokens(self):
        decoder = lively_decoder()
        with pytest.raises(ValueError, match="all padding"):
            generate(decoder, torch.tensor([[0, 0, 0], [0, 4, 5]]), max_new_tokens=2)
        for bad in (torch.tensor([[1.0, 2.0]]), torch.tensor([1, 2]), torch.zeros(2, 0).long()):
            with pytest.raises(ValueError, match="tokens: expected non-empty integer ids"):
                generate(decoder, bad, max_new_tokens=2)
        with pytest.raises(TypeError, match="model"):
            generate(nn.Linear(2, 2), torch.tensor([[1, 2]]), max_new_tokens=2)

    def test_early_fusion(self):
        model = tiny_fusion()
        tokens = torch.tensor([[5, IMAGE, IMAGE, IMAGE]])
        with pytest.raises(ValueError, match=r"encoder_input: unknown encoder names \['audio'\]"):
            generate(model, tokens, encoder_input={"audio": {}}, max_new_tokens=2)
        clashing = EarlyFusion(lively_decoder(), {"image": CountingEncoder()}, {"image": 3})
        with pytest.raises(ValueError, match="pad_id: 3 is a placeholder"):
            generate(clashing, torch.tensor([[5, 3, 3, 3]]), max_new_tokens=2, pad_id=3)

    def test_left_pad(self):
        assert left_pad([[4, 5], [6]], pad_id=0).tolist() == [[4, 5], [0, 6]]
        with pytest.raises(ValueError, match=r"prompts\[1\]: starts with pad_id=0"):
            left_pad([[4, 5], [0, 6]], pad_id=0)
        with pytest.raises(ValueError, match=r"prompts\[0\]: expected at least one token"):
            left_pad([[]], pad_id=0)
        with pytest.raises(ValueError, match="at least one prompt"):
            left_pad([], pad_id=0)


def test_models_wrapped_by_torch_compile():
    # backend="eager": dynamo traces and guards, without compiling kernels (seconds on a CPU).
    tokens = left_pad(PROMPTS[:2], pad_id=0)
    for model in (lively_decoder(), tiny_fusion()):
        expected = generate(model, tokens, max_new_tokens=3, temperature=0)
        compiled = torch.compile(model, backend="eager")
        assert torch.equal(generate(compiled, tokens, max_new_tokens=3, temperature=0), expected)
        assert not model.caches_are_setup()
