"""quantize / dequantize / pack / unpack on the CPU: exact against tests/reference.py.

Codes and scales must be bit-identical to the oracle, dequantized values bit-identical after
rounding to the output dtype; SQNR floors come from tolerances.py.
"""

import numpy as np
import pytest

from cquant import ops

import reference as ref
from dlpack_producer import LegacyProducer, Producer
from helpers import (FLOAT_DTYPE_PARAMS, as_input, assert_same_bits, bits, from_values, is_torch, random_input,
                     sqnr_db, to_framework, to_numpy, torch_module)
from tolerances import QUANT_SQNR_FLOOR_DB

ALL = list(ref.FORMATS)
GRANULARITIES = ["row", "tensor"]
# odd sizes and tails; a 3-D input is viewed as [rows, last dim]
SHAPES = [(1, 1), (1, 7), (3, 97), (5, 1025), (7, 1), (2, 3, 97)]
SQNR_SHAPES = [(7, 1025), (3, 97), (33, 97)]  # the shapes QUANT_SQNR_FLOOR_DB was measured on


def out_dtypes(x):
    """Dequantization dtypes available in x's framework (NumPy has no bfloat16)."""
    return ["float32", "float16", "bfloat16"] if is_torch(x) else ["float32", "float16"]


def check_against_reference(x, x32, name, granularity, q, s, static_scale=None, what=""):
    """q, s from cquant == the oracle's; and dequantize == the oracle's in every output dtype."""
    f = ref.fmt(name)
    rows, cols = int(np.prod(x32.shape[:-1])), x32.shape[-1]
    codes, want_scale = ref.quantize(x32.reshape(rows, cols), f, granularity, static_scale)
    assert tuple(q.shape) == (rows, ops.packed_row_bytes(name, cols)), what
    assert tuple(s.shape) == ((rows,) if granularity == "row" else (1,)), what
    assert_same_bits(s, want_scale, f"{what}: scales", nan_by_position=True)
    np.testing.assert_array_equal(bits(q).astype(np.uint8), ref.stored(f, codes), err_msg=f"{what}: stored codes")
    for dtype in out_dtypes(x):
        y = ops.dequantize(q, s, name, cols=cols, dtype=dtype, granularity=granularity)
        assert type(y) is type(x) and tuple(y.shape) == (rows, cols), what
        want = ref.round_to(ref.dequantize(codes, want_scale, f, granularity), dtype)
        assert_same_bits(y, from_values(want, dtype), f"{what}: dequantize to {dtype}")
    return codes


def expected_code_dtype(x, name):
    f = ref.fmt(name)
    if f.packed:
        return "uint8"
    if name == "int8":
        return "int8"
    return ("float8_e4m3fn" if name == "fp8_e4m3" else "float8_e5m2") if is_torch(x) else "uint8"


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPE_PARAMS)
@pytest.mark.parametrize("name", ALL)
def test_quantize_matches_reference(rng, name, dtype, granularity):
    for shape in SHAPES:
        x, x32 = random_input(rng, shape, dtype, spread=2.0)
        q, s = ops.quantize(x, name, granularity)
        assert type(q) is type(x) and type(s) is type(x)
        assert str(q.dtype).split(".")[-1] == expected_code_dtype(x, name)
        assert str(s.dtype).split(".")[-1] == "float32"
        check_against_reference(x, x32, name, granularity, q, s, what=f"{name} {dtype} {granularity} {shape}")


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPE_PARAMS)
@pytest.mark.parametrize("name", ALL)
def test_quantize_sqnr_above_floor(rng, name, dtype, granularity):
    for shape in SQNR_SHAPES:
        x, x32 = random_input(rng, shape, dtype)
        q, s = ops.quantize(x, name, granularity)
        y = to_numpy(ops.dequantize(q, s, name, cols=shape[1], granularity=granularity))
        db = sqnr_db(x32.astype(np.float64), y)
        assert db >= QUANT_SQNR_FLOOR_DB[name], f"{name} {dtype} {granularity} {shape}: {db:.2f} dB"


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("name", ALL)
def test_all_zero_groups_get_a_finite_scale_and_zero_codes(rng, name, granularity):
    f = ref.fmt(name)
    floor_scale = ref.AMAX_FLOOR / np.float32(f.max_value)
    x32 = rng.standard_normal((5, 97)).astype(np.float32)
    x32[1] = 0.0
    x32[3] = -0.0
    q, s = ops.quantize(x32, name, granularity)
    codes = check_against_reference(x32, x32, name, granularity, q, s, what=f"{name} zero rows")
    if granularity == "row":
        assert s[1] == s[3] == floor_scale and np.isfinite(floor_scale) and floor_scale > 0
        assert np.all(ref.decode(f, codes[[1, 3]]) == 0)
        y = ops.dequantize(q, s, name, cols=97)
        assert np.all(y[[1, 3]] == 0)
    # a whole tensor of zeros
    z = np.zeros((3, 7), np.float32)
    q, s = ops.quantize(z, name, granularity)
    assert np.all(s == floor_scale)
    assert not bits(q).any()
    assert np.all(ops.dequantize(q, s, name, cols=7, granularity=granularity) == 0)


@pytest.mark.parametrize("name", ALL)
def test_amax_floor_keeps_scale_and_inverse_normal(name):
    """cquant.h: the floor keeps scale and 1/scale finite and normal in fp32 for every format."""
    maxv = np.float32(ref.fmt(name).max_value)
    tiny = np.finfo(np.float32).tiny
    scale, inv = ref.AMAX_FLOOR / maxv, maxv / ref.AMAX_FLOOR
    assert tiny <= scale and np.isfinite(inv) and tiny <= inv
    q, s = ops.quantize(np.zeros((1, 3), np.float32), name)
    assert s[0] == scale


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("name", ALL)
def test_codes_do_not_change_when_data_is_scaled_by_powers_of_two(rng, name, granularity):
    """amax, scale and 1/scale scale exactly with 2^k (down to amax near the floor), so the
    codes stay the same and the scales move by exactly 2^k."""
    x32 = rng.standard_normal((3, 97)).astype(np.float32)
    q0, s0 = ops.quantize(x32, name, granularity)
    for k in (-85, -40, -7, 9, 60):
        q, s = ops.quantize(x32 * np.float32(2.0**k), name, granularity)
        np.testing.assert_array_equal(q, q0, err_msg=f"2^{k}")
        np.testing.assert_array_equal(s, s0 * np.float32(2.0**k), err_msg=f"2^{k}")


@pytest.mark.parametrize("bad", ["nan", "inf", "-inf"])
@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPE_PARAMS)
@pytest.mark.parametrize("name", ["int8", "fp8_e4m3", "fp8_e5m2", "fp6_e3m2", "fp4_e2m1", "fp3_e2m0"])
def test_nonfinite_groups_give_nan_scale_and_zero_codes(rng, name, dtype, granularity, bad):
    rows, cols = 6, 97
    x32 = rng.standard_normal((rows, cols)).astype(np.float32)
    bad_rows = [1, 4]
    for r in bad_rows:
        x32[r, rng.integers(cols)] = float(bad)
    x, x32 = as_input(x32, dtype)
    q, s = ops.quantize(x, name, granularity)
    check_against_reference(x, x32, name, granularity, q, s, what=f"{name} {bad} rows")
    sn, qb = to_numpy(s), bits(q)
    y = to_numpy(ops.dequantize(q, s, name, cols=cols, granularity=granularity))
    if granularity == "tensor":
        assert np.isnan(sn[0]) and not qb.any() and np.all(np.isnan(y))
        return
    good = [r for r in range(rows) if r not in bad_rows]
    assert np.all(np.isnan(sn[bad_rows])) and np.all(np.isfinite(sn[good]))
    assert not qb[bad_rows].any()
    assert np.all(np.isnan(y[bad_rows])) and np.all(np.isfinite(y[good]))
    # the other rows are exactly what they would be on their own
    qg, sg = ops.quantize(as_input(x32[good], dtype)[0], name, granularity)
    assert_same_bits(to_numpy(sg), sn[good], "scales of the finite rows")
    np.testing.assert_array_equal(bits(qg), qb[good])


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPE_PARAMS)
@pytest.mark.parametrize("name", ALL)
def test_static_scales(rng, name, dtype, granularity):
    rows, cols = 5, 97
    x, x32 = random_input(rng, (rows, cols), dtype, spread=1.0)
    f = ref.fmt(name)
    # around the dynamic scale, from 4x too small (many codes saturate) to 4x too large
    amax = np.abs(x32).max(axis=1) if granularity == "row" else np.abs(x32).max(keepdims=True).reshape(1)
    scale32 = (amax / np.float32(f.max_value) * np.exp2(rng.uniform(-2, 2, amax.shape))).astype(np.float32)
    scale = to_framework(scale32, "float32", torch_module() if is_torch(x) else None)
    before = bits(scale).copy()
    q, s = ops.quantize(x, name, granularity, scale=scale)
    assert s is scale
    np.testing.assert_array_equal(bits(scale), before)  # read, never written
    codes = check_against_reference(x, x32, name, granularity, q, s, static_scale=scale32, what=f"{name} static")
    # every row whose largest |x| / scale (in fp32, as the library computes it) reaches the format's
    # largest value stores +-max_value there, whatever the sign of that element
    inv = np.repeat(ref.static_inverse(scale32), rows) if granularity == "tensor" else ref.static_inverse(scale32)
    peak = np.abs(x32).argmax(axis=1)
    saturated = np.abs(x32[np.arange(rows), peak]) * inv >= np.float32(f.max_value)
    peak_values = np.abs(ref.decode(f, codes[np.arange(rows), peak]))
    np.testing.assert_array_equal(peak_values[saturated], f.max_value, err_msg=f"{name}: saturated rows")


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("name", ["int8", "fp8_e4m3", "fp6_e2m3", "fp4_e2m1"])
def test_static_scales_without_a_finite_inverse_give_zero_codes(rng, name, granularity):
    x32 = rng.standard_normal((4, 33)).astype(np.float32)
    for bad in (np.nan, 0.0, -0.0, -0.5, np.inf, -np.inf):
        scale = np.array([bad] if granularity == "tensor" else [0.5, bad, 0.01, bad], np.float32)
        q, s = ops.quantize(x32, name, granularity, scale=scale)
        check_against_reference(x32, x32, name, granularity, q, s, static_scale=scale, what=f"{name} scale {bad}")
        zero_rows = [0, 1, 2, 3] if granularity == "tensor" else [1, 3]
        assert not bits(q)[zero_rows].any()


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("name", ["int8", "fp8_e4m3", "fp8_e5m2", "fp6_e2m3", "fp4_e2m1", "fp7_e6m0"])
def test_tiny_static_scales_saturate(rng, name, granularity):
    """A valid (finite, > 0) scale so small that 1 / scale overflows fp32 (below 2^-128, e.g. the
    subnormal 1e-39) still quantizes: inv = +inf, every nonzero element saturates to +-max, zeros
    and NaN give code 0, as cquant.h's math says (they were all-zero codes)."""
    f = ref.fmt(name)
    x32 = rng.standard_normal((4, 33)).astype(np.float32)
    x32[:, 0], x32[:, 1], x32[:, 2], x32[:, 3] = 0.0, np.nan, np.inf, -np.inf
    x32[:, 4] = 1e-30
    for tiny in (1e-39, 2.0**-129, 1e-45, 2.0**-128 * 0.75):
        scale = np.array([tiny] if granularity == "tensor" else [tiny, 0.5, tiny, 1e-40], np.float32)
        q, s = ops.quantize(x32, name, granularity, scale=scale)
        codes = check_against_reference(x32, x32, name, granularity, q, s, static_scale=scale, what=f"{name} {tiny}")
        rows = [0, 1, 2, 3] if granularity == "tensor" else [0, 2, 3]
        for r in rows:
            nonzero = np.isfinite(x32[r]) & (x32[r] != 0)
            nonzero |= np.isinf(x32[r])
            mags = codes[r] % (f.sign_bit if f.kind == "float" else 256)
            if f.kind == "int":
                mags = np.where(codes[r] >= 128, 256 - codes[r], codes[r])
            assert np.all(mags[nonzero] == f.max_code), f"{name} row {r}: not saturated"
            assert np.all(codes[r][[0, 1]] == 0)


@pytest.mark.parametrize("dtype", FLOAT_DTYPE_PARAMS)
@pytest.mark.parametrize("name", ["int8", "fp8_e5m2", "fp5_e2m2"])
def test_out_buffers_are_filled_and_returned(rng, name, dtype):
    x, x32 = random_input(rng, (3, 97), dtype, spread=1.0)
    q0, s0 = ops.quantize(x, name)
    q, s = ops.quantize(x, name)  # fresh buffers of the right kind, then poisoned
    _poison(q, 0xA5)
    _poison(s, 0xFF)
    q1, s1 = ops.quantize(x, name, out=q, scale_out=s)
    assert q1 is q and s1 is s
    np.testing.assert_array_equal(bits(q), bits(q0))
    np.testing.assert_array_equal(bits(s), bits(s0))
    y = ops.dequantize(q, s, name, cols=97)
    _poison(y, 0xFF)
    assert ops.dequantize(q, s, name, cols=97, out=y) is y
    check_against_reference(x, x32, name, "row", q, s, what="out=")


def _poison(a, byte):
    if is_torch(a):
        import torch

        a.view(torch.uint8).fill_(byte)
    else:
        a.view(np.uint8).fill(byte)


def test_dequantize_defaults(rng):
    x32 = rng.standard_normal((4, 16)).astype(np.float32)
    q, s = ops.quantize(x32, "int8", "tensor")
    y = ops.dequantize(q, s, "int8")  # cols from q, granularity "tensor" from one scale for 4 rows
    np.testing.assert_array_equal(y, ref.dequantize(q.astype(np.int64) & 0xFF, s, ref.INT8, "tensor"))
    assert y.dtype == np.float32
    q, s = ops.quantize(x32[:1], "fp6_e3m2")
    with pytest.raises(ValueError, match="cols"):
        ops.dequantize(q, s, "fp6_e3m2")


# ---------------------------------------------------------------- pack / unpack


PACK_SHAPES = [(1, 1), (1, 7), (3, 97), (5, 1025), (4, 128), (2, 3)]


@pytest.mark.parametrize("bits_", range(1, 9))
def test_pack_unpack_round_trip(rng, bits_):
    mask = (1 << bits_) - 1
    for rows, cols in PACK_SHAPES:
        codes = rng.integers(0, 256, (rows, cols), dtype=np.uint8)  # high bits must be ignored
        row_bytes = ref.packed_row_bytes(bits_, cols)
        packed = np.full((rows, row_bytes), 0xFF, np.uint8)  # poisoned: padding must come out 0
        assert ops.pack(codes, bits_, out=packed) is packed
        np.testing.assert_array_equal(packed, ref.pack(codes & mask, bits_), err_msg=f"{bits_} bits {rows}x{cols}")
        used = cols * bits_
        tail = np.unpackbits(packed, axis=1, bitorder="little")[:, used:]
        assert not tail.any(), "pad bits and pad bytes are zero"
        np.testing.assert_array_equal(ops.pack(codes, bits_), packed)
        out = np.full((rows, cols), 0xEE, np.uint8)
        assert ops.unpack(packed, bits_, cols, out=out) is out
        np.testing.assert_array_equal(out, codes & mask)
        if used < 8 * row_bytes:  # a bit set in the padding, which pack leaves zero, is refused
            dirty = np.unpackbits(packed, axis=1, bitorder="little")
            dirty[-1, -1] = 1
            with pytest.raises(ValueError, match=f"cols = {cols}"):
                ops.unpack(np.packbits(dirty, axis=1, bitorder="little"), bits_, cols)


def test_pack_torch_in_torch_out(torch, rng):
    codes = torch.from_numpy(rng.integers(0, 64, (3, 97), dtype=np.uint8))
    packed = ops.pack(codes, 6)
    assert isinstance(packed, torch.Tensor) and packed.dtype == torch.uint8
    np.testing.assert_array_equal(packed.numpy(), ref.pack(codes.numpy(), 6))
    back = ops.unpack(packed, 6, 97)
    assert isinstance(back, torch.Tensor) and torch.equal(back, codes)


def test_packed_layout_by_hand():
    """LSB first: code j takes bits [j*b, (j+1)*b) of the row's byte string; rows padded to 16."""
    codes = np.array([[0b101101, 0b110011, 0b000111, 0b111000]], np.uint8)  # 4 x 6 bits = 3 bytes
    want = np.zeros((1, 16), np.uint8)
    want[0, :3] = [0b11101101, 0b01111100, 0b11100000]
    np.testing.assert_array_equal(ops.pack(codes, 6), want)
    codes4 = np.array([[1, 2, 3]], np.uint8)
    np.testing.assert_array_equal(ops.pack(codes4, 4)[0, :3], [0x21, 0x03, 0x00])
    np.testing.assert_array_equal(ops.pack(codes4, 3)[0, :2], [0b11010001, 0b0])


def narrower_cols(bits_, cols):
    """Column counts below cols whose packed rows take as many bytes as cols' rows."""
    return [c for c in range(1, cols) if ref.packed_row_bytes(bits_, c) == ref.packed_row_bytes(bits_, cols)]


def in_framework(a, framework):
    return torch_module(load=True).from_numpy(a) if framework == "torch" else a


def codes_past(rng, bits_, rows, cols, c):
    """Random codes [rows, cols], zero from column c on."""
    codes = np.zeros((rows, cols), np.uint8)
    codes[:, :c] = rng.integers(0, 1 << bits_, (rows, c))
    return codes


# Column counts of b-bit codes whose rows have padding: as many as 16 bytes hold, one fewer than 48 hold
PADDED_COLS = (lambda b: 128 // b, lambda b: 3 * 128 // b - 1)


@pytest.mark.parametrize("framework", ["numpy", "torch"])
@pytest.mark.parametrize("bits_", range(1, 9))
def test_unpack_refuses_codes_past_cols(rng, framework, bits_):
    """cols smaller than the packed one but of the same row size: refused when a code past cols
    is not zero (bits set where pack leaves zero padding for cols), accepted and exact when all
    are; the packed cols reads every code."""
    for cols in (f(bits_) for f in PADDED_COLS):
        narrower = narrower_cols(bits_, cols)
        assert narrower, (bits_, cols)
        for c in narrower:
            codes = codes_past(rng, bits_, 3, cols, c)
            got = ops.unpack(in_framework(ref.pack(codes, bits_), framework), bits_, c)
            np.testing.assert_array_equal(to_numpy(got), codes[:, :c], err_msg=f"{bits_} bits, {cols} -> {c}")
            # the lowest bit of code c (the first padding bit of c columns) and the top bit of the last code
            for j, code in ((c, 1), (cols - 1, 1 << (bits_ - 1))):
                dirty = codes.copy()
                dirty[1, j] = code
                packed = in_framework(ref.pack(dirty, bits_), framework)
                with pytest.raises(ValueError, match=rf"cols = {c}\b.*past.*padding"):
                    ops.unpack(packed, bits_, c)
                np.testing.assert_array_equal(to_numpy(ops.unpack(packed, bits_, cols)), dirty)


@pytest.mark.parametrize("framework", ["numpy", "torch"])
@pytest.mark.parametrize("name", [f.name for f in ref.FPX])
def test_dequantize_refuses_codes_past_cols(rng, framework, name):
    """As test_unpack_refuses_codes_past_cols, for the packed rows of every fpX format."""
    f = ref.fmt(name)
    scale = rng.uniform(0.5, 2.0, 3).astype(np.float32)
    s = in_framework(scale, framework)
    for cols in (g(f.bits) for g in PADDED_COLS):
        assert ops.packed_row_bytes(name, cols) == ref.packed_row_bytes(f.bits, cols)
        for c in narrower_cols(f.bits, cols):
            codes = codes_past(rng, f.bits, 3, cols, c)
            y = ops.dequantize(in_framework(ref.pack(codes, f.bits), framework), s, name, cols=c)
            np.testing.assert_array_equal(to_numpy(y), ref.dequantize(codes[:, :c], scale, f),
                                          err_msg=f"{name}, {cols} -> {c}")
            for j, code in ((c, 1), (cols - 1, f.max_code)):
                dirty = codes.copy()
                dirty[2, j] = code
                q = in_framework(ref.pack(dirty, f.bits), framework)
                with pytest.raises(ValueError, match=rf"cols = {c}\b.*past.*padding"):
                    ops.dequantize(q, s, name, cols=c)
                np.testing.assert_array_equal(to_numpy(ops.dequantize(q, s, name, cols=cols)),
                                              ref.dequantize(dirty, scale, f))


@pytest.mark.parametrize("producer", [Producer, LegacyProducer])
def test_codes_past_cols_are_refused_from_any_dlpack_producer(producer):
    """Another framework's array (read through DLPack, results in out=) is checked the same way."""
    codes = np.zeros((2, 21), np.uint8)  # 21 codes of 6 bits: 16-byte rows, as for 20
    q = ref.pack(codes, 6)
    assert ops.unpack(producer(q), 6, 20, out=np.empty((2, 20), np.uint8)).tolist() == codes[:, :20].tolist()
    codes[1, 20] = 1
    q = ref.pack(codes, 6)
    with pytest.raises(ValueError, match=r"cols = 20, .*past column 20 .*expected the number of columns packed .*\(21"):
        ops.unpack(producer(q), 6, 20, out=np.empty((2, 20), np.uint8))
    with pytest.raises(ValueError, match=r"cols = 20, .*past column 20 .*expected the number of columns q .*\(21"):
        ops.dequantize(producer(q), np.ones(2, np.float32), "fp6_e3m2", cols=20, out=np.empty((2, 20), np.float32))
    assert ops.unpack(producer(q), 6, 21, out=np.empty((2, 21), np.uint8))[1, 20] == 1


@pytest.mark.parametrize("name", [f.name for f in ref.FPX])
def test_quantize_packs_like_pack(rng, name):
    """The packed fpX codes of quantize are pack() of the unpacked codes."""
    f = ref.fmt(name)
    x32 = rng.standard_normal((3, 1025)).astype(np.float32)
    q, _ = ops.quantize(x32, name)
    codes = ops.unpack(q, f.bits, 1025)
    np.testing.assert_array_equal(ops.pack(codes, f.bits), q)
    np.testing.assert_array_equal(codes, ref.quantize(x32, f)[0])
