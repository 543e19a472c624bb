"""``--data`` / ``--eval-data`` as Hugging Face data sets (written by ``datasets`` in the test,
images embedded as PNG bytes): the run equals the one on the same conversations as JSON Lines
with image files, loss for loss; a bad row is one error line naming the row; without the
``data`` extra the error names it."""

import json

import pytest

from recipes.finetune import main
from vlm_helpers import trl_features

datasets = pytest.importorskip("datasets")
pytest.importorskip("pyarrow")
datasets.disable_progress_bars()


def as_data_set(jsonl):
    """The conversations of ``jsonl`` in TRL's columns: image items without paths, the
    image files' bytes in ``images``."""
    rows = {"messages": [], "images": []}
    for line in jsonl.read_text().splitlines():
        images, messages = [], []
        for message in json.loads(line)["messages"]:
            content = []
            for item in message["content"]:
                if item["type"] == "image":
                    data = (jsonl.parent / item["path"]).read_bytes()
                    images.append({"bytes": data, "path": None})
                    content.append({"type": "image"})
                else:
                    content.append(item)
            messages.append({**message, "content": content})
        rows["messages"].append(messages)
        rows["images"].append(images)
    features = trl_features()
    return datasets.Dataset.from_dict(rows, features=features)


@pytest.mark.parametrize("layout", ["parquet", "save_to_disk"])
def test_a_data_set_trains_as_its_json_lines(layout, model_dirs, tmp_path, ft):
    jsonl = ft.write_data(tmp_path / "data", count=6)
    dataset = as_data_set(jsonl)
    if layout == "parquet":
        data = tmp_path / "train.parquet"
        dataset.to_parquet(str(data))
    else:
        data = tmp_path / "train_saved"
        dataset.save_to_disk(str(data))
    runs = {}
    for name, path in (("jsonl", jsonl), ("hf", data)):
        out = tmp_path / f"run_{name}"
        argv = ft.recipe_args(model_dirs["llava"], path, out, "--steps", "3", "--lr", "1e-2")
        assert main([*argv, "--batch-tokens", "256", "--eval-data", str(path)]) == 0
        runs[name] = ft.metrics(out)
    assert runs["hf"]["losses"] == runs["jsonl"]["losses"]
    assert runs["hf"]["eval_losses"] == runs["jsonl"]["eval_losses"]
    assert runs["hf"]["conversations"] == 6


def test_a_bad_row_is_one_line_naming_the_row(model_dirs, tmp_path, ft, capsys):
    jsonl = ft.write_data(tmp_path / "data", count=3)
    rows = as_data_set(jsonl).to_dict()
    rows["images"][1] = [{"bytes": b"not a png", "path": None}]
    data = tmp_path / "bad.parquet"
    datasets.Dataset.from_dict(rows, features=as_data_set(jsonl).features).to_parquet(str(data))
    out = tmp_path / "run"
    capsys.readouterr()
    assert main(ft.recipe_args(model_dirs["llava"], data, out, "--steps", "1")) == 1
    err = capsys.readouterr().err
    assert f"error: --data: {data}:row 1: images[0]: not an image Pillow can decode" in err
    assert len(err.splitlines()) == 1
    capsys.readouterr()
    argv = ft.recipe_args(model_dirs["llava"], data, out, "--steps", "1", "--skip-bad-samples")
    assert main(argv) == 0
    assert ft.metrics(out)["conversations"] == 2 and ft.metrics(out)["skipped"] == 1


def test_without_the_extra_the_error_names_it(model_dirs, tmp_path, ft, capsys, monkeypatch):
    import builtins

    jsonl = ft.write_data(tmp_path / "data", count=2)
    data = tmp_path / "train.parquet"
    as_data_set(jsonl).to_parquet(str(data))
    real = builtins.__import__

    def no_pyarrow(name, *args, **kwargs):
        if name.split(".")[0] == "pyarrow":
            raise ImportError(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_pyarrow)
    capsys.readouterr()
    assert main(ft.recipe_args(model_dirs["llava"], data, tmp_path / "run", "--steps", "1")) == 1
    err = capsys.readouterr().err
    assert "error: --data: reading Parquet data sets needs pyarrow: pip install " in err
    assert "'torch-early-fusion[data]'" in err
