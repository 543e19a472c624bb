"""The gated delta rule (Gated DeltaNet's linear attention) over packed rows.

A Gated DeltaNet layer (Qwen3.5's linear-attention layers) runs a causal depthwise conv1d over
its q, k and v channels, then a recurrence over a state ``S`` [dk, dv] per head: at each token,

    S <- exp(g_t) * S                        (decay, g_t <= 0)
    S <- S + beta_t * k_t (v_t - k_t^T S)^T  (delta rule: write the part of v_t not predicted)
    o_t = S^T q_t

with q and k L2-normalised and q scaled by ``dk ** -0.5``. :func:`chunk_gated_delta_rule`
computes it chunk by chunk (training, prefill) and :func:`recurrent_gated_delta_rule` token by
token (decoding, and the plain reference the tests compare against).

Packed rows hold several samples one after the other; neither the conv (its taps reach
``kernel - 1`` tokens back) nor the state may carry from one sample into the next.
:class:`SampleRegions` re-lays each row so that every sample starts on a chunk boundary behind
``kernel - 1`` zeros: the conv *module* is then called on the whole re-laid row (its taps
before a sample see only zeros), and the kernel's ``resets`` zero the state at each sample's
first chunk. All index work uses the host lengths of :class:`~fusion.decoder.packed
.PackedSegments`, so nothing reads the device.
"""

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from fusion._validation import describe
from fusion.decoder.packed import PackedSegments, _check_lengths

#: Added under the square root of :func:`_l2norm`, as transformers' (and FLA's) ``l2norm``.
L2NORM_EPS = 1e-6


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    chunk_size: int = 64,
    resets: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule over whole sequences, ``chunk_size`` tokens at a time.

    Within each chunk the recurrence is solved in closed form for every chunk at once (one
    batched triangular solve); a loop over the chunks then carries the state from one to the
    next. The sequence is padded to a multiple of ``chunk_size`` with identity steps (no
    decay, no write) and cut back.

    Args:
        q: [b, s, hk, dk] queries (L2-normalised here, then scaled by ``dk ** -0.5``).
        k: [b, s, hk, dk] keys (L2-normalised here).
        v: [b, s, h, dv] values; ``h`` a multiple of ``hk`` (each query/key head serves
            ``h // hk`` consecutive value heads, as in Qwen3.5).
        g: [b, s, h] log decays (<= 0; not checked, which would read the device).
        beta: [b, s, h] write strengths (in (0, 1) after a sigmoid).
        chunk_size: tokens per chunk, >= 1.
        resets: optional bool [b, ceil(s / chunk_size)]: True where the state is zeroed before
            that chunk (a new sample starts at its first position; see
            :attr:`SampleRegions.resets`).
        initial_state: optional [b, h, dk, dv] state before the first token (a cached
            sequence continued, e.g. chunked prefill); zeros when None.
        output_final_state: also return the state after the last token.

    Returns:
        The outputs [b, s, h, dv] in v's dtype, and the final state [b, h, dk, dv] in the
        compute dtype (float32; float64 for float64 inputs) or None. q, k and v of float16,
        bfloat16 or float32 are computed in float32.

    Raises:
        ValueError: a chunk size that is not a positive integer, tensors of mismatched shapes,
            dtypes or devices, non-floating inputs, empty head dimensions, ``resets`` or
            ``initial_state`` of the wrong shape.
    """
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size: expected a positive integer, got {chunk_size!r}")
    _check_inputs(q, k, v, g, beta)
    batch, seq_len = q.shape[:2]
    heads, dk, dv = v.shape[2], q.shape[3], v.shape[3]
    n_chunks = -(-seq_len // chunk_size)
    _check_resets(resets, (batch, n_chunks), chunk_size, q.device)
    _check_state(initial_state, "initial_state", (batch, heads, dk, dv), q.device)

    out_dtype, dtype = v.dtype, _compute_dtype(v.dtype)
    q, k = _normalised_qk(q, k, heads, dtype)
    # [b, h, s, ...] from here: each head's sequence is contiguous for the chunk matmuls.
    v = v.transpose(1, 2).to(dtype)
    g, beta = (x.transpose(1, 2).to(dtype) for x in (g, beta))

    # Padded steps have g = 0 and beta = 0: no decay and no write, so the state after them is
    # the state after the last real token.
    pad = n_chunks * chunk_size - seq_len
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    q, k, v = (x.reshape(batch, heads, n_chunks, chunk_size, x.shape[-1]) for x in (q, k, v))
    g, beta = (x.reshape(batch, heads, n_chunks, chunk_size) for x in (g, beta))

    # Log decay from the chunk's start through position i (inclusive): the state read at i has
    # decayed by exp(gc_i) since the chunk began, a write at j reaches i decayed by
    # exp(gc_i - gc_j). The exponent is masked above the diagonal before exp, where it is
    # positive and could overflow.
    gc = g.cumsum(-1)
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    pair_decay = (gc[..., :, None] - gc[..., None, :]).masked_fill(~causal, -math.inf).exp()

    # Within a chunk, the writes u_i (the corrections v_i - k_i^T S the delta rule adds) depend
    # on the earlier writes of the same chunk: (I + L) u = beta v - beta k exp(gc) S0, with
    # L_ij = beta_i k_i . k_j decay_ij strictly below the diagonal and S0 the chunk-start
    # state. Solving for both right-hand sides once, for all chunks, leaves the loop only the
    # product with S0.
    k_beta = k * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2)) * pair_decay
    rhs = torch.cat([v * beta[..., None], k_beta * gc.exp()[..., None]], dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    fresh, reads = solved[..., :dv], solved[..., dv:]  # fresh: u with S0 = 0; reads: w
    intra = (q @ k.transpose(-1, -2)) * pair_decay  # [b, h, n, C, C], causal within a chunk
    q_read = q * gc.exp()[..., None]  # reading the chunk-start state at i
    k_write = k * (gc[..., -1:] - gc).exp()[..., None]  # a write at i, decayed to the chunk end
    chunk_decay = gc[..., -1].exp()  # [b, h, n]

    if initial_state is None:
        state = q.new_zeros(batch, heads, dk, dv)
    else:
        state = initial_state.to(dtype)
    if resets is not None:
        # A reset multiplies the state by 0 (a -inf decay instead would meet -inf - -inf = NaN
        # in the cumulative sums): the first chunk's on the state given, every later chunk's
        # folded into the update of the chunk before it (its decay and its writes).
        keep = (~resets).to(dtype)  # [b, n]
        state = state * keep[:, None, 0, None, None]
        keep_next = F.pad(keep[:, 1:], (0, 1), value=1.0)[:, None, :]  # [b, 1, n]
        chunk_decay = chunk_decay * keep_next
        k_write = k_write * keep_next[..., None, None]

    s0, u, state = _scan_chunks(fresh, reads, k_write, chunk_decay, state)
    if s0 is not None and u is not None:
        out = (q_read @ s0 + intra @ u).reshape(batch, heads, n_chunks * chunk_size, dv)
    else:
        out = v.new_zeros(batch, heads, 0, dv)
    out = out[:, :, :seq_len].transpose(1, 2).contiguous().to(out_dtype)
    return out, state if output_final_state else None


def _scan_chunks(
    fresh: torch.Tensor,
    reads: torch.Tensor,
    k_write: torch.Tensor,
    chunk_decay: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """The loop over the chunks of :func:`chunk_gated_delta_rule`: from the chunks' ``fresh``
    and ``reads`` [b, h, n, C, dv / dk], ``k_write`` [b, h, n, C, dk], ``chunk_decay``
    [b, h, n] and the first chunk's start ``state`` [b, h, dk, dv], each chunk's start state
    and writes ([b, h, n, dk, dv] and [b, h, n, C, dv]; None without chunks) and the final
    state.

    The scan carries only the state: per chunk c, u_c = fresh_c - reads_c S_c (the writes)
    and S_{c+1} = decay_c S_c + k_write_c^T u_c, three ops on [b * h] matrices; the outputs
    (q_read_c S_c + intra_c u_c) are computed after it, for every chunk at once. Chunk-major
    operands are unbound once: indexing one chunk at a time would make the backward write
    each chunk's gradient into a zeroed tensor of the whole input (quadratic in the chunks).
    """
    batch, heads, n_chunks = fresh.shape[:3]
    dk, dv = state.shape[-2:]

    def chunk_major(x: torch.Tensor) -> torch.Tensor:  # [b, h, n, ...] -> [n, b * h, ...]
        return x.movedim(2, 0).reshape(n_chunks, batch * heads, *x.shape[3:])

    fresh_c, reads_c = chunk_major(fresh).unbind(0), chunk_major(reads).unbind(0)
    writes_c = chunk_major(k_write).transpose(-1, -2).unbind(0)  # [b * h, dk, C] each
    decay_c = chunk_major(chunk_decay)[..., None, None].unbind(0)  # [b * h, 1, 1] each
    state = state.reshape(batch * heads, dk, dv)
    starts, writes = [], []
    for fresh_i, reads_i, writes_i, decay_i in zip(
        fresh_c, reads_c, writes_c, decay_c, strict=True
    ):
        starts.append(state)
        u = torch.baddbmm(fresh_i, reads_i, state, alpha=-1)  # [b * h, C, dv]
        writes.append(u)
        state = torch.baddbmm(state * decay_i, writes_i, u)
    final = state.reshape(batch, heads, dk, dv)
    if not starts:
        return None, None, final
    # [n, b * h, ...] -> [b, h, n, ...], the layout of q_read and intra
    s0, u = (
        torch.stack(x).reshape(n_chunks, batch, heads, *x[0].shape[1:]).movedim(0, 2)
        for x in (starts, writes)
    )
    return s0, u, final


def _check_resets(
    resets: torch.Tensor | None, shape: tuple[int, int], chunk_size: int, device: torch.device
) -> None:
    if resets is not None and (
        not isinstance(resets, torch.Tensor)
        or resets.dtype != torch.bool
        or resets.shape != shape
        or resets.device != device
    ):
        raise ValueError(
            f"resets: expected bool [{shape[0]}, {shape[1]}] (one per chunk of {chunk_size}) "
            f"on {device}, got {_what(resets)}"
        )


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule token by token: decoding (``s == 1``), and the plain reference.

    Args:
        q, k: [b, s, hk, dk]; v: [b, s, h, dv]; g, beta: [b, s, h]; as
            :func:`chunk_gated_delta_rule` takes them.
        state: [b, h, dk, dv] the state before the first token (zeros for a new sequence).

    Returns:
        The outputs [b, s, h, dv] in v's dtype and the state after the last token
        [b, h, dk, dv] in the compute dtype (float32; float64 for float64 inputs).

    Raises:
        ValueError: as :func:`chunk_gated_delta_rule`, or a state of the wrong shape.
    """
    _check_inputs(q, k, v, g, beta)
    batch, seq_len, heads, dv = v.shape
    _check_state(state, "state", (batch, heads, q.shape[3], dv), q.device)
    out_dtype, dtype = v.dtype, _compute_dtype(v.dtype)
    q, k = _normalised_qk(q, k, heads, dtype)  # [b, h, s, dk]
    v = v.transpose(1, 2).to(dtype)
    g, beta = (x.transpose(1, 2).to(dtype) for x in (g, beta))
    state = state.to(dtype)
    outputs = []
    for t in range(seq_len):
        state = state * g[:, :, t].exp()[..., None, None]
        predicted = (k[:, :, t, None, :] @ state)[:, :, 0]  # k_t^T S: [b, h, dv]
        delta = beta[:, :, t, None] * (v[:, :, t] - predicted)
        state = state + k[:, :, t, :, None] * delta[:, :, None, :]
        outputs.append((q[:, :, t, None, :] @ state)[:, :, 0])
    out = torch.stack(outputs, dim=2) if outputs else v.new_zeros(batch, heads, 0, dv)
    return out.transpose(1, 2).contiguous().to(out_dtype), state


def gated_delta_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> torch.Tensor:
    """One decoding step of :func:`recurrent_gated_delta_rule`, updating ``state`` in place:
    the decay, the delta rule's write and the read are three in-place or batched-product
    passes over the state (no new state, no copy back), and the shapes are the same at every
    step.

    Args:
        q, k: [b, 1, hk, dk]; v: [b, 1, h, dv]; g, beta: [b, 1, h]; as
            :func:`chunk_gated_delta_rule` takes them.
        state: [b, h, dk, dv], overwritten with the state after the token (computed in
            float32, float64 for float64 inputs; in place when the state is of that dtype).

    Returns:
        The output [b, 1, h, dv] in v's dtype.

    Raises:
        ValueError: as :func:`recurrent_gated_delta_rule`, or more than one token.
    """
    _check_inputs(q, k, v, g, beta)
    batch, seq_len, heads, dv = v.shape
    if seq_len != 1:
        raise ValueError(f"v: expected one token [b, 1, h, dv], got {describe(v)}")
    _check_state(state, "state", (batch, heads, q.shape[3], dv), q.device)
    dtype = _compute_dtype(v.dtype)
    # A state in another dtype (a float32 cache of a float64 model) is computed on a copy.
    work = state if state.dtype == dtype else state.to(dtype)
    q, k = _normalised_qk(q, k, heads, dtype)  # [b, h, 1, dk]
    v_t = v.transpose(1, 2).to(dtype)  # [b, h, 1, dv]
    g_t, beta_t = (x.transpose(1, 2).to(dtype)[..., None] for x in (g, beta))  # [b, h, 1, 1]
    work.mul_(g_t.exp())
    delta = beta_t * (v_t - k @ work)  # k_t^T S: [b, h, 1, dv]
    work.addcmul_(k.transpose(-1, -2), delta)  # the outer product k_t delta^T, in place
    out = (q @ work).transpose(1, 2).to(v.dtype)  # [b, 1, h, dv]
    if work is not state:
        state.copy_(work)
    return out


class _Indices(NamedTuple):
    """What :class:`SampleRegions` computes with, on one device."""

    gather: torch.Tensor  # int64 [b * s']: each re-laid position's packed position (flat)
    valid: torch.Tensor  # bool [b, s']: sample positions of the re-laid rows
    scatter: torch.Tensor  # int64 [b * s]: each packed position's re-laid position (flat)
    samples: torch.Tensor  # bool [b, s]: sample positions of the packed rows
    resets: torch.Tensor  # bool [b, s' / chunk_size]: each region's first chunk
    cu_seqlens: torch.Tensor  # int64 [n + 1]: the flattened rows' n sequences (see below)


class SampleRegions:
    """Each sample of packed rows in a region of its own, for the conv and the delta rule.

    A region is ``kernel - 1`` zero positions, the sample, then zeros up to a multiple of
    ``chunk_size``; regions follow one another, so each starts on a chunk boundary. The rows'
    padding segments get no region. Every row is re-laid to the same length ``s'`` (the
    longest row's regions; shorter rows end in all-zero chunks).

    Then a causal conv (padding ``kernel - 1``) on the re-laid row reaches, before each
    sample, only the gap's zeros, and :func:`chunk_gated_delta_rule` with ``resets`` zeroes
    the state at each region's first chunk: each sample is computed as if alone. The steps in
    the gaps must leave the state as it is, which ``g = 0`` (no decay) and ``beta = 0`` (no
    write) do: :meth:`gather` gives them when g and beta are computed on the packed row and
    re-laid. The gaps' q, k and v (the conv's outputs there, which a conv bias or the taps
    after a sample make nonzero) then change nothing: a sample's outputs read only its own
    positions, and the state after its last token is carried unchanged to the region's end.

    The indices are built on the host from the lengths, once, and moved to a device on first
    use there (cached per device).

    Attributes:
        lengths: per row, its samples' lengths (padding excluded).
        seq_len: ``s``, the packed rows' length.
        chunk_size: the chunk the regions are aligned to.
        kernel: the conv kernel size the gaps are sized for.
        relaid_len: ``s'``, a multiple of ``chunk_size``.
        starts: per row, where each sample starts in the re-laid row.
        bounds: where the sequences of the rows flattened to ``b * s'`` positions start, and
            their end: every region's start (a row's first is the row's), then ``b * s'``;
            the ``cu_seqlens`` of a varlen kernel that zeroes the state where :attr:`resets`
            does (a row's last sequence runs on through its trailing all-zero chunks).
    """

    def __init__(
        self,
        lengths: Sequence[Sequence[int]],
        padding: Sequence[int],
        *,
        chunk_size: int,
        kernel: int,
        device: str | torch.device | None = None,
    ) -> None:
        """Regions for rows of segment ``lengths`` (samples, then the padding segment where
        ``padding[r] > 0``, as :class:`~fusion.decoder.packed.PackedSegments` holds them).

        Args:
            lengths: per row, its segments' lengths.
            padding: per row, its trailing padding's length (0: none).
            chunk_size: the delta rule's chunk size, >= 1.
            kernel: the conv's kernel size, >= 1.
            device: where :attr:`valid` and :attr:`resets` live (default: the CPU).

        Raises:
            ValueError: a chunk size or kernel that is not a positive integer; lengths and
                padding that do not describe packed rows.
        """
        for name, value in (("chunk_size", chunk_size), ("kernel", kernel)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive integer, got {value!r}")
        rows = tuple(tuple(row) for row in lengths) if isinstance(lengths, Sequence) else lengths
        pads = tuple(padding) if isinstance(padding, Sequence) else padding
        _check_lengths(rows, pads)
        self.chunk_size, self.kernel = chunk_size, kernel
        self.seq_len = sum(rows[0])
        self.lengths = tuple(
            row[: len(row) - (pad > 0)] for row, pad in zip(rows, pads, strict=True)
        )
        starts: list[tuple[int, ...]] = []
        ends = []
        for row in self.lengths:
            row_starts, at = [], 0
            for n in row:
                row_starts.append(at + kernel - 1)
                at += -(-(kernel - 1 + n) // chunk_size) * chunk_size
            starts.append(tuple(row_starts))
            ends.append(at)
        self.starts = tuple(starts)
        self.relaid_len = max(ends)
        s2 = self.relaid_len
        self.bounds = (
            *(r * s2 + start - (kernel - 1) for r, row in enumerate(starts) for start in row),
            len(starts) * s2,
        )
        self._host = self._build()
        self._cache: dict[torch.device, _Indices] = {}
        self.device = torch.device("cpu") if device is None else torch.device(device)

    @classmethod
    def from_segments(
        cls, segments: PackedSegments, *, chunk_size: int, kernel: int
    ) -> "SampleRegions":
        """The regions of ``segments``' samples, with :attr:`valid` and :attr:`resets` on the
        segments' device (read from their host lengths: no synchronisation)."""
        return cls(
            segments.lengths,
            segments.padding,
            chunk_size=chunk_size,
            kernel=kernel,
            device=segments.device,
        )

    @property
    def batch_size(self) -> int:
        return len(self.lengths)

    @property
    def n_chunks(self) -> int:
        return self.relaid_len // self.chunk_size

    @property
    def valid(self) -> torch.Tensor:
        """bool [b, s']: True at the re-laid rows' sample positions."""
        return self._on(self.device).valid

    @property
    def resets(self) -> torch.Tensor:
        """bool [b, s' / chunk_size]: True at each region's first chunk (the ``resets`` of
        :func:`chunk_gated_delta_rule`)."""
        return self._on(self.device).resets

    def cu_seqlens_on(self, device: torch.device) -> torch.Tensor:
        """int64 [n + 1]: :attr:`bounds` on ``device`` (moved once, then cached)."""
        return self._on(device).cu_seqlens

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [b, s, ...] re-laid [b, s', ...]: each sample in its region, zeros elsewhere
        (whatever the packed row's padding held). Differentiable."""
        self._check_rows(x, self.seq_len, "x")
        on = self._on(x.device)
        flat = x.reshape(-1, *x.shape[2:]).index_select(0, on.gather)
        flat = flat.reshape(self.batch_size, self.relaid_len, *x.shape[2:])
        # The gaps' index points at some sample position; where, not a product, so that a
        # non-finite value there could not leak (0 * inf is NaN).
        mask = on.valid.reshape(on.valid.shape + (1,) * (x.dim() - 2))
        return torch.where(mask, flat, flat.new_zeros(()))

    def scatter(self, y: torch.Tensor) -> torch.Tensor:
        """``y`` [b, s', ...] back to the packed rows [b, s, ...] (padding positions zero).
        Differentiable."""
        self._check_rows(y, self.relaid_len, "y")
        on = self._on(y.device)
        flat = y.reshape(-1, *y.shape[2:]).index_select(0, on.scatter)
        flat = flat.reshape(self.batch_size, self.seq_len, *y.shape[2:])
        mask = on.samples.reshape(on.samples.shape + (1,) * (y.dim() - 2))
        return torch.where(mask, flat, flat.new_zeros(()))

    def _check_rows(self, x: torch.Tensor, length: int, name: str) -> None:
        expected = (self.batch_size, length)
        if not isinstance(x, torch.Tensor) or x.dim() < 2 or x.shape[:2] != expected:
            raise ValueError(
                f"{name}: expected a tensor [{self.batch_size}, {length}, ...], got {_what(x)}"
            )

    def _build(self) -> "_Indices":
        """The host tensors (see :class:`_Indices`)."""
        b, s, s2, chunk = self.batch_size, self.seq_len, self.relaid_len, self.chunk_size
        index = torch.zeros(b, s2, dtype=torch.int64)
        valid = torch.zeros(b, s2, dtype=torch.bool)
        back = torch.zeros(b, s, dtype=torch.int64)
        samples = torch.zeros(b, s, dtype=torch.bool)
        resets = torch.zeros(b, s2 // chunk, dtype=torch.bool)
        for r, (row, starts) in enumerate(zip(self.lengths, self.starts, strict=True)):
            at = 0  # where the sample starts in the packed row
            for n, start in zip(row, starts, strict=True):
                index[r, start : start + n] = torch.arange(r * s + at, r * s + at + n)
                valid[r, start : start + n] = True
                back[r, at : at + n] = torch.arange(r * s2 + start, r * s2 + start + n)
                samples[r, at : at + n] = True
                resets[r, (start - self.kernel + 1) // chunk] = True
                at += n
        cu_seqlens = torch.tensor(self.bounds, dtype=torch.int64)
        return _Indices(index.reshape(-1), valid, back.reshape(-1), samples, resets, cu_seqlens)

    def _on(self, device: torch.device) -> "_Indices":
        if device not in self._cache:
            # Non-blocking: a blocking copy to a GPU would wait for its queued work; the host
            # tensors stay alive in ``_host`` until the copy is done.
            self._cache[device] = _Indices(*(t.to(device, non_blocking=True) for t in self._host))
        return self._cache[device]

    def __repr__(self) -> str:
        return (
            f"SampleRegions(lengths={self.lengths}, seq_len={self.seq_len}, chunk_size="
            f"{self.chunk_size}, kernel={self.kernel}, relaid_len={self.relaid_len})"
        )


def causal_conv(conv: nn.Conv1d, x: torch.Tensor) -> torch.Tensor:
    """The causal conv of ``x`` [b, s, c] by ``conv`` (padded ``kernel - 1`` on both sides, so
    its first ``s`` outputs are the causal ones): [b, s, c], no activation. The module is
    called, not its weight read, so hooks and wrappers around it (LoRA, FSDP) apply.

    Raises:
        ValueError: a conv that is not a stride-1, undilated, zero-padded ``nn.Conv1d`` with
            padding ``kernel - 1``, or ``x`` not [b, s, conv.in_channels].
    """
    _check_conv(conv)
    if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[2] != conv.in_channels:
        raise ValueError(f"x: expected [b, s, {conv.in_channels}], got {_what(x)}")
    if x.shape[1] == 0:  # conv1d refuses an empty sequence
        return x.new_zeros(x.shape[0], 0, conv.out_channels)
    # A contiguous [b, c, s] input: the depthwise conv's CPU backward is several times slower
    # on the transposed view of a [b, s, c] tensor.
    return conv(x.transpose(1, 2).contiguous())[..., : x.shape[1]].transpose(1, 2)


def conv_step(
    conv: nn.Conv1d, x: torch.Tensor, conv_state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decoding step of :func:`causal_conv`: the output for token ``x`` [b, 1, c] given
    the ``kernel - 1`` inputs before it, ``conv_state`` [b, c, kernel - 1] (zeros at a
    sequence's start). The module is called on the window ``[state, x]``; the output whose
    taps cover the whole window is taken.

    Returns:
        The output [b, 1, c] and the new state [b, c, kernel - 1] (the window's last
        ``kernel - 1`` inputs), in ``x``'s dtype.

    Raises:
        ValueError: as :func:`causal_conv`, ``x`` not [b, 1, c] or a state of the wrong shape.
    """
    _check_conv(conv)
    channels, kernel = conv.in_channels, conv.kernel_size[0]
    if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[1:] != (1, channels):
        raise ValueError(f"x: expected one token [b, 1, {channels}], got {_what(x)}")
    expected = (x.shape[0], channels, kernel - 1)
    if not isinstance(conv_state, torch.Tensor) or conv_state.shape != expected:
        raise ValueError(f"conv_state: expected {list(expected)}, got {_what(conv_state)}")
    window = torch.cat([conv_state.to(x.dtype), x.transpose(1, 2)], dim=-1)  # [b, c, kernel]
    # Output position kernel - 1 of the padded conv is the one whose taps span the window.
    out = conv(window)[..., kernel - 1 : kernel].transpose(1, 2)
    return out, window[..., 1:]


def _check_conv(conv: nn.Conv1d) -> None:
    if not isinstance(conv, nn.Conv1d):
        raise ValueError(f"conv: expected an nn.Conv1d, got {type(conv).__name__}")
    kernel = conv.kernel_size[0]
    if (
        conv.padding != (kernel - 1,)
        or conv.stride != (1,)
        or conv.dilation != (1,)
        or conv.padding_mode != "zeros"
    ):
        raise ValueError(
            f"conv: expected stride 1, dilation 1 and zero padding {kernel - 1} (kernel - 1), "
            f"got stride {conv.stride}, dilation {conv.dilation}, padding {conv.padding} "
            f"({conv.padding_mode})"
        )


def _check_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> None:
    """q and k [b, s, hk, dk], v [b, s, h, dv] with h a multiple of hk, g and beta [b, s, h],
    all floating on one device; q, k and v of one dtype."""
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise ValueError(f"{name}: expected a floating-point tensor, got {_what(x)}")
        if x.device != q.device:
            raise ValueError(f"{name}: expected the device of q ({q.device}), got {x.device}")
    if q.dim() != 4 or q.shape[2] < 1 or q.shape[3] < 1:
        raise ValueError(f"q: expected [b, s, hk, dk] with hk, dk >= 1, got {describe(q)}")
    if k.shape != q.shape or k.dtype != q.dtype:
        raise ValueError(f"k: expected q's {describe(q)}, got {describe(k)}")
    batch, seq_len, k_heads = q.shape[:3]
    if (
        v.dim() != 4
        or v.shape[:2] != (batch, seq_len)
        or v.shape[2] < 1
        or v.shape[3] < 1
        or v.shape[2] % k_heads
        or v.dtype != q.dtype
    ):
        raise ValueError(
            f"v: expected [{batch}, {seq_len}, h, dv] with h a multiple of {k_heads} (q's "
            f"heads), dv >= 1 and dtype {q.dtype}, got {describe(v)}"
        )
    for name, x in (("g", g), ("beta", beta)):
        if x.shape != v.shape[:3]:
            raise ValueError(
                f"{name}: expected [{batch}, {seq_len}, {v.shape[2]}], got {describe(x)}"
            )


def _check_state(
    state: torch.Tensor | None, name: str, shape: tuple[int, ...], device: torch.device
) -> None:
    if state is None and name == "initial_state":
        return
    if (
        not isinstance(state, torch.Tensor)
        or not state.is_floating_point()
        or state.shape != shape
        or state.device != device
    ):
        raise ValueError(
            f"{name}: expected a floating-point {list(shape)} on {device}, got {_what(state)}"
        )


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32, or float64 for float64 inputs (a tighter reference in tests)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _normalised_qk(
    q: torch.Tensor, k: torch.Tensor, heads: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k [b, s, hk, d] -> [b, h, s, d] in ``dtype``: repeated per value head,
    L2-normalised, q scaled by ``d ** -0.5``."""
    groups = heads // q.shape[2]
    q, k = (x.transpose(1, 2).to(dtype) for x in (q, k))
    if groups > 1:
        q, k = (x.repeat_interleave(groups, dim=1) for x in (q, k))
    return _l2norm(q) * q.shape[-1] ** -0.5, _l2norm(k)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def _what(x: object) -> str:
    if isinstance(x, torch.Tensor):
        return f"{describe(x)} on {x.device}"
    return type(x).__name__
