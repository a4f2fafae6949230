"""The installed package holds every module of the source tree."""

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _setup_packages():
    """The `packages=[...]` list of setup.py, read without running it."""
    with open(os.path.join(ROOT, "setup.py")) as f:
        tree = ast.parse(f.read())
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "packages":
            return set(ast.literal_eval(node.value))
    raise AssertionError("setup.py has no packages=[...]")


def test_every_package_of_the_source_tree_is_installed():
    src = os.path.join(ROOT, "python")
    found = {os.path.relpath(d, src).replace(os.sep, ".")
             for d, _, files in os.walk(os.path.join(src, "cquant")) if "__init__.py" in files}
    assert found == _setup_packages(), "setup.py's packages= must list every package under python/cquant"


def _setup_package_data():
    """The `package_data={...}` dict of setup.py, read without running it (names resolved to None)."""
    with open(os.path.join(ROOT, "setup.py")) as f:
        tree = ast.parse(f.read())
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "package_data":
            return {ast.literal_eval(k): [ast.literal_eval(e) if isinstance(e, ast.Constant) else None for e in v.elts]
                    for k, v in zip(node.value.keys, node.value.values)}
    raise AssertionError("setup.py has no package_data={...}")


def test_every_data_file_is_installed():
    """The demo loads its trained model from python/cquant/data: every file there is package data."""
    import fnmatch

    patterns = [p for p in _setup_package_data()["cquant"] if p]
    data = os.path.join(ROOT, "python", "cquant", "data")
    files = sorted(f"data/{name}" for name in os.listdir(data))
    assert {"data/demo_model.json", "data/demo_model.safetensors"} <= set(files)
    for name in files:
        assert any(fnmatch.fnmatch(name, p) for p in patterns), f"setup.py's package_data does not install {name}"
