"""tests/conftest.py stops a run that would skip every CUDA test on a machine with a GPU, and holds
`pure_python` tests to never reaching libcquant."""

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
