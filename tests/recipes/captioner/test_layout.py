"""The captioner is a recipe beside the library, not part of it."""

import ast
import importlib.util
from pathlib import Path

import fusion
import fusion.encoders

LIBRARY = Path(fusion.__file__).parent


def test_the_library_ships_no_demo():
    # What every recipe needs is the library's (fusion.training); the captioner's own parts
    # (its config, model and data) are not.
    import fusion.training

    assert not {"TrainConfig", "build_model", "load_model"} & set(vars(fusion.training))
    assert importlib.util.find_spec("fusion.training.shapes") is None
    demo = {"VisionEncoder", "PatchEmbedding", "VisionTransformerLayer"}
    assert not demo & set(fusion.encoders.__all__)
    assert not demo & set(vars(fusion.encoders))


def test_the_library_never_imports_the_recipes():
    importers = []
    for file in sorted(LIBRARY.rglob("*.py")):
        for node in ast.walk(ast.parse(file.read_text(), str(file))):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            importers += [
                f"{file.relative_to(LIBRARY)}: {name}"
                for name in names
                if name.split(".")[0] == "recipes"
            ]
    assert importers == []
    assert len(list(LIBRARY.rglob("*.py"))) > 10  # the scan saw the library
