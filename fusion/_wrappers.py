"""The model behind its wrappers: the one place that looks through them.

A wrapper holds the whole model unchanged and adds a prefix to its keys: ``torch.compile``'s
``OptimizedModule`` (``._orig_mod``), ``DistributedDataParallel`` and ``DataParallel``
(``.module``), nested in any order. FSDP2's ``fully_shard`` wraps nothing: the module stays
itself (its class becomes a subclass of its own), so a sharded model needs no unwrapping. A
container such as ``nn.Sequential`` is no wrapper (it may hold several models, or one among
other modules) and is never looked into here; :func:`fusion.checkpoint.decoder_state_dict`
finds a decoder inside one by its keys.
"""

import sys
from typing import Any

from torch.nn.parallel import DataParallel, DistributedDataParallel

from fusion.decoder import TransformerDecoder


def compiled_module_type() -> type | None:
    """``torch.compile``'s wrapper class, or None when ``torch._dynamo`` was never imported
    (then no instance can exist): importing it here would cost seconds."""
    return getattr(sys.modules.get("torch._dynamo.eval_frame"), "OptimizedModule", None)


def is_wrapper(module: object, *, parallel: bool = True) -> bool:
    """Whether ``module`` is a ``torch.compile`` wrapper, or (``parallel``) a DDP or
    DataParallel one."""
    compiled = compiled_module_type()
    if compiled is not None and isinstance(module, compiled):
        return True
    return parallel and isinstance(module, DistributedDataParallel | DataParallel)


def unwrap(model: Any, *, parallel: bool = True) -> Any:
    """``model`` with the wrappers around it removed (``model`` itself when there are none);
    ``parallel=False`` looks through ``torch.compile`` only."""
    while is_wrapper(model, parallel=parallel):
        parallel_wrapper = isinstance(model, DistributedDataParallel | DataParallel)
        model = model.module if parallel_wrapper else model._orig_mod
    return model


def decoder_of(model: object) -> TransformerDecoder | None:
    """The ``TransformerDecoder`` that ``model`` is, or holds as ``.decoder`` (an
    ``EarlyFusion`` over one); None when neither. No wrapper is looked through: call
    :func:`unwrap` first where the model may be wrapped."""
    if isinstance(model, TransformerDecoder):
        return model
    decoder = getattr(model, "decoder", None)
    return decoder if isinstance(decoder, TransformerDecoder) else None
