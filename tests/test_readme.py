"""Every Python block of the README runs as written."""

import re
from pathlib import Path

import pytest

README = Path(__file__).parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)


def test_readme_has_examples():
    assert len(BLOCKS) >= 3


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_block_runs(index):
    namespace = {"__name__": f"readme_block_{index}"}
    exec(compile(BLOCKS[index], f"README.md block {index}", "exec"), namespace)


def test_install_lines_cannot_fetch_another_package():
    """The distribution is ``torch-early-fusion`` (``fusion`` on the package index is an
    unrelated project); no install line in the docs asks the index for ``fusion``."""
    from importlib.metadata import distribution

    assert distribution("torch-early-fusion").metadata["Name"] == "torch-early-fusion"
    docs = [README, *README.parent.glob("benchmarks/*.md")]
    for doc in docs:
        assert not re.search(r"pip install [^\n`]*['\"]?fusion\[", doc.read_text()), doc
        assert not re.search(r"pip install ['\"]?fusion\b", doc.read_text()), doc
