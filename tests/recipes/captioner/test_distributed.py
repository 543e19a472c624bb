"""Two processes on CPU (gloo) under torchrun: DDP and FSDP2 against one process."""

import shutil

import pytest
import torch

from fusion.checkpoint import select_prefix
from fusion.training import latest_checkpoint
from recipes.captioner import (
    build_decoder,
    build_tokenizer,
    load_model,
    main,
    read_model_state_dict,
)
from recipes.captioner.model import image_input
from recipes.captioner.state import load_train_state

# Two processes sum the same per-token losses in a different order (and reduce gradients over
# gloo), so the losses agree to float32 rounding, not bitwise; 1e-4 relative leaves a wide
# margin over what was seen (about 1e-7 after 8 steps, DDP and FSDP2 alike).
RTOL = 1e-4


@pytest.fixture(scope="module")
def single(tmp_path_factory, job):
    """The one-process run with the same global batch: losses and final checkpoint."""
    out = tmp_path_factory.mktemp("single")
    threads = torch.get_num_threads()
    assert main(job.tiny("--steps", "8", "--checkpoint-every", "4", "--output-dir", str(out))) == 0
    torch.set_num_threads(threads)
    return job.losses(out), latest_checkpoint(out / "checkpoints")


def run_two_processes(job, tmp_path, parallel: str, reference: list[float]):
    """Train the tiny config 8 steps on 2 gloo processes; check the losses match one process.
    Returns the output directory and the arguments used."""
    out = tmp_path / parallel
    args = job.tiny("--steps", "8", "--checkpoint-every", "4", "--output-dir", str(out))
    run = job.run(*args, "--parallel", parallel, nproc=2, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"2 process(es) on cpu ({parallel})" in run.stdout
    torch.testing.assert_close(job.losses(out), reference, rtol=RTOL, atol=0)
    return out, args


def test_one_process_resumes_on_two_ddp_processes_and_loads_alone(job, tmp_path, single):
    reference, reference_checkpoint = single
    # The single run as if it had died after step 4, resumed on 2 processes with its stored
    # configuration (rank 0 reads it and hands it to rank 1).
    out = tmp_path / "ddp"
    shutil.copytree(reference_checkpoint.parent.parent, out)
    (out / "metrics.json").unlink()
    shutil.rmtree(out / "checkpoints" / reference_checkpoint.name)
    run = job.run("--output-dir", str(out), "--resume", "--no-progress", nproc=2, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "at step 4 of 8 (saved by 1 process(es), now 2)" in run.stdout
    assert "2 process(es) on cpu (ddp)" in run.stdout
    losses = job.losses(out)
    assert losses[:4] == reference[:4]  # the history, from the checkpoint
    torch.testing.assert_close(losses, reference, rtol=RTOL, atol=0)

    # The distributed checkpoint in one process: a plain EarlyFusion and a plain decoder.
    checkpoint = latest_checkpoint(out / "checkpoints")
    assert load_train_state(checkpoint).world_size == 2
    model, config = load_model(checkpoint)
    expected, _ = load_model(reference_checkpoint)
    decoder = build_decoder(config)
    decoder.load_state_dict(
        select_prefix(read_model_state_dict(checkpoint), "decoder."), strict=True
    )
    tokenizer = build_tokenizer()
    tokens = torch.randint(0, tokenizer.vocab_size, (2, 11))
    tokens[:, :4] = tokenizer.image_id  # one image (4 tokens) per sample, then text
    images = image_input(torch.rand(2, 3, 16, 16))
    with torch.no_grad():
        # Compared through outputs: parameters with (near) zero gradients, such as the key
        # biases, take sign-of-noise Adam steps that differ between runs without any effect.
        torch.testing.assert_close(
            model(tokens, encoder_input=images),
            expected(tokens, encoder_input=images),
            rtol=RTOL,
            atol=1e-4,
        )
        assert torch.equal(model(tokens[:, 4:]), decoder(tokens[:, 4:]))


def test_fsdp_matches_one_process_and_resumes_on_one_process(job, tmp_path, single):
    reference, _ = single
    out, args = run_two_processes(job, tmp_path, "fsdp", reference)

    # As if the 2-process run had died after step 4: its sharded checkpoint continues in one
    # process, to the single run's losses.
    shutil.rmtree(out / "checkpoints" / "step_00000008")
    (out / "metrics.json").unlink()
    assert load_train_state(latest_checkpoint(out / "checkpoints")).world_size == 2
    threads = torch.get_num_threads()
    assert main([*args, "--resume"]) == 0
    torch.set_num_threads(threads)
    torch.testing.assert_close(job.losses(out), reference, rtol=RTOL, atol=0)
    assert load_train_state(latest_checkpoint(out / "checkpoints")).world_size == 1
