"""Helpers shared by the tests: inputs in each framework, exact comparisons, SQNR.

NumPy has no bfloat16 or float8, so bfloat16 inputs are torch CPU tensors and torch float8
codes are compared through their uint8 bits. torch is imported lazily: NumPy-only tests run
without it.
"""

import importlib
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from cquant.metrics import sqnr_db  # noqa: F401  (the one SQNR, re-exported for the tests)

# x dtypes of the ops: float32 / float16 as NumPy arrays, bfloat16 as torch CPU tensors
FLOAT_DTYPE_PARAMS = ["float32", "float16", pytest.param("bfloat16", marks=pytest.mark.torch)]


def under_asan():
    """True in a process with AddressSanitizer's runtime preloaded (scripts/sanitize.sh)."""
    with open("/proc/self/maps") as f:
        return "libasan" in f.read()


def run_fresh_python(code, timeout=600, args=()):
    """stdout of `code` run in a new interpreter that sees this one's sys.path (so the cquant
    under test) but has imported nothing, with `args` in its sys.argv[1:]; fails the test with
    its stderr if it exits non-zero."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    res = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env,
                         timeout=timeout)
    assert res.returncode == 0, res.stderr[-2000:]
    return res.stdout


def spawn_ranks(worker, args, nprocs, timeout_s, what):
    """Run worker(rank, *args) on nprocs processes (torch.multiprocessing); fail the test, not hang,
    where they do not finish in timeout_s (the processes are killed)."""
    import torch.multiprocessing as mp

    ctx = mp.spawn(worker, args=args, nprocs=nprocs, join=False)
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=max(1.0, deadline - time.monotonic())):
        if time.monotonic() >= deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"{what}: the {nprocs} processes did not finish in {timeout_s} s")


def torch_module(load=False):
    """torch if it is imported (or, with load, importable), else None."""
    if load and "torch" not in sys.modules:
        try:
            importlib.import_module("torch")
        except ImportError:
            return None
    return sys.modules.get("torch")


def is_torch(a):
    torch = torch_module()
    return torch is not None and isinstance(a, torch.Tensor)


def to_numpy(a):
    """A NumPy view of an array's stored values: bfloat16 as float32 (exact), float8 as uint8."""
    if isinstance(a, np.ndarray):
        return a
    torch = torch_module()
    a = a.detach().cpu()
    if a.dtype == torch.bfloat16:
        return a.float().numpy()
    if a.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return a.view(torch.uint8).numpy()
    return a.numpy()


def float32_values(a):
    """float32 NumPy copy of a float array's values (exact for f16 / bf16 / f32)."""
    return np.ascontiguousarray(to_numpy(a), dtype=np.float32)


def bits(a):
    """The raw bits of a float (or code) array as an unsigned NumPy array."""
    torch = torch_module()
    if is_torch(a):
        a = a.detach().cpu()
        if a.dtype == torch.bfloat16 or a.dtype == torch.float16:
            return a.view(torch.int16).numpy().view(np.uint16)
        if a.dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.int8):
            return a.view(torch.uint8).numpy()
        a = a.numpy()
    a = np.asarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def to_framework(x32, dtype, torch=None):
    """float32 NumPy data as a cquant input of `dtype`: NumPy for float32/float16, a torch CPU
    tensor for bfloat16 (or for any dtype when torch is given and dtype is a torch one)."""
    if dtype == "bfloat16" or torch is not None:
        torch = torch or torch_module(load=True)
        return torch.from_numpy(np.ascontiguousarray(x32, dtype=np.float32)).to(getattr(torch, dtype))
    return np.ascontiguousarray(x32).astype(dtype)


def as_input(x32, dtype, torch=None):
    """(x, values): float32 data as a cquant input of `dtype` (see to_framework) and the float32
    values x holds after rounding to dtype."""
    x = to_framework(x32, dtype, torch)
    return x, float32_values(x).reshape(np.shape(x32))


def random_input(rng, shape, dtype, torch=None, spread=0.0):
    """(x, values): random N(0, 1) data of `shape` in `dtype` (see as_input). spread > 0
    multiplies each row by exp(spread * N(0, 1)) so that rows differ in magnitude."""
    x32 = rng.standard_normal(shape).astype(np.float32)
    if spread:
        x32 *= np.exp(spread * rng.standard_normal(shape[:-1] + (1,))).astype(np.float32)
    return as_input(x32, dtype, torch)


def from_values(values, dtype):
    """Values exactly representable in `dtype` as an array of it (torch for bfloat16)."""
    v = np.asarray(values, dtype=np.float32)
    if dtype == "bfloat16":
        torch = torch_module(load=True)
        return torch.from_numpy(np.ascontiguousarray(v)).to(torch.bfloat16)
    return v.astype(dtype)


def assert_same_bits(actual, expected, what="", nan_by_position=True):
    """Exact equality of two float (or code) arrays by their bits. NaNs compare by position only
    when nan_by_position (their payload is not part of cquant's contract)."""
    a, e = bits(actual), bits(expected)
    assert a.shape == e.shape, f"{what}: shape {a.shape} != {e.shape}"
    if nan_by_position and to_numpy(expected).dtype.kind == "f":
        ea, ee = to_numpy(actual).astype(np.float64), to_numpy(expected).astype(np.float64)
        nan_a, nan_e = np.isnan(ea), np.isnan(ee)
        assert np.array_equal(nan_a, nan_e), f"{what}: NaN at {np.argwhere(nan_a != nan_e)[:5].tolist()}"
        a, e = np.where(nan_a, 0, a), np.where(nan_e, 0, e)
    bad = np.argwhere(a != e)
    assert bad.size == 0, (f"{what}: {len(bad)} of {a.size} differ, first at {bad[:5].tolist()}: "
                           f"{a[tuple(bad[0])]:#x} != {e[tuple(bad[0])]:#x}")




def dit_attention_inputs(rng, b, sq, skv, h, d, q_mult, *, key_offset=0.0, key_groups=0.0, value_offset=0.0,
                         outliers=0):
    """float32 q [B, Sq, H, D], k and v [B, Skv, H, D] shaped like a diffusion transformer's
    attention inputs: q and k rows RMS-normalized, then times per-channel weights near 1 (with
    `outliers` channels of weight 4-5, different ones for q and k); q of head (b, h) times
    q_mult[b][h] (larger logits: a more peaked softmax). Keys get per-channel offsets of
    key_offset * N(0, 1) (which K smoothing removes) and, with key_groups, the first eighth of
    the keys another key_groups * N(0, 1) per channel (text-like tokens: smoothing leaves half
    the gap). Values N(0, 1) plus per-channel means N(0, 1) and offsets value_offset * N(0, 1)."""

    def rms_rows(rows, weight):
        x = rng.standard_normal((b, rows, h, d))
        x /= np.sqrt((x * x).mean(axis=-1, keepdims=True))
        return x * weight

    def weights():
        w = np.abs(1.0 + 0.2 * rng.standard_normal((1, 1, h, d)))
        for head in range(h):
            idx = rng.choice(d, outliers, replace=False)
            w[0, 0, head, idx] = 4.0 + rng.random(outliers)
        return w

    q = rms_rows(sq, weights()) * np.asarray(q_mult, np.float64).reshape(b, 1, h, 1)
    k = rms_rows(skv, weights()) + key_offset * rng.standard_normal((1, 1, h, d))
    if key_groups:
        k[:, : max(1, skv // 8)] += key_groups * rng.standard_normal((1, 1, h, d))
    v = rng.standard_normal((b, skv, h, d)) + rng.standard_normal((1, 1, h, d))
    v += value_offset * rng.standard_normal((1, 1, h, d))
    return tuple(t.astype(np.float32) for t in (q, k, v))


def ungrouped_schemes(names):
    """The scheme names among `names` without weight groups: those every in_features that is a
    multiple of 16 takes. Tests on shapes such as 97 or 1025 columns, or 64 (below the 4-bit
    schemes' default group of 128), run these; the grouped schemes are tested on shapes they take
    in test_int4.py (ops) and test_int4_workflow.py (layers, models, checkpoints)."""
    from cquant.schemes import scheme

    return [n for n in names if not scheme(n).grouped]
