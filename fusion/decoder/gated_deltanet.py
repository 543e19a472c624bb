"""Gated DeltaNet: the linear-attention token mixer of Qwen3.5's hybrid text stack.

Per token, a causal depthwise convolution over the projected queries, keys and values, then
the gated delta rule: a recurrent state ``[h, dk, dv]`` per head, decayed by ``exp(g)`` and
corrected towards each new key-value pair by ``beta`` (:mod:`fusion.decoder.delta_rule`).

Its state is what makes packing hard: it runs through the whole row. Here each packed sample
gets its own region of the row (:class:`~fusion.decoder.delta_rule.SampleRegions`), so the
convolution's taps and the state start afresh at every sample, from the samples' lengths
(never from positions, whose M-RoPE rows are not monotone over an image). Padding is zeroed
before the convolution, so left padding cannot leak into the first real tokens.

On CUDA with flash-linear-attention installed, the packed path runs its varlen Triton kernel
instead of the pure-torch one (:mod:`fusion.decoder.delta_rule_fla`); the layer's
``delta_rule_backend`` (or ``FUSION_DELTA_RULE_BACKEND``) ``"torch"`` keeps the torch kernel.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fusion._validation import check_int, check_values, host_reads_are_free
from fusion.decoder.delta_rule import (
    SampleRegions,
    causal_conv,
    chunk_gated_delta_rule,
    conv_step,
    gated_delta_step,
)
from fusion.decoder.delta_rule_fla import (
    check_backend,
    delta_rule_backend,
    fla_packed_gated_delta_rule,
)
from fusion.decoder.few_rows import FewRowsLinear
from fusion.decoder.packed import PackedSegments
from fusion.decoder.rms_norm import GatedRMSNorm

#: What a Gated DeltaNet layer is given instead of an attention mask: the samples' regions of
#: packed rows, or the real (non-padding) tokens ``[b or 1, s]`` of a padded batch, or None
#: (every token real).
TokenLayout = SampleRegions | torch.Tensor | None


@dataclass
class DeltaNetState:
    """The decoding state of one Gated DeltaNet layer, per sequence.

    Attributes:
        conv: ``[b, conv_dim, kernel - 1]``, the convolution's last inputs.
        recurrent: float32 ``[b, v_heads, k_dim, v_dim]``, the delta rule's state.
    """

    conv: torch.Tensor
    recurrent: torch.Tensor

    def reset(self) -> None:
        self.conv.zero_()
        self.recurrent.zero_()


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet (Qwen3.5's ``linear_attention`` layers), with Hugging Face's parameter
    names so that checkpoints and adapters carry over unchanged.

    Args:
        embed_dim: model width ``d``.
        num_key_heads, num_value_heads: query/key heads and value heads (the key heads are
            shared by ``num_value_heads // num_key_heads`` value heads each).
        key_head_dim, value_head_dim: per-head widths ``dk``, ``dv``.
        conv_kernel: the causal depthwise convolution's width.
        norm_eps: epsilon of the gated output norm.
        chunk_size: the delta rule's chunk length on the training path.
        delta_rule_backend: the packed path's kernel: ``"auto"`` (FLA's on CUDA where it is
            installed, unless ``FUSION_DELTA_RULE_BACKEND`` says otherwise), ``"torch"`` or
            ``"fla"`` (see :func:`~fusion.decoder.delta_rule_fla.delta_rule_backend`); an
            attribute of the same name, which may be changed.

    Shapes: input ``[b, s, d]``, output ``[b, s, d]``.
    """

    def __init__(
        self,
        embed_dim: int,
        num_key_heads: int,
        num_value_heads: int,
        key_head_dim: int,
        value_head_dim: int,
        conv_kernel: int,
        norm_eps: float = 1e-6,
        chunk_size: int = 64,
        delta_rule_backend: str = "auto",
    ) -> None:
        super().__init__()
        for name, value in (
            ("embed_dim", embed_dim),
            ("num_key_heads", num_key_heads),
            ("num_value_heads", num_value_heads),
            ("key_head_dim", key_head_dim),
            ("value_head_dim", value_head_dim),
            ("conv_kernel", conv_kernel),
            ("chunk_size", chunk_size),
        ):
            check_int(value, name, low=1)
        if num_value_heads % num_key_heads:
            raise ValueError(
                f"num_value_heads: expected a multiple of num_key_heads={num_key_heads}, got "
                f"{num_value_heads}"
            )
        self.num_key_heads, self.num_value_heads = num_key_heads, num_value_heads
        self.key_head_dim, self.value_head_dim = key_head_dim, value_head_dim
        self.conv_kernel, self.chunk_size = conv_kernel, chunk_size
        self.delta_rule_backend = check_backend(delta_rule_backend, "delta_rule_backend")
        key_dim, value_dim = num_key_heads * key_head_dim, num_value_heads * value_head_dim
        self.conv_dim = 2 * key_dim + value_dim
        self.in_proj_qkv = FewRowsLinear(embed_dim, self.conv_dim, bias=False)
        self.in_proj_z = FewRowsLinear(embed_dim, value_dim, bias=False)
        self.in_proj_b = nn.Linear(embed_dim, num_value_heads, bias=False)
        self.in_proj_a = nn.Linear(embed_dim, num_value_heads, bias=False)
        self.conv1d = nn.Conv1d(
            self.conv_dim,
            self.conv_dim,
            conv_kernel,
            groups=self.conv_dim,
            padding=conv_kernel - 1,
            bias=False,
        )
        # Decay rates: A in [0.01, 16) and dt_bias 1, as transformers initialises them.
        self.dt_bias = nn.Parameter(torch.ones(num_value_heads))
        self.A_log = nn.Parameter(torch.empty(num_value_heads).uniform_(0.01, 16).log_())
        self.norm = GatedRMSNorm(value_head_dim, eps=norm_eps)
        self.out_proj = FewRowsLinear(value_dim, embed_dim, bias=False)
        self.state: DeltaNetState | None = None
        self.cache_enabled = False

    def setup_state(self, batch_size: int, dtype: torch.dtype, device: torch.device) -> None:
        """Allocate the decoding state for ``batch_size`` sequences (conv inputs in ``dtype``,
        the recurrent state in float32) and enable it."""
        conv = torch.zeros(batch_size, self.conv_dim, self.conv_kernel - 1, dtype=dtype)
        recurrent = torch.zeros(
            batch_size, self.num_value_heads, self.key_head_dim, self.value_head_dim
        )
        self.state = DeltaNetState(conv.to(device), recurrent.to(device))
        self.cache_enabled = True

    def token_layout(
        self, mask: torch.Tensor | PackedSegments | None, slots: torch.Tensor | None
    ) -> TokenLayout:
        """What this layer needs of the decoder's ``mask``: the samples' regions of packed
        rows; for a dense mask ``[b or 1, 1, s, kv_len]``, the real tokens ``[b or 1, s]`` at
        this call's key positions (``slots`` with a cache, else ``0..s-1``), read from its
        last query's row, which sees every real token before it in a causal batch, left or
        right padded (a padding query may see real tokens and itself, no other padding).

        Raises:
            ValueError: a dense mask that is not causal over each row's real tokens (packed
                samples must come as :class:`~fusion.decoder.PackedSegments`, or the state
                would run across them); a device-side assertion where reading the mask is not
                free (see :func:`fusion._validation.check_values`).
        """
        if isinstance(mask, PackedSegments):
            return SampleRegions.from_segments(
                mask, chunk_size=self.chunk_size, kernel=self.conv_kernel
            )
        seq_len = 0 if mask is None else mask.size(-2)
        if mask is None or seq_len == 1:  # a generated token is never padding
            return None
        keys = torch.arange(seq_len, device=mask.device) if slots is None else slots
        real = mask[:, 0, -1].index_select(-1, keys)  # [b or 1, s]
        rows = mask[:, 0].index_select(-1, keys)  # [b or 1, s, s]: this call's keys
        causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=mask.device).tril()
        # Padding queries see real tokens or themselves, never other padding: else a packed
        # row's earlier samples (unseen by its last query) would pass for left padding.
        alone = torch.eye(seq_len, dtype=torch.bool, device=mask.device)
        check_values(
            torch.where(
                real[:, :, None],
                rows == (causal & real[:, None, :]),
                ~rows | real[:, None, :] | alone,
            ).all(),
            "mask: a decoder with Gated DeltaNet layers takes a dense mask only when it is "
            "causal over each row's real tokens (left or right padding); pass packed samples "
            "as PackedSegments, so that each sample's state starts afresh",
            eager=host_reads_are_free(mask.device),
        )
        return real

    def forward(
        self, x: torch.Tensor, *, mask: TokenLayout, input_pos: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Mix ``x`` [b, s, d] along the sequence, continuing the decoding state when it is
        enabled.

        Args:
            mask: from :meth:`token_layout`.
            input_pos: unused (the layer has no positions); accepted like attention's.

        Returns:
            [b, s, d]
        """
        b, s, _ = x.shape
        if isinstance(mask, torch.Tensor):
            x = x * mask[..., None].to(x.dtype)
        qkv = self.in_proj_qkv(x)  # [b, s, conv_dim]
        z = self.in_proj_z(x).view(b, s, self.num_value_heads, self.value_head_dim)
        beta = torch.sigmoid(self.in_proj_b(x))  # [b, s, hv]
        # The decay in float32: exp(A_log) overflows half precision for large A.
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)
        if isinstance(mask, SampleRegions):
            qkv, beta, g = mask.gather(qkv), mask.gather(beta), mask.gather(g)
            mixed = F.silu(causal_conv(self.conv1d, qkv))
            if delta_rule_backend(mixed.device, self.delta_rule_backend) == "fla":
                # The key heads unrepeated: FLA's grouped values share them as Qwen3.5 does.
                q, k, v = self._split(mixed, repeat=False)
                out = fla_packed_gated_delta_rule(q, k, v, g, beta, mask)
            else:
                out, _ = self._delta_rule(mixed, g, beta, mask.resets)
            out = mask.scatter(out)
        elif self.state is not None and self.cache_enabled:
            out = self._continue(qkv, g, beta, self.state)
        else:
            out, _ = self._delta_rule(F.silu(causal_conv(self.conv1d, qkv)), g, beta, None)
        out = self.norm(out, z).reshape(b, s, self.num_value_heads * self.value_head_dim)
        return self.out_proj(out)

    def _split(
        self, mixed: torch.Tensor, repeat: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys [b, s, hv, dk] (key heads repeated to the value heads; [b, s, hk, dk]
        without ``repeat``) and values [b, s, hv, dv] of the convolved projections
        [b, s, conv_dim]."""
        b, s, _ = mixed.shape
        key_dim = self.num_key_heads * self.key_head_dim
        q, k, v = mixed.split([key_dim, key_dim, self.num_value_heads * self.value_head_dim], -1)
        q = q.reshape(b, s, self.num_key_heads, self.key_head_dim)
        k = k.reshape(b, s, self.num_key_heads, self.key_head_dim)
        repeats = self.num_value_heads // self.num_key_heads
        if repeat and repeats > 1:
            q, k = q.repeat_interleave(repeats, dim=2), k.repeat_interleave(repeats, dim=2)
        return q, k, v.reshape(b, s, self.num_value_heads, self.value_head_dim)

    def _delta_rule(
        self,
        mixed: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        resets: torch.Tensor | None,
        initial_state: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        q, k, v = self._split(mixed)
        return chunk_gated_delta_rule(
            q,
            k,
            v,
            g,
            beta,
            chunk_size=self.chunk_size,
            resets=resets,
            initial_state=initial_state,
            output_final_state=initial_state is not None,
        )

    def _continue(
        self, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: DeltaNetState
    ) -> torch.Tensor:
        """Run ``s`` tokens after the cached ones (a prompt, or one generated token), updating
        the state in place (static shapes: compiled decoding steps keep their graph)."""
        s = qkv.size(1)
        if s == 1:  # a decoding step: the conv on one window, the state updated in place
            conv_out, window = conv_step(self.conv1d, qkv, state.conv)
            state.conv.copy_(window)
            q, k, v = self._split(F.silu(conv_out))
            return gated_delta_step(q, k, v, g, beta, state.recurrent)
        history = torch.cat([state.conv.transpose(1, 2).to(qkv.dtype), qkv], dim=1)
        kept = history.size(1) - (self.conv_kernel - 1)  # the last kernel - 1 inputs
        state.conv.copy_(history[:, kept:].transpose(1, 2))
        mixed = F.silu(causal_conv(self.conv1d, history)[:, -s:])
        out, final = self._delta_rule(mixed, g, beta, None, state.recurrent)
        state.recurrent.copy_(final if final is not None else state.recurrent)
        return out
