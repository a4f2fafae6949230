"""tests/conftest.py stops a run that would skip every CUDA test on a machine with a GPU, and holds
`pure_python` tests to never reaching libcquant; CI's `per_build` selection keeps what it covers."""

import types

import pytest

import cquant
import conftest


@pytest.fixture
def gpu_but_cpu_only_build(torch, monkeypatch):
    """torch "sees" a GPU; the cquant under test "has no CUDA kernels"."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "Fake GPU 80GB")
    monkeypatch.setattr(cquant._C, "built_with_cuda", lambda: False)
    return monkeypatch


def test_gpu_with_a_cpu_only_build_stops_the_session(gpu_but_cpu_only_build):
    gpu_but_cpu_only_build.delenv(conftest.ALLOW_CPU_BUILD, raising=False)
    with pytest.raises(pytest.exit.Exception, match="Fake GPU.*built without CUDA") as stop:
        conftest.pytest_sessionstart(None)
    assert stop.value.returncode == pytest.ExitCode.USAGE_ERROR
    gpu_but_cpu_only_build.setenv(conftest.ALLOW_CPU_BUILD, "0")
    with pytest.raises(pytest.exit.Exception):
        conftest.pytest_sessionstart(None)


def test_the_opt_out_lets_the_cpu_tests_run(gpu_but_cpu_only_build):
    gpu_but_cpu_only_build.setenv(conftest.ALLOW_CPU_BUILD, "1")
    conftest.pytest_sessionstart(None)


def test_a_cuda_build_or_no_gpu_runs(torch, monkeypatch):
    monkeypatch.delenv(conftest.ALLOW_CPU_BUILD, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cquant._C, "built_with_cuda", lambda: True)
    conftest.pytest_sessionstart(None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(cquant._C, "built_with_cuda", lambda: False)
    conftest.pytest_sessionstart(None)


def test_the_guard_of_pure_python_tests_sees_libcquant_and_processes():
    """A `pure_python` test is left out of scripts/sanitize.sh; the guard the conftest puts around
    it in every other run must notice each way into libcquant, and undo itself."""
    import multiprocessing
    import subprocess
    import sys

    from cquant import ops

    calls = {name: getattr(cquant._C, name) for name in dir(cquant._C)}
    guard = conftest.LibcquantGuard().start()
    try:
        assert guard.reached == []
        ops.packed_row_bytes(ops.format_info("fp6_e3m2"), 7)
        subprocess.run([sys.executable, "-c", "pass"], check=True)
        proc = multiprocessing.get_context("spawn").Process(target=int)
        proc.start()
        proc.join()
    finally:
        reached = guard.stop()
    assert {"a process (multiprocessing)", "a process (subprocess)", "cquant._C.packed_row_bytes"} <= set(reached)
    assert {name: getattr(cquant._C, name) for name in dir(cquant._C)} == calls
    assert conftest.LibcquantGuard().start().stop() == []


@pytest.mark.pure_python
def test_a_pure_python_test_runs_under_the_guard():
    assert isinstance(cquant._C.packed_row_bytes, types.FunctionType)  # the guard's stand-in, not the C function


def test_the_per_build_selection_holds_every_scheme_and_the_budgets(request):
    """CI runs `pytest -m per_build` alone against its CUDA build and its installed wheel
    (scripts/compile_cuda.sh, .ci/run): that selection must keep checking each scheme of the
    SCHEMES table, the library's size budget and what `cquant info` says. Checked on what this
    session collected, when that is the whole of tests/ (the suite's own runs)."""
    import os

    config = request.config
    here = os.path.dirname(os.path.abspath(__file__))
    args = {os.path.abspath(os.path.join(config.invocation_params.dir, a)) for a in config.args}
    if args != {here}:
        pytest.skip(f"this run collected {sorted(config.args)}, not the whole of {here}")
    selected = {item.nodeid for item in config.stash[conftest.COLLECTED] if item.get_closest_marker("per_build")}
    files = {nodeid.split("::")[0] for nodeid in selected}
    assert {"tests/test_per_build.py", "tests/test_info.py", "tests/test_abi.py", "tests/test_attention.py"} <= files
    for name in cquant.SCHEMES:
        assert f"tests/test_per_build.py::test_quantize_forward_save_and_load_every_scheme[{name}]" in selected, name
    assert {"tests/test_info.py::test_the_library_keeps_its_size_budget",
            "tests/test_info.py::test_build_info_says_what_was_built",
            "tests/test_info.py::test_info_prints_the_build_and_the_versions"} <= selected
    assert len(selected) < 200, "per_build is for what can differ between builds, not the whole suite"
