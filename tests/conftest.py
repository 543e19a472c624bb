import os

import pytest
from hypothesis import settings

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
