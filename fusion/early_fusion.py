"""EarlyFusion: encoders whose outputs are written into a text decoder's input embeddings."""

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from fusion.decoder_kinds import (
    FUSION,
    HUGGING_FACE,
    check_gathered,
    decoder_kind,
    embedding_module,
    vocab_size,
)
from fusion.hooks import DeepStackRows, FusionHook, MRopePositions
from fusion.merge import IMPLEMENTATIONS, EncoderRows, merge_embeddings
from fusion.merge.placement import PlaceholderIds

_FUSION_MODULE_FLAG = "_fusion_module"


def register_fusion_module(module: nn.Module) -> nn.Module:
    """Mark ``module`` (e.g. an encoder's projection head) as a fusion module.

    Its parameters are governed by ``EarlyFusion(fusion_trainable=...)``, which overrides the
    encoder's and the decoder's flags. Returns ``module`` for chaining.
    """
    setattr(module, _FUSION_MODULE_FLAG, True)
    return module


def fusion_parameter_names(model: nn.Module) -> set[str]:
    """Names (relative to ``model``) of all parameters inside registered fusion modules."""
    return {
        f"{prefix}.{name}" if prefix else name
        for prefix, module in model.named_modules()
        if getattr(module, _FUSION_MODULE_FLAG, False)
        for name, _ in module.named_parameters()
    }


@dataclass(frozen=True)
class SharedEncoder:
    """An encoder entry of :class:`EarlyFusion` whose rows come from another entry's module,
    called on this entry's own input: e.g. a ``"video"`` entry, with its own placeholder id,
    whose clips run through the ``"image"`` entry's vision tower.

    The entry owns nothing: the module is looked up by name (``encoders[encoder]``) at each
    call, so the model's modules, parameters and state-dict keys are those without it, and
    whatever the target has become by then (sharded, adapted, compiled, wrapped) is what
    runs; what trains is the target's. Its input's keys are renamed to the module's
    arguments by ``arguments``; a key mapped to None is not passed (it is there for a hook,
    e.g. the seconds of a video's M-RoPE positions).

    Attributes:
        encoder: the name of the entry whose module is called (not itself a shared one).
        arguments: this entry's input keys -> the module's argument names (or None).
    """

    encoder: str
    arguments: Mapping[str, str | None]

    def module_kwargs(self, name: str, kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """``kwargs``, entry ``name``'s input, as the module's arguments.

        Raises:
            ValueError: a key that ``arguments`` does not list (named, with those it does).
        """
        unknown = sorted(set(kwargs) - set(self.arguments), key=str)
        if unknown:
            raise ValueError(
                f"encoder_input[{name!r}]: unknown keys {unknown}, expected some of "
                f"{sorted(self.arguments)} (passed to encoder {self.encoder!r} as "
                f"{dict(self.arguments)})"
            )
        renamed = {self.arguments[key]: value for key, value in kwargs.items()}
        renamed.pop(None, None)
        return cast(dict[str, Any], renamed)


class EarlyFusion(nn.Module):
    """A text decoder with encoders whose outputs replace placeholder tokens' embeddings.

    A drop-in replacement for ``decoder``: same ``forward`` signature, same checkpoint keys
    under ``decoder.``, no module replaced and no state-dict hook. Text tokens are embedded by
    calling the decoder's embedding module (whatever it is: sharded, LoRA-wrapped, quantized,
    scaled) and encoder rows are written at their placeholders by
    :func:`fusion.merge_embeddings` (sync-free; placeholder ids never reach the embedding).
    Under ``torch.autocast``, lower-precision encoder rows are cast to the text embeddings'
    dtype; outside it, rows of another dtype are refused.

    Three kinds of decoder, told apart once here from what the decoder offers
    (:func:`fusion.decoder_kinds.decoder_kind`, never by calling it), kept as
    ``self.decoder_kind``:

    - ``"fusion"``, this library's :class:`TransformerDecoder`: the merge runs inside the
      decoder's forward (``embed=``), after its hooks, on ``decoder.tok_embeddings``.
    - ``"torchtune"``, any module with ``tok_embeddings`` and a ``forward`` taking
      ``input_embeds``: rows are merged into ``decoder.tok_embeddings(tokens)`` and the result
      is passed as ``decoder(None, input_embeds=..., mask=..., input_pos=..., **kwargs)``
      (``mask`` and ``input_pos`` only when given), as torchtune's ``EarlyFusionModel`` does.
    - ``"huggingface"``, a transformers model with ``get_input_embeddings()`` and a ``forward``
      taking ``inputs_embeds`` (causal LMs and base models): rows are merged into
      ``decoder.get_input_embeddings()(tokens)`` and passed as
      ``decoder(inputs_embeds=..., **kwargs)`` (``attention_mask``, ``position_ids``,
      ``cache`` or ``past_key_values``, ``labels``, ...); what it returns (its
      ``ModelOutput``) is returned.
      Text only, the embeddings are those the model computes itself from ``input_ids`` (the
      same module called on the same ids), so the output is bitwise the decoder's own on
      ``input_ids=tokens`` (tested), and placeholder ids are still checked.

    For the last two the merge runs before the decoder's forward, so outside the decoder's own
    hooks: a sharding plan must leave the embedding in a unit of its own or in the
    ``EarlyFusion``'s root unit (see the README's sharding notes).

    Args:
        decoder: the text decoder (one of the kinds above); kept as ``self.decoder``, still
            callable on its own.
        encoders: encoder name -> module. An encoder returns its rows for the batch: a tensor
            (packed: ``[n_rows, d]`` or ``[n_media, tokens_per_media, d]``, in order of
            appearance of the placeholders) or a :class:`fusion.Packed` / :class:`fusion.Padded`.
        encoder_tokens: encoder name -> placeholder token id (inside or outside the vocabulary),
            for the names of ``encoders`` and ``shared_encoders``.
        shared_encoders: entry name -> :class:`SharedEncoder`: entries with placeholders of
            their own whose rows another entry's module computes (none by default); kept as
            ``self.shared_encoders``, a plain dict (no module, no parameter, no key).
        decoder_trainable, encoders_trainable, fusion_trainable: which parameters require
            grad. With none of them given, no ``requires_grad`` is changed: the model trains
            what the decoder and encoders you passed in train. Given any of them, torchtune's
            semantics apply to all three, unspecified ones taking torchtune's defaults:
            ``decoder_trainable`` (default False) for the decoder, ``encoders_trainable``
            (default False) for all encoders or per encoder name, ``fusion_trainable``
            (default True) for parameters of modules marked with
            :func:`register_fusion_module`, overriding the other two.
        merge_impl, eager_checks: passed to :func:`fusion.merge_embeddings` (``eager_checks=True``
            checks placeholder counts on the host, with a synchronisation, on any device).
        hooks: what a family's decoder computes beyond the merge, called in order at each
            forward through this library's decoder, without ``EarlyFusion`` knowing the
            family (:mod:`fusion.hooks`: :class:`~fusion.hooks.MRopePositions`,
            :class:`~fusion.hooks.DeepStackRows`, :class:`~fusion.hooks.ImageBlocks`); kept
            as ``self.hooks``.
        mrope, deepstack: deprecated shorthands for ``hooks=[MRopePositions(*mrope),
            DeepStackRows(deepstack)]``.

    Raises:
        TypeError: ``decoder`` is none of the kinds above (the message names what was looked
            for), or a ``torch.compile`` / DDP wrapper of one; an encoder is not a module; a
            placeholder id is not a Python int.
        ValueError: the names of ``encoders`` (with ``shared_encoders``), ``encoder_tokens``
            and a dict ``encoders_trainable`` differ, placeholder ids repeat, a shared entry
            names no entry of ``encoders`` or one of theirs, or ``merge_impl`` is unknown.
    """

    # One of the three kinds: typed Any, so that code written for this library's decoder
    # (``model.decoder.vocab_size``, ...) type-checks; ``decoder_kind`` says which it is.
    decoder: Any
    decoder_kind: str

    def __init__(
        self,
        decoder: nn.Module,
        encoders: Mapping[str, nn.Module],
        encoder_tokens: Mapping[str, int],
        *,
        decoder_trainable: bool | None = None,
        encoders_trainable: bool | Mapping[str, bool] | None = None,
        fusion_trainable: bool | None = None,
        merge_impl: str = "auto",
        eager_checks: bool | None = None,
        hooks: Sequence[FusionHook] = (),
        shared_encoders: Mapping[str, SharedEncoder] | None = None,
        mrope: tuple[str, int] | None = None,
        deepstack: str | None = None,
    ) -> None:
        super().__init__()
        kind = decoder_kind(decoder)
        if not isinstance(encoders, Mapping) or not all(
            isinstance(e, nn.Module) for e in encoders.values()
        ):
            raise TypeError(
                f"encoders: expected a mapping of name -> nn.Module, got {encoders!r:.200}"
            )
        encoder_tokens = PlaceholderIds(encoder_tokens)  # checked here, once
        if merge_impl != "auto" and merge_impl not in IMPLEMENTATIONS:
            raise ValueError(
                f"merge_impl: expected 'auto' or one of {list(IMPLEMENTATIONS)}, got {merge_impl!r}"
            )
        shared = _checked_shared(encoders, shared_encoders or {})
        names = {
            "encoders" + (" with shared_encoders" if shared else ""): set(encoders) | set(shared),
            "encoder_tokens": set(encoder_tokens),
        }
        if isinstance(encoders_trainable, Mapping):  # the modules' names: shared ones own none
            names["encoders_trainable"] = set(encoders_trainable) | set(shared)
        if len({frozenset(n) for n in names.values()}) > 1:
            listed = ", ".join(f"{arg} has {sorted(n)}" for arg, n in names.items())
            raise ValueError(f"encoders, encoder_tokens: expected the same names, got: {listed}")
        self.decoder = decoder
        self.decoder_kind = kind
        self.encoders = nn.ModuleDict(encoders)
        self.encoder_tokens = encoder_tokens
        self.shared_encoders = shared
        self.merge_impl = merge_impl
        self.eager_checks = eager_checks
        hooks = [
            *hooks,
            *([MRopePositions(*mrope)] if mrope is not None else []),
            *([DeepStackRows(deepstack)] if deepstack is not None else []),
        ]
        for hook in hooks:
            if kind != FUSION:
                raise ValueError(f"hooks: {hook!r} needs this library's decoder, got a {kind} one")
            hook.check(decoder, encoder_tokens)
        self.hooks = tuple(hooks)
        flags = (decoder_trainable, encoders_trainable, fusion_trainable)
        if any(flag is not None for flag in flags):
            self.set_trainable(
                decoder=bool(decoder_trainable),
                encoders=encoders_trainable or False,
                fusion=True if fusion_trainable is None else fusion_trainable,
            )

    def set_trainable(
        self,
        *,
        decoder: bool = False,
        encoders: bool | Mapping[str, bool] = False,
        fusion: bool = True,
    ) -> None:
        """Set which parameters require grad, with the constructor's torchtune semantics
        (``decoder_trainable``, ``encoders_trainable``, ``fusion_trainable``): the decoder's,
        each encoder's (all, or per name), and those of :func:`register_fusion_module`
        modules, which ``fusion`` overrides (a shared entry's flag is ignored: what trains
        is its target's). Every other parameter is frozen. The one
        mechanism for what trains, at construction or later (e.g. a loaded model)."""
        if not isinstance(encoders, Mapping):
            encoders = dict.fromkeys(self.encoders, bool(encoders))
        trainable = (
            {f"decoder.{n}" for n, _ in self.decoder.named_parameters()} if decoder else set()
        )
        for name, flag in encoders.items():
            if flag and name not in self.shared_encoders:  # a shared entry owns nothing
                prefix = f"encoders.{name}."
                trainable |= {prefix + n for n, _ in self.encoders[name].named_parameters()}
        fusion_params = fusion_parameter_names(self)
        trainable = trainable | fusion_params if fusion else trainable - fusion_params
        for name, param in self.named_parameters():
            param.requires_grad_(name in trainable)

    # ------------------------------------------------------------------ forward

    def encode(self, encoder_input: Mapping[str, Any]) -> dict[str, EncoderRows]:
        """Run the encoders once: name -> kwargs for that encoder, or an already-computed
        output (a tensor, ``Packed`` or ``Padded``), which passes through. The result can be
        passed back as ``encoder_input`` (e.g. reused across steps) without re-encoding."""
        self.check_encoder_names(encoder_input)
        return {
            name: self._run_encoder(name, value) if isinstance(value, Mapping) else value
            for name, value in encoder_input.items()
        }

    def check_encoder_names(self, encoder_input: Mapping[Any, Any]) -> None:
        """Refuse ``encoder_input`` naming an encoder this model lacks (``ValueError``
        listing the names it has)."""
        known = set(self.encoders) | set(self.shared_encoders)
        unknown = sorted(set(encoder_input) - known, key=str)
        if unknown:
            raise ValueError(
                f"encoder_input: unknown encoder names {unknown}, expected some of {sorted(known)}"
            )

    def _run_encoder(self, name: str, kwargs: Mapping[str, Any]) -> EncoderRows:
        """Call encoder ``name``; one with nothing to train (every parameter frozen, no input
        asking for a gradient) runs under ``torch.no_grad()``: its forward is all it costs,
        since autograd records nothing for it and keeps none of its activations. A shared
        entry calls its target's module (looked up now) on its renamed input."""
        shared = self.shared_encoders.get(name)
        if shared is not None:
            arguments = shared.module_kwargs(name, kwargs)
            try:
                return self._run_encoder(shared.encoder, arguments)
            except (TypeError, ValueError) as error:  # named as the caller named its input
                if type(error) not in (TypeError, ValueError):
                    raise  # a subclass may take other arguments: passed on as it is
                raise type(error)(
                    f"encoder_input[{name!r}] (passed to encoder {shared.encoder!r} as "
                    f"{dict(shared.arguments)}): {error}"
                ) from error
        encoder = self.encoders[name]
        frozen = (
            torch.is_grad_enabled()
            and not any(p.requires_grad for p in encoder.parameters())
            and not any(isinstance(v, torch.Tensor) and v.requires_grad for v in kwargs.values())
        )
        with torch.no_grad() if frozen else nullcontext():
            return encoder(**kwargs)

    def forward(
        self,
        tokens: torch.Tensor,
        *,
        mask: torch.Tensor | None = None,
        encoder_input: Mapping[str, Any] | None = None,
        input_pos: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> Any:
        """Merge encoder rows into the embeddings of ``tokens`` [b, s] and run the decoder.

        Args:
            tokens: ids [b, s], with placeholder ids where encoder rows go.
            mask, input_pos: passed to a fusion or torchtune-style decoder (see
                ``TransformerDecoder.forward``); a Hugging Face decoder takes
                ``attention_mask`` and ``position_ids`` in ``kwargs`` instead.
            kwargs: passed to the decoder as they are.
            encoder_input: see :meth:`encode`. Encoders without input have no rows, so their
                placeholders must not appear.

        Returns:
            what the decoder returns: for this library's decoder float32 logits
            [b, s, vocab] by default; a Hugging Face model's ``ModelOutput``. With no encoder
            input and no placeholder, bitwise equal to ``decoder(tokens)`` (Hugging Face:
            ``decoder(input_ids=tokens, **kwargs)``).

        Raises:
            ValueError: unknown encoder names, or placeholder counts that do not match the rows
                (see :func:`fusion.merge_embeddings`); rows of another width or dtype than the
                text embeddings; ``mask`` or ``input_pos`` given to a Hugging Face decoder, or
                ``kwargs`` holding the embeddings or ids this model computes. All before any
                decoder layer runs.
            RuntimeError: (other libraries' decoders) the embedding's weight is still sharded
                by FSDP2 when the merge calls it (the decoder sharded as one unit around it).
        """
        kind = self.decoder_kind
        if kind != FUSION:
            _check_foreign_arguments(kind, mask, input_pos, kwargs)
        rows = self.encode(encoder_input or {})
        if kind == FUSION:
            kwargs = dict(kwargs)
            for hook in self.hooks:
                input_pos = hook.before_decoder(
                    self.decoder,
                    tokens,
                    self.encoder_tokens,
                    rows,
                    encoder_input or {},
                    input_pos,
                    kwargs,
                )

            def embed(tok_embeddings: nn.Module, ids: torch.Tensor) -> torch.Tensor:
                # Called inside the decoder's forward, so the embedding is called as the
                # decoder would call it, after the decoder's own hooks (FSDP unshard and the
                # like).
                return merge_embeddings(
                    ids,
                    tok_embeddings,
                    rows,
                    self.encoder_tokens,
                    impl=self.merge_impl,
                    vocab_size=self.decoder.vocab_size,
                    eager_checks=self.eager_checks,
                )

            return self.decoder(tokens, mask=mask, input_pos=input_pos, embed=embed, **kwargs)
        embedding = embedding_module(self.decoder, kind)
        check_gathered(embedding)
        embeds = merge_embeddings(
            tokens,
            embedding,
            rows,
            self.encoder_tokens,
            impl=self.merge_impl,
            vocab_size=vocab_size(self.decoder, kind, embedding),
            eager_checks=self.eager_checks,
        )
        if kind == HUGGING_FACE:
            return self.decoder(inputs_embeds=embeds, **kwargs)
        given = {"mask": mask, "input_pos": input_pos}
        kwargs = {**{k: v for k, v in given.items() if v is not None}, **kwargs}
        return self.decoder(None, input_embeds=embeds, **kwargs)

    # ------------------------------------------------------------------ delegated to the decoder
    # A Hugging Face decoder keeps its cache in its ``cache`` argument and has none of these;
    # a torchtune-style one has those it defines.

    def setup_caches(
        self,
        batch_size: int,
        dtype: torch.dtype,
        *,
        encoder_max_seq_len: None = None,
        decoder_max_seq_len: int | None = None,
    ) -> None:
        self.decoder.setup_caches(
            batch_size,
            dtype,
            encoder_max_seq_len=encoder_max_seq_len,
            decoder_max_seq_len=decoder_max_seq_len,
        )

    def caches_are_setup(self) -> bool:
        return self.decoder.caches_are_setup()

    def caches_are_enabled(self) -> bool:
        return self.decoder.caches_are_enabled()

    def reset_caches(self) -> None:
        self.decoder.reset_caches()

    def teardown_caches(self) -> None:
        self.decoder.teardown_caches()

    @contextmanager
    def caches_disabled(self) -> Iterator[None]:
        with self.decoder.caches_disabled():
            yield

    def unembed(self, h: torch.Tensor) -> torch.Tensor:
        """The decoder's output projection: hidden [b, s, d] -> float32 logits [b, s, vocab]."""
        return self.decoder.unembed(h)

    @property
    def skip_output_layer(self) -> bool:
        return self.decoder.skip_output_layer

    @skip_output_layer.setter
    def skip_output_layer(self, value: bool) -> None:
        self.decoder.skip_output_layer = value

    @property
    def output_hidden_states(self) -> list[int]:
        return self.decoder.output_hidden_states

    @output_hidden_states.setter
    def output_hidden_states(self, value: list[int]) -> None:
        self.decoder.output_hidden_states = list(value)


def _checked_shared(
    encoders: Mapping[str, nn.Module], shared: Mapping[str, SharedEncoder]
) -> dict[str, SharedEncoder]:
    """``shared_encoders`` as a dict, each entry a :class:`SharedEncoder` of an entry of
    ``encoders`` under a name of its own."""
    if not isinstance(shared, Mapping) or not all(
        isinstance(v, SharedEncoder) for v in shared.values()
    ):
        raise TypeError(
            f"shared_encoders: expected a mapping of name -> SharedEncoder, got {shared!r:.200}"
        )
    for name, entry in shared.items():
        if name in encoders or entry.encoder not in encoders:
            raise ValueError(
                f"shared_encoders[{name!r}]: expected a name not in encoders "
                f"{sorted(encoders)} sharing one of theirs, got {entry!r}"
            )
    return dict(shared)


def _check_foreign_arguments(
    kind: str, mask: Any, input_pos: Any, kwargs: Mapping[str, Any]
) -> None:
    """Arguments a torchtune-style or Hugging Face decoder would take silently (into
    ``**kwargs``) or twice, refused by name before anything runs."""
    if kind == HUGGING_FACE:
        for name, value, instead in (
            ("mask", mask, "attention_mask"),
            ("input_pos", input_pos, "position_ids"),
        ):
            if value is not None:
                raise ValueError(
                    f"{name}: a Hugging Face decoder takes {instead} (a keyword passed to it "
                    f"as it is), not {name}"
                )
        computed = ("input_ids", "inputs_embeds")
    else:
        computed = ("tokens", "input_embeds")
    for name in computed:
        if name in kwargs:
            raise ValueError(
                f"{name}: EarlyFusion computes the decoder's input embeddings from tokens "
                f"(its first argument); got {name} as well"
            )
