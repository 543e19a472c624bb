"""Text out: KV-cached generation for decoders and ``EarlyFusion`` models, eager or compiled
(:mod:`fusion.generation.steps`), and its CLI, ``python -m fusion.generation --help``."""

from fusion.generation.autoregressive import generate, generate_stream
from fusion.generation.sampling import check_sampling_args, sample_next_token
from fusion.padding import left_pad

__all__ = ["check_sampling_args", "generate", "generate_stream", "left_pad", "sample_next_token"]
