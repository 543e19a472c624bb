"""``fusion.testing``'s strategies are fast from a cold start: a fresh interpreter, an empty
Hypothesis directory and Hypothesis' default settings (health checks included), as in a
user's first CI run. The property-test examples of the README and of docs/*.md are run
exactly so."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]


def property_examples(page: Path) -> list[str]:
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.DOTALL)
    return [block for block in blocks if "@given(" in block]


PROPERTY_EXAMPLES = [block for page in PAGES for block in property_examples(page)]


def test_the_docs_have_both_property_examples():
    assert any("fusion_inputs(" in block for block in property_examples(README))
    assert any("wrapping_trees(n_models=2" in block for block in PROPERTY_EXAMPLES)
    assert any("class AudioEncoder" in block for block in PROPERTY_EXAMPLES)  # fusion_inputs


@pytest.mark.parametrize("index", range(len(PROPERTY_EXAMPLES)))
def test_readme_property_example_passes_health_checks_from_a_cold_start(tmp_path, index):
    script = tmp_path / "example.py"
    script.write_text(PROPERTY_EXAMPLES[index])
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=300,
        env={"HYPOTHESIS_STORAGE_DIRECTORY": str(tmp_path / "hypothesis"), "PATH": ""},
        cwd=tmp_path,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]


# A user's first property test over their own model's checkpoint keys, with Hypothesis'
# defaults (200 ms deadline): the first example must not pay for importing
# torch.distributed.tensor (0.5 s), which made it a FlakyFailure every time.
CHECKPOINT_KEYS_PROPERTY = """
import sys

import torch
from hypothesis import given, strategies as st
from torch import nn

from fusion import EarlyFusion
from fusion.models import llama3_2
from fusion.testing import assert_checkpoint_compatible, assert_state_dict_round_trip

torch.manual_seed(0)
model = EarlyFusion(llama3_2(128, 1, 2, 1, 16, 32), {}, {})
plain = llama3_2(128, 1, 2, 1, 16, 32)
plain.load_state_dict(model.decoder.state_dict())
fresh = EarlyFusion(llama3_2(128, 1, 2, 1, 16, 32), {}, {})


@given(name=st.sampled_from(["policy", "model", "decoder", "module"]), depth=st.integers(0, 2))
def test_checkpoint_keys(name, depth):
    root, other = model, fresh
    for _ in range(depth):
        root, other = nn.ModuleDict({name: root}), nn.ModuleDict({name: other})
    assert_checkpoint_compatible(root, model, plain)
    assert_state_dict_round_trip(root, other)


test_checkpoint_keys()
assert "torch.distributed.tensor" not in sys.modules, "imported torch.distributed.tensor"
"""


def test_checkpoint_assertions_meet_the_default_deadline_from_a_cold_start(tmp_path):
    script = tmp_path / "first_property.py"
    script.write_text(CHECKPOINT_KEYS_PROPERTY)
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=300,
        env={"HYPOTHESIS_STORAGE_DIRECTORY": str(tmp_path / "hypothesis"), "PATH": ""},
        cwd=tmp_path,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
