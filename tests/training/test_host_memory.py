"""Freed host memory handed back at a CPU step's two peaks
(``fusion.training.release_freed_memory``): when each release runs, that nothing else
changes, and that glibc's ``malloc_trim`` really gives freed heap pages back."""

import os
import sys

import pytest
import torch

from fusion.training import host_memory, release_freed_host_memory, release_freed_memory
from helpers import FEATURES, IMAGE_ID, build_tiny_decoder, build_tiny_fusion, text_tokens


@pytest.fixture
def events(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """What happened, in order: each release ("release"), and marks the test adds."""
    seen: list[str] = []
    monkeypatch.setattr(host_memory, "release_freed_host_memory", lambda: seen.append("release"))
    return seen


def marked_step(model, events: list[str], **inputs) -> dict[str, torch.Tensor]:
    """One forward and backward of ``model``'s hidden states with marks around the loss and
    at the token embedding's gradient; returns the gradients."""
    model.zero_grad(set_to_none=True)
    decoder = model.decoder if hasattr(model, "decoder") else model
    decoder.skip_output_layer = True
    weight = decoder.tok_embeddings.weight
    handle = weight.register_post_accumulate_grad_hook(lambda _: events.append("embedding grad"))
    hidden = model(**inputs)
    events.append("loss")
    hidden.square().mean().backward()
    events.append("done")
    handle.remove()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("fused", [False, True])
def test_releases_before_the_loss_and_before_the_embedding_gradient(events, fused):
    torch.manual_seed(0)
    model = build_tiny_fusion() if fused else build_tiny_decoder(tie_word_embeddings=False)
    tokens = text_tokens(2, 8)
    inputs: dict = {"tokens": tokens}
    if fused:
        tokens[:, 2:4] = IMAGE_ID
        inputs["encoder_input"] = {"image": {"features": torch.randn(4, 1, FEATURES)}}
    plain = marked_step(model, events, **inputs)
    assert events == ["loss", "embedding grad", "done"]
    events.clear()
    handle = release_freed_memory(model)
    released = marked_step(model, events, **inputs)
    assert events == ["release", "loss", "release", "embedding grad", "done"]
    assert plain.keys() == released.keys()
    for name, grad in plain.items():
        assert torch.equal(released[name], grad), name
    events.clear()
    handle.remove()
    marked_step(model, events, **inputs)
    assert events == ["loss", "embedding grad", "done"]


def test_nothing_without_grad_or_off_the_cpu(events):
    model = build_tiny_decoder()
    release_freed_memory(model)
    with torch.no_grad():
        model(text_tokens(2, 8))  # evaluation: nothing to free for
    for param in model.parameters():
        param.requires_grad_(False)
    model(text_tokens(2, 8)).sum()  # a frozen embedding: no gradient to wait for
    assert events == ["release"]  # the forward's, in grad mode
    events.clear()
    meta = build_tiny_decoder().to("meta")
    release_freed_memory(meta)
    meta(text_tokens(2, 8).to("meta")).sum().backward()
    assert events == []  # not host memory


def test_releases_after_a_forward_that_returns_a_list(events):
    model = build_tiny_decoder()
    release_freed_memory(model)
    model.num_output_chunks = 2  # the logits in chunks
    model(text_tokens(2, 8))
    model.num_output_chunks = 0
    model.output_hidden_states = [0]  # [embeddings, logits]
    model(text_tokens(2, 8))
    assert events == ["release", "release"]


def test_refuses_a_model_without_a_decoder():
    with pytest.raises(ValueError, match="model: expected a TransformerDecoder"):
        release_freed_memory(torch.nn.Linear(2, 2))


def test_false_without_malloc_trim(monkeypatch):
    monkeypatch.setattr(host_memory, "_malloc_trim", lambda: None)
    assert release_freed_host_memory() is False


def _resident_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or host_memory._malloc_trim() is None,
    reason="glibc's malloc_trim",
)
def test_freed_heap_pages_go_back_to_the_system():
    # Blocks under glibc's mmap threshold (128 KiB at first) live in its heap; the last one
    # stays alive, so freeing the others leaves holes that the heap's top trim cannot return.
    blocks = [torch.ones(16_000) for _ in range(1_000)]  # 64 kB each, 61 MiB, touched
    last = blocks.pop()
    before = _resident_mib()
    del blocks
    freed = _resident_mib()
    assert release_freed_host_memory() is True
    after = _resident_mib()
    assert freed - after > 30, (before, freed, after)
    assert last.sum() == 16_000  # what is alive is untouched
