"""FSDP2 plans: which modules form a ``fully_shard`` unit, inner units first, the root last."""

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from fusion.parallel._model import find_decoder

Unit = nn.Module | list[nn.Module]


def fsdp_units(model: nn.Module, *, per_module: bool = True) -> list[Unit]:
    """The FSDP2 units of ``model`` (a ``TransformerDecoder`` or an ``EarlyFusion``), in the
    order to shard them; the last one is ``model`` itself, the root.

    ``per_module=True`` (torchtitan's plan): each block of every encoder that has ``.layers``,
    each decoder layer, then with an untied output ``tok_embeddings`` alone and
    ``[norm, output]`` together, then the root, which keeps everything else. With a tied
    output, ``tok_embeddings`` and ``norm`` stay in the root: the output reads the embedding's
    weight after the norm, outside the embedding's forward, where only the root unit is
    gathered. ``per_module=False``: the blocks, then the root.

    Raises:
        TypeError: ``model`` is neither a decoder nor has one as ``.decoder``.
    """
    decoder = find_decoder(model)
    units: list[Unit] = []
    encoders = getattr(model, "encoders", None) if model is not decoder else None
    if isinstance(encoders, nn.ModuleDict):
        for encoder in encoders.values():
            blocks = getattr(encoder, "layers", None)
            if isinstance(blocks, nn.ModuleList | nn.Sequential):
                units.extend(blocks)
    units.extend(decoder.layers)
    if per_module and decoder.output is not None:
        units.append(decoder.tok_embeddings)
        units.append([decoder.norm, decoder.output])
    units.append(model)
    return units


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    per_module: bool = True,
    mp_policy: MixedPrecisionPolicy | None = None,
    reshard_after_forward: bool = True,
) -> nn.Module:
    """Shard ``model`` in place with FSDP2 ``fully_shard``, one call per unit of
    :func:`fsdp_units` (same ``per_module``), all on ``mesh``. Returns ``model``.

    ``reshard_after_forward`` applies to every unit but the root, which stays gathered from
    forward to backward. Parameter names and state-dict keys do not change. Compose with
    tensor parallelism by calling :func:`fusion.parallel.apply_tp` first, on the other
    dimension of a 2-D mesh.

    Raises:
        TypeError: ``model`` is neither a decoder nor has one as ``.decoder``; ``mesh`` is not
            a ``DeviceMesh``.
        ValueError: some module of ``model`` is already sharded with ``fully_shard``.
    """
    units = fsdp_units(model, per_module=per_module)
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh: expected a DeviceMesh, got {type(mesh).__name__}")
    sharded = [name or "<root>" for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    if sharded:
        raise ValueError(f"model: already sharded with fully_shard at {sharded[:3]}")
    for unit in units:
        fully_shard(
            unit,
            mesh=mesh,
            mp_policy=mp_policy or MixedPrecisionPolicy(),
            # The root stays gathered from forward to backward (FSDP2's own choice for a root,
            # which backward gathers first anyway): a tied output or a per_module=False output
            # called after the forward, as fusion.chunked_token_loss does, then works.
            reshard_after_forward=reshard_after_forward and unit is not model,
        )
    return model
