"""Tensor parallelism of the decoder with DTensor's ``parallelize_module`` (Megatron layout)."""

from fnmatch import fnmatch

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

from fusion.decoder import TransformerDecoder
from fusion.decoder.few_rows import PLAIN_LINEARS
from fusion.parallel._model import find_decoder

_TIED = (
    "tensor parallelism needs an untied output: a tied output reads the embedding's weight, "
    "which is sharded along the vocabulary here; build the decoder with "
    "tie_word_embeddings=False (copy tok_embeddings.weight into output.weight to keep a "
    "tied checkpoint's values)"
)


# Exact types: wrappers change what the weight means.
_SHARDABLE = (*PLAIN_LINEARS, nn.Embedding)


def llama_tp_plan(decoder: TransformerDecoder) -> dict[str, ParallelStyle]:
    """The Llama tensor-parallel plan, keyed by module names relative to ``decoder``.

    Vocabulary-parallel embedding (rows of the table sharded, replicated output); column-wise
    ``q_proj``, ``k_proj``, ``v_proj`` and the MLP's ``w1`` (gate) and ``w3`` (up), whose
    outputs stay sharded into the row-wise ``output_proj`` and ``w2`` (down), which all-reduce;
    column-wise ``output`` gathered to full logits. Each rank then holds ``1/n`` of the heads:
    :func:`apply_tp` sets the attention modules' head counts to match.

    Raises:
        ValueError: the output is tied to the embedding.
    """
    if decoder.output is None:
        raise ValueError(f"decoder: {_TIED}")
    colwise, rowwise = ColwiseParallel, RowwiseParallel
    return {
        "tok_embeddings": rowwise(input_layouts=Replicate(), output_layouts=Replicate()),
        "layers.*.attn.q_proj": colwise(),
        "layers.*.attn.k_proj": colwise(),
        "layers.*.attn.v_proj": colwise(),
        "layers.*.attn.output_proj": rowwise(),
        "layers.*.mlp.w1": colwise(),
        "layers.*.mlp.w3": colwise(),
        "layers.*.mlp.w2": rowwise(),
        "output": colwise(output_layouts=Replicate()),
    }


def apply_tp(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """Tensor-parallelise the decoder of ``model`` in place over the 1-D ``mesh`` with
    :func:`llama_tp_plan`; the rest of the model (``EarlyFusion``'s encoders) stays replicated.
    Returns ``model``.

    Every process must then feed the same inputs. Each layer's ``attn.num_heads`` and
    ``attn.num_kv_heads`` become the per-rank counts (divided by ``mesh.size()``), as the
    attention reshapes its local projections with them. Parameter names do not change.

    Raises:
        TypeError: ``model`` is neither a decoder nor has one as ``.decoder``; ``mesh`` is not
            a ``DeviceMesh``.
        ValueError: ``mesh`` is not 1-D; the output is tied; a module the plan names is missing
            or is not exactly an ``nn.Linear`` (or the decoder's ``FewRowsLinear``) /
            ``nn.Embedding`` (e.g. a LoRA wrapper); a
            layer's head counts are not divisible by the mesh size; the decoder is already
            tensor-parallel or has KV caches (set them up afterwards). All checked before
            anything is sharded.
    """
    decoder = find_decoder(model)
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh: expected a DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim != 1:
        raise ValueError(
            f"mesh: expected a 1-D mesh (slice the tensor-parallel dimension, e.g. mesh['tp']), "
            f"got {mesh.ndim} dimensions"
        )
    if decoder.output is None:
        raise ValueError(f"model: {_TIED}")
    if any(isinstance(p, DTensor) for p in decoder.parameters()):
        raise ValueError("model: the decoder's parameters are already DTensors (sharded)")
    if decoder.caches_are_setup():
        raise ValueError(
            "model: the decoder has KV caches sized for all heads; call teardown_caches() "
            "and set them up after apply_tp"
        )
    plan = llama_tp_plan(decoder)
    modules = dict(decoder.named_modules())
    for key in plan:
        matched = {name: m for name, m in modules.items() if fnmatch(name, key)}
        wrong = {n: type(m).__name__ for n, m in matched.items() if type(m) not in _SHARDABLE}
        if not matched or wrong:
            raise ValueError(
                f"model: the plan shards {key!r}, which must name nn.Linear or nn.Embedding "
                f"modules of the decoder; got {wrong or 'no such module'}"
            )
    size = mesh.size()
    for i, attn in enumerate(decoder.attentions()):
        heads, kv_heads = attn.num_heads, attn.num_kv_heads
        if heads % size or kv_heads % size:
            raise ValueError(
                f"mesh: tensor parallelism over {size} ranks splits attention heads evenly, "
                f"but layer {i} has num_heads={heads} and num_kv_heads={kv_heads}; use a mesh "
                f"size that divides both"
            )
    parallelize_module(decoder, mesh, plan)
    for attn in decoder.attentions():
        attn.num_heads //= size
        attn.num_kv_heads //= size
    return model
