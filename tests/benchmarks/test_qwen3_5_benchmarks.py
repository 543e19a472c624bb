"""``benchmarks/deltanet_layer.py`` and ``benchmarks/qwen3_5_generation.py`` run end to end in
their quick mode (tiny widths, rounds in alternating order) and report what they measure: the
contestants agree before timing, tokens/s, paired ratios to transformers, the targets."""

import json
import statistics

import pytest

from bench_helpers import run_script


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
