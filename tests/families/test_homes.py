"""Each family lives in its home: outside ``fusion/families/``, fusion's code names no family
and no model type a family reads, except where a package gathers the families' public names
(the imports and ``__all__`` of ``fusion.models``, ``fusion.preprocessing`` and
``fusion.checkpoint``) and in the deprecated per-family aliases (``fusion.checkpoint.hf_vlm``,
kept for one release). The Llama family is the fallback every text stack is built as, and is
not counted."""

import ast
import re
from pathlib import Path

import fusion
from fusion.families import FAMILIES, LLAMA

PACKAGE_DIR = Path(fusion.__file__).parent
HOME = PACKAGE_DIR / "families"
DEPRECATED_ALIASES = PACKAGE_DIR / "checkpoint" / "hf_vlm.py"


def family_words() -> list[str]:
    """Every registered family's name and model types (Llama's aside)."""
    return sorted({w for f in FAMILIES if f is not LLAMA for w in (f.name, *f.model_types)})


def naming(words: list[str]) -> re.Pattern[str]:
    """A word of ``words`` as an identifier, a string or a part of either (``save_hf_llava``,
    ``"qwen2_vl"``), but not inside a longer name (``qwen2_vl`` in ``qwen2_vlm``)."""
    return re.compile(r"(?<![a-z0-9])(" + "|".join(map(re.escape, words)) + r")(?![a-z0-9])")


def gathering_lines(file: Path) -> set[int]:
    """The lines of a package ``__init__``'s imports and ``__all__``: where it gathers names."""
    if file.name != "__init__.py":
        return set()
    lines: set[int] = set()
    for node in ast.parse(file.read_text(encoding="utf-8")).body:
        is_all = isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        )
        if isinstance(node, ast.Import | ast.ImportFrom) or is_all:
            lines.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    return lines


def places_naming_a_family(package_dir: Path, words: list[str]) -> list[str]:
    """``path:line: text`` of each line outside the families' home that names one of
    ``words``, other than the gathering lines and the deprecated aliases."""
    pattern = naming(words)
    found = []
    for file in sorted(package_dir.rglob("*.py")):
        if file.is_relative_to(package_dir / "families") or file == DEPRECATED_ALIASES:
            continue
        allowed = gathering_lines(file)
        for number, line in enumerate(file.read_text(encoding="utf-8").splitlines(), 1):
            if number not in allowed and pattern.search(line):
                found.append(f"{file.relative_to(package_dir)}:{number}: {line.strip()}")
    return found


def test_no_family_is_named_outside_its_home():
    found = places_naming_a_family(PACKAGE_DIR, family_words())
    assert not found, "family names outside fusion/families/:\n" + "\n".join(found)


def test_the_words_are_every_vision_family_and_model_type():
    words = family_words()
    assert {"llava", "idefics3", "qwen2_vl", "qwen2_5_vl", "qwen3_vl"} <= set(words)
    assert {"gemma3", "gemma3_text", "qwen3_5", "qwen3_5_text"} <= set(words)


def test_the_check_finds_a_family_named_in_generic_code(tmp_path):
    """The check itself: a branch on a model type is found, by its line; a gathering
    ``__init__`` and a longer name are not."""
    (tmp_path / "families").mkdir()
    (tmp_path / "families" / "toy.py").write_text('MODEL_TYPE = "toy_vl"\n')
    (tmp_path / "loader.py").write_text(
        'def load(config):\n    if config["model_type"] == "toy_vl":\n        pass\ntoy_vlm = 1\n'
    )
    (tmp_path / "__init__.py").write_text(
        'from families.toy import toy_vl_builder\n\n__all__ = ["toy_vl_builder"]\n'
        "toy_vl_default = 2\n"
    )
    assert places_naming_a_family(tmp_path, ["toy_vl"]) == [
        "__init__.py:4: toy_vl_default = 2",
        'loader.py:2: if config["model_type"] == "toy_vl":',
    ]
