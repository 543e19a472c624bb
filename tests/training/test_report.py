import io
import json
import os

import pytest
import torch

from fusion.training import Runtime, log, plot_losses, progress_bar, write_json
from fusion.training import report as report_module
from fusion.training.report import NoBar

MAIN = Runtime(0, 2, 0, torch.device("cpu"), distributed=True)
OTHER = Runtime(1, 2, 1, torch.device("cpu"), distributed=True)


def test_the_loss_plot_shows_eval_points(tmp_path):
    pytest.importorskip("matplotlib")
    from PIL import Image

    losses = [4.0 / (step + 1) for step in range(120)] + [float("nan")]
    plot_losses(losses, tmp_path / "train.png", title="t")
    plot_losses(losses, tmp_path / "both.png", title="t", eval_losses=[(0, 5.0), (60, 0.5)])
    with Image.open(tmp_path / "both.png") as image:
        assert image.format == "PNG" and image.size == (700, 400)
        both = image.convert("RGB").tobytes()
    with Image.open(tmp_path / "train.png") as image:
        assert both != image.convert("RGB").tobytes()  # the eval points are drawn
    assert sorted(p.name for p in tmp_path.iterdir()) == ["both.png", "train.png"]


def test_metrics_json_is_written_atomically(tmp_path, monkeypatch):
    path = tmp_path / "metrics.json"
    write_json({"losses": [1.0, 0.5], "tokens_per_second": 10.0}, path)
    assert json.loads(path.read_text()) == {"losses": [1.0, 0.5], "tokens_per_second": 10.0}

    def fail(*args):
        raise OSError("disk full")

    monkeypatch.setattr(report_module, "atomic_write_bytes", fail)
    with pytest.raises(OSError, match="disk full"):
        write_json({"losses": []}, path)
    assert json.loads(path.read_text())["losses"] == [1.0, 0.5]


def test_only_the_main_process_logs_and_shows_a_bar(capsys):
    log(OTHER, "from rank 1")
    log(MAIN, "from rank 0")
    assert capsys.readouterr().out == "from rank 0\n"
    assert isinstance(progress_bar(OTHER, total=3), NoBar)
    assert isinstance(progress_bar(MAIN, total=3, enabled=False), NoBar)


def test_the_progress_bar(monkeypatch):
    tqdm = pytest.importorskip("tqdm").tqdm
    stream = io.StringIO()
    monkeypatch.setattr(report_module.sys, "stderr", stream)
    bar = progress_bar(MAIN, total=10, initial=4, unit="step")
    assert isinstance(bar, tqdm)
    bar.set_postfix(loss="1.0000", tokens_per_s="512", refresh=False)
    bar.update(1)
    bar.close()
    text = stream.getvalue()
    assert "5/10" in text and "tokens_per_s=512" in text
    monkeypatch.setattr(report_module, "tqdm", None)
    assert isinstance(progress_bar(MAIN, total=10), NoBar)
    assert "tqdm is not installed" in report_module.progress_unavailable()


def test_peak_memory_is_at_least_what_the_process_holds_now():
    """On CPU the peak resident set, in bytes: not below the resident set now (Linux's
    /proc/self/statm counts pages; the kernel updates the peak lazily, hence the margin, far
    from the factor 1024 of a peak in KiB)."""
    peak = report_module.peak_memory(torch.device("cpu"))
    with open("/proc/self/statm") as statm:
        resident = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    assert peak["kind"] == "cpu_max_rss" and peak["bytes"] >= resident // 2 > 0
    if torch.cuda.is_available():
        device = torch.device("cuda")
        held = torch.empty(2**20, device=device)  # 4 MiB
        peak = report_module.peak_memory(device)
        assert peak["kind"] == "cuda_max_allocated" and peak["bytes"] >= held.numel() * 4
