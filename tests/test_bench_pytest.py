"""The pytest-benchmark entry points (benchmarks/conftest.py): a reported time is the time of one
call, measured after the queued GPU work finished, and without a GPU the whole benchmarks/
collection skips. Each runs pytest in a subprocess; a fake CUDA stream stands in for the GPU."""

import json
import os
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("pytest_benchmark")
pytest.importorskip("torch")
import cquant  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# torch.cuda made to queue work on a stream that finishes it `seconds` later, the way a GPU
# does: a kernel launch returns at once, Stream.synchronize waits for the queue to drain
FAKE_CUDA = '''
import time

import torch

import cquant


class FakeStream:
    busy_until = 0.0

    def queue(self, seconds):
        FakeStream.busy_until = max(FakeStream.busy_until, time.perf_counter()) + seconds

    def synchronize(self):
        time.sleep(max(0.0, FakeStream.busy_until - time.perf_counter()))


STREAM = FakeStream()
torch.cuda.is_available = lambda: True
torch.cuda.current_stream = lambda device=None: STREAM
cquant._C.built_with_cuda = lambda: True
'''

KERNEL_SECONDS = 0.005
FAKE_BENCHMARK = f'''
import torch


def test_fake_kernel(per_call):
    per_call(lambda: torch.cuda.current_stream().queue({KERNEL_SECONDS}), group="fake", flops=1e9, nbytes=1e6)
'''


def _pytest(args, cwd, extra_path=()):
    # not a pytest-xdist worker's variables (this run's, when it has workers): pytest-benchmark
    # reads PYTEST_XDIST_WORKER and would disable itself in the run under test
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    env.update(CUDA_VISIBLE_DEVICES="",  # a GPU machine runs the CPU path too
               PYTHONPATH=os.pathsep.join([*extra_path, os.path.dirname(os.path.dirname(cquant.__file__)),
                                           os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_reported_time_is_one_call_after_the_queue_drained(tmp_path):
    shutil.copy(os.path.join(ROOT, "benchmarks", "conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "fake_cuda.py").write_text(FAKE_CUDA)
    (tmp_path / "test_fake.py").write_text(FAKE_BENCHMARK)
    out = tmp_path / "bench.json"
    r = _pytest(["-p", "fake_cuda", "test_fake.py", "--benchmark-only", f"--benchmark-json={out}", "-q"], tmp_path,
                [str(tmp_path)])
    assert r.returncode == 0, r.stdout + r.stderr
    (bench,) = json.loads(out.read_text())["benchmarks"]
    stats = bench["stats"]
    calls = stats["iterations"]
    assert calls > 1 and bench["group"] == "fake"
    assert bench["options"]["timer"].endswith("synchronized_clock")
    # a round queues `calls` kernels at once: without the synchronize it would take microseconds,
    # and a round reported as one call would read calls * KERNEL_SECONDS
    assert KERNEL_SECONDS <= stats["mean"] < 1.5 * KERNEL_SECONDS
    assert KERNEL_SECONDS <= stats["min"] and stats["median"] < 1.5 * KERNEL_SECONDS
    assert bench["extra_info"]["tflops"] == pytest.approx(1e9 / stats["median"] / 1e12)
    assert bench["extra_info"]["gbps"] == pytest.approx(1e6 / stats["median"] / 1e9)


@pytest.mark.parametrize("plugin", ["loaded", "absent"])
def test_benchmarks_skip_without_a_gpu(plugin):
    args = ["benchmarks/", "--benchmark-only", "-q", "-rs"] + (["-p", "no:benchmark"] if plugin == "absent" else [])
    r = _pytest(args, ROOT)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "error" not in out.lower() and " passed" not in out
    modules = {f for f in os.listdir(os.path.join(ROOT, "benchmarks")) if f.startswith("test_bench_")}
    assert len(modules) == 6 and all(f"benchmarks/{m}" in out for m in modules), out
    reason = "pytest-benchmark is not installed" if plugin == "absent" else "needs a CUDA GPU"
    assert reason in out and " skipped" in out
