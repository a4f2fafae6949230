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


def _module_names(package_dir, package):
    """{dotted module name: (path, is_package)} of every .py file under package_dir."""
    out = {}
    for d, _, files in os.walk(package_dir):
        for f in sorted(files):
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(d, f), package_dir)[:-3].split(os.sep)
                is_package = rel[-1] == "__init__"
                out[".".join([package] + rel[:-1 if is_package else None])] = (os.path.join(d, f), is_package)
    return out


def _import_graph(package_dir, package):
    """{module: {modules of the same tree it imports}}, read with ast. Imports inside functions
    count: a circle through them still fails at run time, only later (at the first call)."""
    modules = _module_names(package_dir, package)
    graph = {}
    for name, (path, is_package) in modules.items():
        with open(path) as f:
            tree = ast.parse(f.read())
        here = name.split(".") if is_package else name.split(".")[:-1]
        deps = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name in modules)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(here[:len(here) - node.level + 1] + ([node.module] if node.module else []))
                for a in node.names:  # `from pkg import mod` imports the module; `from mod import x`, mod itself
                    target = f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                    if target in modules:
                        deps.add(target)
        graph[name] = deps - {name}
    return graph


def _circles(graph):
    """The strongly connected sets of more than one module (Tarjan's algorithm), each sorted."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            members = []
            while not members or members[-1] != v:
                members.append(stack.pop())
                on_stack.discard(members[-1])
            if len(members) > 1:
                out.append(sorted(members))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_two_modules_of_the_package_import_each_other():
    """No import circle among the modules of python/cquant, directly or through others. A
    package's __init__ is left out: it imports (or lazily re-exports) its own modules by design."""
    graph = _import_graph(os.path.join(ROOT, "python", "cquant"), "cquant")
    packages = {name for name, (_, is_package) in _module_names(os.path.join(ROOT, "python", "cquant"),
                                                                "cquant").items() if is_package}
    modules = {name: deps - packages for name, deps in graph.items() if name not in packages}
    assert _circles(modules) == []


def test_the_verify_package_has_no_import_circle():
    """cquant.verify, its __init__ included: the command line imports the run, the run imports
    the hooks, the targets and the report, and none of them imports back."""
    graph = _import_graph(os.path.join(ROOT, "python", "cquant", "verify"), "cquant.verify")
    assert {"cquant.verify", "cquant.verify.cli", "cquant.verify.runner", "cquant.verify.probe",
            "cquant.verify.targets", "cquant.verify.report"} <= set(graph)
    assert _circles(graph) == []
