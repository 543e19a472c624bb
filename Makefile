# `make run` runs the main job, `make test` the whole test suite (with ruff and mypy).
# Both create the virtual environment in .venv on first use; nothing else is needed.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# CPU build for CI and fresh machines; users with a GPU install their own torch>=2.6 first.
TORCH_PIN ?= torch==2.13.0
# transformers' video processors (the video tests' reference) need torchvision; it goes to a
# folder on no path, so that transformers' image processors stay the Pillow ones elsewhere.
TORCHVISION_PIN ?= torchvision==0.28.0
export HYPOTHESIS_PROFILE ?= ci

.PHONY: run test lint clean

run: $(STAMP)
	$(BIN)/python -m recipes.captioner

test: $(STAMP) lint
	$(BIN)/python -m pytest

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

$(STAMP): setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet $(TORCH_PIN)
	$(BIN)/python -m pip install --quiet -e '.[test]'
	$(BIN)/python -m pip install --quiet --no-deps --upgrade --target $(VENV)/torchvision-ref $(TORCHVISION_PIN)
	touch $(STAMP)

clean:
	rm -rf $(VENV)
