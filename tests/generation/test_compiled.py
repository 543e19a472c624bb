"""Compiled, sync-free decoding: ``generate(..., compile=...)`` against eager generation, counted
recompilations, and probes for host synchronisation inside the steps.

On the CPU these run dynamo with the ``eager``/``aot_eager`` backends (tracing, guards and
ATen graphs, without compiling kernels); inductor runs once, opt-in (``FUSION_INDUCTOR_TESTS=1``,
about a minute on 2 cores); CUDA graphs run where a GPU is.
"""

import operator
import os
from unittest import mock

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._functorch.aot_autograd import aot_module_simplified, make_boxed_func

from fusion import EarlyFusion, generate
from fusion.generation import generate_stream, left_pad
from fusion.generation.steps import bucket
from helpers import EMBED_DIM, SYNC_TAGS, VOCAB, build_tiny_decoder, lively_decoder, sync_ops_in

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 4], [12, 13, 14, 15], [7, 0, 9, 0]]
NEW = 10
IMAGE = VOCAB + 1


class Encoder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(6, 3 * EMBED_DIM)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.proj(images).view(images.size(0), 3, EMBED_DIM)


def tiny_fusion() -> EarlyFusion:
    torch.manual_seed(1)
    return EarlyFusion(lively_decoder(), {"image": Encoder()}, {"image": IMAGE}).eval()


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test counts its own compilations."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def greedy(model, tokens, **kwargs):
    return generate(model, tokens, max_new_tokens=NEW, temperature=0, **kwargs)


class TestSameTokensAsEager:
    def test_decoder(self):
        decoder = lively_decoder()
        tokens = left_pad(PROMPTS, pad_id=0)
        expected = greedy(decoder, tokens)
        assert len({tuple(row) for row in expected[:, 7:].tolist()}) == len(PROMPTS)
        # aot_eager: the ATen graphs dynamo and AOTAutograd make, run op by op.
        assert torch.equal(greedy(decoder, tokens, compile={"backend": "aot_eager"}), expected)
        assert not decoder.caches_are_setup()

    def test_stop_tokens_sampling_and_own_caches(self):
        decoder = lively_decoder()
        tokens = left_pad(PROMPTS, pad_id=0)
        stop = int(greedy(decoder, tokens)[0, 7 + 3])
        compiled = {"backend": "eager"}  # dynamo's graphs, run as traced
        expected = greedy(decoder, tokens, stop_tokens=[stop])
        assert torch.equal(greedy(decoder, tokens, stop_tokens=[stop], compile=compiled), expected)

        def sampled(**kwargs):
            generator = torch.Generator().manual_seed(3)
            return generate(
                decoder, tokens, max_new_tokens=NEW, top_k=9, generator=generator, **kwargs
            )

        # Sampling draws outside the graph, from the same generator.
        assert torch.equal(sampled(compile=compiled), sampled())
        decoder.setup_caches(len(PROMPTS), torch.float32, decoder_max_seq_len=40)
        assert torch.equal(greedy(decoder, tokens, stop_tokens=[stop], compile=compiled), expected)
        assert decoder.caches_are_setup()  # the user's caches stay

    def test_early_fusion_and_a_torch_compile_wrapper(self):
        model = tiny_fusion()
        prompts = [[5, IMAGE, IMAGE, IMAGE, 7, 8], [12, 13]]
        tokens = left_pad(prompts, pad_id=0)
        images = {
            "image": {"images": torch.randn(1, 6, generator=torch.Generator().manual_seed(0))}
        }
        expected = greedy(model, tokens, encoder_input=images)
        # The prefill (encoders, merge) runs eagerly, the steps compiled; a torch.compile
        # wrapper is looked through: the module itself is compiled.
        wrapped = torch.compile(model, backend="eager")
        compiled = {"backend": "eager"}
        assert torch.equal(
            greedy(wrapped, tokens, encoder_input=images, compile=compiled), expected
        )


class TestNoRecompilation:
    def test_across_steps_calls_models_and_prompt_lengths(self):
        counter = CompileCounterWithBackend("eager")
        compiled = {"backend": counter}
        decoder = lively_decoder()
        tokens = left_pad(PROMPTS, pad_id=0)
        greedy(decoder, tokens, compile=compiled)
        # Warm: the prefill and the greedy step, one graph each.
        assert counter.frame_count == 2
        with torch._dynamo.config.patch(error_on_recompile=True):
            # More steps (the cache's length stays in its bucket), other prompts of the same
            # batch size and other lengths of the same bucket, another model of the same shape.
            generate(decoder, tokens, max_new_tokens=NEW + 4, temperature=0, compile=compiled)
            greedy(decoder, torch.randint(1, VOCAB, (4, 3)), compile=compiled)
            greedy(decoder, torch.randint(1, VOCAB, (4, 13)), compile=compiled)
            greedy(lively_decoder(seed=5), tokens, compile=compiled)
            with_stops = greedy(decoder, tokens, compile=compiled, stop_tokens=[1, 2, 3])
        assert counter.frame_count == 2
        assert with_stops.shape[0] == 4


class TestNoHostSynchronisation:
    def test_compiled_graphs_hold_no_synchronising_op(self):
        graphs: list[torch.fx.GraphModule] = []

        def record(gm, example_inputs):
            def compiler(aten_graph, _):
                graphs.append(aten_graph)
                return make_boxed_func(aten_graph.forward)

            return aot_module_simplified(gm, example_inputs, fw_compiler=compiler)

        decoder = lively_decoder()
        tokens = left_pad(PROMPTS, pad_id=0)
        expected = greedy(decoder, tokens, stop_tokens=[1])
        out = greedy(decoder, tokens, stop_tokens=[1], compile={"backend": record})
        assert torch.equal(out, expected)
        assert len(graphs) == 2  # fullgraph: the prefill and the whole step, nothing outside
        ops = {str(node.target) for g in graphs for node in g.graph.nodes}
        assert "aten.index_copy.default" in ops and "aten.isin.Tensor_Tensor" in ops
        assert [sync_ops_in(g) for g in graphs] == [[], []]

    @pytest.mark.parametrize("interval", [1, 4])
    def test_the_loop_looks_at_the_host_only_every_few_steps(self, interval):
        # The eager loop as it runs on an accelerator: the CPU's eager input checks become
        # device-side assertions, as they do there and under torch.compile.
        decoder = lively_decoder()
        tokens = left_pad(PROMPTS, pad_id=0)
        for stop_tokens, looks in (((), 0), ((VOCAB - 1,), (NEW - 1) // interval)):
            stream = generate_stream(
                decoder,
                tokens,
                max_new_tokens=NEW,
                temperature=0,
                stop_tokens=stop_tokens,
                stop_check_interval=interval,
            )
            probe = SyncProbe()
            with mock.patch("torch.compiler.is_compiling", return_value=True), probe:
                steps = list(stream)
            assert len(steps) == NEW
            assert probe.found == ["aten._local_scalar_dense.default"] * looks, stop_tokens


class SyncProbe(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the ops that would synchronise on an accelerator (see :func:`sync_ops_in`)."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        integer_index = func.overloadpacket in (torch.ops.aten.index, torch.ops.aten.index_put)
        integer_index = integer_index and all(
            i.dtype in (torch.int64, torch.int32) for i in args[1] if i is not None
        )
        if (SYNC_TAGS & set(func.tags) and not integer_index) or "item" in str(func):
            self.found.append(str(func))
        return func(*args, **(kwargs or {}))


class TestStopTokens:
    def test_generate_ends_where_the_last_sample_stopped(self):
        decoder = lively_decoder()
        tokens = left_pad(PROMPTS, pad_id=0)
        free = greedy(decoder, tokens)[:, 7:]
        stop = int(free[0, 2])
        outputs = [
            greedy(decoder, tokens[:1], stop_tokens=[stop], stop_check_interval=n)
            for n in (1, 3, 8, 100)
        ]
        assert outputs[0].shape[1] == 7 + 3
        assert all(torch.equal(out, outputs[0]) for out in outputs)

    def test_a_stream_runs_at_most_interval_steps_past_the_last_stop(self):
        decoder = lively_decoder()
        tokens = left_pad(PROMPTS, pad_id=0)[:1]
        free = greedy(decoder, tokens)[0, 7:].tolist()
        stop = free[1]  # the 2nd new token
        steps = generate_stream(
            decoder,
            tokens,
            max_new_tokens=NEW,
            temperature=0,
            stop_tokens=[stop],
            pad_id=0,
            stop_check_interval=4,
        )
        got = [int(t) for t in steps]
        assert got == [*free[:2], 0, 0]  # looked after the 4th step: pad_id past the stop


class TestBadArguments:
    @pytest.mark.parametrize(
        ("value", "match"),
        [
            ("inductor", "compile: expected True, False or a mapping"),
            (1, "compile: expected True, False or a mapping"),
            ({"fullgraph": False}, r"compile: unknown torch.compile options \['fullgraph'\]"),
            ({"mode": "default", "options": {}}, "compile: expected mode or options, not both"),
            ({"dynamic": "yes"}, "compile: dynamic: expected True, False or None"),
            ({"backend": 3}, "compile: backend: expected a name or a callable"),
            ({"backend": "no-such-backend"}, "compile: torch.compile refused"),
            ({"recompile_limit": 0}, "compile: recompile_limit: expected a positive integer"),
        ],
    )
    def test_compile(self, value, match):
        decoder = lively_decoder()
        with pytest.raises(ValueError, match=match):
            generate_stream(decoder, torch.tensor([[5, 6]]), max_new_tokens=2, compile=value)
        assert not decoder.caches_are_setup()

    @pytest.mark.parametrize("value", [0, -1, 2.0, True, "4"])
    def test_stop_check_interval(self, value):
        decoder = lively_decoder()
        with pytest.raises(ValueError, match=r"^stop_check_interval: expected"):
            generate(decoder, torch.tensor([[5, 6]]), max_new_tokens=2, stop_check_interval=value)
        assert not decoder.caches_are_setup()


def test_buckets():
    previous = 0
    for length in range(1, 1200):
        size = bucket(length, most=10_000)
        assert size >= length and size >= previous  # covers it; longer never gets shorter
        if size <= 256:
            assert size >= 16 and size & (size - 1) == 0
        else:
            assert size % 256 == 0 and size - length < 256
        assert bucket(length, most=length + 3) <= length + 3  # capped by the room there is
        assert bucket(length, most=1) == length  # never below the length
        previous = size


@pytest.mark.skipif(
    os.environ.get("FUSION_INDUCTOR_TESTS") != "1",
    reason="inductor's C++ compilation takes about a minute on 2 cores: FUSION_INDUCTOR_TESTS=1",
)
def test_inductor_greedy_equals_eager():
    decoder = lively_decoder()
    tokens = left_pad(PROMPTS[:2], pad_id=0)
    expected = greedy(decoder, tokens)
    assert torch.equal(greedy(decoder, tokens, compile=True), expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_graphs_greedy_equals_eager_and_steps_never_synchronise():
    decoder = lively_decoder().cuda()
    tokens = left_pad(PROMPTS, pad_id=0, device="cuda")
    expected = greedy(decoder, tokens)
    decoder.setup_caches(len(PROMPTS), torch.float32, decoder_max_seq_len=64)
    greedy(decoder, tokens, compile=True)  # warm-up: compile, record the CUDA graphs
    stream = generate_stream(decoder, tokens, max_new_tokens=NEW, temperature=0, compile=True)
    first = next(stream)  # the prefill (its eager input checks run once, before the loop)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        rest = list(stream)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(torch.stack([first, *rest], 1), expected[:, -NEW:])


@pytest.mark.parametrize(("tied", "batch"), [(True, 1), (True, 2), (False, 1)])
def test_one_sample_s_tied_output_projection_is_a_multiply_and_sum(tied, batch):
    """The one CPU-specific step (``last_slot_logits``): compiled, one sample through a tied
    output is projected as a multiply and a sum, with eager's tokens; more samples or an
    untied output keep a matrix product."""
    graphs: list[torch.fx.GraphModule] = []

    def record(gm: torch.fx.GraphModule, example_inputs):
        graphs.append(gm)
        return gm.forward

    decoder = build_tiny_decoder(tie_word_embeddings=tied, seed=2).eval()
    tokens = left_pad(PROMPTS[:batch], pad_id=0)
    assert torch.equal(
        greedy(decoder, tokens, compile={"backend": record}), greedy(decoder, tokens)
    )
    linears = [sum(n.target is torch._C._nn.linear for n in g.graph.nodes) for g in graphs]
    products = [sum(n.target is operator.matmul for n in g.graph.nodes) for g in graphs]
    per_layer = 7 * len(decoder.layers)
    assert linears == [per_layer + (not tied)] * 2  # the prefill, the step
    # A tied output of a few rows is ``weight @ h.T`` (see TransformerDecoder.unembed).
    assert products == [int(tied and batch > 1)] * 2
