"""``benchmarks/packed_attention.py --quick`` runs end to end and reports every case, and
``benchmarks/gpu_check.py --packed-only --cpu-smoke`` checks the CPU packed-attention paths."""

import json
import statistics

import pytest

from bench_helpers import run_script


def test_packed_attention_quick(tmp_path):
    stdout = run_script(
        "packed_attention.py", "--quick", "--only", "mask", "sdpa", "--threads", "1",
        "--out", str(tmp_path),
    )  # fmt: skip
    report = json.loads((tmp_path / "packed_attention_op.json").read_text())
    assert (tmp_path / "packed_attention_op_cpu.txt").read_text().strip() in stdout
    results = report["results"]
    cases = {(r["seq_len"], r["mode"], r["contestant"]) for r in results}
    assert cases == {
        (s, m, c) for s in (128, 256) for m in ("fwd", "fwd+bwd") for c in ("mask", "sdpa")
    }
    for r in results:
        assert r["median_ms"] == pytest.approx(statistics.median(r["round_ms"]))
        assert r["max_abs_diff_vs_mask"] < 1e-5  # the same attention at the samples' positions
        assert r["samples"] > r["rows"] >= 1
    assert all(r["x_mask"] == 1.0 for r in results if r["contestant"] == "mask")


def test_gpu_check_packed_cpu_smoke(tmp_path):
    stdout = run_script("gpu_check.py", "--packed-only", "--cpu-smoke", "--out", str(tmp_path))
    report = json.loads((tmp_path / "gpu_check_packed_cpu_smoke.json").read_text())
    paths = report["packed_attention"]["paths"]
    assert set(paths) == {f"{b} {d}" for b in ("mask", "sdpa") for d in ("fp32", "bf16")}
    assert all(p["ok"] and p["finite"] for p in paths.values())
    assert paths["sdpa fp32"]["max_abs_diff_vs_alone"] < 1e-4
    assert report["failures"] == [] and "all checks passed" in stdout
