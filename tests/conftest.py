import os

import pytest
from hypothesis import settings

import fusion.hf.files
from fusion.decoder import TransformerDecoder
from helpers import build_tiny_decoder

# `ci`: deterministic (derandomized) and sized for 2 CPU cores; `dev`: a wider search.
settings.register_profile(
    "ci",
    max_examples=50,
    derandomize=True,
    deadline=None,
    print_blob=True,
)
settings.register_profile("dev", max_examples=500, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


@pytest.fixture
def tiny_decoder() -> TransformerDecoder:
    return build_tiny_decoder()


@pytest.fixture
def config_reads(monkeypatch):
    """The config.json files read, in order, through the one bounded reader."""
    reads: list[str] = []
    read = fusion.hf.files.read_bounded

    def counting(file, *args, **kwargs):
        if file.name == "config.json":
            reads.append(str(file))
        return read(file, *args, **kwargs)

    monkeypatch.setattr(fusion.hf.files, "read_bounded", counting)
    return reads
