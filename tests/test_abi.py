"""libcquant's exported ABI is what cquant.h declares (CQ_API, hidden visibility for the rest),
and the extension links to nothing else of it."""

import glob
import os
import re
import shutil
import subprocess

import pytest

import cquant

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEADER = os.path.join(ROOT, "csrc", "include", "cquant.h")
PKG = os.path.dirname(cquant.__file__)

# the symbols a build exports depend on how it was built (CUDA or not, its linker flags)
pytestmark = pytest.mark.per_build


def header_functions():
    text = open(HEADER).read()
    return set(re.findall(r"^CQ_API [^;]*?\b(cq_[a-z0-9_]+)\(", text, flags=re.M | re.S))


def dynamic_symbols(path, defined):
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm (binutils) is not installed")
    flag = "--defined-only" if defined else "--undefined-only"
    out = subprocess.run([nm, "-D", flag, path], capture_output=True, text=True, check=True).stdout
    return {line.split()[-1].split("@")[0] for line in out.splitlines() if line.strip()}


def test_exports_are_the_header():
    lib = os.path.join(PKG, "libcquant.so")
    exported = {s for s in dynamic_symbols(lib, True) if s.startswith("cq_")}
    declared = header_functions()
    assert len(declared) > 25
    assert exported == declared, f"exported, not declared: {sorted(exported - declared)}; " \
                                 f"declared, not exported: {sorted(declared - exported)}"
    others = {s for s in dynamic_symbols(lib, True) if not s.startswith("cq_") and not s.startswith("_")}
    assert not {s for s in others if s.startswith("cuda") or s.startswith("cublas")}, sorted(others)


def test_extension_uses_only_the_header():
    ext = glob.glob(os.path.join(PKG, "_C*.so"))
    assert ext, "the extension is not built in place"
    used = {s for s in dynamic_symbols(ext[0], False) if s.startswith("cq_")}
    assert used and used <= header_functions(), sorted(used - header_functions())


def test_constants_are_the_header_values():
    """Constants Python code would otherwise repeat as magic numbers."""
    from cquant import _C

    assert (_C.ATTENTION_FULL, _C.ATTENTION_INT8) == (0, 1)
    assert (_C.ATTENTION_Q_BLOCK, _C.ATTENTION_K_BLOCK, _C.ATTENTION_MAX_HEAD_DIM) == (32, 128, 256)
    assert (_C.MIN_CC_WEIGHT_ONLY, _C.MIN_CC_INT8_DYNAMIC, _C.MIN_CC_FP8_DYNAMIC) == (80, 80, 89)
    assert issubclass(_C.CudaError, RuntimeError) and _C.CudaError.__module__ == "cquant"


def test_module_state_survives_reimport():
    """Multi-phase init: a second module object made from the same definition has its own
    CudaError and works."""
    import importlib.util

    import cquant._C as first

    spec = importlib.util.find_spec("cquant._C")
    second = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(second)
    assert second is not first and second.CudaError is not first.CudaError
    assert second.packed_row_bytes(first.FORMAT_INT8, 7) == 7
