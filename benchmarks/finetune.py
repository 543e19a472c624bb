"""Fine-tuning throughput and peak memory: fusion with packed samples, fusion padded, and
``transformers``' own model class on padded batches and padding-free (packed) rows, on the same
weights, samples and optimizer, for three families (``--family``): SmolVLM
(``Idefics3ForConditionalGeneration``), Qwen2.5-VL (``Qwen2_5_VLForConditionalGeneration``) and
Qwen3.5 (``Qwen3_5ForConditionalGeneration``).

The model has SmolVLM-256M's shape (SmolLM2-135M's decoder: 576 wide, 9/3 heads, MLP 1536,
vocabulary 49280; SigLIP base patch-16/512; 4 x 4 pixel shuffle: 64 rows per 512 x 512 image)
cut to ``--text-layers`` decoder layers and ``--vision-layers`` SigLIP layers: by default 6 and
3 on CPU (of the published 30 and 12: the cut the issue-31 measurement used, so that a round
fits in minutes on 2 cores) and the full 30 and 12 on CUDA. Random weights, written once by
``transformers`` and loaded by each contestant (``fusion.checkpoint.load_hf_idefics3`` for
ours). Every contestant trains the decoder and the connector (vision tower frozen, as in
SmolVLM's and LLaVA's fine-tuning) with torch's fused AdamW (the recipe's, and the Hugging
Face Trainer's default), one optimizer step per ``--samples-per-step`` samples (the same
samples, in the same order, for everyone):

- ``fusion_packed``: the fine-tuning recipe's path: the step's samples packed into rows of at
  most ``--max-seq-len`` tokens (default :data:`ROW_TOKENS`, SmolVLM-256M's
  ``max_position_embeddings``: the recipe packs rows as long as the model takes, so a step's
  samples share one row and only the last row is padded; ``fusion.data.Collate``:
  ``pack_samples``, positions restarting per sample, the rows' sample boundaries for
  attention instead of a dense mask), one micro-batch per step made ahead by the recipe's
  data loader (``fusion.data.MicroBatches`` over ``StepBatches``, one worker process), the
  model's hidden states and
  ``fusion.chunked_token_loss`` (the output layer applied at the targets only), divided by the
  step's target count;
- ``fusion_padded``: the same, with the step's samples right-padded to the longest
  (``Collate(packing=False)``: ``collate_padded``);
- ``transformers_padded``: the same padded batch through ``Idefics3ForConditionalGeneration``
  (SDPA attention, ``attention_mask``, ``labels`` with -100: its own loss), as the Hugging Face
  Trainer trains with ``per_device_train_batch_size = samples_per_step``;
- ``transformers_padding_free``: the step's samples concatenated into rows (batch size 1) with
  ``position_ids`` restarting at 0 for every sample, SDPA attention, no ``attention_mask`` and
  ``use_cache=False``, so that transformers' own packed-sequence detection
  (``masking_utils.find_packed_sequence_indices``, the contract TRL's ``padding_free`` relies
  on) turns the positions into a block-causal mask; ``labels`` are each sample's with -100 on
  its first token, so no sample predicts the next one's first token. ``use_cache=False`` is
  needed: with the config's ``use_cache=True`` (and no gradient checkpointing) the model builds
  a ``DynamicCache``, the detection is skipped (it runs only without a cache) and every token
  attends to the samples before it in the row. The rows are the ones ``fusion_packed`` gets
  (``fusion.data.pack_samples``: greedy first fit into at most ``--max-seq-len`` tokens), one
  forward/backward per row, each row's loss a sum over its targets divided by the step's
  target count (transformers' ``num_items_in_batch``, how the Trainer accumulates gradients):
  both packed contestants compute the same positions. A ``--max-seq-len`` above the step's
  total puts the whole step in one row, as TRL's collator does. Before training, the process
  checks on the first timed step's first two samples, with the same weights, that this loss
  equals ``transformers_padded``'s (relative difference at most :data:`SAME_WEIGHTS_TOLERANCE`
  in fp32), and the run checks the first timed step's losses of the two across processes
  (:data:`FIRST_LOSS_TOLERANCE`); either failing stops the run with both losses.

``--family qwen2_5_vl``: Qwen2.5-VL-3B's widths (:data:`QWEN2_5_VL_3B_TEXT`,
:data:`QWEN2_5_VL_3B_VISION`: text 2048 wide, 16/2 heads, MLP 11008, vocabulary 151936, tied
output layer, M-RoPE sections 16/24/24; ViT 1280 wide, 16 heads, MLP 3420, 112-pixel windows,
14-pixel patches, 2 x 2 merge into 2048) with 2 text layers and 2 vision blocks by default
(block 1 full attention, block 0 windowed; ``--vision-layers N``: full attention in blocks 7,
15, ... as in the 3B, or the last block alone below 8), loaded by
``fusion.checkpoint.load_hf_vlm``. The decoder and the merger train, the rest of the tower is
frozen (the recipe's ``--train full``). Each sample has one image of its own size: 16 to 32
patches a side (224 to 448 pixels, even), so 64 to 256 rows, and grids differ from sample to
sample; transformers gets the same patches, grids and ``mm_token_type_ids``, and M-RoPE
positions come from the grids on both sides (fusion packed: from its 1-D positions restarting
per sample; transformers padding-free: ``get_rope_index`` of each sample alone, behind a first
row of text positions restarting per sample, the ``[4, 1, s]`` form Qwen2.5-VL's text model
reads for packed rows).

``--family qwen3_5``: Qwen3.5-0.8B's widths (:data:`QWEN3_5_0_8B_TEXT`,
:data:`QWEN3_5_0_8B_VISION`: text 1024 wide, MLP 3584, gated full attention with 8/2 heads of
256, Gated DeltaNet with 16/16 heads of 128 and a kernel of 4, tied output layer, interleaved
M-RoPE; the tower 768 wide, 12 heads, 16-pixel patches, out 1024) cut to one [L, L, L, F]
group of its 24 layers (three DeltaNet layers, then full attention; ``--text-layers N``: that
pattern repeated and cut) and 2 vision blocks (``--vision-layers``), the vocabulary cut from
248320 to :data:`QWEN3_5_VOCAB` for time, loaded by ``fusion.checkpoint.load_hf_model``.
Samples as Qwen2.5-VL's (its synthetic ids, no tokenizer: images of 16 to 28 patches a side).
The contestants are fusion packed, fusion padded and transformers padded: transformers'
padding-free rows leak across samples on Qwen3.5 on CPU (its DeltaNet carries its recurrent and
convolution state across ``position_ids`` boundaries; its pure-torch kernels refuse
``cu_seq_lens``), so instead of timing them, a fresh process before the rounds checks them on
the initial weights and the first timed step's samples against transformers' padded batch,
the step's loss and each sample's (:func:`padding_free_per_sample`), recorded as
``padding_free_untimed_check`` and reported as wrong where they differ. The report's ``target``
is issue 37's: fusion packed at least :data:`QWEN3_5_TARGET` x transformers padded.

Samples: a fixed-seed mix of LLaVA-Instruct-like lengths: one image per sample (SmolVLM: 64
rows and its 3 wrapper tokens; Qwen2.5-VL: its rows between ``<|vision_start|>`` and
``<|vision_end|>``), a question of 8 to 40 tokens, an answer of 10 to 400 tokens (40% short
10-100 as in its conversations, 30% 100-250 as in its detailed descriptions, 30% 250-400 as in
its complex reasoning), and an end-of-turn token. The loss covers the answer and the end token.

Each contestant runs in a fresh process (``--quick``: in this process): a warm-up step (2
samples: allocator, kernels, the optimizer's state; ``--short-warmup``: the first sample alone,
its answer cut to 16 tokens, which sets up the same state in a fraction of the time), then
``--steps`` timed steps (the same samples either way). ``--rounds N`` (default 3; ``--quick``:
1) runs every contestant N times, each time in a fresh process, in alternating order (the
``--only`` order, then reversed, ...): reported per contestant are the median over rounds and
the range, and each ratio (to ``transformers_padded``, to ``transformers_padding_free``, and
``fusion_packed`` to ``fusion_padded``) is the median over rounds of the ratio within a round,
with its range. Reported: non-padding tokens per second over the timed steps (wall clock, and
per CPU-second of the process: user and system time of all its threads and of fusion's data
loader worker, which time-slicing by
other jobs on shared cores moves less than the wall clock, though spinning threads still
count), the positions computed per step (padding included), the peak resident memory of the
process (``ru_maxrss``, the training process alone: the loader worker is forked from it and
shares its pages; CPU) or the peak CUDA memory allocated (GPU), the first timed step's
loss (all must agree: same weights, same samples), and the load average at each process's start
and end. On CPU, after each round, a fresh process times fp32 matrix products at the family's
sizes (:data:`GEMM_SHAPES`, ``matrix_rate`` in the JSON): the machine's speed in the run's own
minutes, at which ``finetune_floor.py`` sets the time floors. ``--memory-limit-gib G`` caps
each contestant's address space at G GiB: one that runs out (or that the kernel kills for
memory) is reported as out of memory in that round, with no timings or ratios, and the run
goes on with the others.

    python benchmarks/finetune.py                 # CPU, fp32, 2 threads -> benchmarks/results/
    python benchmarks/finetune.py --quick         # a tiny model, seconds -> a temporary directory
    python benchmarks/finetune.py --device cuda   # bf16 autocast, fp32 weights, 30 + 12 layers
    python benchmarks/finetune.py --family qwen2_5_vl --samples-per-step 2 --steps 1 \
        --rounds 2 --short-warmup                 # Qwen2.5-VL-3B-wide, 5-10 min on 2 CPU cores

Writes ``finetune.json`` (and ``finetune_<device>.txt``, the table) to ``--out``; for
``--family F`` other than smolvlm, ``finetune_F.json`` and ``finetune_F_<device>.txt``.
"""

import argparse
import dataclasses
import itertools
import json
import multiprocessing
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from common import QWEN3_5_TEXT, add_out_argument, idefics3_hf_config, machine, output_dir
from torch.autograd.profiler import record_function

from fusion import chunked_token_loss, fused_token_loss
from fusion.data import (
    IGNORE_INDEX,
    Collate,
    MicroBatch,
    MicroBatches,
    Sample,
    StepBatches,
    collate_padded,
    pack_samples,
)
from fusion.families.idefics3.builders import (
    SMOLVLM_256M_IMAGE_TOKEN_ID,
    SMOLVLM_256M_SCALE_FACTOR,
    SMOLVLM_256M_TEXT,
    SMOLVLM_256M_VISION,
)
from fusion.training import release_freed_memory

#: The packed rows' default length: SmolVLM-256M's ``max_position_embeddings``, the rows the
#: fine-tuning recipe packs for it (it packs rows as long as the model takes).
ROW_TOKENS = 8192

CONTESTANTS = (
    "transformers_padded",
    "transformers_padding_free",
    "fusion_padded",
    "fusion_packed",
)
FAMILIES = ("smolvlm", "qwen2_5_vl", "qwen3_5")
PAD_ID = 2  # SmolVLM's <|im_end|> doubles as padding; any id works: padding is never a target
BOS_ID, FAKE_ID, GLOBAL_ID, END_ID = 1, 49_189, 49_152, 49_279
LR = 1e-5
TRAIN_MODES = ("full", "lora")
LOSSES = ("chunked", "fused")
LORA_RANK, LORA_ALPHA = 8, 16.0
QWEN_MAX_IMAGE = 448  # pixels: the default largest image side of the Qwen2.5-VL samples
#: The profile's ranges (--profile), in the order reported.
PROFILE_RANGES = ("vision_tower", "decoder", "loss", "backward", "optimizer")
SHORT_WARMUP_ANSWER = 16  # --short-warmup: answer tokens kept in the warm-up sample
#: SmolVLM-256M's layers kept on CPU (text, vision) unless --text-layers / --vision-layers.
SMOLVLM_CPU_LAYERS = (6, 3)
#: fp32 matrix products at each family's sizes (rows, inner, columns): its tower's MLP, its
#: decoder's MLP and its output layer at a step's targets. On CPU the run times them in a fresh
#: process after each round (:func:`matrix_rate`): ``finetune_floor.py``'s rate.
GEMM_SHAPES = {
    "smolvlm": ((8192, 768, 3072), (2474, 576, 1536), (1024, 576, 49280)),
    "qwen2_5_vl": ((4096, 1280, 3420), (2048, 2048, 11008), (1024, 2048, 151936)),
    "qwen3_5": ((4096, 768, 3072), (2048, 1024, 3584), (1024, 1024, 32768)),
}
#: Timed calls per shape in each round's rate process.
RATE_CALLS = 3
#: The relative difference allowed between transformers' padded and padding-free losses on the
#: same weights and samples (one process, before training): fp32, and bf16 autocast on CUDA.
SAME_WEIGHTS_TOLERANCE = {"cpu": 1e-5, "cuda": 1e-2}
#: The same for the first timed step's losses of the two contestants' processes (after each
#: one's warm-up step: AdamW's first update, lr * g / (|g| + eps), can differ where a gradient
#: is about as small as fp32's rounding).
FIRST_LOSS_TOLERANCE = {"cpu": 1e-4, "cuda": 2e-2}

#: Qwen2.5-VL-3B-Instruct's text stack as its published ``config.json`` gives it
#: (``Qwen2_5_VLTextConfig`` fields; ``rope_scaling`` {"type": "mrope"} there).
QWEN2_5_VL_3B_TEXT: dict[str, Any] = {
    "vocab_size": 151_936,
    "hidden_size": 2048,
    "intermediate_size": 11_008,
    "num_hidden_layers": 36,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128_000,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 1_000_000.0,
        "mrope_section": [16, 24, 24],
    },
}
#: Its vision tower (``vision_config``).
QWEN2_5_VL_3B_VISION: dict[str, Any] = {
    "depth": 32,
    "hidden_size": 1280,
    "intermediate_size": 3420,
    "num_heads": 16,
    "out_hidden_size": 2048,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "window_size": 112,
    "fullatt_block_indexes": [7, 15, 23, 31],
    "tokens_per_second": 2,
    "hidden_act": "silu",
}
#: Its special ids (the 3B ties its output layer to the embeddings).
QWEN2_5_VL_IDS = {
    "image_token_id": 151_655,
    "video_token_id": 151_656,
    "vision_start_token_id": 151_652,
    "vision_end_token_id": 151_653,
    "pad_token_id": 151_643,  # <|endoftext|>
}
QWEN_IM_START, QWEN_IM_END = 151_644, 151_645
#: The layers kept for CPU: 2 text layers; 2 vision blocks, block 1 full attention as the last
#: block of each group of 8 in the 3B (7, 15, 23, 31), block 0 within 112-pixel windows.
QWEN_TEXT_LAYERS, QWEN_VISION_DEPTH, QWEN_FULL_ATTENTION = 2, 2, [1]

#: Qwen3.5-0.8B's text stack (:data:`common.QWEN3_5_0_8B_TEXT`), positions for a packed row.
QWEN3_5_0_8B_TEXT: dict[str, Any] = QWEN3_5_TEXT | {"max_position_embeddings": ROW_TOKENS}
#: Its vision tower (Qwen3-VL's without DeepStack; the MLP width 4 x 768 is assumed), cut to
#: :data:`QWEN3_5_VISION_DEPTH` blocks of its 12.
QWEN3_5_0_8B_VISION: dict[str, Any] = {
    "depth": 12,
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_heads": 12,
    "out_hidden_size": 1024,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "num_position_embeddings": 2304,
    "hidden_act": "gelu_pytorch_tanh",
}
#: The layers kept for CPU: one group of the 0.8B's [L, L, L, F] x 6 (three Gated DeltaNet
#: layers, then gated full attention), 2 vision blocks.
QWEN3_5_LAYER_TYPES = [*["linear_attention"] * 3, "full_attention"]
QWEN3_5_VISION_DEPTH = 2
#: The vocabulary, cut from the 0.8B's 248320 for time (as ``qwen3_5_generation.py`` does): the
#: padded side's logits and the tied table's gradient and AdamW state scale with it.
QWEN3_5_VOCAB = 32_768
#: transformers' padding-free rows leak across samples on Qwen3.5 on CPU (its DeltaNet carries
#: its state across ``position_ids`` boundaries): checked once, not timed.
QWEN3_5_CONTESTANTS = ("transformers_padded", "fusion_padded", "fusion_packed")
#: The issue's target: fusion packed / transformers padded, non-padding tokens/s.
QWEN3_5_TARGET = 1.5


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a tiny model: checks the script")
    add_out_argument(p)
    p.add_argument("--family", choices=FAMILIES, default="smolvlm", help="the model's shape")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--threads", type=int, default=2, help="torch threads on CPU")
    p.add_argument("--samples-per-step", type=int, default=None, help="default 8 (CPU), 32")
    p.add_argument("--steps", type=int, default=2, help="timed optimizer steps")
    p.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="fresh processes per contestant, alternating order (default 3; --quick: 1)",
    )
    p.add_argument(
        "--text-layers",
        type=int,
        default=None,
        help=f"decoder layers (SmolVLM: default {SMOLVLM_CPU_LAYERS[0]} on CPU, all 30 on CUDA; "
        f"Qwen2.5-VL: {QWEN_TEXT_LAYERS}; --quick: 2)",
    )
    p.add_argument(
        "--vision-layers",
        type=int,
        default=None,
        help=f"vision tower layers (SmolVLM: default {SMOLVLM_CPU_LAYERS[1]} on CPU, all 12 on "
        f"CUDA; Qwen2.5-VL: {QWEN_VISION_DEPTH}; --quick: 2)",
    )
    p.add_argument(
        "--short-warmup",
        action="store_true",
        help=f"warm up on the first sample alone, its answer cut to {SHORT_WARMUP_ANSWER} tokens",
    )
    p.add_argument(
        "--max-seq-len", type=int, default=None, help="packed rows' length (default 8192)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--train",
        choices=TRAIN_MODES,
        default="full",
        help="full: the decoder and the connector train (the vision tower frozen); lora: "
        f"rank-{LORA_RANK} adapters on the decoder's q and v projections alone (fusion.lora."
        "apply_lora; transformers: peft's inject_adapter_in_model, the same layers)",
    )
    p.add_argument(
        "--loss",
        choices=LOSSES,
        default=None,
        help="fusion's loss: chunked (fusion.chunked_token_loss, checkpointed chunks) or fused "
        "(fusion.fused_token_loss: the output's backward made in the forward); default the "
        "recipe's: fused on CPU, chunked on CUDA",
    )
    p.add_argument(
        "--loss-chunk-rows",
        type=int,
        default=None,
        help="the most target rows fusion's loss projects to the vocabulary at once (default "
        "the library's: 512 for the fused loss, 1024 for the chunked one; a chunk's logits "
        "are rows x vocabulary floats)",
    )
    p.add_argument(
        "--defer-output-grad",
        action="store_true",
        help="the fused loss makes the output's gradient at the end of the backward, from a "
        "second projection of each chunk (fusion.fused_token_loss(defer_output_grad=True)): "
        "less memory at the loss, one more output-sized product per target",
    )
    p.add_argument(
        "--release-freed-memory",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="fusion's contestants hand freed host memory back to the system at each step's "
        "two peaks (fusion.training.release_freed_memory: glibc's malloc_trim before the "
        "loss and before the embedding's gradient); default the recipe's: on for CPU",
    )
    p.add_argument(
        "--max-image",
        type=int,
        default=None,
        help="Qwen2.5-VL: the largest image side in pixels, sides drawn from 224 up to it "
        "(default 448; the users' workload: 1024)",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="also the timed steps' shares (torch.profiler record_function ranges): vision "
        "tower forward, decoder forward, loss, backward, optimizer",
    )
    p.add_argument(
        "--only",
        choices=CONTESTANTS,
        nargs="+",
        default=None,
        help="the contestants (default all; Qwen3.5: all but transformers_padding_free, whose "
        "rows leak across samples there: its loss is checked against padded, not timed)",
    )
    p.add_argument(
        "--transparent-huge-pages",
        action="store_true",
        help="every contestant's process with THP_MEM_ALLOC_ENABLE=1 (PyTorch's CPU allocator "
        "then asks the kernel for 2 MiB pages for buffers of 2 MiB and more: far fewer page "
        "faults where a step's large tensors are made afresh); not with --quick, which runs in "
        "this process",
    )
    p.add_argument(
        "--memory-limit-gib",
        type=float,
        default=None,
        help="cap each contestant's process at this much address space (RLIMIT_AS, which is "
        "somewhat above its resident memory): a contestant that runs out is reported as out of "
        "memory in that round, with no timing, and the run goes on (default: no cap; one that "
        "the kernel kills for memory is reported the same way)",
    )
    p.add_argument("--worker", choices=CONTESTANTS, help=argparse.SUPPRESS)
    p.add_argument("--check-only", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rate-only", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rounds is None:
        args.rounds = 1 if args.quick else 3
    if args.only is None:
        args.only = list(QWEN3_5_CONTESTANTS if args.family == "qwen3_5" else CONTESTANTS)
    if args.family == "qwen3_5" and "transformers_padding_free" in args.only:
        p.error(
            "--only transformers_padding_free: on Qwen3.5 transformers' padding-free rows leak "
            "across samples on CPU (its DeltaNet carries its state across position_ids "
            "boundaries); the run checks its loss against transformers_padded's, untimed"
        )
    for name in ("rounds", "text_layers", "vision_layers", "memory_limit_gib", "loss_chunk_rows"):
        value = getattr(args, name)
        if value is not None and not 1 <= value < float("inf"):  # NaN fails too
            p.error(f"--{name.replace('_', '-')}: expected at least 1 (finite), got {value}")
    cuda = args.device == "cuda"
    if args.loss is None:  # the fine-tuning recipe's choice (its --fused-loss)
        args.loss = "chunked" if cuda else "fused"
    if args.transparent_huge_pages and args.quick:
        p.error(
            "--transparent-huge-pages: expected a run in fresh processes, got --quick (one "
            "process, whose allocator has read its environment already)"
        )
    if args.release_freed_memory is None:  # the recipe's choice (its --release-freed-memory)
        args.release_freed_memory = not cuda
    if args.defer_output_grad and args.loss != "fused":
        p.error(f"--defer-output-grad: expected --loss fused, got --loss {args.loss}")
    if args.samples_per_step is None:
        args.samples_per_step = 4 if args.quick else 32 if cuda else 8
    if args.max_seq_len is None:
        args.max_seq_len = 256 if args.quick else ROW_TOKENS
    if args.family == "smolvlm" and not args.quick:
        full = (SMOLVLM_256M_TEXT["num_layers"], SMOLVLM_256M_VISION["num_hidden_layers"])
        text, vision = full if cuda else SMOLVLM_CPU_LAYERS
        args.text_layers = text if args.text_layers is None else args.text_layers
        args.vision_layers = vision if args.vision_layers is None else args.vision_layers
    if args.quick:
        args.steps = 1
    if args.worker is None and not args.rate_only:
        args.out = output_dir(args.out, check=args.quick)
    return args


# ---------------------------------------------------------------------- model and samples


def hf_config(
    quick: bool,
    family: str = "smolvlm",
    text_layers: int | None = None,
    vision_layers: int | None = None,
) -> dict:
    """The transformers config's fields: SmolVLM-256M's shape (``Idefics3Config``) or
    Qwen2.5-VL-3B's widths (``Qwen2_5_VLConfig``), or a tiny one for ``--quick``; with
    ``text_layers`` decoder layers and ``vision_layers`` vision layers (None: SmolVLM's
    :data:`SMOLVLM_CPU_LAYERS`, Qwen2.5-VL's :data:`QWEN_TEXT_LAYERS` and
    :data:`QWEN_VISION_DEPTH`, ``--quick``'s 2 and 2)."""
    if family == "qwen2_5_vl":
        return qwen_hf_config(quick, text_layers, vision_layers)
    if family == "qwen3_5":
        return qwen3_5_hf_config(quick, text_layers, vision_layers)
    text, vision = dict(SMOLVLM_256M_TEXT), dict(SMOLVLM_256M_VISION)
    scale, image_id = SMOLVLM_256M_SCALE_FACTOR, SMOLVLM_256M_IMAGE_TOKEN_ID
    text_default, vision_default = SMOLVLM_CPU_LAYERS
    if quick:
        text |= {"embed_dim": 36, "intermediate_dim": 64}
        vision |= {"hidden_size": 16, "intermediate_size": 32}
        vision |= {"num_attention_heads": 2, "image_size": 32, "patch_size": 4}
        scale, text_default, vision_default = 2, 2, 2
    text["num_layers"] = text_default if text_layers is None else text_layers
    vision["num_hidden_layers"] = vision_default if vision_layers is None else vision_layers
    config = idefics3_hf_config(text, vision, scale, image_id)
    config["text_config"]["pad_token_id"] = config["pad_token_id"] = PAD_ID
    return config


def qwen_hf_config(
    quick: bool, text_layers: int | None = None, vision_layers: int | None = None
) -> dict:
    """``Qwen2_5_VLConfig`` fields: Qwen2.5-VL-3B's widths, ``text_layers`` text layers and
    ``vision_layers`` vision blocks (None: :data:`QWEN_TEXT_LAYERS`, :data:`QWEN_VISION_DEPTH`
    with full attention in :data:`QWEN_FULL_ATTENTION`; else full attention in blocks 7, 15,
    ... as in the 3B, or in the last block alone below 8); ``quick``: tiny widths (a 256-token
    vocabulary, the specials at its top; 56-pixel windows)."""
    depth = QWEN_VISION_DEPTH if vision_layers is None else vision_layers
    full = QWEN_FULL_ATTENTION if vision_layers is None else list(range(7, depth, 8))
    text = QWEN2_5_VL_3B_TEXT | {
        "num_hidden_layers": QWEN_TEXT_LAYERS if text_layers is None else text_layers
    }
    vision = QWEN2_5_VL_3B_VISION | {"depth": depth, "fullatt_block_indexes": full or [depth - 1]}
    ids = dict(QWEN2_5_VL_IDS)
    if quick:
        text |= {"vocab_size": 256, "hidden_size": 32, "intermediate_size": 64}
        text |= {"num_attention_heads": 4, "num_key_value_heads": 2}
        text["rope_parameters"] = text["rope_parameters"] | {"mrope_section": [2, 1, 1]}
        vision |= {"hidden_size": 16, "intermediate_size": 24, "num_heads": 2}
        vision |= {"out_hidden_size": 32, "window_size": 56}
        ids = {key: 250 + i for i, key in enumerate(ids)}  # 250 ... 254
    im_end = qwen_chat_ids({"text_config": text})[1]
    text |= {"pad_token_id": ids["pad_token_id"], "eos_token_id": im_end}
    text["bos_token_id"] = None if quick else QWEN2_5_VL_IDS["pad_token_id"]  # as published
    return {
        "text_config": text,
        "vision_config": vision,
        **ids,
        "tie_word_embeddings": True,
    }


def qwen3_5_hf_config(
    quick: bool, text_layers: int | None = None, vision_layers: int | None = None
) -> dict:
    """``Qwen3_5Config`` fields: Qwen3.5-0.8B's widths with :data:`QWEN3_5_VOCAB` ids and
    ``text_layers`` text layers (None: :data:`QWEN3_5_LAYER_TYPES`; else that pattern repeated
    and cut, every fourth full attention as in the 0.8B) and ``vision_layers`` vision blocks
    (None: :data:`QWEN3_5_VISION_DEPTH`), a tied output layer; the special ids at the top of
    the vocabulary (:func:`qwen3_5_special_ids`); ``quick``: tiny widths and 256 ids."""
    count = len(QWEN3_5_LAYER_TYPES) if text_layers is None else text_layers
    vocab = 256 if quick else QWEN3_5_VOCAB
    text = QWEN3_5_0_8B_TEXT | {
        "vocab_size": vocab,
        "num_hidden_layers": count,
        "layer_types": [QWEN3_5_LAYER_TYPES[i % 4] for i in range(count)],
    }
    depth = QWEN3_5_VISION_DEPTH if vision_layers is None else vision_layers
    vision = QWEN3_5_0_8B_VISION | {"depth": depth}
    if quick:
        text |= {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4}
        text |= {"head_dim": 32, "linear_num_key_heads": 2, "linear_num_value_heads": 4}
        text |= {"linear_key_head_dim": 8, "linear_value_head_dim": 8}
        text["rope_parameters"] = text["rope_parameters"] | {"mrope_section": [2, 1, 1]}
        vision |= {"hidden_size": 16, "intermediate_size": 32, "num_heads": 2}
        vision |= {"out_hidden_size": 32, "num_position_embeddings": 16}
    ids = qwen3_5_special_ids(vocab)
    im_end = ids.pop("im_end")
    ids.pop("im_start")
    text |= {"pad_token_id": ids["pad_token_id"], "eos_token_id": im_end}
    return {
        "text_config": text,
        "vision_config": vision,
        **{k: v for k, v in ids.items() if k != "pad_token_id"},
        "pad_token_id": ids["pad_token_id"],
        "tie_word_embeddings": True,
    }


def qwen3_5_special_ids(vocab: int) -> dict[str, int]:
    """The Qwen3.5 samples' special ids in a ``vocab``-id vocabulary, its top seven (the
    ``--quick`` Qwen2.5-VL layout: image, video, vision start and end, padding, then
    ``<|im_start|>`` last and ``<|im_end|>`` below them); text ids stay below all seven."""
    names = ("image_token_id", "video_token_id", "vision_start_token_id")
    names += ("vision_end_token_id", "pad_token_id")
    ids = {name: vocab - 6 + i for i, name in enumerate(names)}
    return ids | {"im_start": vocab - 1, "im_end": vocab - 7}


def is_qwen3_5(config: dict) -> bool:
    return "layer_types" in config["text_config"]


def qwen_chat_ids(config: dict) -> tuple[int, int]:
    """``<|im_start|>`` and ``<|im_end|>`` (the tiny vocabulary's 255 and 249 for
    ``--quick``; Qwen3.5's: :func:`qwen3_5_special_ids`)."""
    vocab = config["text_config"]["vocab_size"]
    if vocab == QWEN2_5_VL_3B_TEXT["vocab_size"]:
        return QWEN_IM_START, QWEN_IM_END
    return vocab - 1, vocab - 7


def is_qwen(config: dict) -> bool:
    return "vision_start_token_id" in config


def pad_id(config: dict) -> int:
    return config["pad_token_id"]


def image_rows(config: dict) -> int:
    """SmolVLM's rows per image (Qwen2.5-VL's vary: see the samples' grids)."""
    vision = config["vision_config"]
    return (vision["image_size"] // vision["patch_size"] // config["scale_factor"]) ** 2


def answer_length(generator: torch.Generator, quick: bool) -> int:
    """10-400 tokens: 40% 10-100, 30% 100-250, 30% 250-400 (``--quick``: a tenth)."""
    u = float(torch.rand((), generator=generator))
    low, high = (10, 100) if u < 0.4 else (100, 250) if u < 0.7 else (250, 400)
    length = int(torch.randint(low, high + 1, (), generator=generator))
    return max(length // 10, 2) if quick else length


def make_samples(
    count: int, config: dict, seed: int, quick: bool, max_image: int | None = None
) -> list[Sample]:
    """``count`` samples of the fixed-seed length mix (see the module docstring); Qwen2.5-VL's
    images up to ``max_image`` pixels a side (None: :data:`QWEN_MAX_IMAGE`)."""
    if is_qwen(config):
        return make_qwen_samples(count, config, seed, quick, max_image)
    generator = torch.Generator().manual_seed(seed)
    image_id, vocab = config["image_token_id"], config["text_config"]["vocab_size"]
    rows, size = image_rows(config), config["vision_config"]["image_size"]
    samples: list[Sample] = []
    for _ in range(count):
        question = int(torch.randint(8, 41, (), generator=generator))
        answer = answer_length(generator, quick)
        text = torch.randint(
            100, min(image_id, FAKE_ID) - 1, (question + answer,), generator=generator
        )
        prompt = [
            BOS_ID,
            FAKE_ID,
            GLOBAL_ID,
            *[image_id] * rows,
            FAKE_ID,
            *text[:question].tolist(),
        ]
        tokens = torch.tensor([*prompt, *text[question:].tolist(), END_ID], dtype=torch.int64)
        assert int(tokens.max()) < vocab
        labels = torch.full_like(tokens, IGNORE_INDEX)
        start = len(prompt)  # the first answer token: predicted at position start - 1
        labels[start - 1 : -1] = tokens[start:]
        pixels = torch.randn(1, 3, size, size, generator=generator)
        samples.append(Sample(tokens, labels, pixels, source=f"synthetic:{len(samples)}"))
    return samples


def make_qwen_samples(
    count: int, config: dict, seed: int, quick: bool, max_image: int | None = None
) -> list[Sample]:
    """Qwen2.5-VL samples: ``<|im_start|>``, the image (``<|vision_start|>``, its rows,
    ``<|vision_end|>``), the question, ``<|im_end|>``, ``<|im_start|>``, the answer and
    ``<|im_end|>``. Each image is ``h x w`` patches, h and w drawn from 16 (224 pixels) to
    ``max_image`` pixels' patches (default :data:`QWEN_MAX_IMAGE`: 32; 1024 pixels: 72), even
    so the 2 x 2 merge divides them (``--quick``: 4 to 8), its patches random values."""
    generator = torch.Generator().manual_seed(seed)
    vision, vocab = config["vision_config"], config["text_config"]["vocab_size"]
    merge, patch = vision["spatial_merge_size"], vision["patch_size"]
    patch_dim = 3 * vision["temporal_patch_size"] * patch**2
    image_id = config["image_token_id"]
    start_id, end_id = config["vision_start_token_id"], config["vision_end_token_id"]
    im_start, im_end = qwen_chat_ids(config)
    largest = (QWEN_MAX_IMAGE if max_image is None else max_image) // patch // merge * merge
    sides = list(range(4, 9, 2) if quick else range(16, max(largest, 16) + 1, 2))
    text_high = 240 if quick else QWEN2_5_VL_IDS["pad_token_id"]  # below every special id
    if is_qwen3_5(config) and not quick:
        text_high = vocab - 7
    samples: list[Sample] = []
    for _ in range(count):
        h, w = (sides[int(torch.randint(len(sides), (), generator=generator))] for _ in "hw")
        rows = h * w // merge**2
        question = int(torch.randint(8, 41, (), generator=generator))
        answer = answer_length(generator, quick)
        text = torch.randint(3, text_high, (question + answer,), generator=generator)
        prompt = [im_start, start_id, *[image_id] * rows, end_id, *text[:question].tolist()]
        prompt += [im_end, im_start]
        tokens = torch.tensor([*prompt, *text[question:].tolist(), im_end], dtype=torch.int64)
        assert int(tokens.max()) < vocab
        labels = torch.full_like(tokens, IGNORE_INDEX)
        labels[len(prompt) - 1 : -1] = tokens[len(prompt) :]
        pixels = torch.randn(h * w, patch_dim, generator=generator)
        grid = torch.tensor([[1, h, w]], dtype=torch.int64)
        source = f"synthetic:{len(samples)}"
        samples.append(Sample(tokens, labels, pixels, source=source, image_grid_thw=grid))
    return samples


def cut_answer(sample: Sample, answer_tokens: int) -> Sample:
    """``sample`` with its answer cut to its first ``answer_tokens`` tokens (the image and the
    question kept; the last kept token has no target)."""
    first_target = int((sample.labels != IGNORE_INDEX).nonzero()[0])
    end = min(first_target + 1 + answer_tokens, len(sample))
    labels = sample.labels[:end].clone()
    labels[-1] = IGNORE_INDEX
    return Sample(
        sample.tokens[:end],
        labels,
        sample.pixel_values,
        source=sample.source,
        truncated=end < len(sample),
        image_grid_thw=sample.image_grid_thw,
    )


def step_samples(args: argparse.Namespace, config: dict) -> list[list[Sample]]:
    """The warm-up step's samples (2; ``--short-warmup``: the first, its answer cut to
    :data:`SHORT_WARMUP_ANSWER` tokens), then each timed step's (the same either way)."""
    n = args.samples_per_step
    samples = make_samples(
        2 + n * args.steps, config, args.seed, args.quick, getattr(args, "max_image", None)
    )
    warmup = samples[:2]
    if args.short_warmup:
        warmup = [cut_answer(samples[0], SHORT_WARMUP_ANSWER)]
    return [warmup] + [samples[2 + i * n : 2 + (i + 1) * n] for i in range(args.steps)]


# ---------------------------------------------------------------------- contestants


def gemm_shapes(family: str, quick: bool) -> tuple[tuple[int, int, int], ...]:
    """:data:`GEMM_SHAPES`' shapes of ``family``; ``quick``: an eighth of each size."""
    shapes = GEMM_SHAPES[family]
    return tuple((m // 8, k // 8, n // 8) for m, k, n in shapes) if quick else shapes


def gemm_gflops(calls: int, shapes: tuple[tuple[int, int, int], ...]) -> dict[str, float]:
    """The best rate (GFLOP/s) of each fp32 matrix product shape over ``calls`` timed calls,
    after one untimed."""
    rates = {}
    for m, k, n in shapes:
        a, b = torch.randn(m, k), torch.randn(k, n)
        out = torch.empty(m, n)
        torch.mm(a, b, out=out)  # warm-up
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            torch.mm(a, b, out=out)
            times.append(time.perf_counter() - start)
        rates[f"{m}x{k}x{n}"] = 2 * m * k * n / min(times) / 1e9
    return rates


def cpu_seconds() -> float:
    """CPU time of this process so far, every thread, user and system, and of its live child
    processes (fusion's data loader worker; Linux: ``/proc/<pid>/stat``)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    total = usage.ru_utime + usage.ru_stime
    for child in multiprocessing.active_children():
        try:
            fields = Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone, or not Linux
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
    return total


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def peak_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class StepSettings:
    """What a contestant's step needs besides the model and the samples."""

    device: torch.device
    pad: int  # the pad id of padded batches
    max_seq_len: int  # the most tokens per packed row
    feed: Iterator[MicroBatch] | None = None  # fusion's micro-batches, step by step
    loss: str = "chunked"  # fusion's loss (--loss)
    loss_chunk_rows: int | None = None  # the most rows a chunk projects (None: the library's)
    defer_output_grad: bool = False  # the fused loss's output gradient after the backward


#: A contestant's training step: (model, the step's samples, settings) -> (the step's loss, a
#: 0-d tensor left on the device; the positions computed). It runs the forward and backward
#: passes (the caller steps the optimizer), the loss averaged over the step's targets.
Step = Callable[[torch.nn.Module, list[Sample], StepSettings], tuple[torch.Tensor, int]]


def hf_labels(sample: Sample) -> torch.Tensor:
    """int64 [s]: ``sample``'s targets as transformers takes ``labels`` (it shifts them itself:
    the label at position i is the target of position i - 1), -100 at position 0, so that in a
    packed row the previous sample's last position predicts nothing."""
    return torch.cat([torch.tensor([IGNORE_INDEX]), sample.labels[:-1]])


def hf_padded_inputs(model, samples: list[Sample], settings: StepSettings) -> dict:
    """Keyword arguments of transformers' model for ``samples`` as one right-padded batch
    ([b, s]: ``input_ids``, ``attention_mask``, ``labels``; the images), on the device."""
    device = settings.device
    batch = collate_padded(samples, pad_id=settings.pad)
    labels = torch.full_like(batch.labels, IGNORE_INDEX)
    labels[:, 1:] = batch.labels[:, :-1]  # transformers shifts labels itself
    attention = torch.zeros_like(batch.tokens)
    for row, sample in enumerate(samples):
        attention[row, : len(sample)] = 1
    images = batch.encoder_input["image"]
    if "image_grid_thw" in images:  # Qwen2.5-VL: patches, grids, placeholders for M-RoPE
        image_id = model.config.image_token_id
        inputs = {
            "pixel_values": images["pixel_values"].to(device),
            "image_grid_thw": images["image_grid_thw"].to(device),
            "mm_token_type_ids": (batch.tokens == image_id).to(torch.int32).to(device),
            "use_cache": False,
        }
    else:
        pixels = torch.cat([s.pixel_values for s in samples])[:, None]  # [b, 1 image, 3, h, w]
        inputs = {"pixel_values": pixels.to(device)}
    return inputs | {
        "input_ids": batch.tokens.to(device),
        "attention_mask": attention.to(device),
        "labels": labels.to(device),
    }


def hf_padding_free_inputs(model, samples: list[Sample], settings: StepSettings) -> dict:
    """Keyword arguments of transformers' model for ``samples`` concatenated into one row
    ([1, s], s their total length): ``input_ids``, ``labels`` (:func:`hf_labels`),
    ``position_ids`` restarting at 0 per sample, the images; no ``attention_mask`` and
    ``use_cache=False``, which is what transformers' packed-sequence detection needs (it runs
    only without a mask and without a cache). Qwen2.5-VL: ``position_ids`` [4, 1, s], the text
    positions restarting per sample, then each sample's M-RoPE positions (``get_rope_index`` of
    the sample alone), as its text model reads packed rows."""
    device = settings.device
    tokens = torch.cat([s.tokens for s in samples])[None]
    labels = torch.cat([hf_labels(s) for s in samples])[None]
    positions = torch.cat([torch.arange(len(s)) for s in samples])[None]
    inputs: dict = {"use_cache": False}
    if getattr(model.config, "vision_start_token_id", None) is not None:  # Qwen2.5-VL
        image_id = model.config.image_token_id
        rope = [
            model.model.get_rope_index(
                s.tokens[None],
                mm_token_type_ids=(s.tokens == image_id).to(torch.int32)[None],
                image_grid_thw=s.image_grid_thw,
            )[0]
            for s in samples
        ]  # each [3, 1, len(s)]
        positions = torch.cat([positions[None], torch.cat(rope, dim=-1)])  # [4, 1, s]
        inputs["pixel_values"] = torch.cat([s.pixel_values for s in samples]).to(device)
        grids = torch.cat([s.image_grid_thw for s in samples])
        inputs["image_grid_thw"] = grids.to(device)
    else:
        pixels = torch.cat([s.pixel_values for s in samples])[None]  # [1, images, 3, h, w]
        inputs["pixel_values"] = pixels.to(device)
    return inputs | {
        "input_ids": tokens.to(device),
        "labels": labels.to(device),
        "position_ids": positions.to(device),
    }


def transformers_padded_step(
    model, samples: list[Sample], settings: StepSettings
) -> tuple[torch.Tensor, int]:
    """One padded batch through transformers' model and its own loss."""
    inputs = hf_padded_inputs(model, samples, settings)
    out = model(**inputs)
    with record_function("backward"):
        out.loss.backward()
    return out.loss.detach(), inputs["input_ids"].numel()


def transformers_padding_free_step(
    model, samples: list[Sample], settings: StepSettings
) -> tuple[torch.Tensor, int]:
    """The step's samples in the rows ``fusion_packed`` gets, each row one padding-free
    forward/backward (:func:`hf_padding_free_inputs`) whose loss is its targets' sum divided
    by the step's target count (``num_items_in_batch``), so the gradients are one batch's."""
    targets = sum(sample.num_targets for sample in samples)
    total, positions = torch.zeros((), device=settings.device), 0
    for row in pack_samples(samples, settings.max_seq_len):
        inputs = hf_padding_free_inputs(model, row, settings)
        out = model(**inputs, num_items_in_batch=targets)
        with record_function("backward"):
            out.loss.backward()
        total += out.loss.detach()
        positions += inputs["input_ids"].numel()
    return total, positions


def fusion_step(model, samples: list[Sample], settings: StepSettings) -> tuple[torch.Tensor, int]:
    """The fine-tuning recipe's step: its micro-batch from its data loader (``settings.feed``,
    :class:`fusion.data.MicroBatches` over :class:`fusion.data.StepBatches`, one worker
    process making the next step's batch: packed rows with sample boundaries, or padded), the
    model's hidden states and :func:`fusion.chunked_token_loss` at the targets only, divided by
    the step's target count."""
    assert settings.feed is not None
    item = next(settings.feed)
    assert item.batch is not None and item.tokens == sum(len(s) for s in samples)
    batch = item.batch
    loss = fusion_loss(model, batch, sum(sample.num_targets for sample in samples), settings)
    with record_function("backward"):
        loss.backward()
    return loss.detach(), batch.tokens.numel()


def fusion_loss(model, batch, targets: int, settings: StepSettings) -> torch.Tensor:
    """The forward pass of :func:`fusion_step`: ``batch``'s loss over the step's ``targets``
    (``settings.loss``: the chunked or the fused token loss)."""
    hidden = model(**batch.model_inputs())
    rows = settings.loss_chunk_rows
    chunk = {} if rows is None else {"chunk_size": rows}  # None: the library's default
    with record_function("loss"):
        if settings.loss == "fused":
            loss_sum, _ = fused_token_loss(
                hidden, batch.labels, model.decoder.unembed, grad_scale=1 / targets,
                num_targets=batch.num_targets, defer_output_grad=settings.defer_output_grad,
                **chunk,
            )  # fmt: skip
        else:
            loss_sum, _ = chunked_token_loss(
                hidden, batch.labels, model.decoder.unembed, num_targets=batch.num_targets,
                **chunk,
            )  # fmt: skip
        return loss_sum / targets


def fusion_feed(steps: list[list[Sample]], settings: StepSettings, packing: bool) -> "MicroBatches":
    """The recipe's loader over the run's steps (warm-up included), one micro-batch each."""
    samples = [sample for step in steps for sample in step]
    bounds = [0, *itertools.accumulate(len(step) for step in steps)]
    indices = [list(range(a, b)) for a, b in itertools.pairwise(bounds)]
    collate = Collate(settings.pad, settings.max_seq_len, packing)
    return MicroBatches(
        StepBatches(samples, indices, collate), num_workers=1, device=settings.device
    )


#: Each contestant's step, one function each (what changes when a contestant's path does).
STEPS: dict[str, Step] = {
    "transformers_padded": transformers_padded_step,
    "transformers_padding_free": transformers_padding_free_step,
    "fusion_padded": fusion_step,
    "fusion_packed": fusion_step,
}


def padding_free_losses(model, samples: list[Sample], settings: StepSettings) -> dict:
    """transformers' padding-free loss against its padded one on ``samples`` (no gradients,
    the same weights; the padding-free rows as ``transformers_padding_free`` makes them:
    :func:`~fusion.data.pack_samples` into rows of at most ``settings.max_seq_len``, each
    row's summed loss over the samples' target count): a packed row whose samples attended to
    each other, or a sample that predicted the next one's first token, would move the loss.
    ``agree``: within :data:`SAME_WEIGHTS_TOLERANCE`."""
    tolerance = SAME_WEIGHTS_TOLERANCE[settings.device.type]
    targets = sum(sample.num_targets for sample in samples)
    with torch.no_grad():
        padded = float(model(**hf_padded_inputs(model, samples, settings)).loss)
        free = sum(
            float(
                model(
                    **hf_padding_free_inputs(model, row, settings), num_items_in_batch=targets
                ).loss
            )
            for row in pack_samples(samples, settings.max_seq_len)
        )
    difference = abs(free - padded) / abs(padded)
    return {
        "samples": len(samples),
        "padded_loss": padded,
        "padding_free_loss": free,
        "relative_difference": difference,
        "tolerance": tolerance,
        "agree": difference <= tolerance,
    }


def padding_free_per_sample(model, samples: list[Sample], settings: StepSettings) -> dict:
    """:func:`padding_free_losses` sample by sample (Qwen3.5's untimed check): each sample's
    summed cross-entropy over its targets and its logits, from transformers' padded batch and
    from its padding-free rows (no gradients, the same weights). A row's first sample has no
    sample before it, so its difference is the arithmetic's noise; a state carried across a
    boundary shows in the samples after it. ``agree``: the step's loss and every sample's
    within :data:`SAME_WEIGHTS_TOLERANCE` (relative)."""
    tolerance = SAME_WEIGHTS_TOLERANCE[settings.device.type]
    targets = sum(sample.num_targets for sample in samples)

    def losses(logits: torch.Tensor, sample: Sample) -> float:
        return float(
            torch.nn.functional.cross_entropy(
                logits.float(), sample.labels.to(logits.device), reduction="sum"
            )
        )

    padded, free, logit_diffs, first_in_row = [], [], [], []
    with torch.no_grad():
        inputs = hf_padded_inputs(model, samples, settings)
        inputs.pop("labels")
        logits = model(**inputs).logits
        padded_logits = [logits[i, : len(s)] for i, s in enumerate(samples)]
        by_source = {s.source: i for i, s in enumerate(samples)}
        free_logits: list = [None] * len(samples)
        for row in pack_samples(samples, settings.max_seq_len):
            inputs = hf_padding_free_inputs(model, row, settings)
            inputs.pop("labels")
            row_logits, offset = model(**inputs).logits[0], 0
            for k, sample in enumerate(row):
                free_logits[by_source[sample.source]] = row_logits[offset : offset + len(sample)]
                first_in_row.append(k == 0)
                offset += len(sample)
        for sample, a, b in zip(samples, padded_logits, free_logits, strict=True):
            padded.append(losses(a, sample))
            free.append(losses(b, sample))
            logit_diffs.append(float((a - b).abs().max() / a.abs().max()))
    per_sample = [abs(f - p) / abs(p) for f, p in zip(free, padded, strict=True)]
    step_padded, step_free = sum(padded) / targets, sum(free) / targets
    difference = abs(step_free - step_padded) / abs(step_padded)
    return {
        "samples": len(samples),
        "padded_loss": step_padded,
        "padding_free_loss": step_free,
        "relative_difference": difference,
        "tolerance": tolerance,
        "per_sample_relative_difference": per_sample,
        "per_sample_logits_relative_difference": logit_diffs,
        "first_in_row": first_in_row,
        "agree": difference <= tolerance and max(per_sample) <= tolerance,
    }


def check_padding_free(model, samples: list[Sample], settings: StepSettings) -> dict:
    """:func:`padding_free_losses`, raising RuntimeError with both losses when they differ by
    more than :data:`SAME_WEIGHTS_TOLERANCE`."""
    check = padding_free_losses(model, samples, settings)
    if not check.pop("agree"):
        raise RuntimeError(
            f"transformers_padding_free: on the same weights and {len(samples)} samples its "
            f"loss {check['padding_free_loss']:.8f} differs from transformers_padded's "
            f"{check['padded_loss']:.8f} (relative {check['relative_difference']:.2e} > "
            f"{check['tolerance']:.0e}): transformers did not keep the packed samples apart"
        )
    return check


def load_contestant(args: argparse.Namespace, device: torch.device):
    """The contestant's model, loaded from ``--model-dir``; the modules that stay frozen and,
    inside them, those that train (Qwen2.5-VL's merger)."""
    qwen = args.family in ("qwen2_5_vl", "qwen3_5")
    if args.worker.startswith("transformers_"):
        from transformers import (
            Idefics3ForConditionalGeneration,
            Qwen2_5_VLForConditionalGeneration,
            Qwen3_5ForConditionalGeneration,
        )

        cls: Any = {
            "qwen2_5_vl": Qwen2_5_VLForConditionalGeneration,
            "qwen3_5": Qwen3_5ForConditionalGeneration,
        }.get(args.family, Idefics3ForConditionalGeneration)
        model = cls.from_pretrained(
            args.model_dir, dtype=torch.float32, attn_implementation="sdpa"
        ).to(device)
        if qwen:
            return model, model.model.visual, model.model.visual.merger
        return model, model.model.vision_model, None
    if args.family == "qwen3_5":
        from fusion.checkpoint import load_hf_model

        model = load_hf_model(args.model_dir, device=device)
        return model, model.encoders["image"], model.encoders["image"].merger
    if qwen:
        from fusion.checkpoint import load_hf_vlm

        model = load_hf_vlm(args.model_dir, device=device)
        return model, model.encoders["image"], model.encoders["image"].merger
    from fusion.checkpoint import load_hf_idefics3

    model = load_hf_idefics3(args.model_dir, device=device)
    return model, model.encoders["image"].vision_model, None


def set_trainable(
    args: argparse.Namespace, model, tower, trained_in_tower
) -> list[torch.nn.Parameter]:
    """Train mode and what trains (``--train``): everything but the vision ``tower`` (its
    ``trained_in_tower`` part does), or LoRA adapters alone; the trained parameters."""
    model.train()
    for param in model.parameters():
        param.requires_grad_(True)
    for param in tower.parameters():
        param.requires_grad_(False)
    if trained_in_tower is not None:
        for param in trained_in_tower.parameters():
            param.requires_grad_(True)
    if args.train == "lora":
        add_lora(args.worker, model, args.seed)
    return [p for p in model.parameters() if p.requires_grad]


def add_lora(worker: str, model, seed: int) -> None:
    """``--train lora``: rank-:data:`LORA_RANK` adapters on the decoder's q and v projections,
    everything else frozen; fusion's ``apply_lora``, transformers' peft (its layers, in place:
    the model class unchanged). Both start with B = 0, so the first loss is the base model's."""
    torch.manual_seed(seed)
    if worker.startswith("fusion_"):
        from fusion.lora import apply_lora

        apply_lora(model, ("q_proj", "v_proj"), rank=LORA_RANK, alpha=LORA_ALPHA)
        return
    from peft import LoraConfig, inject_adapter_in_model

    config = LoraConfig(
        r=LORA_RANK,
        lora_alpha=LORA_ALPHA,
        target_modules=r".*language_model.*\.(q_proj|v_proj)",
        lora_dropout=0.0,
    )
    inject_adapter_in_model(config, model)
    for name, param in model.named_parameters():
        param.requires_grad_("lora_" in name)


def profiled_modules(worker: str, model, tower) -> dict[str, torch.nn.Module]:
    """The modules whose forward is a --profile range: the vision tower, the decoder and (for
    transformers, whose cross-entropy is inside its forward) the output layer as "loss"."""
    if worker.startswith("fusion_"):
        return {"vision_tower": tower, "decoder": model.decoder}
    inner = model.model
    decoder = getattr(inner, "language_model", None) or getattr(inner, "text_model", None)
    return {"vision_tower": tower, "decoder": decoder, "loss": model.lm_head}


def profile_ranges(modules: dict[str, torch.nn.Module]) -> None:
    """A ``record_function`` range around each module's forward, by forward hooks."""
    for name, module in modules.items():
        active: list = []
        module.register_forward_pre_hook(
            lambda *_, name=name, active=active: active.append(record_function(name).__enter__())
        )
        module.register_forward_hook(
            lambda *_, active=active: active.pop().__exit__(None, None, None)
        )


def profile_seconds(profiler) -> dict[str, float]:
    """Seconds per :data:`PROFILE_RANGES` range over the timed steps (CPU time of the range's
    own thread, its children included)."""
    totals = {event.key: event.cpu_time_total / 1e6 for event in profiler.key_averages()}
    return {name: totals.get(name, 0.0) for name in PROFILE_RANGES}


def run_worker(args: argparse.Namespace) -> None:
    """One contestant, in this process: load, train, write the measurements to ``--result``."""
    load_start = os.getloadavg()
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    config = hf_config(args.quick, args.family, args.text_layers, args.vision_layers)
    settings = StepSettings(device, pad_id(config), args.max_seq_len)
    steps = step_samples(args, config)
    model, tower, trained_in_tower = load_contestant(args, device)
    if args.check_only:  # Qwen3.5's padding-free check: the first timed step, the initial weights
        model.eval()
        check = padding_free_per_sample(model, steps[1], settings)
        args.result.write_text(json.dumps(check | {"peak_memory_bytes": peak_bytes(device)}))
        return
    step = STEPS[args.worker]
    trainable = set_trainable(args, model, tower, trained_in_tower)
    if args.worker.startswith("fusion_") and args.release_freed_memory:
        release_freed_memory(model)
    # Fused: the recipe's AdamW (fusion.training.adamw_warmup_cosine) and the Hugging Face
    # Trainer's default (optim="adamw_torch_fused" for torch >= 2.8), for every contestant.
    optimizer = torch.optim.AdamW(trainable, lr=LR, fused=True)
    loaded = rss_bytes()
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    checks = {}
    if args.worker == "transformers_padding_free":
        # Before any update, on two samples (at least one boundary; a small forward, which
        # stays below the training steps' peak memory).
        with autocast:
            checks["same_weights_check"] = check_padding_free(model, steps[1][:2], settings)
    times, cpu_times, losses, positions = [], [], [], []
    stack = ExitStack()
    settings = dataclasses.replace(
        settings, loss=args.loss, loss_chunk_rows=args.loss_chunk_rows,
        defer_output_grad=args.defer_output_grad,
    )  # fmt: skip
    if args.worker.startswith("fusion_"):
        model.skip_output_layer = True  # hidden states for the chunked loss
        feed = stack.enter_context(fusion_feed(steps, settings, args.worker == "fusion_packed"))
        settings = dataclasses.replace(settings, feed=feed)
    profiler = None
    if args.profile:
        profile_ranges(profiled_modules(args.worker, model, tower))
    for i, samples in enumerate(steps):
        if i == 1 and args.profile:  # the timed steps, under the profiler
            profiler = stack.enter_context(
                torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            )
        sync(device)
        start, cpu_start = time.perf_counter(), cpu_seconds()
        with autocast:
            loss, computed = step(model, samples, settings)
        with record_function("optimizer"):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        sync(device)
        if i:  # step 0 is the warm-up
            times.append(time.perf_counter() - start)
            cpu_times.append(cpu_seconds() - cpu_start)
            losses.append(float(loss))
            positions.append(computed)
    stack.close()
    tokens = [sum(len(s) for s in samples) for samples in steps[1:]]
    result = {
        "step_s": times,
        "step_cpu_s": cpu_times,
        "losses": losses,
        "tokens": tokens,
        "positions": positions,
        "tokens_per_s": sum(tokens) / sum(times),
        "tokens_per_cpu_s": sum(tokens) / sum(cpu_times),
        "padding_fraction": 1 - sum(tokens) / sum(positions),
        "peak_memory_bytes": peak_bytes(device),
        "rss_after_load_bytes": loaded,
        "trainable_parameters": sum(p.numel() for p in trainable),
        "profile_s": None if profiler is None else profile_seconds(profiler),
        "load_average_start": load_start,
        "load_average_end": os.getloadavg(),
        "thp_mem_alloc_enable": os.environ.get("THP_MEM_ALLOC_ENABLE"),
        **checks,
    }
    args.result.write_text(json.dumps(result))


# ---------------------------------------------------------------------- the run


def run_contestant(
    args: argparse.Namespace, name: str, workdir: Path, check_only: bool = False
) -> dict:
    """Run contestant ``name`` in a fresh process (in this one for ``--quick``, where the
    peak memory is then the whole run's so far); its measurements. ``check_only``: its
    padding-free check alone (:func:`padding_free_losses`; no training)."""
    result_file = workdir / f"{name}{'_check' * check_only}.json"
    if args.quick:
        worker = argparse.Namespace(**vars(args))
        worker.worker, worker.model_dir, worker.result = name, workdir / "model", result_file
        worker.check_only = check_only
        run_worker(worker)
        return json.loads(result_file.read_text())
    command = [sys.executable, __file__, "--worker", name, "--model-dir", str(workdir / "model")]
    command += ["--check-only"] if check_only else []
    command += ["--result", str(result_file), "--device", args.device]
    command += ["--threads", str(args.threads), "--seed", str(args.seed)]
    command += ["--samples-per-step", str(args.samples_per_step), "--family", args.family]
    command += ["--steps", str(args.steps), "--max-seq-len", str(args.max_seq_len)]
    for option in ("text_layers", "vision_layers"):
        if getattr(args, option) is not None:
            command += [f"--{option.replace('_', '-')}", str(getattr(args, option))]
    command += ["--short-warmup"] if args.short_warmup else []
    command += ["--train", args.train, "--loss", args.loss]
    if args.loss_chunk_rows is not None:
        command += ["--loss-chunk-rows", str(args.loss_chunk_rows)]
    command += ["--defer-output-grad"] if args.defer_output_grad else []
    release = args.release_freed_memory
    command += ["--release-freed-memory" if release else "--no-release-freed-memory"]
    command += [] if args.max_image is None else ["--max-image", str(args.max_image)]
    command += ["--profile"] if args.profile else []
    limit = args.memory_limit_gib
    done = subprocess.run(
        command,
        capture_output=True,
        text=True,
        check=False,
        env=contestant_env(args),
        preexec_fn=None if limit is None else memory_cap(int(limit * 2**30)),
    )
    if done.returncode:
        detail = out_of_memory(done.returncode, done.stderr)
        if detail is not None:
            return {"out_of_memory": detail}
        raise RuntimeError(f"{name} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return json.loads(result_file.read_text())


def contestant_env(args: argparse.Namespace) -> dict[str, str]:
    """The environment of every process the run starts: this one's, with
    ``THP_MEM_ALLOC_ENABLE=1`` under ``--transparent-huge-pages``."""
    huge_pages = {"THP_MEM_ALLOC_ENABLE": "1"} if args.transparent_huge_pages else {}
    return dict(os.environ) | huge_pages


def matrix_rate(args: argparse.Namespace, workdir: Path) -> dict[str, float]:
    """:func:`gemm_gflops` of the family's shapes in a fresh process (in this one for
    ``--quick``) with the contestants' threads: the machine's rate in the run's own minutes,
    which ``finetune_floor.py`` sets each contestant's time floor at."""
    result_file = workdir / "matrix_rate.json"
    if args.quick:
        return own_matrix_rate(args)
    command = [sys.executable, __file__, "--rate-only", "--family", args.family]
    command += ["--threads", str(args.threads), "--result", str(result_file)]
    done = subprocess.run(command, capture_output=True, text=True, env=contestant_env(args))
    if done.returncode:
        raise RuntimeError(f"the matrix-rate process failed:\n{done.stderr[-3000:]}")
    return json.loads(result_file.read_text())


def own_matrix_rate(args: argparse.Namespace) -> dict[str, float]:
    """:func:`matrix_rate`'s measurement, in this process."""
    torch.set_num_threads(args.threads)
    return gemm_gflops(RATE_CALLS, gemm_shapes(args.family, args.quick))


def memory_cap(limit_bytes: int) -> Callable[[], None]:
    """What a child process runs before it starts: its address space capped at
    ``limit_bytes``, so that an allocation past it fails in the child (torch: "can't allocate
    memory") rather than the kernel killing whichever process it picks."""

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit_bytes, limit_bytes))

    return cap


#: What a contestant's process says when an allocation fails (torch's CPU allocator, Python).
OUT_OF_MEMORY_MESSAGES = ("can't allocate memory", "MemoryError", "std::bad_alloc")


def out_of_memory(returncode: int, stderr: str) -> str | None:
    """Why a failed contestant ran out of memory (the kernel killed it, or an allocation
    failed under ``--memory-limit-gib``), or None if it failed otherwise."""
    if returncode == -signal.SIGKILL:
        return "killed by the kernel (SIGKILL: the OOM killer)"
    lines = [line for line in stderr.splitlines() if any(m in line for m in OUT_OF_MEMORY_MESSAGES)]
    return lines[-1].strip()[:300] if lines else None


def save_model(family: str, config: dict, directory: Path) -> None:
    """Random weights of the family's transformers class, written with ``save_pretrained``."""
    import transformers

    if family == "qwen2_5_vl":
        config_class: Any = transformers.Qwen2_5_VLConfig
        model_class: Any = transformers.Qwen2_5_VLForConditionalGeneration
    elif family == "qwen3_5":
        config_class = transformers.Qwen3_5Config
        model_class = transformers.Qwen3_5ForConditionalGeneration
    else:
        config_class, model_class = (
            transformers.Idefics3Config,
            transformers.Idefics3ForConditionalGeneration,
        )
    model_class(config_class(**config)).save_pretrained(directory)


def round_order(names: list[str], round_index: int) -> list[str]:
    """The contestants' order in round ``round_index``: as given, then reversed, ..."""
    return list(names) if round_index % 2 == 0 else list(reversed(names))


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.rate_only:
        args.result.write_text(json.dumps(own_matrix_rate(args)))
        return {}
    if args.worker is not None:
        run_worker(args)
        return {}
    config = hf_config(args.quick, args.family, args.text_layers, args.vision_layers)
    info = machine(torch.device(args.device))  # the load average at the start
    workdir = Path(tempfile.mkdtemp(prefix="finetune_bench_"))
    try:
        torch.manual_seed(args.seed)
        save_model(args.family, config, workdir / "model")
        rounds: dict[str, list[dict]] = {name: [] for name in args.only}
        rates: list[dict[str, float]] = []  # CPU: each round's matrix products
        untimed = None
        if args.family == "qwen3_5":  # transformers' padding-free rows: checked, not timed
            untimed = run_contestant(args, "transformers_padding_free", workdir, check_only=True)
            print(f"transformers_padding_free (untimed check): {untimed}", flush=True)
        for r in range(args.rounds):
            for name in round_order(args.only, r):
                started = time.perf_counter()
                result = run_contestant(args, name, workdir)
                result["process_s"] = time.perf_counter() - started
                result["round"], result["order"] = r, round_order(args.only, r).index(name)
                rounds[name].append(result)
                failed = result.get("out_of_memory")
                failed = "" if failed is None else f" (out of memory: {failed})"
                print(f"round {r}: {name} done in {result['process_s']:.0f} s{failed}", flush=True)
            if args.device == "cpu":
                rates.append(matrix_rate(args, workdir))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    report = summarise(args, config, rounds, info)
    if rates:
        report["matrix_rate"] = {
            "gflops_rounds": rates,
            "best_gflops": max(rate for r in rates for rate in r.values()),
        }
    if untimed is not None:
        report["padding_free_untimed_check"] = untimed
        ratio = report["results"].get("fusion_packed", {}).get("x_transformers_tokens_per_s")
        if ratio is not None:
            report["target"] = {
                "what": "fusion_packed / transformers_padded, non-padding tokens/s (median of "
                "paired ratios)",
                "target": QWEN3_5_TARGET,
                "measured": ratio,
                "met": ratio >= QWEN3_5_TARGET,
            }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "finetune" if args.family == "smolvlm" else f"finetune_{args.family}"
    (args.out / f"{stem}.json").write_text(json.dumps(report, indent=1))
    table = format_table(report)
    (args.out / f"{stem}_{args.device}.txt").write_text(table)
    print(table, end="")
    print(f"-> {args.out / f'{stem}.json'}")
    check = report.get("padding_free_first_loss")
    if check is not None and not check["agree"]:
        # After writing the report, so that the losses of every round stay on record.
        raise SystemExit(
            "transformers_padding_free: first timed step's loss differs from "
            f"transformers_padded's beyond {check['tolerance']:.0e} (relative) in round(s) "
            f"{[i for i, r in enumerate(check['rounds']) if not r['agree']]}: {check['rounds']}"
        )
    return report


# What is summarised over rounds, and the name of its ratios (x_<baseline>_<name>).
MEASURES = {
    "tokens_per_s": "tokens_per_s",
    "tokens_per_cpu_s": "tokens_per_cpu_s",
    "peak_memory_bytes": "peak_memory",
}
#: The baselines of the paired ratios: the ratio's prefix, the baseline, who gets the ratio
#: (None: every other contestant).
BASELINES: tuple[tuple[str, str, tuple[str, ...] | None], ...] = (
    ("transformers", "transformers_padded", None),
    ("padding_free", "transformers_padding_free", ("fusion_padded", "fusion_packed")),
    ("fusion_padded", "fusion_padded", ("fusion_packed",)),
)


def combine(rounds: list[dict], baselines: dict[str, list[dict]]) -> dict:
    """One contestant's rounds -> its summary: the first round's fields, medians over rounds
    (``tokens_per_s``, ``tokens_per_cpu_s``, ``peak_memory_bytes``) with their range, every
    round, and each ratio to each of ``baselines`` (prefix -> the baseline's rounds) as the
    median over rounds of the ratio within the round (``x_<prefix>_<measure>``), with its
    rounds and range."""
    out = dict(rounds[0])
    for key in MEASURES:
        values = [r[key] for r in rounds]
        out[key] = statistics.median(values)
        out[f"{key}_rounds"] = values
        out[f"{key}_range"] = [min(values), max(values)]
    out["step_s"] = [t for r in rounds for t in r["step_s"]]
    out["step_cpu_s"] = [t for r in rounds for t in r["step_cpu_s"]]
    out["losses_rounds"] = [r["losses"] for r in rounds]
    out["load_average_rounds"] = [[r["load_average_start"], r["load_average_end"]] for r in rounds]
    out["process_s"] = [r["process_s"] for r in rounds]
    out["order_rounds"] = [r["order"] for r in rounds]  # its place in each round's order
    if "same_weights_check" in out:
        out["same_weights_check_rounds"] = [r["same_weights_check"] for r in rounds]
    out.pop("round", None)
    out.pop("order", None)
    for prefix, baseline in baselines.items():
        for key, name in MEASURES.items():
            paired = [r[key] / b[key] for r, b in zip(rounds, baseline, strict=True)]
            out[f"x_{prefix}_{name}"] = statistics.median(paired)
            out[f"x_{prefix}_{name}_rounds"] = paired
            out[f"x_{prefix}_{name}_range"] = [min(paired), max(paired)]
    return out


def padding_free_first_loss(rounds: dict, device: str) -> dict | None:
    """transformers_padding_free's first timed loss against transformers_padded's, round by
    round (same weights written once, the same warm-up and samples; fresh processes), within
    :data:`FIRST_LOSS_TOLERANCE`; None unless both ran."""
    if "transformers_padding_free" not in rounds or "transformers_padded" not in rounds:
        return None
    tolerance = FIRST_LOSS_TOLERANCE[device]
    paired = []
    for free, padded in zip(
        rounds["transformers_padding_free"], rounds["transformers_padded"], strict=True
    ):
        a, b = free["losses"][0], padded["losses"][0]
        difference = abs(a - b) / abs(b)
        paired.append(
            {
                "padding_free": a,
                "padded": b,
                "relative_difference": difference,
                "agree": difference <= tolerance,
            }
        )
    agree = all(r["agree"] for r in paired)
    return {"tolerance": tolerance, "agree": agree, "rounds": paired}


def summarise(args: argparse.Namespace, config: dict, rounds: dict, info: dict) -> dict:
    import transformers

    # A contestant out of memory in any round is reported as such, with no timings or ratios.
    out_of_memory = {
        name: {
            "rounds": [i for i, r in enumerate(runs) if "out_of_memory" in r],
            "detail": next(r["out_of_memory"] for r in runs if "out_of_memory" in r),
            "memory_limit_gib": args.memory_limit_gib,
        }
        for name, runs in rounds.items()
        if any("out_of_memory" in r for r in runs)
    }
    rounds = {name: runs for name, runs in rounds.items() if name not in out_of_memory}
    results = {}
    for name, runs in rounds.items():
        baselines = {
            prefix: rounds[baseline]
            for prefix, baseline, who in BASELINES
            if baseline in rounds and baseline != name and (who is None or name in who)
        }
        results[name] = combine(runs, baselines)
    first_losses = [losses[0] for r in results.values() for losses in r["losses_rounds"]]
    info["transformers"] = transformers.__version__
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    for key in ("worker", "model_dir", "result", "check_only"):
        settings.pop(key)
    model: dict = {"family": args.family, "config": config}
    model["text_layers"] = config["text_config"]["num_hidden_layers"]
    vision = config["vision_config"]
    model["vision_layers"] = vision.get("num_hidden_layers", vision.get("depth"))
    if args.family == "smolvlm":
        model["image_rows"] = image_rows(config)
    else:
        samples = [s for step in step_samples(args, config)[1:] for s in step]
        model["image_grids_thw"] = [s.image_grid_thw[0].tolist() for s in samples]
        merge = config["vision_config"]["spatial_merge_size"]
        model["image_rows"] = [int(s.image_grid_thw.prod()) // merge**2 for s in samples]
    return {
        "machine": info,
        "settings": settings
        | {"lr": LR, "dtype": "bfloat16 autocast" if args.device == "cuda" else "float32"},
        "model": model,
        "results": results,
        "first_step_losses_agree": not first_losses
        or max(first_losses) - min(first_losses) <= 1e-3 * max(abs(x) for x in first_losses),
        "out_of_memory": out_of_memory,
        "padding_free_first_loss": padding_free_first_loss(rounds, args.device),
        "load_average_end": os.getloadavg(),
    }


def format_table(report: dict) -> str:
    """The measurements per contestant (median [range] over rounds), then the paired ratios."""
    s, m = report["settings"], report["model"]
    shape = {
        "smolvlm": "SmolVLM-256M-shaped",
        "qwen2_5_vl": "Qwen2.5-VL-3B-wide",
        "qwen3_5": "Qwen3.5-0.8B-wide",
    }
    rounds = s["rounds"]

    def spread(r: dict, key: str, scale: float = 1.0, digits: int = 1) -> str:
        low, high = r[f"{key}_range"]
        return f"{r[key] / scale:.{digits}f} [{low / scale:.{digits}f}-{high / scale:.{digits}f}]"

    lines = [
        f"fine-tuning, {shape[s['family']]}{' (quick: tiny)' if s['quick'] else ''}, "
        f"{m['text_layers']} text + {m['vision_layers']} vision layers, "
        f"{s['device']} {s['dtype']}, {s['threads']} threads, "
        f"{s['samples_per_step']} samples/step, {s['steps']} timed steps, packed rows <= "
        f"{s['max_seq_len']}, {rounds} round{'s' * (rounds > 1)} (median [range]), --train "
        f"{s['train']}, fusion's loss {s['loss']}",
        f"{'contestant':26} {'tokens/s':>22} {'tokens/CPU-s':>22} {'positions':>9} "
        f"{'padding':>7} {'peak MiB':>18} {'loss':>8}",
    ]
    for name, r in report["results"].items():
        lines.append(
            f"{name:26} {spread(r, 'tokens_per_s'):>22} {spread(r, 'tokens_per_cpu_s'):>22} "
            f"{sum(r['positions']) / len(r['positions']):9.0f} {r['padding_fraction']:7.1%} "
            f"{spread(r, 'peak_memory_bytes', 2**20, 0):>18} {r['losses'][0]:8.4f}"
        )
    lines.append(
        f"{'paired ratios, median [range]':50} {'tokens/s':>22} {'tokens/CPU-s':>22} "
        f"{'peak memory':>22}"
    )
    for name, r in report["results"].items():
        for prefix, baseline, _ in BASELINES:
            if f"x_{prefix}_tokens_per_s" not in r:
                continue
            cells = [spread(r, f"x_{prefix}_{key}", digits=2) for key in MEASURES.values()]
            label = f"{name} / {baseline}"
            lines.append(f"{label:50} {cells[0]:>22} {cells[1]:>22} {cells[2]:>22}")
    for name, r in report["results"].items():
        if r.get("profile_s"):  # the first round's, under the profiler
            step = sum(r["step_s"][: len(r["tokens"])])
            shares = ", ".join(f"{k} {v / step:.0%}" for k, v in r["profile_s"].items())
            lines.append(f"profile {name}: {shares} of {step:.1f} s (round 0, profiled)")
    rate = report.get("matrix_rate")
    if rate is not None:
        bests = ", ".join(f"{max(r.values()):.0f}" for r in rate["gflops_rounds"])
        lines.append(
            f"fp32 matrix products after each round: best {rate['best_gflops']:.0f} GFLOP/s "
            f"(rounds: {bests})"
        )
    for name, failed in report.get("out_of_memory", {}).items():
        cap = failed["memory_limit_gib"]
        line = f"{name}: out of memory in round(s) {failed['rounds']}: {failed['detail']}"
        if cap is not None:
            shares = ", ".join(
                f"{other} {r['peak_memory_bytes'] / (cap * 2**30):.2f}"
                for other, r in report["results"].items()
            )
            line += (
                f"; address space capped at {cap:g} GiB; the others' peaks as its shares: {shares}"
            )
        lines.append(line)
    check = report.get("padding_free_first_loss")
    if check is not None:
        worst = max(r["relative_difference"] for r in check["rounds"])
        lines.append(
            f"transformers_padding_free's first loss equals transformers_padded's: "
            f"{check['agree']} (largest relative difference {worst:.1e}, tolerance "
            f"{check['tolerance']:.0e})"
        )
    untimed = report.get("padding_free_untimed_check")
    if untimed is not None:
        verdict = "equal" if untimed["agree"] else "WRONG: differs, so not timed"
        per_sample = untimed["per_sample_relative_difference"]
        firsts = untimed["first_in_row"]
        later = [d for d, first in zip(per_sample, firsts, strict=True) if not first] or [0.0]
        row_first = [d for d, first in zip(per_sample, firsts, strict=True) if first]
        logits = untimed["per_sample_logits_relative_difference"]
        lines.append(
            f"transformers_padding_free (untimed), initial weights, the first timed step's "
            f"{untimed['samples']} samples: loss {untimed['padding_free_loss']:.6f} against "
            f"padded {untimed['padded_loss']:.6f} (relative {untimed['relative_difference']:.1e});"
            f" per sample: first in its row {max(row_first):.1e}, after a boundary up to "
            f"{max(later):.1e}; logits up to {max(logits):.1e} of their largest (tolerance "
            f"{untimed['tolerance']:.0e}): {verdict}"
        )
    target = report.get("target")
    if target is not None:
        lines.append(
            f"target: {target['what']} >= {target['target']}: {target['measured']:.2f}, "
            f"{'met' if target['met'] else 'NOT MET'}"
        )
    lines.append(
        f"first-step losses agree: {report['first_step_losses_agree']}; load average "
        f"at start {report['machine']['load_average_start']}, end {report['load_average_end']}"
    )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
