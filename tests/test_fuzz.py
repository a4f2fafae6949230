"""Hostile inputs through the array ops on the CPU: every call either raises a clear exception or
returns exactly what the float64 oracle (tests/reference.py) says.

Each case draws a format, granularity, dtype, shape, a layout (contiguous, sliced, transposed,
flipped, broadcast, offset, read-only) and values (normal, huge, tiny, subnormal, NaN / Inf,
constant rows), and static scales from the whole fp32 range. A refusal must be one of the
documented exception types; an accepted result must match the oracle bit for bit (quantize,
dequantize) or within the rounding bound of tests/tolerances.py (linear).
"""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from cquant import ops

import reference as ref
from helpers import assert_same_bits, bits, from_values, to_numpy, torch_module, under_asan
from tolerances import linear_abs_bound

REFUSALS = (ValueError, TypeError, NotImplementedError, BufferError)
CASES = 150
FORMATS = ["int8", "fp8_e4m3", "fp8_e5m2", "fp6_e3m2", "fp6_e2m3", "fp5_e2m2", "fp4_e2m1", "fp3_e1m1", "fp7_e6m0"]


def hostile_values(rng, shape):
    """float32 data of one of several hostile kinds."""
    kind = rng.integers(7)
    x = rng.standard_normal(shape).astype(np.float32)
    if kind == 1:  # huge, near the float32 and float16 limits
        with np.errstate(over="ignore"):
            x *= np.float32(rng.choice([6e4, 1e30, 3e38]))
    elif kind == 2:  # tiny, subnormal in float32
        x *= np.float32(rng.choice([1e-30, 1e-39, 1e-44]))
    elif kind == 3:  # NaN and Inf sprinkled in
        flat = x.reshape(-1)
        idx = rng.integers(flat.size, size=max(1, flat.size // 17))
        flat[idx] = rng.choice([np.nan, np.inf, -np.inf], size=idx.size).astype(np.float32)
    elif kind == 4:  # constant rows, zero rows
        x[...] = np.float32(rng.choice([0.0, 1.0, -3.5]))
    elif kind == 5:  # rows of very different magnitude
        x *= np.exp(8 * rng.standard_normal(shape[:-1] + (1,))).astype(np.float32)
    return x


def hostile_layout(rng, a):
    """a itself, or a view of it with a layout a producer may hand over."""
    kind = rng.integers(7)
    if kind == 1 and a.ndim >= 2 and a.shape[0] > 1:
        return a[::2]
    if kind == 2 and a.ndim >= 2:
        return np.swapaxes(a, -1, -2)
    if kind == 3:
        return np.flip(a, axis=-1)
    if kind == 4 and a.ndim >= 1:
        return np.broadcast_to(a[..., :1], a.shape)
    if kind == 5:
        buf = np.empty(a.size + 1, dtype=a.dtype)
        buf[1:] = a.reshape(-1)
        return buf[1:].reshape(a.shape)  # an element-aligned but offset view
    if kind == 6:
        b = a.copy()
        b.setflags(write=False)
        return b
    return a


def maybe_torch(rng, a):
    """a, or a torch CPU tensor of its values: bfloat16 sometimes, and sometimes a view with the
    negative bit set (its values are -a, which the ops must read as such)."""
    torch = torch_module(load=True)
    if torch is None or rng.integers(3):
        return a
    t = torch.from_numpy(np.array(a, order="C", copy=True))
    if t.is_floating_point() and rng.integers(2):
        t = t.to(torch.bfloat16)
    if t.is_floating_point() and rng.integers(2):
        t = torch._neg_view(t)
    return t


def dtype_of(rng):
    return str(rng.choice(["float32", "float16"]))


def call(fn, *args, **kwargs):
    """fn's result, or None when it refused with a documented exception type."""
    try:
        return fn(*args, **kwargs)
    except REFUSALS:
        return None


def values_of(a):
    if hasattr(a, "resolve_neg"):
        a = a.resolve_neg()
    return np.ascontiguousarray(to_numpy(a)).astype(np.float32)


@pytest.mark.parametrize("case", range(CASES))
def test_quantize_accepts_only_what_it_gets_right(case, seed):
    rng = np.random.default_rng([seed, case])
    name = str(rng.choice(FORMATS))
    f = ref.fmt(name)
    granularity = str(rng.choice(["row", "tensor"]))
    shape = (int(rng.integers(1, 6)), int(rng.integers(1, 70)))
    with np.errstate(over="ignore"):
        x = maybe_torch(rng, hostile_layout(rng, hostile_values(rng, shape).astype(dtype_of(rng))))
    static = None
    if rng.integers(3) == 0:
        n = shape[0] if granularity == "row" else 1
        static = np.abs(hostile_values(rng, (n,))).astype(np.float32)
        static[rng.integers(n)] = np.float32(rng.choice([1e-40, 2e-39, 1e-45, 3e38, 0.0, -1.0, np.inf, np.nan]))
    result = call(ops.quantize, x, name, granularity, scale=static)
    if result is None:
        return
    q, s = result
    x32 = values_of(x).reshape(-1, np.shape(x)[-1])
    codes, want_scale = ref.quantize(x32, f, granularity, static)
    assert_same_bits(s, want_scale, f"{name} {granularity} scales")
    np.testing.assert_array_equal(bits(q).astype(np.uint8), ref.stored(f, codes), err_msg=f"{name} {granularity} codes")


@pytest.mark.parametrize("case", range(CASES))
def test_dequantize_accepts_only_what_it_gets_right(case, seed):
    rng = np.random.default_rng([seed, case])
    name = str(rng.choice(FORMATS))
    f = ref.fmt(name)
    granularity = str(rng.choice(["row", "tensor"]))
    rows, cols = int(rng.integers(1, 6)), int(rng.integers(1, 70))
    codes = rng.integers(0, 1 << f.bits, size=(rows, cols)).astype(np.uint32)
    q = hostile_layout(rng, ref.stored(f, codes).astype(np.int8 if name == "int8" else np.uint8))
    scale = np.abs(hostile_values(rng, (rows if granularity == "row" else 1,)))
    out_dtype = dtype_of(rng)
    given_cols = cols if rng.integers(4) else int(rng.integers(0, 80))
    y = call(ops.dequantize, q, scale, name, cols=given_cols, dtype=out_dtype, granularity=granularity)
    if y is None:
        return
    # accepted: q, as handed over (a transposed view has other rows), must be stored rows of
    # `given_cols` codes
    assert ops.packed_row_bytes(name, given_cols) == np.shape(q)[-1], "accepted codes that are not given_cols wide"
    stored = np.ascontiguousarray(q).view(np.uint8)
    if f.packed:  # and rows with codes past given_cols (given_cols too few) are refused
        assert not np.unpackbits(stored, axis=-1, bitorder="little")[:, given_cols * f.bits:].any(), \
            "accepted rows that hold codes past given_cols"
    got_codes = ref.codes_of_stored(f, stored, given_cols)
    want = ref.round_to(ref.dequantize(got_codes, scale, f, granularity), out_dtype)
    assert_same_bits(y, from_values(want, out_dtype), f"{name} dequantize to {out_dtype}")


@pytest.mark.parametrize("case", range(CASES))
def test_linear_accepts_only_what_it_gets_right(case, seed):
    rng = np.random.default_rng([seed, case])
    scheme = rng.integers(4)
    wname, aname = [("int8", None), ("int8", "int8"), ("fp8_e4m3", "fp8_e4m3"), (str(rng.choice(FORMATS)), None)][scheme]
    wf = ref.fmt(wname)
    af = ref.fmt(aname) if aname else None
    m, k, n = int(rng.integers(1, 5)), int(rng.integers(1, 70)), int(rng.integers(1, 9))
    dtype = dtype_of(rng)
    with np.errstate(over="ignore"):
        x = maybe_torch(rng, hostile_layout(rng, hostile_values(rng, (m, k)).astype(dtype)))
    w32 = rng.standard_normal((n, k)).astype(np.float32)
    wq, ws = ops.quantize(w32, wname, "row")
    w = hostile_layout(rng, wq)
    with np.errstate(over="ignore"):
        bias = hostile_values(rng, (n,)).astype(dtype) if rng.integers(2) else None
    if bias is not None and not isinstance(x, np.ndarray):
        bias = torch_module().from_numpy(bias).to(x.dtype)
    # in_features: right, omitted (then x's last dim decides), or wrong; x may have other features than w
    in_features = [k, None, int(rng.integers(1, 80))][min(int(rng.integers(5)), 2)]
    if rng.integers(5) == 0:
        with np.errstate(over="ignore"):
            x = hostile_values(rng, (m, int(rng.integers(1, 80)))).astype(dtype)
    dtype = str(x.dtype).split(".")[-1]
    y = call(ops.linear, x, w, ws, weight_format=wname, bias=bias, act_format=aname, in_features=in_features)
    if y is None:
        return
    kx = np.shape(x)[-1]
    assert in_features in (kx, None), "accepted in_features that are not x's"
    # The layer is the weight as handed over (a hostile layout may be a transposed view: then
    # its rows are other ones) with kx inputs a row: its stored rows must hold kx codes. A packed
    # row pads to 16 bytes, so rows of kx and of k codes can have the same bytes (its first kx
    # codes are then the row). Anything else must be refused.
    assert ops.packed_row_bytes(wname, kx) == np.shape(w)[-1], "accepted features that are not the weight's"
    x32 = values_of(x)
    w_codes = ref.codes_of_stored(wf, np.ascontiguousarray(w).view(np.uint8), kx)
    b = None if bias is None else values_of(bias).astype(np.float64)
    want, terms = ref.linear(x32, w_codes, values_of(ws), wf, "row", af, "row", b)
    got = values_of(y).astype(np.float64)
    finite = np.isfinite(want)
    # cquant.h evaluates the sums and acc * sx * sw in fp32: where the finite terms of an output
    # can pass fp32's largest value (inputs within ~1e3 of it) that evaluation may overflow, so
    # the documented result is +-inf, or NaN where such an overflow meets an infinite input,
    # even where the float64 value is finite or +-inf
    x_finite = np.where(np.isfinite(x32), x32, np.float32(0))
    _, inter = ref.linear(x_finite, w_codes, np.ones_like(values_of(ws)), wf, "row", af, "row", None)
    overflow = inter > float(np.finfo(np.float32).max)
    nan_differs = np.isnan(got) != np.isnan(want)
    assert not (nan_differs & ~(overflow & np.isnan(got))).any(), f"{wname}/{aname}: NaN positions differ"
    with np.errstate(invalid="ignore"):
        wscale = 0.0 if af else float(np.nanmax(np.abs(values_of(ws))))
        bound = linear_abs_bound(kx, terms, want, dtype, wscale)
        top = float(np.finfo(np.float16).max) if dtype == "float16" else 3.3895e38
        ok = ~finite | (np.abs(got - want) <= bound) | (np.isinf(got) & (np.abs(want) >= top))
    ok |= ~np.isfinite(got) & overflow
    assert ok.all(), f"{wname}/{aname} {dtype}: {np.argwhere(~ok)[:3].tolist()} beyond the rounding bound"


def run_with_address_space(code, gib):
    """Run `code` in a fresh Python whose address space is capped at `gib` GiB: an op that asks
    for memory its arguments do not need fails there instead of passing on overcommit."""
    script = f"import resource\nresource.setrlimit(resource.RLIMIT_AS, ({gib} << 30, {gib} << 30))\n" + textwrap.dedent(code)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=os.environ)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@pytest.mark.skipif(under_asan(), reason="AddressSanitizer's shadow memory needs more address space than the cap")
def test_int8_attention_blocks_longer_than_the_sequence_allocate_for_the_sequence():
    """q_block / k_block beyond the sequence mean one block: the temporaries are the sequence's
    size, not the block's (2**31 - 1 keys of logits were 8 GiB per head)."""
    out = run_with_address_space("""
        import numpy as np
        import cquant
        rng = np.random.default_rng(0)
        q, k, v = (rng.standard_normal((1, n, 2, 16)).astype(np.float32) for n in (5, 7, 7))
        huge = cquant.attention(q, k, v, mode="int8", scale=0.25, q_block=2**31 - 1, k_block=2**31 - 1, return_lse=True)
        whole = cquant.attention(q, k, v, mode="int8", scale=0.25, q_block=5, k_block=7, return_lse=True)
        print(all(np.array_equal(a, b) for a, b in zip(huge, whole)))
    """, gib=2)
    assert out.strip() == "True"
