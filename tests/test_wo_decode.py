"""The weight decoders of the CUDA weight-only kernels (kernels/wo_decode.cuh), compiled as
host C++ and checked against the C reference over every code of every format, at every
position the GEMV and the row decoder read it from (tests/wo_decode_check.cpp). Needs only a
C++ compiler, no GPU: the bit tricks of the kernels are checked wherever the tests run."""

import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCE = os.path.join(ROOT, "tests", "wo_decode_check.cpp")


def cxx():
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def test_every_code_decodes_exactly(tmp_path):
    compiler = cxx()
    if compiler is None:
        pytest.skip("no C++ compiler on PATH (set CXX)")
    exe = tmp_path / "wo_decode_check"
    cmd = [compiler, "-std=c++17", "-O1", "-Wall", "-Wextra", "-Werror",
           "-I" + os.path.join(ROOT, "csrc"), "-I" + os.path.join(ROOT, "csrc", "include"),
           "-I" + os.path.join(ROOT, "kernels"), SOURCE, "-o", str(exe)]
    build = subprocess.run(cmd, capture_output=True, text=True)
    assert build.returncode == 0, f"{' '.join(cmd)}\n{build.stderr}"
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("ok: 23 formats"), run.stdout
