"""``fusion.testing``'s strategies are fast from a cold start: a fresh interpreter, an empty
Hypothesis directory and Hypothesis' default settings (health checks included), as in a
user's first CI run. The README's property-test example is run exactly so."""

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).parents[2] / "README.md"


def test_readme_property_example_passes_health_checks_from_a_cold_start(tmp_path):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)
    (example,) = [b for b in blocks if "wrapping_trees(" in b]
    script = tmp_path / "example.py"
    script.write_text(example)
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
