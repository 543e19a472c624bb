"""The benchmark scripts run end to end (``--quick``, ``--cpu-smoke``) and report what they
measure: every contestant, the floor, transient memory and host synchronisation."""

import json
import os
import statistics

import pytest
import torch

from bench_helpers import (
    BENCHMARKS,
    FINETUNE_CONTESTANTS,
    assert_padding_free_matches_padded,
    load_script,
    run_script,
)
from fusion.merge.fused import triton


def test_merge_kernels_quick(tmp_path):
    stdout = run_script("merge_kernels.py", "--quick", "--out", str(tmp_path))
    report = json.loads((tmp_path / "merge_kernels.json").read_text())
    assert (tmp_path / "merge_kernels.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert report["machine"]["torch"] and report["machine"]["cpu_count"]
    assert report["settings"]["default_impl"] == "index"

    results = report["results"]
    cases = {(r["tokens"], r["dim"], r["fraction"], r["mode"]) for r in results}
    assert cases == {(256, 64, f, m) for f in (0.0, 0.5) for m in ("fwd", "fwd+bwd")}
    impls = {"copy", "reference", "index", "auto", "index_table"}
    impls |= {"bool_index", "torchtune"}
    for case in cases:
        rows = {
            r["impl"]: r
            for r in results
            if (r["tokens"], r["dim"], r["fraction"], r["mode"]) == case
        }
        assert set(rows) == impls, case
        assert rows["copy"]["ratio_to_copy"] == 1.0
        for r in rows.values():
            assert r["median_ms"] > 0 and r["ratio_to_copy"] > 0
            assert len(r["round_ms"]) == report["settings"]["rounds"]
            assert r["median_ms"] == pytest.approx(statistics.median(r["round_ms"]))
            paired = zip(r["round_ms"], rows["copy"]["round_ms"], strict=True)
            assert r["ratio_to_copy"] == pytest.approx(statistics.median(a / b for a, b in paired))
        # Sync-free implementations; the baselines' boolean indexing and masked_select are not.
        assert not rows["index"]["synchronises"] and not rows["reference"]["synchronises"]
        assert not rows["auto"]["synchronises"] and rows["auto"]["auto_picks"] == "index"
        assert "aten.masked_select.default" in rows["torchtune"]["sync_ops"]
        assert rows["bool_index"]["synchronises"]
        if case[3] == "fwd":
            # index keeps O(tokens) metadata; reference drops a whole embedded copy.
            out = rows["index"]["output_bytes"]
            assert rows["index"]["transient_bytes"] < out / 4
            assert rows["reference"]["transient_bytes"] >= out
    for impl in impls:
        assert impl in stdout


def test_fusion_forward_quick(tmp_path):
    stdout = run_script("fusion_forward.py", "--quick", "--out", str(tmp_path))
    report = json.loads((tmp_path / "fusion_forward.json").read_text())
    for mode in ("fwd", "fwd+bwd"):
        r = report["results"][mode]
        assert set(r["median_ms"]) == {"fusion", "decoder", "merge"}
        assert all(len(t) == report["settings"]["rounds"] for t in r["round_ms"].values())
        assert r["merge_share_pct"] > 0
        assert mode in stdout


@pytest.mark.skipif(triton is None, reason="Triton is not installed")
def test_gpu_check_cpu_smoke(tmp_path):
    """The GPU script's shared code paths, on Triton's interpreter (no GPU checks here)."""
    stdout = run_script("gpu_check.py", "--cpu-smoke", "--out", str(tmp_path))
    report = json.loads((tmp_path / "gpu_check_cpu_smoke.json").read_text())
    assert report["bits_equal_reference"] == {"index": True, "fused": True}
    assert set(report["bandwidth"]["median_us"]) >= {"copy_ (d2d)", "fused kernel"}
    assert all(p["ok"] for p in report["deltanet"]["paths"].values())
    cases = report["fused_loss"]["cases"]
    assert set(cases) == {"fp32 untied", "fp32 tied", "bf16 untied", "bf16 tied"}
    assert all(c["ok"] and c["relative_diff"]["loss"] <= 1e-5 for c in cases.values())
    assert "fused loss against the chunked loss" in stdout
    assert report["failures"] == []
    assert "all checks passed" in stdout


def test_checks_never_overwrite_the_committed_results():
    """Without ``--out``, a check (``--quick``) writes to a new temporary directory."""
    results = BENCHMARKS / "results"
    before = {p: p.stat().st_mtime_ns for p in results.rglob("*") if p.is_file()}
    for script in ("merge_kernels.py", "fusion_forward.py"):
        output = run_script(script, "--quick")
        assert "fusion-bench-" in output and str(results) not in output
    after = {p: p.stat().st_mtime_ns for p in results.rglob("*") if p.is_file()}
    assert after == before


def test_vlm_generation_quick(tmp_path):
    stdout = run_script("vlm_generation.py", "--quick", "--out", str(tmp_path))
    report = json.loads((tmp_path / "vlm_generation.json").read_text())
    assert report["same_tokens"] and "same tokens: True" in stdout
    for side in ("fusion", "transformers"):
        assert report["results"][side]["new_tokens"] == 4
        assert report["results"][side]["tokens_per_s"] > 0


def test_finetune_quick(tmp_path):
    stdout = run_script("finetune.py", "--quick", "--out", str(tmp_path))
    report = json.loads((tmp_path / "finetune.json").read_text())
    results = report["results"]
    assert set(results) == set(FINETUNE_CONTESTANTS)
    assert report["settings"]["rounds"] == 1  # --quick: one round unless --rounds
    assert report["first_step_losses_agree"]  # same weights, samples and loss on every side
    assert_padding_free_matches_padded(report, rounds=1)
    tokens = {name: r["tokens"] for name, r in results.items()}
    assert len({tuple(t) for t in tokens.values()}) == 1  # the same samples for everyone
    assert results["fusion_packed"]["padding_fraction"] == 0.0
    assert results["fusion_padded"]["positions"] == results["transformers_padded"]["positions"]
    assert results["fusion_padded"]["padding_fraction"] > 0
    packed_positions = results["fusion_packed"]["positions"]  # the same rows
    assert results["transformers_padding_free"]["positions"] == packed_positions
    for name, r in results.items():
        assert r["tokens_per_s"] > 0 and r["peak_memory_bytes"] > 0
        assert name in stdout
    # The paired ratios: to transformers padded (everyone else), to transformers padding-free
    # (fusion's), and fusion packed to fusion padded.
    has = {
        prefix: {name for name, r in results.items() if f"x_{prefix}_tokens_per_s" in r}
        for prefix in ("transformers", "padding_free", "fusion_padded")
    }
    assert has == {
        "transformers": set(FINETUNE_CONTESTANTS) - {"transformers_padded"},
        "padding_free": {"fusion_padded", "fusion_packed"},
        "fusion_padded": {"fusion_packed"},
    }
    packed, padded = results["fusion_packed"], results["fusion_padded"]
    for key, ratio in (("tokens_per_s", "tokens_per_s"), ("peak_memory_bytes", "peak_memory")):
        assert packed[f"x_fusion_padded_{ratio}"] == pytest.approx(packed[key] / padded[key])
        free = results["transformers_padding_free"][key]
        assert packed[f"x_padding_free_{ratio}"] == pytest.approx(packed[key] / free)
    assert "fusion_packed / fusion_padded" in stdout
    assert (tmp_path / "finetune_cpu.txt").read_text() in stdout
    # The machine's matrix-product rate, timed after each round: the floors' rate below.
    during = report["matrix_rate"]
    assert len(during["gflops_rounds"]) == 1 and set(during["gflops_rounds"][0]) == {
        "1024x96x384", "309x72x192", "128x72x6160"
    }  # fmt: skip
    assert during["best_gflops"] == max(during["gflops_rounds"][0].values()) > 0
    assert "fp32 matrix products after each round" in stdout

    # The floor under these results: the same model and samples, their work counted.
    floor_file = tmp_path / "floor.json"
    args = ("--quick", "--rounds", "2", "--results", str(tmp_path / "finetune.json"))
    args += ("--family", "qwen2_5_vl", "--train", "lora")  # the results' own stand over these
    stdout = run_script("finetune_floor.py", *args, "--out", str(floor_file))
    floor = json.loads(floor_file.read_text())
    stored = json.loads((tmp_path / "finetune.json").read_text())["settings"]
    for key in ("family", "train", "loss"):
        assert floor["settings"][key] == floor["finetune_settings"][key] == stored[key]
    work = floor["work"]
    assert set(work) == set(FINETUNE_CONTESTANTS)
    assert {name: w["positions"] for name, w in work.items()} == {
        name: r["positions"][0] for name, r in results.items()
    }
    assert len({w["tower_gflop"] for w in work.values()}) == 1  # the same frozen tower
    assert work["fusion_packed"]["tower_gflop"] > 0
    # Fewer positions, and the output layer at the targets only: less work.
    assert work["fusion_packed"]["gflop"] < work["fusion_padded"]["gflop"]
    assert work["fusion_packed"]["gflop"] < work["transformers_padding_free"]["gflop"]
    assert work["transformers_padding_free"]["gflop"] < work["transformers_padded"]["gflop"]
    rate = floor["rate_gflops"]
    assert floor["rate_from"] == "run" and rate == during["best_gflops"]
    assert floor["rate_now_gflops"] == max(floor["gemm_gflops"].values()) > 0
    for w in work.values():
        assert w["floor_s"] == pytest.approx(w["gflop"] / rate)
        # The step's kernels replayed alone: matrix products and attention among them, and
        # the share of the floor their rate reaches against the best rate measured now.
        assert {"aten::mm", "aten::_scaled_dot_product_flash_attention_for_cpu"} <= set(
            w["kernels_by_op"]
        )
        assert w["kernels_s"] == pytest.approx(
            sum(e["seconds"] for e in w["kernels_by_op"].values())
        )
        assert w["kernels_reach"] == pytest.approx(
            w["gflop"] / w["kernels_s"] / floor["rate_now_gflops"]
        )
    memory = floor["memory"]
    parts = ("process_before_load_mib", "parameters_mib", "adamw_state_mib", "step_inputs_mib")
    assert memory["floor_mib"] == pytest.approx(
        sum(memory[k] for k in parts)
        + max(memory["saved_activations_mib"], memory["gradients_mib"])
    )
    assert memory["saved_activations_mib"] > 0 and memory["step_inputs_mib"] > 0
    assert memory["gradients_mib"] == pytest.approx(memory["adamw_state_mib"] / 2)
    # The loss's own floor: every saved activation, one chunk's logits and (the fused loss
    # in full fine-tuning) the output's gradient at once; a frozen output (LoRA) adds none.
    assert memory["loss_time_floor_mib"] == pytest.approx(
        sum(memory[k] for k in parts) + memory["saved_activations_mib"]
        + memory["loss_chunk_logits_mib"] + memory["output_gradient_at_loss_mib"]
    )  # fmt: skip
    assert memory["loss_chunk_logits_mib"] > 0
    assert (memory["output_gradient_at_loss_mib"] > 0) == (stored["train"] == "full")
    assert "loss-time floor" in stdout
    step = results["transformers_padded"]["step_s"][0]  # one round: its first timed step
    bound = floor["bounds"]["fusion_packed / transformers_padded (tokens/s, at most)"]
    assert bound == pytest.approx(step / work["fusion_packed"]["floor_s"])
    assert "memory floor" in stdout
    shares = floor["share_of_time_floor"]
    assert set(shares) == set(FINETUNE_CONTESTANTS)
    assert shares["transformers_padded"] == pytest.approx(
        work["transformers_padded"]["floor_s"] / step
    )
    assert floor["kernels_of_step"]["transformers_padded"] == pytest.approx(
        work["transformers_padded"]["kernels_s"] / step
    )
    assert "its kernels alone (timed now) take" in stdout
    peak = results["fusion_packed"]["peak_memory_bytes"] / 2**20
    above = floor["fusion_packed_peak_above_memory_floor"]
    assert above == pytest.approx(peak / memory["floor_mib"] - 1)
    assert "of its time floor" in stdout and "above its memory floor" in stdout

    # A contestant the results lack (out of memory there, or left out with --only) gets no
    # floor, and no bound; results without a rate of their own (older runs) get the rate now.
    lacking = json.loads((tmp_path / "finetune.json").read_text())
    del lacking["results"]["transformers_padded"], lacking["results"]["fusion_padded"]
    del lacking["matrix_rate"]
    (tmp_path / "lacking.json").write_text(json.dumps(lacking))
    args = ("--quick", "--rounds", "1", "--results", str(tmp_path / "lacking.json"))
    stdout = run_script("finetune_floor.py", *args, "--out", str(floor_file))
    floor = json.loads(floor_file.read_text())
    assert set(floor["work"]) == {"transformers_padding_free", "fusion_packed"}
    assert not any("padded" in key for key in floor["bounds"])
    assert floor["rate_from"] == "now" and floor["rate_gflops"] == floor["rate_now_gflops"]
    assert "the floors' rate" in stdout and "measured now" in stdout

    # Times measured on another machine are not bounded by this one's floor: refused.
    elsewhere = json.loads((tmp_path / "finetune.json").read_text())
    elsewhere["machine"]["platform"] = "Linux-another-machine"
    (tmp_path / "elsewhere.json").write_text(json.dumps(elsewhere))
    floor_script = load_script("finetune_floor")
    args = floor_script.parse_args(["--quick", "--results", str(tmp_path / "elsewhere.json")])
    with pytest.raises(SystemExit, match="measured on Linux-another-machine, this is"):
        floor_script.finetune_settings(args, tmp_path)


@pytest.mark.parametrize(
    ("loss", "deferred", "tied", "gradient"),
    [("fused", False, True, True), ("fused", False, False, True), ("fused", True, True, False),
     ("chunked", False, True, False)],
)  # fmt: skip
def test_the_loss_time_floor_holds_a_chunk_and_the_output_gradient(loss, deferred, tied, gradient):
    """1100 targets go in three even chunks of at most 512 rows (367, 367, 366): the largest
    one's float32 logits; the trained output's gradient only where the fused loss makes it in
    the forward (not deferred; the chunked loss makes it in the backward)."""
    from types import SimpleNamespace

    from helpers import build_tiny_decoder

    floor_script = load_script("finetune_floor")
    decoder = build_tiny_decoder(tie_word_embeddings=tied)
    model = SimpleNamespace(decoder=decoder)
    fargs = SimpleNamespace(loss=loss, defer_output_grad=deferred, loss_chunk_rows=None)
    logits, output_gradient = floor_script.loss_held_mib(model, fargs, 1100)
    vocab, width = decoder.tok_embeddings.weight.shape
    assert logits == 367 * vocab * 4 / 2**20
    assert output_gradient == (vocab * width * 4 / 2**20 if gradient else 0)
    fargs.loss_chunk_rows = 100  # the run's own chunks: 11 of 100
    assert floor_script.loss_held_mib(model, fargs, 1100)[0] == 100 * vocab * 4 / 2**20
    decoder.requires_grad_(False)  # a frozen output has no gradient to hold
    assert floor_script.loss_held_mib(model, fargs, 1100)[1] == 0


@pytest.mark.parametrize(
    "during", [{}, {"best_gflops": 0}, {"best_gflops": -3.0}, {"best_gflops": float("nan")},
               {"best_gflops": float("inf")}, {"best_gflops": "200"}, {"best_gflops": True}, [200]],
)  # fmt: skip
def test_the_floor_refuses_a_run_rate_that_bounds_nothing(during):
    floor_script = load_script("finetune_floor")
    with pytest.raises(SystemExit, match=r"matrix_rate.best_gflops: expected a positive finite"):
        floor_script.run_rate(during)
    assert floor_script.run_rate({"best_gflops": 203}) == 203.0


def test_finetune_matrix_rate_process(tmp_path):
    """What the run starts after each round on CPU (``matrix_rate``): the family's matrix
    products timed in a fresh process, written as a rate per shape."""
    out = tmp_path / "rate.json"
    run_script(
        "finetune.py", "--rate-only", "--quick", "--family", "qwen2_5_vl", "--result", str(out)
    )
    rates = json.loads(out.read_text())
    assert set(rates) == {"512x160x427", "256x256x1376", "128x256x18992"}  # Qwen's, / 8
    assert all(rate > 0 for rate in rates.values())


def test_finetune_transparent_huge_pages_reach_every_process(tmp_path, capsys):
    """``--transparent-huge-pages`` sets PyTorch's ``THP_MEM_ALLOC_ENABLE`` in the environment
    of every process the run starts, and nowhere without it; ``--quick``, one process whose
    allocator has read its environment already, is refused by name."""
    script = load_script("finetune")
    out = ["--out", str(tmp_path)]
    on = script.contestant_env(script.parse_args([*out, "--transparent-huge-pages"]))
    off = script.contestant_env(script.parse_args(out))
    assert on["THP_MEM_ALLOC_ENABLE"] == "1"
    assert off.get("THP_MEM_ALLOC_ENABLE") == os.environ.get("THP_MEM_ALLOC_ENABLE")
    assert {k: v for k, v in on.items() if k != "THP_MEM_ALLOC_ENABLE"} == {
        k: v for k, v in off.items() if k != "THP_MEM_ALLOC_ENABLE"
    }
    with pytest.raises(SystemExit):
        script.parse_args(["--quick", "--transparent-huge-pages"])
    assert "--transparent-huge-pages: expected a run in fresh processes" in capsys.readouterr().err


def test_preprocessing_quick(tmp_path):
    stdout = run_script("preprocessing.py", "--quick", "--threads", "1", "--out", str(tmp_path))
    report = json.loads((tmp_path / "preprocessing.json").read_text())
    assert report["settings"]["fusion_resize"] == "pillow"  # Pillow is installed here
    rows = report["results"]
    assert {(r["processor"], r["height"], r["width"]) for r in rows} == {
        (name, h, w) for name in ("llava_1_5", "smolvlm_256m") for h, w in ((120, 160), (90, 90))
    }
    for r in rows:
        assert r["same_shape"] and r["max_abs_difference"] == 0.0  # the same pixels
        assert len(r["fusion_s"]) == len(r["transformers_s"]) == report["settings"]["rounds"]
        assert r["fusion_median_s"] > 0 and r["ratio_transformers_to_fusion"] > 0
        assert r["processor"] in stdout


def test_finetune_qwen_lora_fused_profile_quick(tmp_path):
    """Qwen2.5-VL with LoRA adapters (fusion's and peft's), fusion's fused loss and the
    profile's shares: the same first loss everywhere (adapters start at zero), every range
    seen."""
    args = ("--quick", "--family", "qwen2_5_vl", "--train", "lora", "--loss", "fused")
    stdout = run_script("finetune.py", *args, "--profile", "--out", str(tmp_path))
    report = json.loads((tmp_path / "finetune_qwen2_5_vl.json").read_text())
    assert report["settings"]["train"] == "lora" and report["settings"]["loss"] == "fused"
    assert report["first_step_losses_agree"]
    assert_padding_free_matches_padded(report, rounds=1)
    trainable = {r["trainable_parameters"] for r in report["results"].values()}
    assert len(trainable) == 1  # the same adapters on both sides
    for name, r in report["results"].items():
        assert set(r["profile_s"]) == {"vision_tower", "decoder", "loss", "backward", "optimizer"}
        assert r["profile_s"]["decoder"] > 0 and r["profile_s"]["backward"] > 0
        assert f"profile {name}:" in stdout


def test_finetune_deferred_output_grad_quick(tmp_path):
    """``--defer-output-grad``: the same steps as the output's gradient made in the forward
    (Qwen2.5-VL, full fine-tuning of its tied output: the timed step's loss follows the
    warm-up step's gradients); refused with the chunked loss."""
    losses = {}
    for deferred in (False, True):
        out = tmp_path / str(deferred)
        args = ("--quick", "--family", "qwen2_5_vl", "--train", "full", "--loss", "fused")
        args += ("--only", "fusion_packed", "--out", str(out))
        run_script("finetune.py", *args, *["--defer-output-grad"] * deferred)
        report = json.loads((out / "finetune_qwen2_5_vl.json").read_text())
        assert report["settings"]["defer_output_grad"] == deferred
        losses[deferred] = report["results"]["fusion_packed"]["losses"]
    assert len(losses[True]) == 1  # the timed step, after the warm-up's optimizer step
    # Within a few float32 ulps (the chunks' summation order); without the deferred gradient
    # of its output the step's loss moves by 2e-6 relative.
    torch.testing.assert_close(losses[True], losses[False], rtol=5e-7, atol=0)
    script = load_script("finetune")
    with pytest.raises(SystemExit):
        script.parse_args(["--quick", "--loss", "chunked", "--defer-output-grad"])


def test_optimizer_step_quick(tmp_path):
    stdout = run_script("optimizer_step.py", "--quick", "--out", str(tmp_path))
    report = json.loads((tmp_path / "optimizer_step.json").read_text())
    assert set(report["results"]) == {"loop", "foreach", "fused"}
    assert report["results"]["loop"]["speedup_over_loop"] == 1.0
    for name, result in report["results"].items():
        low, high = result["step_ms_range"]
        assert 0 < low <= result["step_ms_median"] <= high, name
        assert f"{name} " in stdout
    assert report["settings"]["parameters"] == sum(
        torch.Size(s).numel() for s in load_script("optimizer_step").parameter_shapes(2, 16)
    )
