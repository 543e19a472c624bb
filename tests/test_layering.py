"""fusion's imports run one way: no two of its parts import each other, directly or around a
circle, whether the import is at module level, inside a function (a lazy import) or under
``TYPE_CHECKING``, since each of those hides a circle rather than removing it.

The parts are, at the top, fusion's subpackages and top-level modules (``fusion.data``,
``fusion.training``, ``fusion.errors``, ...), and inside each package its modules and
subpackages. An import of a package's own ``__init__`` is no edge inside that package: the
``__init__`` only re-exports its modules. The packages are found on disk, so a new one is
covered without naming it here.
"""

import ast
from collections import defaultdict
from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path

import pytest

import fusion

PACKAGE_DIR = Path(fusion.__file__).parent
ROOT = "fusion"

# (importing part, imported part) -> where: "path:line" of each import making the edge.
Edges = dict[tuple[str, str], list[str]]


def modules(package_dir: Path, root: str) -> dict[str, tuple[Path, bool]]:
    """Every module under ``package_dir`` (the package ``root``): dotted name -> (file,
    whether it is a package's ``__init__``)."""
    found = {}
    for file in sorted(package_dir.rglob("*.py")):
        parts = [root, *file.relative_to(package_dir).with_suffix("").parts]
        is_package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if is_package else parts)] = (file, is_package)
    return found


def imported_names(name: str, is_package: bool, tree: ast.AST) -> Iterator[tuple[str, int]]:
    """(imported module, line) of every import anywhere in ``tree``, the module ``name``'s:
    ``from a import b`` names both ``a`` and ``a.b`` (which may be a module), relative
    imports made absolute."""
    for node in ast.walk(tree):  # every depth: functions, TYPE_CHECKING and try blocks too
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                package = name.split(".") if is_package else name.split(".")[:-1]
                base = package[: len(package) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            yield source, node.lineno
            for alias in node.names:
                yield f"{source}.{alias.name}", node.lineno


def part_of(module: str, package: str) -> str | None:
    """The part of ``package`` (its module or subpackage) that ``module`` is or is in; None
    for the package itself (its ``__init__``) and for modules outside it."""
    if not module.startswith(package + "."):
        return None
    return f"{package}.{module[len(package) + 1 :].split('.')[0]}"


def edges_between_parts(
    package: str, found: dict[str, tuple[Path, bool]], relative_to: Path
) -> Edges:
    """The imports between the parts of ``package``, with where each is made."""
    edges: Edges = defaultdict(list)
    for name, (file, is_package) in found.items():
        source = part_of(name, package)
        if source is None:
            continue
        tree = ast.parse(file.read_text(encoding="utf-8"), filename=str(file))
        for imported, line in imported_names(name, is_package, tree):
            target = part_of(imported, package)
            where = f"{file.relative_to(relative_to).as_posix()}:{line}"
            if target is not None and target != source and where not in edges[source, target]:
                edges[source, target].append(where)
    return dict(edges)


def circles(edges: Edges) -> list[list[str]]:
    """One circle (``[a, b, ..., a]``) through each group of parts that import each other
    (each strongly connected component of more than one part), in a stable order."""
    graph: dict[str, list[str]] = defaultdict(list)
    for source, target in sorted(edges):
        graph[source].append(target)
    index: dict[str, int] = {}
    lowest: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def visit(node: str) -> None:  # Tarjan's algorithm; fusion's graphs are shallow
        index[node] = lowest[node] = len(index)
        stack.append(node)
        for successor in graph[node]:
            if successor not in index:
                visit(successor)
                lowest[node] = min(lowest[node], lowest[successor])
            elif successor in stack:
                lowest[node] = min(lowest[node], index[successor])
        if lowest[node] == index[node]:
            group = set()
            while True:
                member = stack.pop()
                group.add(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(group)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_circle_in(sorted(group)[0], group, graph) for group in groups]


def _circle_in(start: str, group: set[str], graph: dict[str, list[str]]) -> list[str]:
    """The shortest circle from ``start`` back to itself inside ``group`` (breadth first)."""
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for successor in graph[node]:
                if successor == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [*reversed(path), start]
                if successor in group and successor not in came_from:
                    came_from[successor] = node
                    following.append(successor)
        frontier = following
    raise AssertionError(f"{start} is in no circle of {sorted(group)}")  # not a component


def circle_report(package: str, package_dir: Path, root: str) -> str:
    """Each circle between the parts of ``package`` and the imports that make it, one
    paragraph each; empty when there is none."""
    edges = edges_between_parts(package, modules(package_dir, root), package_dir.parent)
    paragraphs = []
    for circle in circles(edges):
        lines = [" -> ".join(circle)]
        for source, target in pairwise(circle):
            lines.append(f"  {source} imports {target}: {', '.join(edges[source, target])}")
        paragraphs.append("\n".join(lines))
    return "\n".join(paragraphs)


def packages(package_dir: Path, root: str) -> list[str]:
    """``root`` and every package under it."""
    return [name for name, (_, is_package) in modules(package_dir, root).items() if is_package]


def test_the_subpackages_and_top_level_modules_import_one_way():
    report = circle_report(ROOT, PACKAGE_DIR, ROOT)
    assert not report, f"fusion's parts import each other in a circle:\n{report}"


@pytest.mark.parametrize("package", [p for p in packages(PACKAGE_DIR, ROOT) if p != ROOT])
def test_the_modules_of_each_package_import_one_way(package):
    report = circle_report(package, PACKAGE_DIR, ROOT)
    assert not report, f"the modules of {package} import each other in a circle:\n{report}"


def test_a_circle_is_found_through_lazy_relative_and_type_checking_imports(tmp_path):
    """The check itself: every kind of import counts, and the message names the files."""
    files = {
        "__init__.py": "from pkg.low import f\n",
        "low/__init__.py": "",
        "low/a.py": "def f():\n    from ..high import g\n",  # lazy and relative
        "high.py": (
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.low.a\n"
            "import pkg\n"  # the package's own __init__: no edge
        ),
        "low/b.py": "from pkg.low import a\n",
        "low/c.py": "from . import b\nfrom pkg.low import c as _c\n",  # b -> ... no circle
    }
    for name, text in files.items():
        (tmp_path / "pkg" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "pkg" / name).write_text(text)
    report = circle_report("pkg", tmp_path / "pkg", "pkg")
    assert report == (
        "pkg.high -> pkg.low -> pkg.high\n"
        "  pkg.high imports pkg.low: pkg/high.py:3\n"
        "  pkg.low imports pkg.high: pkg/low/a.py:2"
    )
    assert circle_report("pkg.low", tmp_path / "pkg", "pkg") == ""
    (tmp_path / "pkg" / "low" / "a.py").write_text("import pkg.low.c\n")
    assert circle_report("pkg.low", tmp_path / "pkg", "pkg") == (
        "pkg.low.a -> pkg.low.c -> pkg.low.b -> pkg.low.a\n"
        "  pkg.low.a imports pkg.low.c: pkg/low/a.py:1\n"
        "  pkg.low.c imports pkg.low.b: pkg/low/c.py:1\n"
        "  pkg.low.b imports pkg.low.a: pkg/low/b.py:1"
    )
