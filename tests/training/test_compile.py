"""Regional compilation (``fusion.training.modules.compile_layers``): one compiled graph
serves every decoder layer and every packed row length, with no recompilation over a run of
varied batches, and the loss and gradients equal eager."""

import pytest
import torch

from fusion import masked_token_loss
from fusion.data import Sample, collate_packed, pack_samples
from fusion.models import llama3_2
from fusion.training.modules import compile_layers

VOCAB = 64


def decoder(num_layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return llama3_2(
        vocab_size=VOCAB,
        num_layers=num_layers,
        num_heads=4,
        num_kv_heads=2,
        embed_dim=32,
        max_seq_len=64,
        intermediate_dim=64,
    )


def batches(seed: int, count: int) -> list:
    """Packed batches of random sample lengths: one row or several, rows of varied length."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        lengths = torch.randint(2, 30, (int(torch.randint(1, 6, (1,), generator=generator)),))
        samples = []
        for length in lengths.tolist():
            tokens = torch.randint(0, VOCAB, (length,), generator=generator)
            labels = torch.cat([tokens[1:], torch.tensor([-100])])
            samples.append(Sample(tokens, labels, torch.empty(0)))
        out.append(collate_packed(pack_samples(samples, 48), pad_id=0))
    return out


def warm_up() -> list:
    """A batch of one row and one of several: the two graphs dynamic shapes need."""
    run = batches(0, 20)
    return [
        next(b for b in run if b.tokens.size(0) == 1),
        next(b for b in run if b.tokens.size(0) > 1),
    ]


def loss_and_grads(model: torch.nn.Module, batch) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = masked_token_loss(
        model(batch.tokens, **{k: v for k, v in batch.model_inputs().items() if k != "tokens"}),
        batch.labels,
    )[0]
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def counting_backend(graphs: list[int]):
    def backend(graph_module: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(len(graph_module.graph.nodes))
        return graph_module.forward  # run the captured graph eagerly: dynamo's work only

    return backend


def graphs_compiled(num_layers: int) -> int:
    graphs: list[int] = []
    model = decoder(num_layers)
    keys = list(model.state_dict())
    compile_layers(model, backend=counting_backend(graphs))
    for batch in warm_up():
        loss_and_grads(model, batch)
    warm = len(graphs)
    with torch.compiler.set_stance("fail_on_recompile"):
        for batch in batches(1, 8):  # new lengths, one row and several
            loss_and_grads(model, batch)
    assert len(graphs) == warm  # nothing compiled again
    assert list(model.state_dict()) == keys
    return warm


def test_one_graph_serves_every_layer_and_row_length():
    assert 0 < graphs_compiled(1) == graphs_compiled(3)


def test_compiled_layers_equal_eager_in_loss_and_gradients():
    eager, compiled = decoder(2), decoder(2)
    compile_layers(compiled)
    for batch in warm_up():
        loss_and_grads(compiled, batch)
    with torch.compiler.set_stance("fail_on_recompile"):
        for batch in batches(2, 4):
            expected, expected_grads = loss_and_grads(eager, batch)
            got, grads = loss_and_grads(compiled, batch)
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
            for a, b in zip(grads, expected_grads, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_compile_layers_refuses_a_model_without_a_decoder():
    with pytest.raises(ValueError, match="model: expected a TransformerDecoder"):
        compile_layers(torch.nn.Linear(2, 2))
