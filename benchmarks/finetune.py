"""Fine-tuning throughput and peak memory: fusion with packed samples, fusion padded, and
``transformers``' own model class on padded batches, on the same weights, samples and optimizer,
for two families (``--family``): SmolVLM (``Idefics3ForConditionalGeneration``) and Qwen2.5-VL
(``Qwen2_5_VLForConditionalGeneration``).

The model has SmolVLM-256M's shape (SmolLM2-135M's decoder, SigLIP base patch-16/512, 4 x 4
pixel shuffle: 64 rows per 512 x 512 image) with random weights: written once by
``transformers`` and loaded by each contestant (``fusion.checkpoint.load_hf_idefics3`` for
ours). Every contestant trains the decoder and the connector (vision tower frozen, as in
SmolVLM's and LLaVA's fine-tuning) with AdamW, one optimizer step per ``--samples-per-step``
samples (the same samples, in the same order, for everyone):

- ``fusion_packed``: the step's samples packed into rows of at most ``--max-seq-len`` tokens
  (``fusion.data.pack_samples``, block-causal mask, positions restarting per sample), one row
  per forward/backward, gradients accumulated (``fusion.masked_token_loss`` sums divided by
  the step's target count: the gradients of one big batch);
- ``fusion_padded``: the step's samples in one batch, right-padded to the longest
  (``fusion.data.collate_padded``);
- ``transformers_padded``: the same padded batch through ``Idefics3ForConditionalGeneration``
  (SDPA attention, ``attention_mask``, ``labels`` with -100: its own loss), as the Hugging Face
  Trainer trains with ``per_device_train_batch_size = samples_per_step``.

``--family qwen2_5_vl``: Qwen2.5-VL-3B's widths (:data:`QWEN2_5_VL_3B_TEXT`,
:data:`QWEN2_5_VL_3B_VISION`: text 2048 wide, 16/2 heads, MLP 11008, vocabulary 151936, tied
output layer, M-RoPE sections 16/24/24; ViT 1280 wide, 16 heads, MLP 3420, 112-pixel windows,
14-pixel patches, 2 x 2 merge into 2048) with 2 text layers and 2 vision blocks (block 1 full
attention, block 0 windowed), loaded by ``fusion.checkpoint.load_hf_vlm``. The decoder and the
merger train, the rest of the tower is frozen (the recipe's ``--train full``). Each sample has
one image of its own size: 16 to 32 patches a side (224 to 448 pixels, even), so 64 to 256
rows, and grids differ from sample to sample; transformers gets the same patches, grids and
``mm_token_type_ids``, and M-RoPE positions come from the grids on both sides (fusion packed:
from its 1-D positions restarting per sample).

Samples: a fixed-seed mix of LLaVA-Instruct-like lengths: one image per sample (SmolVLM: 64
rows and its 3 wrapper tokens; Qwen2.5-VL: its rows between ``<|vision_start|>`` and
``<|vision_end|>``), a question of 8 to 40 tokens, an answer of 10 to 400 tokens (40% short
10-100 as in its conversations, 30% 100-250 as in its detailed descriptions, 30% 250-400 as in
its complex reasoning), and an end-of-turn token. The loss covers the answer and the end token.

Each contestant runs in a fresh process, one after the other (``--quick``: in this process): a
warm-up step (2 samples: allocator, kernels, the optimizer's state; ``--short-warmup``: the
first sample alone, its answer cut to 16 tokens, which sets up the same state in a fraction of
the time), then ``--steps`` timed steps (the same samples either way). ``--rounds N`` runs
every contestant N times, each time in a fresh process, in alternating order (the ``--only``
order, then reversed, ...): reported per contestant are the median over rounds and the range,
and each ratio to transformers is the median over rounds of the ratio within a round.
Reported: non-padding tokens per second over the timed steps (wall clock, and per CPU-second of
the process: user and system time of all its threads, which time-slicing by other jobs on
shared cores moves less than the wall clock, though spinning threads still count), the
positions computed (padding included), the peak resident memory of the process (``ru_maxrss``;
CPU) or the peak CUDA memory allocated (GPU), the first timed step's loss (all must agree: same
weights, same samples), and the load average at each process's start and end.

    python benchmarks/finetune.py                 # CPU, fp32, 2 threads -> benchmarks/results/
    python benchmarks/finetune.py --quick         # a tiny model, seconds -> a temporary directory
    python benchmarks/finetune.py --device cuda   # bf16 autocast, fp32 weights
    python benchmarks/finetune.py --family qwen2_5_vl --samples-per-step 2 --steps 1 \
        --rounds 2 --short-warmup                 # Qwen2.5-VL-3B-wide, 5-10 min on 2 CPU cores

Writes ``finetune.json`` (and ``finetune_<device>.txt``, the table) to ``--out``; for
``--family qwen2_5_vl``, ``finetune_qwen2_5_vl.json`` and ``finetune_qwen2_5_vl_<device>.txt``.
"""

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import add_out_argument, idefics3_hf_config, machine, output_dir

from fusion import masked_token_loss
from fusion.data import IGNORE_INDEX, Sample, collate_packed, collate_padded, pack_samples
from fusion.models.idefics3 import (
    SMOLVLM_256M_IMAGE_TOKEN_ID,
    SMOLVLM_256M_SCALE_FACTOR,
    SMOLVLM_256M_TEXT,
    SMOLVLM_256M_VISION,
)

CONTESTANTS = ("transformers_padded", "fusion_padded", "fusion_packed")
FAMILIES = ("smolvlm", "qwen2_5_vl")
PAD_ID = 2  # SmolVLM's <|im_end|> doubles as padding; any id works: padding is never a target
BOS_ID, FAKE_ID, GLOBAL_ID, END_ID = 1, 49_189, 49_152, 49_279
LR = 1e-5
SHORT_WARMUP_ANSWER = 16  # --short-warmup: answer tokens kept in the warm-up sample

#: Qwen2.5-VL-3B-Instruct's text stack as its published ``config.json`` gives it
#: (``Qwen2_5_VLTextConfig`` fields; ``rope_scaling`` {"type": "mrope"} there).
QWEN2_5_VL_3B_TEXT = {
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
QWEN2_5_VL_3B_VISION = {
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
        "--rounds", type=int, default=1, help="fresh processes per contestant, alternating order"
    )
    p.add_argument(
        "--short-warmup",
        action="store_true",
        help=f"warm up on the first sample alone, its answer cut to {SHORT_WARMUP_ANSWER} tokens",
    )
    p.add_argument("--max-seq-len", type=int, default=None, help="default 1024 (CPU), 4096")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", choices=CONTESTANTS, nargs="+", default=list(CONTESTANTS))
    p.add_argument("--worker", choices=CONTESTANTS, help=argparse.SUPPRESS)
    p.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds: expected at least 1")
    cuda = args.device == "cuda"
    if args.samples_per_step is None:
        args.samples_per_step = 4 if args.quick else 32 if cuda else 8
    if args.max_seq_len is None:
        args.max_seq_len = 256 if args.quick else 4096 if cuda else 1024
    if args.quick:
        args.steps = 1
    if args.worker is None:
        args.out = output_dir(args.out, check=args.quick)
    return args


# ---------------------------------------------------------------------- model and samples


def hf_config(quick: bool, family: str = "smolvlm") -> dict:
    """The transformers config's fields: SmolVLM-256M's shape (``Idefics3Config``) or
    Qwen2.5-VL-3B's widths with CPU depths (``Qwen2_5_VLConfig``), or a tiny one for
    ``--quick``."""
    if family == "qwen2_5_vl":
        return qwen_hf_config(quick)
    text, vision = dict(SMOLVLM_256M_TEXT), dict(SMOLVLM_256M_VISION)
    scale, image_id = SMOLVLM_256M_SCALE_FACTOR, SMOLVLM_256M_IMAGE_TOKEN_ID
    if quick:
        text |= {"num_layers": 2, "embed_dim": 36, "intermediate_dim": 64}
        vision |= {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2}
        vision |= {"num_attention_heads": 2, "image_size": 32, "patch_size": 4}
        scale = 2
    config = idefics3_hf_config(text, vision, scale, image_id)
    config["text_config"]["pad_token_id"] = config["pad_token_id"] = PAD_ID
    return config


def qwen_hf_config(quick: bool) -> dict:
    """``Qwen2_5_VLConfig`` fields: Qwen2.5-VL-3B's widths, :data:`QWEN_TEXT_LAYERS` text
    layers and :data:`QWEN_VISION_DEPTH` vision blocks; ``quick``: tiny widths (a 256-token
    vocabulary, the specials at its top; 56-pixel windows)."""
    text = QWEN2_5_VL_3B_TEXT | {"num_hidden_layers": QWEN_TEXT_LAYERS}
    vision = QWEN2_5_VL_3B_VISION | {
        "depth": QWEN_VISION_DEPTH,
        "fullatt_block_indexes": QWEN_FULL_ATTENTION,
    }
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


def qwen_chat_ids(config: dict) -> tuple[int, int]:
    """``<|im_start|>`` and ``<|im_end|>`` (the tiny vocabulary's 255 and 249 for
    ``--quick``)."""
    if config["text_config"]["vocab_size"] == QWEN2_5_VL_3B_TEXT["vocab_size"]:
        return QWEN_IM_START, QWEN_IM_END
    return 255, 249


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


def make_samples(count: int, config: dict, seed: int, quick: bool) -> list[Sample]:
    """``count`` samples of the fixed-seed length mix (see the module docstring)."""
    if is_qwen(config):
        return make_qwen_samples(count, config, seed, quick)
    generator = torch.Generator().manual_seed(seed)
    image_id, vocab = config["image_token_id"], config["text_config"]["vocab_size"]
    rows, size = image_rows(config), config["vision_config"]["image_size"]
    samples = []
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


def make_qwen_samples(count: int, config: dict, seed: int, quick: bool) -> list[Sample]:
    """Qwen2.5-VL samples: ``<|im_start|>``, the image (``<|vision_start|>``, its rows,
    ``<|vision_end|>``), the question, ``<|im_end|>``, ``<|im_start|>``, the answer and
    ``<|im_end|>``. Each image is ``h x w`` patches, h and w drawn from 16 to 32 (even, so the
    2 x 2 merge divides them; ``--quick``: 4 to 8), its patches random values."""
    generator = torch.Generator().manual_seed(seed)
    vision, vocab = config["vision_config"], config["text_config"]["vocab_size"]
    merge, patch = vision["spatial_merge_size"], vision["patch_size"]
    patch_dim = 3 * vision["temporal_patch_size"] * patch**2
    image_id = config["image_token_id"]
    start_id, end_id = config["vision_start_token_id"], config["vision_end_token_id"]
    im_start, im_end = qwen_chat_ids(config)
    sides = list(range(4, 9, 2) if quick else range(16, 33, 2))
    text_high = 240 if quick else QWEN2_5_VL_IDS["pad_token_id"]  # below every special id
    samples = []
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
    samples = make_samples(2 + n * args.steps, config, args.seed, args.quick)
    warmup = samples[:2]
    if args.short_warmup:
        warmup = [cut_answer(samples[0], SHORT_WARMUP_ANSWER)]
    return [warmup] + [samples[2 + i * n : 2 + (i + 1) * n] for i in range(args.steps)]


# ---------------------------------------------------------------------- contestants


def cpu_seconds() -> float:
    """CPU time of this process so far, every thread, user and system."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


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


def hf_step(
    model, samples: list[Sample], device: torch.device, pad: int = PAD_ID
) -> tuple[float, int]:
    """One padded batch through transformers' model and its own loss; (loss, positions)."""
    batch = collate_padded(samples, pad_id=pad)
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
    out = model(
        input_ids=batch.tokens.to(device),
        attention_mask=attention.to(device),
        labels=labels.to(device),
        **inputs,
    )
    out.loss.backward()
    return out.loss.detach(), batch.tokens.numel()


def fusion_padded_step(
    model, samples: list[Sample], device: torch.device, pad: int = PAD_ID
) -> tuple[float, int]:
    batch = collate_padded(samples, pad_id=pad).to(device)
    loss_sum, count = masked_token_loss(model(**batch.model_inputs()), batch.labels)
    loss = loss_sum / count
    loss.backward()
    return loss.detach(), batch.tokens.numel()


def fusion_packed_step(
    model, samples: list[Sample], device: torch.device, max_seq_len: int, pad: int = PAD_ID
) -> tuple[float, int]:
    """Rows of packed samples, one forward/backward each; the loss is divided by the step's
    target count (known before the step), so the gradients are those of one batch."""
    targets = sum(sample.num_targets for sample in samples)
    total, positions = torch.zeros((), device=device), 0
    for row in pack_samples(samples, max_seq_len):
        batch = collate_packed([row], pad_id=pad).to(device)
        loss_sum, _ = masked_token_loss(model(**batch.model_inputs()), batch.labels)
        (loss_sum / targets).backward()
        total += loss_sum.detach() / targets
        positions += batch.tokens.numel()
    return total, positions


def load_contestant(args: argparse.Namespace, device: torch.device):
    """The contestant's model, loaded from ``--model-dir``; the modules that stay frozen and,
    inside them, those that train (Qwen2.5-VL's merger)."""
    qwen = args.family == "qwen2_5_vl"
    if args.worker == "transformers_padded":
        from transformers import (
            Idefics3ForConditionalGeneration,
            Qwen2_5_VLForConditionalGeneration,
        )

        cls = Qwen2_5_VLForConditionalGeneration if qwen else Idefics3ForConditionalGeneration
        model = cls.from_pretrained(
            args.model_dir, dtype=torch.float32, attn_implementation="sdpa"
        ).to(device)
        if qwen:
            return model, model.model.visual, model.model.visual.merger
        return model, model.model.vision_model, None
    if qwen:
        from fusion.checkpoint import load_hf_vlm

        model = load_hf_vlm(args.model_dir, device=device)
        return model, model.encoders["image"], model.encoders["image"].merger
    from fusion.checkpoint import load_hf_idefics3

    model = load_hf_idefics3(args.model_dir, device=device)
    return model, model.encoders["image"].vision_model, None


def run_worker(args: argparse.Namespace) -> None:
    """One contestant, in this process: load, train, write the measurements to ``--result``."""
    load_start = os.getloadavg()
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    config = hf_config(args.quick, args.family)
    pad = pad_id(config)
    steps = step_samples(args, config)
    model, tower, trained_in_tower = load_contestant(args, device)
    if args.worker == "transformers_padded":

        def step(model, samples, device):
            return hf_step(model, samples, device, pad)
    elif args.worker == "fusion_packed":

        def step(model, samples, device):
            return fusion_packed_step(model, samples, device, args.max_seq_len, pad)
    else:

        def step(model, samples, device):
            return fusion_padded_step(model, samples, device, pad)

    model.train()
    for param in model.parameters():
        param.requires_grad_(True)
    for param in tower.parameters():
        param.requires_grad_(False)
    if trained_in_tower is not None:
        for param in trained_in_tower.parameters():
            param.requires_grad_(True)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=LR)
    loaded = rss_bytes()
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    times, cpu_times, losses, positions = [], [], [], []
    for i, samples in enumerate(steps):
        sync(device)
        start, cpu_start = time.perf_counter(), cpu_seconds()
        with autocast:
            loss, computed = step(model, samples, device)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync(device)
        if i:  # step 0 is the warm-up
            times.append(time.perf_counter() - start)
            cpu_times.append(cpu_seconds() - cpu_start)
            losses.append(float(loss))
            positions.append(computed)
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
        "load_average_start": load_start,
        "load_average_end": os.getloadavg(),
    }
    args.result.write_text(json.dumps(result))


# ---------------------------------------------------------------------- the run


def run_contestant(args: argparse.Namespace, name: str, workdir: Path) -> dict:
    """Run contestant ``name`` in a fresh process (in this one for ``--quick``, where the
    peak memory is then the whole run's so far); its measurements."""
    result_file = workdir / f"{name}.json"
    if args.quick:
        worker = argparse.Namespace(**vars(args))
        worker.worker, worker.model_dir, worker.result = name, workdir / "model", result_file
        run_worker(worker)
        return json.loads(result_file.read_text())
    command = [sys.executable, __file__, "--worker", name, "--model-dir", str(workdir / "model")]
    command += ["--result", str(result_file), "--device", args.device]
    command += ["--threads", str(args.threads), "--seed", str(args.seed)]
    command += ["--samples-per-step", str(args.samples_per_step), "--family", args.family]
    command += ["--steps", str(args.steps), "--max-seq-len", str(args.max_seq_len)]
    command += ["--short-warmup"] if args.short_warmup else []
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"{name} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return json.loads(result_file.read_text())


def save_model(family: str, config: dict, directory: Path) -> None:
    """Random weights of the family's transformers class, written with ``save_pretrained``."""
    if family == "qwen2_5_vl":
        from transformers import Qwen2_5_VLConfig as Config
        from transformers import Qwen2_5_VLForConditionalGeneration as Model
    else:
        from transformers import Idefics3Config as Config
        from transformers import Idefics3ForConditionalGeneration as Model
    Model(Config(**config)).save_pretrained(directory)


def round_order(names: list[str], round_index: int) -> list[str]:
    """The contestants' order in round ``round_index``: as given, then reversed, ..."""
    return list(names) if round_index % 2 == 0 else list(reversed(names))


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.worker is not None:
        run_worker(args)
        return {}
    config = hf_config(args.quick, args.family)
    info = machine(torch.device(args.device))  # the load average at the start
    workdir = Path(tempfile.mkdtemp(prefix="finetune_bench_"))
    try:
        torch.manual_seed(args.seed)
        save_model(args.family, config, workdir / "model")
        rounds: dict[str, list[dict]] = {name: [] for name in args.only}
        for r in range(args.rounds):
            for name in round_order(args.only, r):
                started = time.perf_counter()
                result = run_contestant(args, name, workdir)
                result["process_s"] = time.perf_counter() - started
                result["round"], result["order"] = r, round_order(args.only, r).index(name)
                rounds[name].append(result)
                print(f"round {r}: {name} done in {result['process_s']:.0f} s", flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    report = summarise(args, config, rounds, info)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "finetune" if args.family == "smolvlm" else f"finetune_{args.family}"
    (args.out / f"{stem}.json").write_text(json.dumps(report, indent=1))
    table = format_table(report)
    (args.out / f"{stem}_{args.device}.txt").write_text(table)
    print(table, end="")
    print(f"-> {args.out / f'{stem}.json'}")
    return report


# What is summarised over rounds, and the name of its ratio to transformers (x_transformers_*).
MEASURES = {
    "tokens_per_s": "tokens_per_s",
    "tokens_per_cpu_s": "tokens_per_cpu_s",
    "peak_memory_bytes": "peak_memory",
}


def combine(rounds: list[dict], baseline: list[dict] | None) -> dict:
    """One contestant's rounds -> its summary: the first round's fields, medians over rounds
    (``tokens_per_s``, ``tokens_per_cpu_s``, ``peak_memory_bytes``) with their range, every
    round, and each ratio to the baseline as the median over rounds of the ratio within the
    round."""
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
    out.pop("round", None)
    out.pop("order", None)
    if baseline is not None:
        for key, name in MEASURES.items():
            paired = [r[key] / b[key] for r, b in zip(rounds, baseline, strict=True)]
            out[f"x_transformers_{name}"] = statistics.median(paired)
            out[f"x_transformers_{name}_rounds"] = paired
            out[f"x_transformers_{name}_range"] = [min(paired), max(paired)]
    return out


def summarise(args: argparse.Namespace, config: dict, rounds: dict, info: dict) -> dict:
    import transformers

    baseline = rounds.get("transformers_padded")
    results = {name: combine(runs, baseline) for name, runs in rounds.items()}
    first_losses = [losses[0] for r in results.values() for losses in r["losses_rounds"]]
    info["transformers"] = transformers.__version__
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    for key in ("worker", "model_dir", "result"):
        settings.pop(key)
    model: dict = {"family": args.family, "config": config}
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
        "first_step_losses_agree": max(first_losses) - min(first_losses)
        <= 1e-3 * max(abs(x) for x in first_losses),
        "load_average_end": os.getloadavg(),
    }


def format_table(report: dict) -> str:
    s = report["settings"]
    shape = {"smolvlm": "SmolVLM-256M-shaped", "qwen2_5_vl": "Qwen2.5-VL-3B-wide"}
    rounds = s["rounds"]
    lines = [
        f"fine-tuning, {shape[s['family']]}{' (quick: tiny)' if s['quick'] else ''}, "
        f"{s['device']} {s['dtype']}, {report['machine']['torch_threads']} threads, "
        f"{s['samples_per_step']} samples/step, {s['steps']} timed steps, packed rows <= "
        f"{s['max_seq_len']}, {rounds} round{'s' * (rounds > 1)} (median [range])",
        f"{'contestant':20} {'tokens/s':>20} {'x HF':>17} {'tokens/CPU-s':>20} {'x HF':>17} "
        f"{'padding':>7} {'peak MiB':>8} {'x HF':>5} {'loss':>8}",
    ]

    def cell(r: dict, key: str, ratio: str) -> str:
        low, high = r[f"{key}_range"]
        x = r.get(f"x_transformers_{ratio}", 0)
        x_low, x_high = r.get(f"x_transformers_{ratio}_range", (0, 0))
        return f"{r[key]:7.1f} [{low:5.1f}-{high:5.1f}] {x:5.2f} [{x_low:4.2f}-{x_high:4.2f}]"

    for name, r in report["results"].items():
        lines.append(
            f"{name:20} {cell(r, 'tokens_per_s', 'tokens_per_s')} "
            f"{cell(r, 'tokens_per_cpu_s', 'tokens_per_cpu_s')} "
            f"{r['padding_fraction']:7.1%} {r['peak_memory_bytes'] / 2**20:8.0f} "
            f"{r.get('x_transformers_peak_memory', 0):5.2f} {r['losses'][0]:8.4f}"
        )
    lines.append(
        f"first-step losses agree: {report['first_step_losses_agree']}; load average "
        f"at start {report['machine']['load_average_start']}, end {report['load_average_end']}"
    )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
