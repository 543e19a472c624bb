"""Sharding plans for the decoder and ``EarlyFusion``, applied from outside the model.

The model's modules know nothing of these plans: a plan is plain data (which modules form an
FSDP2 unit, which ``ParallelStyle`` each linear layer gets), applied with PyTorch's own
``fully_shard`` and ``parallelize_module``.

- :func:`apply_fsdp` / :func:`fsdp_units`: FSDP2, one unit per block (and, untied, the
  embedding and ``[norm, output]`` on their own), then the root.
- :func:`apply_tp` / :func:`llama_tp_plan`: Megatron-style tensor parallelism of the decoder
  (vocabulary-parallel embedding, column-wise q/k/v and w1/w3, row-wise output_proj and w2,
  column-wise output); untied output only.
"""

from fusion.parallel.fsdp import apply_fsdp, fsdp_units
from fusion.parallel.tensor_parallel import apply_tp, llama_tp_plan

__all__ = ["apply_fsdp", "apply_tp", "fsdp_units", "llama_tp_plan"]
