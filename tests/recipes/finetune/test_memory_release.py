"""The recipe's --release-freed-memory (on by default, CPU only): freed host memory handed
back twice a step (fusion.training.release_freed_memory), and the run bit for bit the run
without it."""

import torch
from safetensors.torch import load_file

from fusion.training import host_memory
from recipes.finetune import main


def test_releases_twice_a_step_and_changes_nothing(model_dirs, tmp_path, ft, monkeypatch):
    data = ft.write_data(tmp_path / "data")
    calls: list[None] = []
    monkeypatch.setattr(host_memory, "release_freed_host_memory", lambda: calls.append(None))
    runs = {}
    for flag in ("--release-freed-memory", "--no-release-freed-memory"):
        out = tmp_path / flag
        argv = ft.recipe_args(model_dirs["smolvlm"], data, out, "--steps", "3", "--train", "full")
        assert main([*argv, "--checkpoint-every", "3", flag]) == 0
        runs[flag] = ft.metrics(out)["losses"], load_file(out / "final" / "model.safetensors")
        if flag == "--release-freed-memory":
            # each step: after the forward, and before the embedding's gradient
            assert len(calls) == 2 * 3, len(calls)
            calls.clear()
    assert calls == []  # off: no hook installed
    (on_losses, on_final), (off_losses, off_final) = runs.values()
    assert on_losses == off_losses
    assert on_final.keys() == off_final.keys()
    assert all(torch.equal(on_final[k], off_final[k]) for k in off_final)
