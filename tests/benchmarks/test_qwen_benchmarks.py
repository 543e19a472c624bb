"""The Qwen2.5-VL contestants of ``benchmarks/finetune.py`` and ``benchmarks/vlm_generation.py``
run end to end in their quick mode (``--family qwen2_5_vl --quick``, rounds in alternating
order), and the full runs' models have Qwen2.5-VL-3B's widths."""

import json
import statistics

import pytest

from bench_helpers import (
    FINETUNE_CONTESTANTS,
    assert_padding_free_matches_padded,
    load_script,
    run_script,
)


def test_full_model_has_qwen2_5_vl_3b_widths():
    """What the full runs build: the 3B's published widths, 2 text layers, 2 vision blocks (one
    windowed, one full), samples whose images differ in size."""
    from transformers import Qwen2_5_VLConfig

    finetune = load_script("finetune")
    config = finetune.hf_config(False, "qwen2_5_vl")
    hf = Qwen2_5_VLConfig(**config)
    text, vision = hf.text_config, hf.vision_config
    assert (text.vocab_size, text.hidden_size, text.intermediate_size) == (151936, 2048, 11008)
    assert (text.num_attention_heads, text.num_key_value_heads) == (16, 2)
    assert text.num_hidden_layers == 2 and hf.tie_word_embeddings
    assert text.rope_parameters["mrope_section"] == [16, 24, 24]
    assert text.rope_parameters["rope_theta"] == 1e6
    assert (vision.hidden_size, vision.num_heads, vision.intermediate_size) == (1280, 16, 3420)
    assert (vision.out_hidden_size, vision.window_size, vision.patch_size) == (2048, 112, 14)
    assert (vision.spatial_merge_size, vision.depth, vision.fullatt_block_indexes) == (2, 2, [1])
    assert hf.image_token_id == 151655 and hf.vision_start_token_id == 151652

    samples = finetune.make_samples(8, config, seed=0, quick=False)
    grids = [tuple(s.image_grid_thw[0].tolist()) for s in samples]
    assert len(set(grids)) > 1
    for (t, h, w), sample in zip(grids, samples, strict=True):
        assert t == 1 and 16 <= h <= 32 and 16 <= w <= 32 and h % 2 == w % 2 == 0
        assert int((sample.tokens == hf.image_token_id).sum()) == h * w // 4
        assert sample.pixel_values.shape == (h * w, 3 * 2 * 14 * 14)


def test_finetune_quick_qwen2_5_vl(tmp_path):
    stdout = run_script(
        "finetune.py", "--quick", "--family", "qwen2_5_vl", "--rounds", "2", "--out", str(tmp_path)
    )
    report = json.loads((tmp_path / "finetune_qwen2_5_vl.json").read_text())
    assert (tmp_path / "finetune_qwen2_5_vl_cpu.txt").read_text() in stdout
    results = report["results"]
    assert set(results) == set(FINETUNE_CONTESTANTS)
    # Same weights, samples and loss on every side, in every round; transformers' padding-free
    # rows (M-RoPE positions behind a row of text positions) give its padded loss.
    assert report["first_step_losses_agree"]
    assert_padding_free_matches_padded(report, rounds=2)
    assert len({tuple(r["tokens"]) for r in results.values()}) == 1
    assert len({r["trainable_parameters"] for r in results.values()}) == 1
    assert results["fusion_packed"]["padding_fraction"] == 0.0
    assert results["fusion_padded"]["positions"] == results["transformers_padded"]["positions"]
    assert results["fusion_padded"]["padding_fraction"] > 0
    packed_positions = results["fusion_packed"]["positions"]  # the same rows
    assert results["transformers_padding_free"]["positions"] == packed_positions
    # Images of different sizes, some with several 56-pixel (4-patch) windows.
    grids = report["model"]["image_grids_thw"]
    assert len({tuple(g) for g in grids}) > 1 and max(max(g[1:]) for g in grids) > 4
    baseline = results["transformers_padded"]["tokens_per_s_rounds"]
    cpu_baseline = results["transformers_padded"]["tokens_per_cpu_s_rounds"]
    for name, r in results.items():
        assert len(r["tokens_per_s_rounds"]) == len(r["losses_rounds"]) == 2
        assert r["tokens_per_s"] == pytest.approx(statistics.median(r["tokens_per_s_rounds"]))
        assert len(r["step_cpu_s"]) == 2 and min(r["step_cpu_s"]) > 0
        assert r["peak_memory_bytes"] > 0 and name in stdout
        if name == "transformers_padded":  # the baseline has no ratio to itself
            assert "x_transformers_tokens_per_s" not in r
            continue
        paired = [a / b for a, b in zip(r["tokens_per_s_rounds"], baseline, strict=True)]
        assert r["x_transformers_tokens_per_s"] == pytest.approx(statistics.median(paired))
        cpu = [a / b for a, b in zip(r["tokens_per_cpu_s_rounds"], cpu_baseline, strict=True)]
        assert r["x_transformers_tokens_per_cpu_s"] == pytest.approx(statistics.median(cpu))
    # Alternating order: first in round 0 is last in round 1.
    assert results["transformers_padded"]["order_rounds"] == [0, 3]
    assert results["fusion_packed"]["order_rounds"] == [3, 0]


def test_vlm_generation_quick_qwen2_5_vl(tmp_path):
    stdout = run_script(
        "vlm_generation.py",
        "--quick",
        "--family",
        "qwen2_5_vl",
        "--rounds",
        "2",
        "--out",
        str(tmp_path),
    )
    report = json.loads((tmp_path / "vlm_generation_qwen2_5_vl.json").read_text())
    assert report["same_tokens"] and "same tokens: True" in stdout
    assert report["model"]["image_rows"] == 6  # 40 x 56 resized to 56 x 84: 4 x 6 patches
    assert report["model"]["image_grid_thw"] == [[1, 4, 6]]
    rounds = {side: report["results"][side]["rounds"] for side in ("fusion", "transformers")}
    for side, runs in rounds.items():
        r = report["results"][side]
        assert r["new_tokens"] == 4 and len(runs) == 2
        assert r["total_cpu_s"] >= r["first_token_cpu_s"] > 0
        median = statistics.median(x["tokens_per_s"] for x in runs)
        assert r["tokens_per_s"] == pytest.approx(median)
    paired = [
        a["tokens_per_s"] / b["tokens_per_s"]
        for a, b in zip(rounds["fusion"], rounds["transformers"], strict=True)
    ]
    assert report["speedup_tokens_per_s"] == pytest.approx(statistics.median(paired))
    cpu = report["paired_speedups"]["total_cpu_s"]
    expected = [b["total_cpu_s"] / a["total_cpu_s"] for a, b in zip(*rounds.values(), strict=True)]
    assert cpu["rounds"] == pytest.approx(expected)
    assert cpu["median"] == pytest.approx(statistics.median(expected))


def test_finetune_floor_quick_qwen2_5_vl_full_and_lora(tmp_path):
    """The floor tool on Qwen2.5-VL (issue 40): its own matrix shapes, the merger trained
    with the decoder under ``--train full``, and far less to update under ``--train lora``."""
    floors = {}
    for train in ("full", "lora"):
        out = tmp_path / f"{train}.json"
        args = ("--quick", "--rounds", "1", "--family", "qwen2_5_vl", "--train", train)
        stdout = run_script("finetune_floor.py", *args, "--out", str(out))
        floors[train] = json.loads(out.read_text())
        assert "memory floor" in stdout
    full, lora = floors["full"], floors["lora"]
    assert set(full["gemm_gflops"]) == {"512x160x427", "256x256x1376", "128x256x18992"}  # / 8
    for floor in (full, lora):
        work = floor["work"]
        assert set(work) == set(FINETUNE_CONTESTANTS)
        assert work["fusion_packed"]["gflop"] < work["fusion_padded"]["gflop"]
        assert len({w["tower_gflop"] for w in work.values()}) == 1
    # LoRA trains rank-8 adapters alone: a sliver of the AdamW state, and no weight gradients
    assert lora["memory"]["adamw_state_mib"] < full["memory"]["adamw_state_mib"] / 10
    assert lora["memory"]["parameters_mib"] >= full["memory"]["parameters_mib"]
    assert lora["work"]["fusion_packed"]["gflop"] < full["work"]["fusion_packed"]["gflop"]
