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
