"""Tiny Hugging Face model directories (written by transformers in the test), generated images
and conversations, and runners for the fine-tuning recipe's tests."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from vlm_helpers import END_OF_TURN, TEMPLATE, make_image, write_model

ANSWERS = [
    "red fox",
    "blue cat",
    "old dog",
    "big owl",
    "tiny ant",
    "green frog",
    "pale bee",
    "wet eel",
]
KINDS = ("llava", "idefics3", "smolvlm", "llama")


def write_images(directory: Path, count: int, size: int = 16) -> list[str]:
    """``count`` distinct PNG files in ``directory``; their names."""
    names = []
    for i in range(count):
        rng = np.random.default_rng(i)
        image = make_image(size, size, seed=i)
        image[: size // 2] = rng.integers(0, 256, 3, dtype=np.uint8)  # a colour per image
        names.append(f"img{i}.png")
        Image.fromarray(image).save(directory / names[-1])
    return names


def hf_record(answer: str, image: str | None, question: str = "What is it?") -> dict:
    content: list[dict] = [{"type": "text", "text": question}]
    if image is not None:
        content.insert(0, {"type": "image", "path": image})
    return {
        "messages": [
            {"role": "user", "content": content},
            {"role": "assistant", "content": [{"type": "text", "text": answer}]},
        ]
    }


def write_data(
    directory: Path, *, images: bool = True, count: int = 8, name: str = "train.jsonl"
) -> Path:
    """``count`` conversations (one image each unless ``images`` is False, then the question
    tells them apart) with the answers of :data:`ANSWERS`, as a JSON Lines file."""
    directory.mkdir(parents=True, exist_ok=True)
    names = write_images(directory, count) if images else [None] * count
    lines = []
    for i in range(count):
        question = "What is it?" if images else f"What is {i}?"
        lines.append(json.dumps(hf_record(ANSWERS[i % len(ANSWERS)], names[i], question)))
    path = directory / name
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {kind: write_model(kind, root / kind) for kind in KINDS}


@pytest.fixture(autouse=True)
def _keep_thread_count():
    """The recipe may set torch's thread count; give it back to the other tests."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


# Sizes small enough for a step in tens of milliseconds on one CPU thread.
TINY = ["--max-seq-len", "128", "--batch-tokens", "512", "--warmup-steps", "2"]
TINY += ["--threads", "1", "--no-progress"]


def recipe_args(model: Path, data: Path, output_dir: Path, *extra: str) -> list[str]:
    args = ["--model", str(model), "--data", str(data), "--output-dir", str(output_dir)]
    return [*args, *TINY, *extra]


def metrics(output_dir: Path) -> dict:
    return json.loads((Path(output_dir) / "metrics.json").read_text())


class Helpers:
    """This directory's helpers, for its tests (conftest modules cannot be imported by name
    next to the suite's own conftest)."""

    ANSWERS = ANSWERS
    END_OF_TURN = END_OF_TURN
    TEMPLATE = TEMPLATE
    write_model = staticmethod(write_model)
    write_data = staticmethod(write_data)
    write_images = staticmethod(write_images)
    hf_record = staticmethod(hf_record)
    recipe_args = staticmethod(recipe_args)
    metrics = staticmethod(metrics)


@pytest.fixture(scope="session")
def ft() -> type[Helpers]:
    return Helpers
