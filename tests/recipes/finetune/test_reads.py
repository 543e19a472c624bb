"""A fine-tuning run's start-up (the data encoded, the model loaded and made trainable)
parses the model directory's config.json once."""

import pytest

from recipes.finetune import trainer
from recipes.finetune.cli import main


@pytest.mark.parametrize("kind", ["llava", "llama"])
def test_setup_parses_config_json_once(kind, model_dirs, tmp_path, monkeypatch, config_reads, ft):
    real_setup = trainer.setup
    during: list[str] = []

    def counted_setup(*args, **kwargs):
        config_reads.clear()
        run = real_setup(*args, **kwargs)
        during.extend(config_reads)
        return run

    monkeypatch.setattr(trainer, "setup", counted_setup)
    data = ft.write_data(tmp_path / "data", images=kind != "llama", count=2)
    argv = ft.recipe_args(model_dirs[kind], data, tmp_path / "run", "--steps", "1")
    assert main([*argv, "--train", "lora"]) == 0
    assert during == [str(model_dirs[kind] / "config.json")]
