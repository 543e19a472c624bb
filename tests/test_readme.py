"""Every Python block of the README and of the pages under docs/ runs as written, and their
links lead somewhere."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]


def python_blocks(page: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.DOTALL)


BLOCKS = [(page, i, block) for page in PAGES for i, block in enumerate(python_blocks(page))]


def test_readme_has_examples():
    assert len(python_blocks(README)) >= 3


def test_readme_is_short_and_links_every_docs_page():
    text = README.read_text()
    assert len(text.splitlines()) <= 300
    assert DOCS, "docs/ holds no page"
    for page in DOCS:
        assert f"](docs/{page.name})" in text, f"the README does not link {page.name}"


@pytest.mark.parametrize(
    ("page", "index", "block"),
    BLOCKS,
    ids=[f"{page.relative_to(ROOT)}:{index}" for page, index, _ in BLOCKS],
)
def test_readme_block_runs(page, index, block):
    where = page.relative_to(ROOT)
    namespace = {"__name__": f"{where.stem}_block_{index}"}
    exec(compile(block, f"{where} block {index}", "exec"), namespace)


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors for the page's headings (code blocks skipped)."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)
    anchors = set()
    for heading in re.findall(r"^#+ (.+)$", text, flags=re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        anchors.add(slug)
    return anchors


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_relative_links_resolve(page):
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        assert file.exists(), f"{page.name}: {target} leads nowhere"
        if anchor and file.suffix == ".md":
            assert anchor in _anchors(file), f"{page.name}: no heading {anchor!r} in {file.name}"


def test_install_lines_cannot_fetch_another_package():
    """The distribution is ``torch-early-fusion`` (``fusion`` on the package index is an
    unrelated project); no install line in the docs asks the index for ``fusion``."""
    from importlib.metadata import distribution

    assert distribution("torch-early-fusion").metadata["Name"] == "torch-early-fusion"
    docs = [*PAGES, *ROOT.glob("benchmarks/*.md")]
    for doc in docs:
        assert not re.search(r"pip install [^\n`]*['\"]?fusion\[", doc.read_text()), doc
        assert not re.search(r"pip install ['\"]?fusion\b", doc.read_text()), doc
