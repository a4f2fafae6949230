"""100k calls of cheap ops, succeeding and failing: no references, memory or capsules leak."""

import ctypes
import ctypes.util
import gc
import os
import sys
import tracemalloc

import numpy as np
import pytest

from cquant import _C, ops

from dlpack_producer import Producer
from helpers import under_asan
from tolerances import (LEAK_CALLS, LEAK_HEAP_BYTES, LEAK_PYTHON_BLOCKS, LEAK_RSS_BYTES, LEAK_TRACEMALLOC_BYTES,
                        LEAK_TRACEMALLOC_CALLS)

F32 = np.float32


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def heap_in_use():
    """Bytes malloc has handed out and not got back (glibc mallinfo2), or None if unknown."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    if not hasattr(libc, "mallinfo2"):
        return None
    libc.mallinfo2.restype = _Mallinfo2
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd


def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Workload:
    """A mix of cheap calls on tiny arrays: successes, failures in the wrapper, in the DLPack
    import, in argument checks, through NumPy and through a ctypes DLPack producer."""

    def __init__(self, rng):
        self.x = rng.standard_normal((2, 5)).astype(F32)
        self.q = np.empty((2, 5), np.int8)
        self.s = np.empty(2, F32)
        self.bad_q = np.empty((2, 5), F32)
        self.w, self.ws = ops.quantize(rng.standard_normal((3, 5)).astype(F32), "fp4_e2m1")
        self.y = np.empty((2, 3), F32)
        self.px = Producer(self.x)
        self.p_new = Producer(self.x, version=(2, 0))
        self.p_readonly = Producer(self.q, readonly=True)
        self.errors = 0

    def objects(self):
        return [self.x, self.q, self.s, self.bad_q, self.w, self.ws, self.y, self.px, self.p_new, self.p_readonly]

    def producers(self):
        return [self.px, self.p_new, self.p_readonly]

    def call(self, i):
        k = i % 10
        try:
            if k < 3:
                _C.quantize(self.x, self.q, self.s, _C.FORMAT_INT8, _C.GRANULARITY_ROW)
            elif k == 3:
                ops.quantize(self.x, "fp6_e3m2", "tensor")
            elif k == 4:
                ops.linear(self.x, self.w, self.ws, weight_format="fp4_e2m1", in_features=self.x.shape[-1], out=self.y)
            elif k == 5:
                _C.quantize(self.px, self.q, self.s, _C.FORMAT_INT8, _C.GRANULARITY_ROW)
            elif k == 6:
                _C.quantize(self.x, self.bad_q, self.s, _C.FORMAT_INT8, _C.GRANULARITY_ROW)  # TypeError: q
            elif k == 7:
                _C.quantize(self.x, self.q, self.s, 999, _C.GRANULARITY_ROW)  # ValueError: format
            elif k == 8:
                _C.quantize(self.p_new, self.q, self.s, _C.FORMAT_INT8, _C.GRANULARITY_ROW)  # BufferError
            else:
                _C.quantize(self.x, self.p_readonly, self.s, _C.FORMAT_INT8, _C.GRANULARITY_ROW)  # ValueError: q
        except (TypeError, ValueError, BufferError):
            self.errors += 1


@pytest.fixture
def one_omp_thread():
    """One OpenMP thread for the CPU ops while the test runs: each tiny call would otherwise
    wake a thread team, which on a loaded machine costs milliseconds per call. The threads are
    not what these tests are about (the other tests run with all of them)."""
    try:
        gomp = ctypes.CDLL("libgomp.so.1")
    except OSError:
        yield
        return
    before = gomp.omp_get_max_threads()
    gomp.omp_set_num_threads(1)
    yield
    gomp.omp_set_num_threads(before)


def run(work, calls):
    errors0 = work.errors
    for i in range(calls):
        work.call(i)
    gc.collect()
    assert work.errors - errors0 == calls * 4 // 10  # the failing calls did fail


def test_no_leaks_over_many_calls(rng, one_omp_thread):
    work = Workload(rng)
    run(work, 2000)  # warm caches, free lists and arenas first
    refs = [sys.getrefcount(o) for o in work.objects()]
    exports = [p.exports for p in work.producers()]
    native = not under_asan()
    blocks0 = sys.getallocatedblocks()
    heap0, rss0 = (heap_in_use(), rss()) if native else (None, None)

    run(work, LEAK_CALLS)

    assert [sys.getrefcount(o) for o in work.objects()] == refs
    for p, before in zip(work.producers(), exports):
        assert p.exports - before == LEAK_CALLS // 10
        assert p.balanced, f"{p.exports} capsules exported, {p.deletes} deleted"
    blocks = sys.getallocatedblocks() - blocks0
    assert blocks < LEAK_PYTHON_BLOCKS, f"{blocks} more Python memory blocks in use"
    if native and heap0 is not None:
        heap = heap_in_use() - heap0
        assert heap < LEAK_HEAP_BYTES, f"malloc'd memory grew by {heap} bytes"
    if native:
        grown = rss() - rss0
        assert grown < LEAK_RSS_BYTES, f"RSS grew by {grown} bytes"


def test_no_python_allocations_leak(rng, one_omp_thread):
    """tracemalloc sees every Python allocation (capsules, exceptions, NumPy's DLPack structs)."""
    work = Workload(rng)
    run(work, 2000)
    tracemalloc.start()
    try:
        run(work, 1000)
        traced0 = tracemalloc.get_traced_memory()[0]
        run(work, LEAK_TRACEMALLOC_CALLS)
        traced = tracemalloc.get_traced_memory()[0] - traced0
    finally:
        tracemalloc.stop()
    assert traced < LEAK_TRACEMALLOC_BYTES, f"Python allocations grew by {traced} bytes"


def test_torch_tensors_do_not_leak(torch, one_omp_thread):
    x = torch.randn(2, 5, dtype=torch.bfloat16)
    q = torch.empty(2, 5, dtype=torch.float8_e4m3fn)
    s = torch.empty(2)
    bad = torch.empty(2, 5)
    for _ in range(200):
        _C.quantize(x, q, s, _C.FORMAT_FP8_E4M3, _C.GRANULARITY_ROW)
    refs = [sys.getrefcount(t) for t in (x, q, s, bad)]
    for i in range(LEAK_CALLS // 10):
        if i % 2:
            _C.quantize(x, q, s, _C.FORMAT_FP8_E4M3, _C.GRANULARITY_ROW)
        else:
            with pytest.raises(TypeError):
                _C.quantize(x, bad, s, _C.FORMAT_FP8_E4M3, _C.GRANULARITY_ROW)
    assert [sys.getrefcount(t) for t in (x, q, s, bad)] == refs
