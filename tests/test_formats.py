"""The format table and the encoding of single values: exhaustive and exact.

Values are encoded through ops.quantize with a static per-tensor scale of 1.0, so the code of x
is encode(x * 1.0) = encode(x): exactly the format's saturating round-to-nearest-even cast.
"""

import numpy as np
import pytest

import cquant
from cquant import ops

import reference as ref
from helpers import assert_same_bits, bits

ALL = list(ref.FORMATS)
FPX = [f.name for f in ref.FPX]
FP8 = ["fp8_e4m3", "fp8_e5m2"]


def finite_bf16_values():
    """float32 [65280]: every finite bfloat16 value (both zeros, subnormals), by bit pattern."""
    u = np.arange(1 << 16, dtype=np.uint32)
    u = u[((u >> 7) & 0xFF) != 0xFF]
    return (u << 16).view(np.float32)


def encode_with_unit_scale(x, name):
    """uint32 codes of float32 values x [n] (as a [n // 256, 256] or [1, n] tensor)."""
    f = ref.fmt(name)
    x2 = x.reshape(-1, 256) if x.size % 256 == 0 else x.reshape(1, -1)
    q, s = ops.quantize(x2, name, "tensor", scale=np.ones(1, np.float32))
    assert s[0] == 1.0
    return ref.codes_of_stored(f, q, x2.shape[1]).reshape(-1)


# ---------------------------------------------------------------- the table


def test_table_holds_every_format_in_id_order():
    ids = [f.id for f in ops.FORMATS.values()]
    assert ids == sorted(ids)
    # the 4-bit formats per group (tests/test_int4.py) and every format of the reference's table
    assert [n for n, f in ops.FORMATS.items() if f.grouped] == ["int4", "uint4"]
    assert [n for n, f in ops.FORMATS.items() if not f.grouped] == ALL
    assert (ops.FORMATS["int4"].id, ops.FORMATS["uint4"].id) == (4, 5)
    # every fpX with E >= 1 and 3 <= 1 + E + M <= 7, and nothing else
    fpx = {(f.ebits, f.mbits) for f in ops.FORMATS.values() if f.kind == "float" and f.packed}
    assert fpx == {(e, m) for e in range(1, 7) for m in range(0, 7) if 3 <= 1 + e + m <= 7}
    assert len(ops.FORMATS) == 3 + 2 + 20


@pytest.mark.parametrize("name", ALL)
def test_format_fields(name):
    info, want = ops.format_info(name), ref.fmt(name)
    assert info.id == want.id
    assert info.name == name
    assert info.kind == want.kind
    assert (info.bits, info.ebits, info.mbits, info.bias) == (want.bits, want.ebits, want.mbits, want.bias)
    assert info.max_value == want.max_value
    assert info.max_code == want.max_code
    assert info.packed == want.packed
    assert ops.format_info(info.id) is info
    assert ops.format_info(info) is info
    expected_code_dtype = {"int8": "int8", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}.get(name, "uint8")
    assert info.code_dtype == expected_code_dtype


@pytest.mark.parametrize("name", FPX)
def test_fpx_ids_names_and_max_follow_the_formula(name):
    f = ops.format_info(name)
    e, m = f.ebits, f.mbits
    assert f.id == 0x100 + 0x10 * e + m
    assert name == f"fp{1 + e + m}_e{e}m{m}"
    assert f.bias == 2 ** (e - 1) - 1
    # all-ones exponent and mantissa is the largest value: no inf, no NaN
    assert f.max_value == 2.0 ** (2**e - 1 - f.bias) * (2 - 2.0**-m)
    assert f.max_code == 2 ** (e + m) - 1
    assert ops.fpx_format(e, m) is f


def test_fp8_and_int8_constants():
    assert ops.format_info("fp8_e4m3").max_value == 448.0 and ops.format_info("fp8_e4m3").max_code == 0x7E
    assert ops.format_info("fp8_e5m2").max_value == 57344.0 and ops.format_info("fp8_e5m2").max_code == 0x7B
    assert ops.format_info("int8").max_value == 127.0 and ops.format_info("int8").max_code == 127
    assert ops.format_info("float8_e4m3fn") is ops.format_info("fp8_e4m3")
    assert ops.format_info("FLOAT8_E5M2") is ops.format_info("fp8_e5m2")
    assert (ops.format_info(1).name, ops.format_info(2).name, ops.format_info(3).name) == ("int8", "fp8_e4m3", "fp8_e5m2")


def test_versions_and_constants():
    assert cquant.FORMAT_VERSION == 3
    assert cquant._C.PACK_ROW_ALIGN == ref.PACK_ROW_ALIGN == 16
    assert cquant._C.FORMAT_INT8 == 1 and cquant._C.FORMAT_NONE == 0


@pytest.mark.parametrize("name", ALL)
def test_packed_row_bytes(name):
    f = ref.fmt(name)
    for cols in (1, 2, 7, 15, 16, 17, 97, 128, 1025, 3072):
        want = ref.packed_row_bytes(f.bits, cols) if f.packed else cols
        assert ops.packed_row_bytes(name, cols) == want, cols
        if f.packed:
            assert want % 16 == 0 and want * 8 >= cols * f.bits > (want - 16) * 8


# ---------------------------------------------------------------- decode


@pytest.mark.parametrize("name", ALL)
def test_format_values_match_the_formula(name):
    got = ops.format_values(name)
    want = ref.fmt(name).values
    assert got.dtype == np.float32 and got.shape == (2 ** ref.fmt(name).bits,)
    assert_same_bits(got, want.astype(np.float32), name)
    # signed zeros are distinct codes
    f = ref.fmt(name)
    if f.kind == "float":
        assert np.signbit(got[f.sign_bit]) and got[f.sign_bit] == 0 and not np.signbit(got[0])


def test_fp8_values_match_torch(torch):
    for name, dtype in (("fp8_e4m3", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)):
        all_codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype)
        assert_same_bits(ops.format_values(name), all_codes.float().numpy(), name)


# ---------------------------------------------------------------- encode, exhaustively


@pytest.mark.parametrize("name", FP8)
def test_fp8_matches_torch_saturating_cast_on_every_bf16(torch, name):
    """Every finite bf16 bit pattern: cquant's code == torch's cast after clamping to +-max,
    which is what a saturating round-to-nearest-even cast means (torch's own is not saturating)."""
    dtype = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[name]
    maxv = ops.format_info(name).max_value
    values = finite_bf16_values()
    x = torch.from_numpy(values).to(torch.bfloat16).reshape(-1, 256)
    assert np.array_equal(x.float().numpy().reshape(-1), values)  # every pattern, exactly
    q, s = ops.quantize(x, name, "tensor", scale=torch.ones(1))
    assert q.dtype == dtype and tuple(q.shape) == tuple(x.shape)
    want = torch.clamp(x.float(), -maxv, maxv).to(dtype)
    assert_same_bits(q, want, f"{name} codes of bf16 (torch input)")
    # the same values as NumPy float32 give the same codes (raw uint8 in NumPy)
    qn, _ = ops.quantize(values.reshape(-1, 256), name, "tensor", scale=np.ones(1, np.float32))
    assert qn.dtype == np.uint8
    assert_same_bits(qn, want, f"{name} codes of bf16 values (NumPy float32 input)")


@pytest.mark.parametrize("name", ["fp6_e3m2", "fp6_e2m3", "fp4_e2m1"])
def test_fp6_fp4_match_ml_dtypes_on_every_bf16(name):
    """The OCP MX element formats: ml_dtypes' RNE cast (after clamping) gives the same codes."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    dtype = {"fp6_e3m2": ml_dtypes.float6_e3m2fn, "fp6_e2m3": ml_dtypes.float6_e2m3fn,
             "fp4_e2m1": ml_dtypes.float4_e2m1fn}[name]
    maxv = ops.format_info(name).max_value
    values = finite_bf16_values()
    want = np.clip(values, -maxv, maxv).astype(dtype).view(np.uint8).astype(np.uint32)
    np.testing.assert_array_equal(encode_with_unit_scale(values, name), want)


def test_int8_matches_torch_round_on_every_bf16(torch):
    values = finite_bf16_values()
    x = torch.from_numpy(values).to(torch.bfloat16).reshape(-1, 256)
    q, _ = ops.quantize(x, "int8", "tensor", scale=torch.ones(1))
    assert q.dtype == torch.int8
    want = torch.round(torch.clamp(x.float(), -127, 127)).to(torch.int8)  # round half to even
    assert_same_bits(q, want, "int8 codes of bf16")


@pytest.mark.parametrize("name", ALL)
def test_every_bf16_matches_the_reference(name):
    values = finite_bf16_values()
    np.testing.assert_array_equal(encode_with_unit_scale(values, name), ref.encode(ref.fmt(name), values))


# ---------------------------------------------------------------- representable values and ties


def finite_codes(f):
    codes = np.arange(1 << f.bits)
    vals = f.values
    keep = np.isfinite(vals)
    if f.kind == "int":
        keep &= vals >= -127  # code 0x80 (-128) decodes but is never produced
    return codes[keep], vals[keep]


@pytest.mark.parametrize("name", ALL)
def test_every_representable_value_round_trips(name):
    f = ref.fmt(name)
    codes, vals = finite_codes(f)
    x = vals.astype(np.float32)
    assert np.array_equal(x.astype(np.float64), vals)  # every value is an fp32
    got = encode_with_unit_scale(x, name)
    np.testing.assert_array_equal(got, codes)  # -0.0 included: it is its own code
    q, s = ops.quantize(x.reshape(1, -1), name, "tensor", scale=np.ones(1, np.float32))
    y = ops.dequantize(q, s, name, cols=x.size, granularity="tensor")
    assert_same_bits(y.reshape(-1), x, f"{name} decode(encode(v))")


@pytest.mark.parametrize("name", ALL)
def test_midpoints_round_to_the_even_code(name):
    """Halfway between two neighbours goes to the even code; one fp32 ulp off it goes to the
    nearer one; beyond max_value saturates. Both signs."""
    f = ref.fmt(name)
    mags, mcodes = f.positive
    mid = (mags[:-1] + mags[1:]) / 2
    assert np.array_equal(mid.astype(np.float32).astype(np.float64), mid)  # exact in fp32
    lo_code, hi_code = mcodes[:-1], mcodes[1:]
    even = np.where(lo_code % 2 == 0, lo_code, hi_code)
    assert np.all((even % 2 == 0) & ((even == lo_code) | (even == hi_code)))
    mid32 = mid.astype(np.float32)
    above = np.nextafter(mid32, np.float32(np.inf))
    below = np.nextafter(mid32, np.float32(0))
    maxv = np.float32(f.max_value)
    beyond = np.array([np.nextafter(maxv, np.float32(np.inf)), maxv * np.float32(1.5), maxv * 4,
                       np.float32(3e38)], np.float32)
    for sign in (1, -1):
        x = np.concatenate([mid32, above, below, beyond]) * np.float32(sign)
        want = np.concatenate([even, hi_code, lo_code, np.full(beyond.size, f.max_code)])
        if sign < 0:
            want = (-want) & 0xFF if f.kind == "int" else want | f.sign_bit
        got = encode_with_unit_scale(x.astype(np.float32), name)
        np.testing.assert_array_equal(got, want.astype(np.uint32), err_msg=f"{name} sign {sign}")
        np.testing.assert_array_equal(got, ref.encode(f, x), err_msg=f"reference, {name} sign {sign}")


@pytest.mark.parametrize("name", [n for n in ALL if ref.fmt(n).kind == "float"])
def test_tiny_values_keep_their_sign(name):
    f = ref.fmt(name)
    smallest = f.positive[0][1]
    x = np.array([0.0, -0.0, smallest / 4, -smallest / 4, smallest / 2, -smallest / 2, 1e-45, -1e-45], np.float32)
    got = encode_with_unit_scale(x, name)
    z, nz = 0, f.sign_bit
    np.testing.assert_array_equal(got, [z, nz, z, nz, z, nz, z, nz])  # smallest/2 is a tie: to 0 (even)
    assert bits(ops.format_values(name))[nz] == 0x80000000  # -0.0


def test_int8_codes_and_values():
    x = np.array([[0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, -126.5, 127.49, 300.0, -300.0, -0.0]], np.float32)
    q, _ = ops.quantize(x, "int8", "tensor", scale=np.ones(1, np.float32))
    assert q.dtype == np.int8
    np.testing.assert_array_equal(q[0], [0, 2, 2, 0, -2, -2, 126, -126, 127, 127, -127, 0])
    v = ops.format_values("int8")
    np.testing.assert_array_equal(v, np.arange(256).astype(np.uint8).view(np.int8).astype(np.float32))
