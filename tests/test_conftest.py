"""tests/conftest.py stops a run that would skip every CUDA test on a machine with a GPU."""

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
