"""Sharding scenarios: the models, batches and plans shared by the 2-process run and the
one-process references of the tests in this folder.

``python -m parallel.sharding_scenarios RANK WORLD_SIZE INIT_FILE OUT_DIR`` (with ``tests`` on
``PYTHONPATH``) runs every scenario in turn on a gloo group and saves this rank's results to
``OUT_DIR/rank{RANK}.pt``: per scenario, either the outputs (local logits, full gradients,
state) or the error's type, message and traceback, so that one failing scenario leaves the
others reported.
"""

import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from fusion import EarlyFusion, TransformerDecoder
from fusion.lora import apply_lora, lora_linears
from fusion.models import llama3_2
from fusion.parallel import apply_fsdp, apply_tp
from helpers import AUDIO_ID, FEATURES, IMAGE_ID, TinyEncoder, build_tiny_decoder, text_tokens

WORLD_SIZE = 2
BATCH, SEQ = 4, 10  # data-parallel plans give each rank BATCH // WORLD_SIZE samples
# Float32 sums in another order (gloo reductions, split matmuls): about 1e-7 relative was seen.
# The tied models' logits reach about 40, hence a small relative term on top of 1e-5.
TOLERANCE = dict(atol=1e-5, rtol=1e-6)


@dataclass(frozen=True)
class Case:
    """One sharded training step compared with the same step in one process.

    ``plan``: ``fsdp`` (:func:`fusion.parallel.apply_fsdp`, per module), ``decoder_unit``
    (decoder layers, then the decoder, then the root), ``embedding_alone`` (layers,
    ``tok_embeddings`` alone, root: refused when tied), ``tp`` (:func:`fusion.parallel.apply_tp`),
    ``fsdp_tp`` (``apply_tp`` then ``apply_fsdp`` on a 2-D mesh: 1 data-parallel rank, 2
    tensor-parallel ranks), ``fsdp_lora`` (:func:`fusion.lora.apply_lora` on the decoder and
    the image encoder's projection, adapters randomised, then ``apply_fsdp``).
    """

    plan: str
    model: str  # "decoder" or "fusion"
    tied: bool
    images: bool

    @property
    def name(self) -> str:
        inputs = "images" if self.images else "text"
        return f"{self.plan}-{self.model}-{'tied' if self.tied else 'untied'}-{inputs}"

    @property
    def data_parallel(self) -> bool:
        """Whether each rank gets its own samples (else all ranks see the whole batch)."""
        return self.plan not in ("tp", "fsdp_tp")


CASES = [
    *(
        Case("fsdp", model, tied, images)
        for tied in (False, True)
        for model, images in (("decoder", False), ("fusion", False), ("fusion", True))
    ),
    Case("embedding_alone", "decoder", True, False),
    Case("embedding_alone", "fusion", True, True),
    Case("decoder_unit", "fusion", False, False),
    Case("decoder_unit", "fusion", False, True),
    Case("decoder_unit", "fusion", True, True),
    Case("tp", "decoder", False, False),
    Case("tp", "fusion", False, False),
    Case("tp", "fusion", False, True),
    Case("fsdp_tp", "fusion", False, True),
    Case("fsdp_lora", "fusion", False, True),
]
CHECKPOINT = "dcp-checkpoint"  # the folder; the jobs: saved under FSDP2, loaded under TP
SAVE, LOAD = "dcp-save-fsdp", "dcp-load-tp"
REFUSALS = (
    "tp-refused-tied",
    "tp-refused-heads",
    "tp-refused-wrapped",
    "tp-refused-caches",
    "fsdp-refused-twice",
)


def build(model: str, tied: bool, seed: int = 0) -> nn.Module:
    """The tiny decoder, or an EarlyFusion over it with an image and an audio encoder; every
    parameter trainable."""
    decoder = build_tiny_decoder(tie_word_embeddings=tied, seed=seed)
    if model == "decoder":
        return decoder
    torch.manual_seed(seed + 1)
    return EarlyFusion(
        decoder,
        {"image": TinyEncoder(), "audio": TinyEncoder()},
        {"image": IMAGE_ID, "audio": AUDIO_ID},  # outside and inside the vocabulary
        decoder_trainable=True,
        encoders_trainable=True,
    )


def adapt(model: nn.Module, case: Case) -> nn.Module:
    """LoRA for the ``fsdp_lora`` plan (the same random adapters on every rank): only the
    adapters train."""
    if case.plan == "fsdp_lora":
        targets = ("q_proj", "v_proj", "w2", "output", "encoders.image.proj")
        apply_lora(model, targets, rank=2, alpha=4.0)
        generator = torch.Generator().manual_seed(11)
        with torch.no_grad():
            for linear in lora_linears(model).values():
                for child in (linear.lora_a, linear.lora_b):
                    child.weight.copy_(torch.randn(child.weight.shape, generator=generator) * 0.3)
    return model


def batch(images: bool, rows: slice) -> tuple[torch.Tensor, dict | None, torch.Tensor]:
    """Samples ``rows`` of the global batch: tokens, encoder input (None: text only), targets.

    With images, sample i shows one image (3 rows) at positions i+1..i+3, and odd samples one
    audio clip (2 rows, an in-vocabulary placeholder) at 7..8.
    """
    tokens, targets = text_tokens(BATCH, SEQ, seed=1), text_tokens(BATCH, SEQ, seed=2)
    if not images:
        return tokens[rows], None, targets[rows]
    generator = torch.Generator().manual_seed(3)
    image = torch.randn(BATCH, 3, FEATURES, generator=generator)
    audio = torch.randn(BATCH, 2, FEATURES, generator=generator)
    for i in range(BATCH):
        tokens[i, i + 1 : i + 4] = IMAGE_ID
        if i % 2:
            tokens[i, 7:9] = AUDIO_ID
    chosen = list(range(BATCH))[rows]
    encoder_input = {
        "image": {"features": image[chosen]},
        "audio": {"features": audio[[i for i in chosen if i % 2]]},
    }
    return tokens[rows], encoder_input, targets[rows]


def train_step(model: nn.Module, images: bool, rows: slice) -> torch.Tensor:
    """Forward and backward on ``rows`` with a mean cross-entropy; returns the logits."""
    tokens, encoder_input, targets = batch(images, rows)
    kwargs = {} if encoder_input is None else {"encoder_input": encoder_input}
    logits = model(tokens, **kwargs)
    F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
    return logits.detach()


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor, gathered from its shards when it is a DTensor (a collective)."""
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


def full_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None}


def reference(case: Case) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Logits and gradients of the unsharded model on the whole batch, in this process."""
    model = adapt(build(case.model, case.tied), case)
    return train_step(model, case.images, slice(None)), full_grads(model)


def assert_matches_one_process(runs, case: Case) -> None:
    """Every rank's logits (its samples) and full gradients equal the one-process step's, to
    float32 rounding."""
    expected_logits, expected_grads = reference(case)
    assert all(g.abs().sum() > 0 for g in expected_grads.values())  # every parameter matters
    for rank in range(len(runs.ranks)):
        result = runs.result(case.name, rank)
        start, stop = result["rows"]
        torch.testing.assert_close(result["logits"], expected_logits[start:stop], **TOLERANCE)
        assert result["grads"].keys() == expected_grads.keys()
        for name, grad in expected_grads.items():
            torch.testing.assert_close(result["grads"][name], grad, **TOLERANCE, msg=name)


# ---------------------------------------------------------------------------- the 2-process run


def shard(model: nn.Module, plan: str, mesh: DeviceMesh) -> None:
    decoder = model if isinstance(model, TransformerDecoder) else model.decoder
    if plan in ("fsdp", "fsdp_lora"):
        apply_fsdp(model, mesh)
    elif plan == "tp":
        apply_tp(model, mesh)
    elif plan == "fsdp_tp":
        mesh_2d = init_device_mesh("cpu", (1, WORLD_SIZE), mesh_dim_names=("dp", "tp"))
        apply_tp(model, mesh_2d["tp"])
        apply_fsdp(model, mesh_2d["dp"])
    else:  # hand-written FSDP2 plans, outside fusion.parallel
        for layer in decoder.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(decoder if plan == "decoder_unit" else decoder.tok_embeddings, mesh=mesh)
        fully_shard(model, mesh=mesh)


def run_case(case: Case, mesh: DeviceMesh) -> dict:
    rank = dist.get_rank()
    per_rank = BATCH // WORLD_SIZE
    rows = slice(rank * per_rank, (rank + 1) * per_rank) if case.data_parallel else slice(None)
    model = adapt(build(case.model, case.tied), case)
    shard(model, case.plan, mesh)
    logits = train_step(model, case.images, rows)
    return {
        "rows": [rows.start or 0, rows.stop or BATCH],
        "logits": logits,
        "grads": full_grads(model),
    }


def save_checkpoint(mesh: DeviceMesh, out_dir: Path) -> dict:
    """Save the untied EarlyFusion under the per-module FSDP2 plan."""
    saved = build("fusion", tied=False)
    apply_fsdp(saved, mesh)
    dcp.save(get_model_state_dict(saved), checkpoint_id=out_dir / CHECKPOINT)
    return {}


def load_checkpoint(mesh: DeviceMesh, out_dir: Path) -> dict:
    """Load it into a differently seeded model under tensor parallelism: the whole state, and
    the logits of a text batch (the tests also load it in one process)."""
    loaded = build("fusion", tied=False, seed=7)
    apply_tp(loaded, mesh)
    state = get_model_state_dict(loaded)
    dcp.load(state, checkpoint_id=out_dir / CHECKPOINT)
    set_model_state_dict(loaded, state)
    return {
        "state": {k: full(v) for k, v in loaded.state_dict().items()},
        "logits": train_step(loaded, images=False, rows=slice(None)),
    }


class ScaledEmbedding(nn.Module):
    """An embedding wrapper (as LoRA or a scale would be): not what the plan can shard."""

    def __init__(self, inner: nn.Embedding) -> None:
        super().__init__()
        self.inner = inner
        self.num_embeddings, self.embedding_dim = inner.num_embeddings, inner.embedding_dim

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.inner(ids) * 2.0


def refused_model(name: str) -> nn.Module:
    """The model each refusal scenario applies a plan to."""
    if name == "tp-refused-tied":
        return build("fusion", tied=True)
    if name == "tp-refused-heads":
        return llama3_2(
            64, 1, num_heads=4, num_kv_heads=1, embed_dim=32, max_seq_len=16,
            tie_word_embeddings=False,  # untied, so that only the heads fail
        )  # fmt: skip
    model = build("fusion", tied=False)
    if name == "tp-refused-wrapped":
        model.decoder.tok_embeddings = ScaledEmbedding(model.decoder.tok_embeddings)
    elif name == "tp-refused-caches":
        model.setup_caches(1, torch.float32)
    return model


def run_refusal(name: str, mesh: DeviceMesh) -> dict:
    """A plan applied where it is refused: the error, and whether anything was sharded first
    (``fsdp-refused-twice`` is the second application of the plan)."""
    model = refused_model(name)
    apply = apply_fsdp if name.startswith("fsdp") else apply_tp
    if name == "fsdp-refused-twice":
        apply_fsdp(model, mesh)
    before = [type(p) for p in model.parameters()]
    try:
        apply(model, mesh)
    except Exception as error:
        changed = [type(p) for p in model.parameters()] != before
        return {"error_type": type(error).__name__, "message": str(error), "changed": changed}
    return {"error_type": None, "message": "", "changed": True}


def join_group(rank: int, world_size: int, init_file: str) -> DeviceMesh:
    """Join the gloo process group of this scenario run (one thread per rank) and return its
    one-dimensional CPU mesh."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=60),  # a desynchronised scenario fails instead of hanging
    )
    return init_device_mesh("cpu", (world_size,))


def run_all(rank: int, world_size: int, init_file: str, out_dir: Path) -> None:
    mesh = join_group(rank, world_size, init_file)
    jobs: dict[str, Callable[[], dict]] = {c.name: (lambda c=c: run_case(c, mesh)) for c in CASES}
    jobs[SAVE] = lambda: save_checkpoint(mesh, out_dir)
    jobs[LOAD] = lambda: load_checkpoint(mesh, out_dir)
    for name in REFUSALS:
        jobs[name] = lambda name=name: run_refusal(name, mesh)
    run_jobs(jobs, rank, out_dir)


def run_jobs(jobs: dict[str, Callable[[], dict]], rank: int, out_dir: Path) -> None:
    """Run each job on this rank, in order, with a barrier after each; save every result (or
    the error it raised) to ``out_dir/rank{rank}.pt`` and leave the process group."""
    results = {}
    for name, job in jobs.items():
        try:
            results[name] = {"ok": True, **job()}
        except Exception as error:
            results[name] = {
                "ok": False,
                "error_type": type(error).__name__,
                "message": str(error),
                "traceback": traceback.format_exc(),
            }
        dist.barrier()
    torch.save(results, out_dir / f"rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    rank, world_size, init_file, out_dir = sys.argv[1:]
    run_all(int(rank), int(world_size), init_file, Path(out_dir))
