"""``fusion.testing``'s strategies are fast from a cold start: a fresh interpreter, an empty
Hypothesis directory and Hypothesis' default settings (health checks included), as in a
user's first CI run. The README's property-test examples are run exactly so."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).parents[2] / "README.md"


PROPERTY_EXAMPLES = [
    block
    for block in re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)
    if "@given(" in block
]


def test_the_readme_has_both_property_examples():
    assert any("wrapping_trees(n_models=2" in block for block in PROPERTY_EXAMPLES)
    assert any("fusion_inputs(" in block for block in PROPERTY_EXAMPLES)  # an audio encoder


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
