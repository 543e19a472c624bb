"""``benchmarks/deltanet_layer.py`` and ``benchmarks/qwen3_5_generation.py`` run end to end in
their quick mode (tiny widths, rounds in alternating order) and report what they measure: the
contestants agree before timing, tokens/s, paired ratios to transformers, the targets; and
``benchmarks/gpu_check.py --deltanet-only --cpu-smoke`` runs its FLA check's comparison (the
torch kernel against itself: FLA needs CUDA)."""

import json
import statistics

import pytest
import torch

from bench_helpers import load_script, run_script


def test_deltanet_layer_quick(tmp_path):
    stdout = run_script(
        "deltanet_layer.py", "--quick", "--rounds", "2", "--threads", "1", "--out", str(tmp_path)
    )
    report = json.loads((tmp_path / "deltanet_layer.json").read_text())
    assert (tmp_path / "deltanet_layer_cpu.txt").read_text().strip() in stdout
    # The same work: outputs and gradients at the samples' tokens agree with transformers'.
    for diffs in report["agreement"].values():
        assert max(diffs.values()) < 1e-4
    work = report["work"]
    assert work["tokens"] == sum(work["lengths"]) and len(work["lengths"]) == 8
    assert work["positions"]["padded"] == 8 * max(work["lengths"])
    results = report["results"]
    cases = {(r["mode"], r["contestant"]) for r in results}
    names = ("fusion_packed", "fusion_padded", "transformers_padded")
    assert cases == {(m, c) for m in ("fwd", "fwd+bwd") for c in names}
    for r in results:
        assert len(r["tokens_per_s_rounds"]) == 2
        assert r["tokens_per_s"] == pytest.approx(statistics.median(r["tokens_per_s_rounds"]))
        assert r["tokens_per_s_rounds"] == pytest.approx(
            [work["tokens"] / (ms / 1e3) for ms in r["round_ms"]]
        )
        assert r["transient_bytes"] > 0
        baseline = next(
            b for b in results if b["mode"] == r["mode"] and b["contestant"] == names[2]
        )
        paired = [b / a for a, b in zip(r["round_ms"], baseline["round_ms"], strict=True)]
        assert r["x_transformers"] == pytest.approx(statistics.median(paired))
    assert {t["what"].split(", ")[-1] for t in report["targets"]} == {"fwd", "fwd+bwd"}
    assert all(t["met"] == (t["measured"] >= 1.5) for t in report["targets"])


def test_qwen3_5_generation_quick(tmp_path):
    stdout = run_script(
        "qwen3_5_generation.py", "--quick", "--rounds", "2", "--threads", "1",
        "--out", str(tmp_path),
    )  # fmt: skip
    report = json.loads((tmp_path / "qwen3_5_generation.json").read_text())
    assert (tmp_path / "qwen3_5_generation_cpu.txt").read_text().strip() in stdout
    assert report["same_tokens"] and "same tokens: True" in stdout
    text = report["model"]["config"]["text_config"]
    assert text["layer_types"] == [*["linear_attention"] * 3, "full_attention"]
    results = report["results"]
    assert {(r["batch"], r["contestant"]) for r in results} == {
        (b, c) for b in (1, 4) for c in ("fusion_eager", "transformers")
    }
    for r in results:
        assert r["new_tokens"] == 4 and r["tokens_equal"]
        assert r["tokens_per_s"] == pytest.approx(statistics.median(r["tokens_per_s_rounds"]))
        if r["contestant"] == "transformers":
            assert r["x_transformers_tokens_per_s"] == 1.0
    assert len(report["targets"]) == 2


def test_full_generation_model_has_qwen3_5_0_8b_widths():
    """What the full run builds: the 0.8B's text widths, three DeltaNet layers and one full."""
    from transformers import Qwen3_5Config

    from bench_helpers import load_script

    config = Qwen3_5Config(**load_script("qwen3_5_generation").hf_config(32768, quick=False))
    text = config.text_config
    assert (text.hidden_size, text.intermediate_size, text.num_hidden_layers) == (1024, 3584, 4)
    assert (text.num_attention_heads, text.num_key_value_heads, text.head_dim) == (8, 2, 256)
    assert (text.linear_num_key_heads, text.linear_num_value_heads) == (16, 16)
    assert (text.linear_key_head_dim, text.linear_value_head_dim) == (128, 128)
    assert text.linear_conv_kernel_dim == 4 and text.layer_types[-1] == "full_attention"
    assert text.layer_types.count("linear_attention") == 3


@pytest.mark.parametrize("train", ["full", "lora"])
def test_finetune_qwen3_5_quick(tmp_path, train):
    """``finetune.py --family qwen3_5``: fusion packed and padded against transformers padded on
    the same weights and samples, one first loss for all; transformers' padding-free rows
    checked against its padded loss, untimed; the target reported."""
    args = ("--quick", "--family", "qwen3_5", "--train", train, "--out", str(tmp_path))
    stdout = run_script("finetune.py", *args)
    report = json.loads((tmp_path / "finetune_qwen3_5.json").read_text())
    assert (tmp_path / "finetune_qwen3_5_cpu.txt").read_text() in stdout
    assert report["settings"]["train"] == train and report["settings"]["rounds"] == 1
    results = report["results"]
    assert set(results) == {"transformers_padded", "fusion_padded", "fusion_packed"}
    assert report["first_step_losses_agree"]
    first = [r["losses"][0] for r in results.values()]
    assert first == pytest.approx([first[0]] * 3, rel=1e-4)
    assert len({tuple(r["tokens"]) for r in results.values()}) == 1  # the same samples
    assert len({r["trainable_parameters"] for r in results.values()}) == 1
    assert results["fusion_packed"]["padding_fraction"] == 0.0
    assert results["fusion_padded"]["positions"] == results["transformers_padded"]["positions"]
    assert report["padding_free_first_loss"] is None  # not a timed contestant
    check = report["padding_free_untimed_check"]
    assert check["samples"] == report["settings"]["samples_per_step"]
    per_sample = check["per_sample_relative_difference"]
    assert len(per_sample) == check["samples"] and check["first_in_row"][0]
    assert check["agree"] == (max([check["relative_difference"], *per_sample]) <= 1e-5)
    # A row's first sample has nothing before it to leak from: only rounding differs.
    firsts = [d for d, first in zip(per_sample, check["first_in_row"], strict=True) if first]
    assert max(firsts) <= check["tolerance"] == 1e-5
    assert "transformers_padding_free (untimed)" in stdout
    packed = results["fusion_packed"]
    target = report["target"]
    assert target["measured"] == packed["x_transformers_tokens_per_s"]
    assert target["met"] == (target["measured"] >= 1.5)
    text = report["model"]["config"]["text_config"]
    assert text["layer_types"] == [*["linear_attention"] * 3, "full_attention"]


def test_finetune_qwen3_5_model_has_0_8b_widths():
    """What the full fine-tuning run builds: the 0.8B's widths, one [L, L, L, F] group, the
    vision tower cut to 2 blocks, a 32768-id vocabulary; padding-free is not a contestant."""
    from transformers import Qwen3_5Config

    from bench_helpers import load_script

    script = load_script("finetune")
    config = Qwen3_5Config(**script.hf_config(False, "qwen3_5"))
    text, vision = config.text_config, config.vision_config
    assert (text.hidden_size, text.intermediate_size, text.num_hidden_layers) == (1024, 3584, 4)
    assert (text.num_attention_heads, text.num_key_value_heads, text.head_dim) == (8, 2, 256)
    assert (text.linear_num_key_heads, text.linear_num_value_heads) == (16, 16)
    assert (text.linear_key_head_dim, text.linear_value_head_dim) == (128, 128)
    assert text.linear_conv_kernel_dim == 4 and text.vocab_size == 32768
    assert text.layer_types == [*["linear_attention"] * 3, "full_attention"]
    assert (vision.depth, vision.hidden_size, vision.num_heads) == (2, 768, 12)
    assert (vision.out_hidden_size, vision.patch_size) == (1024, 16)
    assert script.parse_args(["--family", "qwen3_5", "--out", "/tmp"]).only == [
        "transformers_padded", "fusion_padded", "fusion_packed",
    ]  # fmt: skip
    with pytest.raises(SystemExit):
        script.parse_args(["--family", "qwen3_5", "--only", "transformers_padding_free"])


def test_gpu_check_deltanet_cpu_smoke(tmp_path):
    stdout = run_script("gpu_check.py", "--deltanet-only", "--cpu-smoke", "--out", str(tmp_path))
    report = json.loads((tmp_path / "gpu_check_deltanet_cpu_smoke.json").read_text())
    d = report["deltanet"]
    assert (d["reference"], d["contestant"]) == ("torch", "torch")
    assert set(d["paths"]) == {"fp32", "bf16"}
    for p in d["paths"].values():
        assert p["ok"] and p["finite"] and p["worst_share_of_tolerance"] == 0
        assert set(p["max_abs_diff"]) >= {"output", "input", "A_log", "out_proj.weight"}
        assert p["fwd_bwd_ms"]["torch"] > 0
    assert report["failures"] == [] and "Gated DeltaNet packed" in stdout


@pytest.mark.parametrize("groups", [1, 4, 16])
@pytest.mark.parametrize("input_grad", [True, False])
def test_floor_counts_a_grouped_conv_backward_as_its_forward(groups, input_grad):
    """The floor tool's FLOPs of a convolution's backward: each gradient asked for costs what
    the forward does, groups counted (torch's own formula overcounts the depthwise conv of the
    Gated DeltaNet's weight gradient by its channel count)."""
    from torch.utils.flop_counter import FlopCounterMode

    floor = load_script("finetune_floor")
    channels, length, kernel = 16, 50, 4
    conv = torch.nn.Conv1d(channels, channels, kernel, groups=groups, padding=kernel - 1)
    x = torch.randn(2, channels, length, requires_grad=input_grad)
    with FlopCounterMode(display=False, custom_mapping=floor.FLOP_FORMULAS) as counter:
        conv(x).sum().backward()
    forward = 2 * 2 * (length + kernel - 1) * channels * (channels // groups) * kernel
    assert counter.get_total_flops() == forward * (2 + input_grad)
