import pytest
import torch

from helpers import EMBED_DIM, VOCAB, build_tiny_decoder


def random_tokens(batch: int = 2, seq: int = 12, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def packed_mask(lengths: list[int]) -> torch.Tensor:
    """Block-diagonal causal mask [1, s, s] for samples of ``lengths`` packed in one row."""
    seq = sum(lengths)
    mask = torch.zeros(seq, seq, dtype=torch.bool)
    start = 0
    for n in lengths:
        mask[start : start + n, start : start + n] = torch.ones(n, n).tril().bool()
        start += n
    return mask[None]


class TestInputEmbeds:
    @pytest.mark.parametrize("tied", [True, False])
    def test_bitwise_equal_to_tokens(self, tied):
        decoder = build_tiny_decoder(tie_word_embeddings=tied)
        tokens = random_tokens()
        expected = decoder(tokens)
        actual = decoder(input_embeds=decoder.tok_embeddings(tokens))
        assert expected.dtype == torch.float32 and expected.shape == (2, 12, VOCAB)
        assert torch.equal(expected, actual)

    def test_bitwise_equal_with_mask_and_input_pos(self, tiny_decoder):
        tokens = random_tokens(batch=1, seq=10)
        mask = packed_mask([4, 6])
        input_pos = torch.cat([torch.arange(4), torch.arange(6)])[None]
        expected = tiny_decoder(tokens, mask=mask, input_pos=input_pos)
        actual = tiny_decoder(
            input_embeds=tiny_decoder.tok_embeddings(tokens), mask=mask, input_pos=input_pos
        )
        assert torch.equal(expected, actual)

    def test_packed_mask_isolates_samples(self, tiny_decoder):
        tokens = random_tokens(batch=1, seq=10)
        mask = packed_mask([4, 6])
        input_pos = torch.cat([torch.arange(4), torch.arange(6)])
        packed = tiny_decoder(tokens, mask=mask, input_pos=input_pos)
        second_alone = tiny_decoder(tokens[:, 4:])
        torch.testing.assert_close(packed[:, 4:], second_alone, atol=1e-5, rtol=1e-5)

    def test_gradients_reach_input_embeds(self):
        decoder = build_tiny_decoder(tie_word_embeddings=False)
        embeds = decoder.tok_embeddings(random_tokens()).detach().requires_grad_()
        decoder(input_embeds=embeds).sum().backward()
        assert embeds.grad is not None and embeds.grad.abs().sum() > 0
        assert decoder.tok_embeddings.weight.grad is None  # the table was skipped


class TestOutputs:
    def test_skip_output_layer_returns_final_hidden(self, tiny_decoder):
        tokens = random_tokens()
        logits = tiny_decoder(tokens)
        tiny_decoder.skip_output_layer = True
        hidden = tiny_decoder(tokens)
        assert hidden.shape == (2, 12, EMBED_DIM)
        assert torch.equal(tiny_decoder.unembed(hidden), logits)

    def test_output_hidden_states(self, tiny_decoder):
        tokens = random_tokens()
        tiny_decoder.output_hidden_states = [0, 2]
        first, last, logits = tiny_decoder(tokens)
        assert torch.equal(first, tiny_decoder.tok_embeddings(tokens))
        assert torch.equal(tiny_decoder.unembed(tiny_decoder.norm(last)), logits)

    @pytest.mark.parametrize("shape", [(1, 1), (2,), (1, 3), (4, 1), (5,), (2, 12)])
    def test_tied_output_of_few_rows_equals_f_linear(self, shape):
        """Up to FEW_ROWS rows take ``weight @ h.T`` on the CPU: the same logits as
        ``F.linear`` to the last bits, of the same shape, with gradients."""
        decoder = build_tiny_decoder(tie_word_embeddings=True)
        weight = decoder.tok_embeddings.weight
        h = torch.randn(*shape, EMBED_DIM, generator=torch.Generator().manual_seed(3))
        h.requires_grad_()
        logits = decoder.unembed(h)
        expected = torch.nn.functional.linear(h, weight)
        assert logits.shape == (*shape, VOCAB) and logits.dtype == torch.float32
        torch.testing.assert_close(logits, expected, atol=1e-6, rtol=1e-5)
        (grad_h,) = torch.autograd.grad(logits.square().sum(), h)
        (expected_grad,) = torch.autograd.grad(expected.square().sum(), h)
        torch.testing.assert_close(grad_h, expected_grad, atol=1e-5, rtol=1e-5)


class TestKVCache:
    @pytest.mark.parametrize("prefill", [1, 5, 11])
    def test_cached_decoding_equals_full_forward(self, tiny_decoder, prefill):
        tokens = random_tokens(seq=16)
        with torch.no_grad():
            full = tiny_decoder(tokens)
            tiny_decoder.setup_caches(2, torch.float32, decoder_max_seq_len=20)
            steps = [tiny_decoder(tokens[:, :prefill])]
            steps += [tiny_decoder(tokens[:, i : i + 1]) for i in range(prefill, 16)]
        # Masked attention over a longer cache sums in a different order: float32 round-off.
        torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)

    def test_reset_and_disable(self, tiny_decoder):
        tokens = random_tokens(seq=6)
        full = tiny_decoder(tokens)
        assert not tiny_decoder.caches_are_setup() and not tiny_decoder.caches_are_enabled()
        tiny_decoder.setup_caches(2, torch.float32, decoder_max_seq_len=8)
        assert tiny_decoder.caches_are_setup() and tiny_decoder.caches_are_enabled()
        tiny_decoder(tokens)
        with tiny_decoder.caches_disabled():
            assert not tiny_decoder.caches_are_enabled()
            assert torch.equal(tiny_decoder(tokens), full)  # no cache involved, fill untouched
        assert tiny_decoder.caches_are_enabled()
        tiny_decoder.reset_caches()
        torch.testing.assert_close(tiny_decoder(tokens), full, atol=1e-5, rtol=1e-5)
        tiny_decoder.teardown_caches()
        assert not tiny_decoder.caches_are_setup()
        assert torch.equal(tiny_decoder(tokens), full)

    def test_fill_level_is_a_device_tensor(self, tiny_decoder):
        tiny_decoder.setup_caches(2, torch.float32, decoder_max_seq_len=8)
        cache = tiny_decoder.layers[0].attn.kv_cache
        tiny_decoder(random_tokens(seq=3))
        tiny_decoder(random_tokens(seq=1))
        assert isinstance(cache.fill, torch.Tensor) and cache.fill.device == tiny_decoder.device
        assert cache.fill.dim() == 0 and cache.size == 4
        assert "fill" not in tiny_decoder.state_dict() and "fill" in dict(cache.named_buffers())
        tiny_decoder.reset_caches()
        assert cache.size == 0 and not cache.k_cache.any()

    def test_compiled_step_by_step_compiles_once(self):
        # The decoder compiled as it is and called one token at a time with its default
        # positions and mask: the fill level is a tensor, so no step sees a new constant.
        from torch._dynamo.testing import CompileCounterWithBackend

        torch._dynamo.reset()
        decoder = build_tiny_decoder().eval()
        counter = CompileCounterWithBackend("eager")
        step = torch.compile(decoder, backend=counter, fullgraph=True, dynamic=False)
        tokens = random_tokens(seq=12)
        with torch.no_grad():
            expected = decoder(tokens)
            decoder.setup_caches(2, torch.float32, decoder_max_seq_len=16)
            with torch._dynamo.config.patch(error_on_recompile=True):
                logits = [step(tokens[:, i : i + 1]) for i in range(12)]
        assert counter.frame_count == 1
        assert decoder.layers[0].attn.kv_cache.size == 12
        torch.testing.assert_close(torch.cat(logits, 1), expected, atol=1e-5, rtol=1e-5)
        torch._dynamo.reset()

    def test_compiled_overflow_is_a_device_side_assertion(self):
        torch._dynamo.reset()
        decoder = build_tiny_decoder().eval()
        step = torch.compile(decoder, backend="aot_eager", fullgraph=True, dynamic=False)
        tokens = random_tokens(seq=4)
        decoder.setup_caches(2, torch.float32, decoder_max_seq_len=3)
        with torch.no_grad():
            for i in range(3):
                step(tokens[:, i : i + 1])
            with pytest.raises(
                RuntimeError, match="1 more positions do not fit in the KV cache of 3"
            ):
                step(tokens[:, 3:4])
        torch._dynamo.reset()

    @staticmethod
    def _key_lengths(decoder, *calls):
        """The number of keys each attention call read, and each call's output."""
        lengths, outs = [], []

        class Keys(torch.overrides.TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                if func is torch.nn.functional.scaled_dot_product_attention:
                    lengths.append(args[1].size(2))
                return func(*args, **(kwargs or {}))

        with torch.no_grad(), Keys():
            for tokens, kwargs in calls:
                outs.append(decoder(tokens, **kwargs))
        return lengths, outs

    def test_eager_cpu_attention_reads_the_filled_slots_only(self, tiny_decoder):
        # A cache set up long once (as generation advises) costs no attention over its empty
        # slots on CPU; the logits are those of a cache of exactly the length used.
        tokens = random_tokens(seq=7)
        calls = [(tokens[:, :5], {}), (tokens[:, 5:6], {}), (tokens[:, 6:7], {})]
        tiny_decoder.setup_caches(2, torch.float32, decoder_max_seq_len=64)
        lengths, long = self._key_lengths(tiny_decoder, *calls)
        layers = len(tiny_decoder.layers)
        assert lengths == [5] * layers + [6] * layers + [7] * layers
        tiny_decoder.setup_caches(2, torch.float32, decoder_max_seq_len=7)
        lengths, exact = self._key_lengths(tiny_decoder, *calls)
        assert lengths == [5] * layers + [6] * layers + [7] * layers
        for a, b in zip(long, exact, strict=True):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)

    def test_a_mask_that_allows_unfilled_slots_keeps_them(self, tiny_decoder):
        # Attending to an empty slot is the caller's choice, and its zero key still weighs in
        # the softmax: the whole cache is read, as under torch.compile and on accelerators.
        tokens = random_tokens(seq=3)
        tiny_decoder.setup_caches(2, torch.float32, decoder_max_seq_len=8)
        mask = torch.ones(2, 3, 8, dtype=torch.bool).tril()
        mask[0, 2, 5] = True  # slot 5 stays empty after this call
        lengths, (out,) = self._key_lengths(tiny_decoder, (tokens, {"mask": mask}))
        assert lengths == [8] * len(tiny_decoder.layers)
        tiny_decoder.reset_caches()
        mask[0, 2, 5] = False
        _, (without,) = self._key_lengths(tiny_decoder, (tokens, {"mask": mask}))
        assert not torch.allclose(out[0, 2], without[0, 2])  # the empty slot did count
        torch.testing.assert_close(out[1], without[1])

    def test_compiled_attention_reads_the_whole_cache(self):
        # Static shapes: under torch.compile every step attends to every slot.
        torch._dynamo.reset()
        decoder = build_tiny_decoder().eval()
        decoder.setup_caches(2, torch.float32, decoder_max_seq_len=16)
        compiled = torch.compile(decoder, backend="eager", fullgraph=True, dynamic=False)
        lengths, _ = self._key_lengths(compiled, (random_tokens(seq=3), {}))
        assert lengths == [16] * len(decoder.layers)
        torch._dynamo.reset()

    def test_cache_under_autocast_keeps_its_dtype(self, tiny_decoder):
        tokens = random_tokens(seq=6)
        tiny_decoder.setup_caches(2, torch.float32, decoder_max_seq_len=8)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            expected = tiny_decoder(tokens)
            tiny_decoder.reset_caches()
            steps = [tiny_decoder(tokens[:, :4]), tiny_decoder(tokens[:, 4:])]
        assert tiny_decoder.layers[0].attn.kv_cache.k_cache.dtype == torch.float32
        torch.testing.assert_close(torch.cat(steps, 1), expected, atol=0.1, rtol=0.05)

    def test_cache_follows_model_device_and_dtype(self, tiny_decoder):
        tiny_decoder.setup_caches(3, torch.bfloat16)
        cache = tiny_decoder.layers[0].attn.kv_cache
        assert cache.k_cache.shape == (3, 2, 64, 8) and cache.k_cache.dtype == torch.bfloat16


class TestBadInput:
    def check(self, match, fn, exc=ValueError):
        with pytest.raises(exc, match=match):
            fn()

    def test_both_or_neither(self, tiny_decoder):
        tokens = random_tokens()
        embeds = tiny_decoder.tok_embeddings(tokens)
        self.check(
            r"tokens, input_embeds: expected exactly one of them, got both",
            lambda: tiny_decoder(tokens, input_embeds=embeds),
        )
        self.check(r"expected exactly one of them, got neither", lambda: tiny_decoder())

    def test_tokens_shape_and_dtype(self, tiny_decoder):
        self.check(
            r"tokens: expected integer ids \[b, s\] .*, got shape \[12\]",
            lambda: tiny_decoder(random_tokens()[0]),
        )
        self.check(
            r"tokens: expected integer ids .*dtype torch.float32",
            lambda: tiny_decoder(random_tokens().float()),
        )

    def test_input_embeds_rank_dim_dtype(self, tiny_decoder):
        self.check(
            r"input_embeds: expected floating \[b, s, 32\], got shape \[12, 32\]",
            lambda: tiny_decoder(input_embeds=torch.zeros(12, EMBED_DIM)),
        )
        self.check(
            r"input_embeds: expected floating \[b, s, 32\], got shape \[2, 12, 16\]",
            lambda: tiny_decoder(input_embeds=torch.zeros(2, 12, 16)),
        )
        self.check(
            r"input_embeds: expected floating \[b, s, 32\], got .*dtype torch.int64",
            lambda: tiny_decoder(input_embeds=torch.zeros(2, 12, EMBED_DIM, dtype=torch.long)),
        )

    def test_too_long(self, tiny_decoder):
        self.check(
            r"tokens: sequence length 65 exceeds max_seq_len=64",
            lambda: tiny_decoder(torch.zeros(1, 65, dtype=torch.long)),
        )
        self.check(
            r"input_embeds: sequence length 65 exceeds max_seq_len=64",
            lambda: tiny_decoder(input_embeds=torch.zeros(1, 65, EMBED_DIM)),
        )

    def test_longer_than_cache(self, tiny_decoder):
        tiny_decoder.setup_caches(2, torch.float32, decoder_max_seq_len=8)
        tiny_decoder(random_tokens(seq=6))
        self.check(
            r"tokens: 3 more positions do not fit in the KV cache of 8; .* \(it holds 6\)",
            lambda: tiny_decoder(random_tokens(seq=3)),
        )
        assert tiny_decoder.layers[0].attn.kv_cache.size == 6  # nothing was written

    def test_cache_batch_mismatch(self, tiny_decoder):
        tiny_decoder.setup_caches(2, torch.float32)
        self.check(
            r"KV cache was set up for batch size 2, got a batch of 3",
            lambda: tiny_decoder(random_tokens(batch=3)),
            RuntimeError,
        )

    @pytest.mark.parametrize("bad", [-1, VOCAB])
    def test_token_ids_out_of_range(self, tiny_decoder, bad):
        tokens = random_tokens()
        tokens[1, 3] = bad
        self.check(
            rf"tokens: expected values in \[0, {VOCAB}\), got values from {min(bad, 0)}",
            lambda: tiny_decoder(tokens),
        )

    def test_mask_shape_and_dtype(self, tiny_decoder):
        tokens = random_tokens()
        self.check(
            r"mask: expected a boolean mask \[2, 12, 12\] or \[1, 12, 12\], got shape \[12, 12\]",
            lambda: tiny_decoder(tokens, mask=torch.ones(12, 12, dtype=torch.bool)),
        )
        self.check(
            r"mask: expected a boolean mask .*dtype torch.float32",
            lambda: tiny_decoder(tokens, mask=torch.ones(2, 12, 12)),
        )
        tiny_decoder.setup_caches(2, torch.float32, decoder_max_seq_len=16)
        self.check(
            r"mask: expected a boolean mask \[2, 12, 16\] or \[1, 12, 16\], "
            r"got shape \[2, 12, 12\]",
            lambda: tiny_decoder(tokens, mask=torch.ones(2, 12, 12, dtype=torch.bool)),
        )

    def test_input_pos(self, tiny_decoder):
        tokens = random_tokens()
        self.check(
            r"input_pos: expected int64 or int32 positions \[2, 12\] or \[1, 12\] or \[12\], "
            r"got shape \[11\]",
            lambda: tiny_decoder(tokens, input_pos=torch.arange(11)),
        )
        self.check(
            r"input_pos: expected values in \[0, 64\), got values from 60 to 71",
            lambda: tiny_decoder(tokens, input_pos=torch.arange(60, 72)),
        )

    def test_cache_methods_in_wrong_order(self, tiny_decoder):
        self.check(
            r"reset_caches\(\) needs KV caches: call setup_caches\(\) first",
            tiny_decoder.reset_caches,
            RuntimeError,
        )
        with pytest.raises(RuntimeError, match=r"caches_disabled\(\) needs KV caches"):
            with tiny_decoder.caches_disabled():
                pass
        self.check(
            r"decoder_max_seq_len: expected 1 to max_seq_len=64, got 65",
            lambda: tiny_decoder.setup_caches(1, torch.float32, decoder_max_seq_len=65),
        )
        self.check(
            r"batch_size: expected a positive integer, got 0",
            lambda: tiny_decoder.setup_caches(0, torch.float32),
        )


class TestTorchtuneCallers:
    """The shapes and attributes torchtune's generation and loss utilities use."""

    def test_broadcast_mask(self, tiny_decoder):
        tokens = random_tokens()
        mask = packed_mask([5, 7])  # [1, 12, 12]
        expected = tiny_decoder(tokens, mask=mask.expand(2, -1, -1).contiguous())
        assert torch.equal(tiny_decoder(tokens, mask=mask), expected)

    def test_one_position_per_sample_at_a_decode_step(self, tiny_decoder):
        tokens = random_tokens()
        tiny_decoder.setup_caches(2, torch.float32, decoder_max_seq_len=16)
        tiny_decoder(tokens[:, :5])
        positions = torch.tensor([5, 3])  # [b]: e.g. left-padded samples
        step_mask = torch.ones(2, 1, 16, dtype=torch.bool)
        by_sample = tiny_decoder(tokens[:, 5:6], input_pos=positions, mask=step_mask)
        tiny_decoder.reset_caches()
        tiny_decoder(tokens[:, :5])
        expected = tiny_decoder(tokens[:, 5:6], input_pos=positions[:, None], mask=step_mask)
        assert torch.equal(by_sample, expected)

    def test_output_chunks(self, tiny_decoder):
        tokens = random_tokens()
        full = tiny_decoder(tokens)
        tiny_decoder.set_num_output_chunks(5)
        chunks = tiny_decoder(tokens)
        assert isinstance(chunks, list) and len(chunks) == 5
        assert all(c.dtype == torch.float32 for c in chunks)
        # A GEMM over a chunk may sum in another order than over the whole: last bits differ.
        torch.testing.assert_close(torch.cat(chunks, dim=1), full, atol=1e-5, rtol=1e-5)
        for bad in (-1, 1.5, True):
            with pytest.raises(ValueError, match="num_output_chunks: expected a non-negative"):
                tiny_decoder.set_num_output_chunks(bad)

    def test_cache_attributes(self, tiny_decoder):
        assert tiny_decoder.decoder_max_cache_seq_len is None
        tiny_decoder.setup_caches(1, torch.float32, encoder_max_seq_len=None, decoder_max_seq_len=9)
        assert tiny_decoder.decoder_max_cache_seq_len == 9
        with pytest.raises(ValueError, match="encoder_max_seq_len: expected None"):
            tiny_decoder.setup_caches(1, torch.float32, encoder_max_seq_len=4)

    def test_unsupported_shapes_name_the_supported_ones(self, tiny_decoder):
        tokens = random_tokens()
        with pytest.raises(
            ValueError, match=r"\[2, 12, 12\] or \[1, 12, 12\], got shape \[2, 1, 12, 12\]"
        ):
            tiny_decoder(tokens, mask=torch.ones(2, 1, 12, 12, dtype=torch.bool))
        with pytest.raises(
            ValueError, match=r"positions \[2, 12\] or \[1, 12\] or \[12\], got shape \[2\]"
        ):
            tiny_decoder(tokens, input_pos=torch.arange(2))


class TestSweep:
    """Odd inputs to every argument: a correct result or an error naming the argument."""

    @pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int16, torch.bool])
    def test_index_dtypes(self, tiny_decoder, dtype):
        tokens = random_tokens()
        with pytest.raises(ValueError, match=r"tokens: expected integer ids \[b, s\] of dtype"):
            tiny_decoder(tokens.to(dtype))
        with pytest.raises(ValueError, match=r"input_pos: expected int64 or int32 positions"):
            tiny_decoder(tokens, input_pos=torch.arange(12).to(dtype))

    def test_int32_ids_and_positions(self, tiny_decoder):
        tokens = random_tokens()
        expected = tiny_decoder(tokens, input_pos=torch.arange(12))
        assert torch.equal(tiny_decoder(tokens.int(), input_pos=torch.arange(12).int()), expected)

    @pytest.mark.parametrize("shape", [(0, 3), (2, 0)])
    def test_empty(self, tiny_decoder, shape):
        with pytest.raises(ValueError, match=r"tokens: expected a non-empty batch and sequence"):
            tiny_decoder(torch.zeros(shape, dtype=torch.long))
        with pytest.raises(ValueError, match=r"input_embeds: expected a non-empty batch"):
            tiny_decoder(input_embeds=torch.zeros(*shape, EMBED_DIM))

    def test_wrong_device(self, tiny_decoder):
        tokens = random_tokens()
        with pytest.raises(ValueError, match=r"tokens: expected device cpu \(the decoder's\)"):
            tiny_decoder(tokens.to("meta"))
        with pytest.raises(ValueError, match=r"input_embeds: expected device cpu"):
            tiny_decoder(input_embeds=torch.zeros(2, 12, EMBED_DIM, device="meta"))

    def test_input_embeds_not_a_tensor(self, tiny_decoder):
        with pytest.raises(TypeError, match=r"input_embeds: expected a tensor, got list"):
            tiny_decoder(input_embeds=[[0.0]])

    def test_embed_must_return_the_right_rows(self, tiny_decoder):
        tokens = random_tokens()
        with pytest.raises(ValueError, match=r"embed: expected \[2, 12, 32\], got shape \[2, 12\]"):
            tiny_decoder(tokens, embed=lambda module, ids: ids.float())
        with pytest.raises(ValueError, match=r"embed: expected a callable"):
            tiny_decoder(tokens, embed="tok_embeddings")
