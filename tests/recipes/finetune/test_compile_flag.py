"""``--compile``: the recipe's decoder layers compiled (``fusion.training.modules
.compile_layers``, whose recompilation tests are in tests/training/test_compile.py) train to
the eager run's losses."""

import torch

from recipes.finetune import main


def test_compiled_run_matches_eager(model_dirs, tmp_path, ft):
    data = ft.write_data(tmp_path / "data")
    runs = {}
    for flag in ("--compile", "--eager"):
        out = tmp_path / flag.strip("-")
        argv = ft.recipe_args(model_dirs["smolvlm"], data, out, "--steps", "3")
        argv += [flag] if flag == "--compile" else []
        assert main([*argv, "--batch-tokens", "256", "--num-workers", "0"]) == 0
        runs[flag] = ft.metrics(out)["losses"]
    assert len(runs["--compile"]) == 3
    torch.testing.assert_close(runs["--compile"], runs["--eager"], rtol=1e-5, atol=1e-5)
