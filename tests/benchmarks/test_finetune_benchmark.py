"""``benchmarks/finetune.py``'s parts: its default shape and settings, and the
``transformers_padding_free`` contestant (transformers' padding-free rows: positions restarting
per sample, no target across a boundary, the same loss and gradients as its padded batch, and
the in-script check that fails when transformers lets packed samples attend to each other).
The script's end-to-end run is in ``test_scripts.py``."""

import pytest
import torch

from bench_helpers import load_script
from fusion.data import IGNORE_INDEX, pack_samples

finetune = load_script("finetune")


@pytest.fixture(scope="module")
def tiny():
    """A tiny random ``Idefics3ForConditionalGeneration`` (SDPA, train mode), its config's
    fields and the step settings on the CPU."""
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration

    torch.manual_seed(0)
    config = finetune.hf_config(True)
    model = Idefics3ForConditionalGeneration(Idefics3Config(**config))
    model.config._attn_implementation = "sdpa"
    settings = finetune.StepSettings(torch.device("cpu"), finetune.pad_id(config), 256)
    return model.train(), config, settings


def test_default_shape_and_settings(tmp_path):
    """CPU: SmolVLM-256M's widths cut to 6 text and 3 vision layers, 8 samples per step, 3
    rounds, rows of its 8192 positions; CUDA: all 30 and 12 layers; --quick: one round."""
    args = finetune.parse_args(["--out", str(tmp_path)])
    assert (args.rounds, args.samples_per_step, args.threads, args.max_seq_len) == (3, 8, 2, 8192)
    assert (args.text_layers, args.vision_layers) == (6, 3)
    config = finetune.hf_config(False, args.family, args.text_layers, args.vision_layers)
    text, vision = config["text_config"], config["vision_config"]
    # rows as the recipe packs them for this model: as long as it takes
    assert text["max_position_embeddings"] == finetune.ROW_TOKENS
    assert (text["num_hidden_layers"], vision["num_hidden_layers"]) == (6, 3)
    assert (text["hidden_size"], text["intermediate_size"], text["vocab_size"]) == (
        576,
        1536,
        49_280,
    )
    assert (vision["hidden_size"], vision["image_size"], finetune.image_rows(config)) == (
        768,
        512,
        64,
    )
    cuda = finetune.parse_args(["--device", "cuda", "--out", str(tmp_path)])
    assert (cuda.text_layers, cuda.vision_layers, cuda.samples_per_step) == (30, 12, 32)
    # fusion's loss as the recipe picks it: fused on CPU in one process, chunked on CUDA
    assert (args.loss, cuda.loss) == ("fused", "chunked")
    assert finetune.parse_args(["--quick", "--out", str(tmp_path)]).rounds == 1
    qwen = finetune.parse_args(["--family", "qwen2_5_vl", "--vision-layers", "12"])
    config = finetune.hf_config(False, qwen.family, qwen.text_layers, qwen.vision_layers)
    assert config["vision_config"]["fullatt_block_indexes"] == [7]
    assert config["text_config"]["num_hidden_layers"] == finetune.QWEN_TEXT_LAYERS
    with pytest.raises(SystemExit):
        finetune.parse_args(["--rounds", "0"])


def test_padding_free_row_keeps_samples_apart(tiny):
    """One row of every sample: positions restart at each sample, each sample's first label is
    -100 (the previous sample's last position predicts nothing), and the targets are the padded
    batch's, padding left out."""
    model, config, settings = tiny
    samples = finetune.make_samples(4, config, seed=1, quick=True)
    inputs = finetune.hf_padding_free_inputs(model, samples, settings)
    padded = finetune.hf_padded_inputs(model, samples, settings)
    assert "attention_mask" not in inputs and inputs["use_cache"] is False
    starts = torch.tensor([0, *torch.tensor([len(s) for s in samples]).cumsum(0)[:-1]])
    total = sum(len(s) for s in samples)
    assert inputs["input_ids"].shape == inputs["position_ids"].shape == (1, total)
    assert (inputs["position_ids"][0] == 0).nonzero()[:, 0].tolist() == starts.tolist()
    assert (inputs["labels"][0, starts] == IGNORE_INDEX).all()
    real = padded["attention_mask"].bool()
    assert torch.equal(inputs["labels"][0], padded["labels"][real])
    assert torch.equal(inputs["input_ids"][0], padded["input_ids"][real])
    assert inputs["pixel_values"].shape[:2] == (1, len(samples))


def test_padding_free_step_equals_padded_step(tiny):
    """Several rows (gradient accumulation with ``num_items_in_batch``): the loss and every
    gradient of transformers' padded batch."""
    model, config, settings = tiny
    samples = finetune.make_samples(4, config, seed=2, quick=True)
    settings = finetune.StepSettings(settings.device, settings.pad, max_seq_len=128)
    assert len(pack_samples(samples, 128)) > 1
    results = []
    for step in (finetune.transformers_padded_step, finetune.transformers_padding_free_step):
        model.zero_grad(set_to_none=True)
        loss, positions = step(model, samples, settings)
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((loss, positions, grads))
    (padded_loss, padded_positions, padded_grads), (loss, positions, grads) = results
    model.zero_grad(set_to_none=True)
    assert loss.item() == pytest.approx(padded_loss.item(), rel=1e-6)
    assert positions == sum(len(s) for s in samples) < padded_positions
    assert grads.keys() == padded_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, padded_grads[name], rtol=1e-4, atol=1e-7, msg=name)


def test_padding_free_check_fails_loudly(tiny, monkeypatch):
    """The in-script check passes on transformers' packed rows and raises, with both losses,
    when the detection is skipped (``use_cache=True``: a cache, so every token attends to the
    samples before it) or a sample predicts the next one's first token."""
    model, config, settings = tiny
    samples = finetune.make_samples(2, config, seed=3, quick=True)
    check = finetune.check_padding_free(model, samples, settings)
    assert check["relative_difference"] <= check["tolerance"] == 1e-5
    build = finetune.hf_padding_free_inputs

    def with_cache(model, samples, settings):
        return build(model, samples, settings) | {"use_cache": True}

    monkeypatch.setattr(finetune, "hf_padding_free_inputs", with_cache)
    with pytest.raises(RuntimeError, match="did not keep the packed samples apart"):
        finetune.check_padding_free(model, samples, settings)
    monkeypatch.setattr(finetune, "hf_padding_free_inputs", build)
    monkeypatch.setattr(finetune, "hf_labels", lambda s: torch.cat([s.tokens[:1], s.labels[:-1]]))
    with pytest.raises(RuntimeError, match=r"loss \d+\.\d+ differs from transformers_padded's"):
        finetune.check_padding_free(model, samples, settings)


def test_a_capped_contestant_out_of_memory_is_named():
    """Under ``--memory-limit-gib`` an allocation past the cap fails in the child, which says
    so (torch's allocator); a kernel kill reads the same; any other failure is not memory."""
    import signal
    import subprocess
    import sys

    allocate = "import torch; torch.empty(2**31).fill_(1.0)"  # 8 GiB under a 4 GiB cap
    done = subprocess.run(
        [sys.executable, "-c", allocate],
        capture_output=True,
        text=True,
        check=False,
        preexec_fn=finetune.memory_cap(4 * 2**30),
    )
    assert done.returncode == 1
    assert "can't allocate memory" in finetune.out_of_memory(done.returncode, done.stderr)
    assert "SIGKILL" in finetune.out_of_memory(-signal.SIGKILL, "")
    assert finetune.out_of_memory(1, "ValueError: bad sample") is None
    for bad in ("0.5", "nan", "inf"):
        with pytest.raises(SystemExit):
            finetune.parse_args(["--memory-limit-gib", bad])


def test_a_contestant_out_of_memory_is_reported_and_the_run_goes_on(tmp_path, monkeypatch):
    """A contestant out of memory in a round gets no timings and no ratios; the others are
    measured and its failure is in the report and the table."""
    run = finetune.run_contestant

    def transformers_runs_out(args, name, workdir, check_only=False):
        if name == "transformers_padded":
            return {"out_of_memory": "DefaultCPUAllocator: can't allocate memory"}
        return run(args, name, workdir, check_only)

    monkeypatch.setattr(finetune, "run_contestant", transformers_runs_out)
    argv = ["--quick", "--only", "fusion_packed", "transformers_padded", "--out", str(tmp_path)]
    report = finetune.main([*argv, "--memory-limit-gib", "20"])
    assert set(report["results"]) == {"fusion_packed"}
    assert "x_transformers_tokens_per_s" not in report["results"]["fusion_packed"]
    failed = report["out_of_memory"]["transformers_padded"]
    assert failed["rounds"] == [0] and failed["memory_limit_gib"] == 20
    table = (tmp_path / "finetune_cpu.txt").read_text()
    assert "transformers_padded: out of memory in round(s) [0]" in table
    assert "capped at 20 GiB" in table and "fusion_packed 0.0" in table
