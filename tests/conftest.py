"""pytest set-up: markers, fresh random generators, the torch fixture.

cquant is imported as installed (CI: `pip install ".[test]" && pytest -q`); for a build in the
source tree, put its python/ on PYTHONPATH. On a machine whose GPU torch sees, a cquant built
without CUDA stops the run before any test (every CUDA test would skip and the run would look
green); CQUANT_TEST_ALLOW_CPU_BUILD=1 runs the CPU tests of such a build anyway. Helpers shared by tests live in helpers.py,
tolerances in tolerances.py and the independent oracle in reference.py (this directory is on
sys.path under pytest's default import mode).

A test marked `pure_python` claims that it never reaches libcquant, so that scripts/sanitize.sh
may leave it out; LibcquantGuard holds it to that claim in every other run.
"""

import functools
import multiprocessing.process
import os
import secrets
import subprocess
import sys

import numpy as np
import pytest

import cquant


def _torch_or_none():
    try:
        import torch
    except ImportError:
        return None
    return torch


def cuda_usable():
    """(usable, reason): torch with a CUDA device, and a libcquant built with CUDA."""
    torch = _torch_or_none()
    if torch is None:
        return False, "torch is not installed"
    if not torch.cuda.is_available():
        return False, "no CUDA device"
    if not cquant._C.built_with_cuda():
        return False, "cquant was built without CUDA"
    return True, ""


ALLOW_CPU_BUILD = "CQUANT_TEST_ALLOW_CPU_BUILD"


def pytest_configure(config):
    config.addinivalue_line("markers", "torch: needs torch (skipped without it)")
    from helpers import under_asan

    if under_asan():
        # importing matplotlib's C++ extensions aborts a process with ASan preloaded (as C++ exceptions
        # thrown through torch do); cquant.bench then writes its tables without plots, as it does
        # wherever matplotlib is not installed
        sys.modules.setdefault("matplotlib", None)


def pytest_sessionstart(session):
    torch = _torch_or_none()
    if torch is None or not torch.cuda.is_available() or cquant._C.built_with_cuda():
        return
    if os.environ.get(ALLOW_CPU_BUILD, "0") not in ("", "0"):
        return
    pytest.exit(
        f"torch sees a CUDA GPU ({torch.cuda.get_device_name(0)}), but the cquant under test "
        f"({os.path.dirname(cquant.__file__)}) was built without CUDA, so every CUDA test would skip. "
        f"Rebuild it with the CUDA kernels (nvcc on PATH; see the README's Build section), or set "
        f"{ALLOW_CPU_BUILD}=1 to run only the CPU tests of this build.",
        returncode=pytest.ExitCode.USAGE_ERROR)


def pytest_report_header(config):
    torch = _torch_or_none()
    return [
        f"cquant {cquant.__version__} from {os.path.dirname(cquant.__file__)} "
        f"(CUDA build: {cquant._C.built_with_cuda()})",
        f"numpy {np.__version__}, torch {torch.__version__ if torch else 'not installed'}",
    ]


class LibcquantGuard:
    """Records what would reach libcquant while it is on: a call of any function of cquant._C
    (libcquant's one door: ops.py, torch_ops.py and the demo call through the module's attributes)
    or a started process (which may load libcquant itself)."""

    def __init__(self):
        self.reached = []
        self._undo = []

    def _record(self, owner, name, what):
        original = getattr(owner, name)

        @functools.wraps(original)
        def recording(*args, **kwargs):
            self.reached.append(what)
            return original(*args, **kwargs)

        setattr(owner, name, recording)
        self._undo.append((owner, name, original))

    def start(self):
        for name in dir(cquant._C):
            f = getattr(cquant._C, name)
            if callable(f) and not isinstance(f, type):
                self._record(cquant._C, name, f"cquant._C.{name}")
        self._record(subprocess.Popen, "__init__", "a process (subprocess)")
        self._record(multiprocessing.process.BaseProcess, "start", "a process (multiprocessing)")
        return self

    def stop(self):
        """Puts everything back; returns what was reached, each once."""
        for owner, name, original in reversed(self._undo):
            setattr(owner, name, original)
        self._undo = []
        return sorted(set(self.reached))


_GUARD = pytest.StashKey()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    # before the fixtures are set up: they belong to the test's claim as much as its body
    if item.get_closest_marker("pure_python"):
        item.stash[_GUARD] = LibcquantGuard().start()


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    guard = item.stash.get(_GUARD, None)
    if guard is None:
        return
    del item.stash[_GUARD]
    reached = guard.stop()
    if reached:
        pytest.fail(f"{item.nodeid} is marked pure_python but reached {', '.join(reached)}: scripts/sanitize.sh "
                    "would leave out a test that runs libcquant. Remove the marker.", pytrace=False)


# every item of the session before -m or -k deselect any: tests/test_conftest.py checks what
# `pytest -m per_build` keeps of them
COLLECTED = pytest.StashKey()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    config.stash[COLLECTED] = list(items)
    usable, reason = cuda_usable()
    torch_missing = _torch_or_none() is None
    for item in items:
        if "cuda" in item.keywords and not usable:
            item.add_marker(pytest.mark.skip(reason=f"cuda test: {reason}"))
        if "torch" in item.keywords and torch_missing:
            item.add_marker(pytest.mark.skip(reason="torch is not installed"))


@pytest.fixture
def seed():
    """A fresh seed per test (CQUANT_TEST_SEED=... repeats one); printed, so failures show it."""
    value = int(os.environ.get("CQUANT_TEST_SEED", secrets.randbits(32)))
    print(f"random seed: {value} (repeat with CQUANT_TEST_SEED={value})")
    return value


@pytest.fixture
def rng(seed):
    """np.random.Generator seeded freshly for each test."""
    return np.random.default_rng(seed)


@pytest.fixture
def torch():
    """The torch module; skips the test when torch is not installed."""
    return pytest.importorskip("torch")


@pytest.fixture
def cq_env(monkeypatch):
    """cq_env(name, value) sets a CQUANT_* switch for one test. libcquant reads its switches once
    (cq_settings), so it is asked to read them again now, and after the test, once the value is
    undone."""

    def set_switch(name, value):
        monkeypatch.setenv(name, value)
        cquant.ops.reload_settings()

    yield set_switch
    monkeypatch.undo()
    cquant.ops.reload_settings()
