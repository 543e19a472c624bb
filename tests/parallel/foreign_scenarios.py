"""FSDP2 plans over an EarlyFusion holding a Hugging Face Llama, run by
``python -m parallel.foreign_scenarios RANK WORLD_SIZE INIT_FILE OUT_DIR`` on a gloo group
(see ``conftest.run_scenarios``) and compared with one process by ``test_fsdp_foreign.py``.

Plans (``fully_shard`` by hand: ``fusion.parallel``'s plans name this library's modules):

- ``per_module``: each decoder layer, ``model.embed_tokens``, ``[model.norm, lm_head]``, then
  the ``EarlyFusion`` (torchtitan's plan, untied output);
- ``blocks_root``: each decoder layer, then the ``EarlyFusion`` (tied output: the embedding,
  the norm and the head stay in the root unit);
- ``decoder_unit``: each layer, then the decoder, then the ``EarlyFusion``: the merge calls the
  embedding before the decoder's forward gathers its unit, so this plan is refused.
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from foreign_decoders import IMAGE, fuse, hf_llama
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from helpers import FEATURES, HF_VOCAB
from parallel.sharding_scenarios import full_grads, join_group, run_jobs

BATCH, SEQ = 4, 10
PLANS = {"per_module": False, "blocks_root": True, "decoder_unit": False}  # plan -> tied


def build(tied: bool) -> nn.Module:
    """EarlyFusion over the tiny Hugging Face Llama, every parameter trainable."""
    return fuse(hf_llama(tied=tied), decoder_trainable=True, encoders_trainable=True)


def batch(rows: slice) -> tuple[torch.Tensor, dict, torch.Tensor]:
    """Samples ``rows`` of the global batch: sample i shows one image (3 rows) at i+1..i+3."""
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(4, HF_VOCAB, (BATCH, SEQ), generator=generator)
    targets = torch.randint(4, HF_VOCAB, (BATCH, SEQ), generator=generator)
    images = torch.randn(BATCH, 3, FEATURES, generator=generator)
    for i in range(BATCH):
        tokens[i, i + 1 : i + 4] = IMAGE
    return tokens[rows], {"image": {"features": images[rows]}}, targets[rows]


def train_step(model: nn.Module, rows: slice) -> torch.Tensor:
    tokens, encoder_input, targets = batch(rows)
    logits = model(tokens, encoder_input=encoder_input).logits
    F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
    return logits.detach()


def shard(model: nn.Module, plan: str, mesh: DeviceMesh) -> None:
    decoder = model.decoder
    for layer in decoder.model.layers:
        fully_shard(layer, mesh=mesh)
    if plan == "per_module":
        fully_shard(decoder.model.embed_tokens, mesh=mesh)
        fully_shard([decoder.model.norm, decoder.lm_head], mesh=mesh)
    elif plan == "decoder_unit":
        fully_shard(decoder, mesh=mesh)
    fully_shard(model, mesh=mesh)


def run_plan(plan: str, mesh: DeviceMesh) -> dict:
    rank = dist.get_rank()
    per_rank = BATCH // dist.get_world_size()
    rows = slice(rank * per_rank, (rank + 1) * per_rank)
    model = build(PLANS[plan])
    shard(model, plan, mesh)
    logits = train_step(model, rows)
    return {"rows": [rows.start, rows.stop], "logits": logits, "grads": full_grads(model)}


def run_all(rank: int, world_size: int, init_file: str, out_dir: Path) -> None:
    mesh = join_group(rank, world_size, init_file)
    run_jobs({plan: (lambda plan=plan: run_plan(plan, mesh)) for plan in PLANS}, rank, out_dir)


if __name__ == "__main__":
    rank, world_size, init_file, out_dir = sys.argv[1:]
    run_all(int(rank), int(world_size), init_file, Path(out_dir))
