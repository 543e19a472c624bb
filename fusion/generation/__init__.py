"""Text out: KV-cached generation for decoders and ``EarlyFusion`` models, and its CLI.

``generate(..., compile=True)`` compiles the prefill and the decoding step (static shapes,
no host synchronisation inside a step, CUDA graphs on CUDA); see :mod:`fusion.generation.steps`.
``python -m fusion.generation --help`` runs a Hugging Face Llama, LLaVA, Idefics3 / SmolVLM,
Qwen2-VL or Qwen2.5-VL directory from the shell.
"""

from fusion.generation.autoregressive import generate, generate_stream
from fusion.generation.sampling import check_sampling_args, sample_next_token
from fusion.padding import left_pad

__all__ = ["check_sampling_args", "generate", "generate_stream", "left_pad", "sample_next_token"]
