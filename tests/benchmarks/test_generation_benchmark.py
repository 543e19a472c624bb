"""``benchmarks/generation.py --quick`` runs end to end and reports every contestant, with
the same tokens, paired ratios and the roofline; a check never writes into the committed
results."""

import importlib.util
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def load_script():
    """The script as a module; its sibling imports (``common``) resolve as when it runs."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location("generation_bench", BENCHMARKS / "generation.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quick_run(tmp_path):
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "generation.py"), "--quick", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"},
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((tmp_path / "generation.json").read_text())
    assert (tmp_path / "generation.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "generation.txt").read_text().strip() in done.stdout
    settings, rounds = report["settings"], report["settings"]["rounds"]
    assert report["machine"]["torch"] and "transformers" in report["machine"]

    (case,) = report["cases"]
    assert (case["batch"], case["dtype"]) == (settings["batches"][0], "fp32")
    assert len(case["copy_round_s"]) == rounds and case["bandwidth_gbs"] > 0
    weights, kv = case["bytes"]["weights"], case["bytes"]["kv_cache"]
    assert case["bytes"]["call"] == settings["new_tokens"] * weights + kv > 0

    rows = {r["contestant"]: r for r in report["results"]}
    assert set(rows) == {
        "fusion_eager",
        "fusion_compiled",
        "hf_default",
        "hf_static_compiled",
        "torchtune",
    }
    timed = {name: r for name, r in rows.items() if "skipped" not in r}
    assert set(timed) >= {"fusion_eager", "fusion_compiled", "hf_default", "hf_static_compiled"}
    if "torchtune" not in timed:
        assert "not installed" in rows["torchtune"]["skipped"]
    eager = timed["fusion_eager"]
    for name, r in timed.items():
        assert r["tokens_equal"] and r["first_divergent_step"] is None, name
        assert len(r["round_s"]) == rounds and r["median_s"] == statistics.median(r["round_s"])
        assert r["tokens_per_s"] == pytest.approx(
            case["batch"] * settings["new_tokens"] / r["median_s"]
        )
        assert 0 < r["roofline_fraction"]
        pairs = zip(eager["round_s"], r["round_s"], strict=True)
        assert r["speedup_over_fusion_eager"] == pytest.approx(
            statistics.median(a / b for a, b in pairs)
        )
        assert name in done.stdout
    assert eager["speedup_over_fusion_eager"] == 1.0
    assert timed["hf_default"]["speedup_over_hf_default"] == 1.0


def test_quick_never_writes_into_the_committed_results(tmp_path):
    script = load_script()
    args = script.parse_args(["--quick"])
    assert args.out.is_dir() and args.out.resolve() != script.RESULTS.resolve()
    assert script.RESULTS not in args.out.resolve().parents
    args.out.rmdir()
    assert script.parse_args(["--quick", "--out", str(tmp_path)]).out == tmp_path
    assert script.parse_args([]).out == script.RESULTS


def test_roofline_bytes():
    script = load_script()
    args = script.parse_args(["--quick", "--out", "unused"])
    decoder = script.build_decoder(script.SHAPES["quick"], 64, seed=0)
    nbytes = script.bytes_per_call(decoder, args, batch=3, dtype=script.DTYPES["bf16"])
    params = sum(p.numel() for p in decoder.parameters())  # tied: the table is the output
    assert nbytes["weights"] == 2 * params
    attn = decoder.layers[0].attn
    slot = 2 * len(decoder.layers) * 3 * attn.num_kv_heads * attn.head_dim * 2
    fills = range(args.prompt_len + 1, args.prompt_len + args.new_tokens)
    assert nbytes["kv_cache"] == slot * sum(fills)
