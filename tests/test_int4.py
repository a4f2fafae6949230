"""The 4-bit formats per group (int4, uint4) and their linear schemes on the CPU.

quantize / dequantize compare bit for bit with the independent NumPy model in tests/reference.py
(quantize_int4 / quantize_uint4 / dequantize_group); the linear layers (int4wo with uint4 or int4
weights, int4dq, fp8da_int4w) against its float64 evaluation of the same codes
(reference.linear_group) within the fp32 rounding bounds of tolerances.py. Bad arguments give
the right exception class with a message naming the argument.
"""

import numpy as np
import pytest

from cquant import _C, ops
from cquant.schemes import SCHEMES, scheme

import reference as ref
from helpers import FLOAT_DTYPE_PARAMS, as_input, assert_same_bits, bits, random_input, to_framework, to_numpy
from tolerances import (GROUP_LINEAR_SQNR_FLOOR_DB, GROUP_QUANT_SQNR_FLOOR_DB, gated_abs_bound, gelu_abs_bound,
                        gelu_tanh, linear_group_abs_bound)

FORMATS = ["int4", "uint4"]
GROUP_SIZES = [32, 64, 128]


def quantize_ref(x32, fmt, gs):
    return ref.quantize_group(x32, fmt, gs)


def check_against_reference(x, x32, fmt, gs):
    q, s = ops.quantize(x, fmt, group_size=gs)
    rows, cols = x32.shape
    codes, scale = quantize_ref(x32, fmt, gs)
    groups = cols // gs
    assert q.dtype == np.uint8 or str(q.dtype).endswith("uint8")
    assert tuple(q.shape) == (rows, ref.packed_row_bytes(4, cols))
    want_shape = (rows, groups) if fmt == "int4" else (rows, groups, 2)
    assert tuple(s.shape) == want_shape
    # the stored bytes: packed nibbles, LSB first, zero padding
    np.testing.assert_array_equal(to_numpy(q), ref.stored_group(codes), err_msg=f"{fmt} stored bytes")
    assert_same_bits(to_numpy(s), scale, f"{fmt} scales", nan_by_position=False)
    return q, s, codes, scale


# ---------------------------------------------------------------- quantize / dequantize


@pytest.mark.parametrize("dtype", FLOAT_DTYPE_PARAMS)
@pytest.mark.parametrize("gs", GROUP_SIZES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_and_dequantize_match_the_reference(rng, fmt, gs, dtype):
    for rows, cols in ((1, gs), (5, 4 * gs), (3, 1024)):
        x, x32 = random_input(rng, (rows, cols), dtype, spread=2.0)
        x32 = x32 + np.float32(0)  # rows get different offsets below: uint4 zero points differ
        q, s, codes, scale = check_against_reference(x, x32, fmt, gs)
        want = ref.dequantize_group(codes, scale, fmt, gs)
        for out_dtype in ("float32", "float16"):
            y = ops.dequantize(q, s, fmt, cols=cols, dtype=out_dtype)
            assert_same_bits(y, want.astype(out_dtype), f"{fmt} dequantize to {out_dtype}")
        # the group size is read from the scales when not given, and may be given
        y = ops.dequantize(q, s, fmt, cols=cols, group_size=gs)
        assert_same_bits(y, want, f"{fmt} dequantize with group_size")


@pytest.mark.torch
@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_to_bfloat16_rounds_once(torch, rng, fmt):
    x32 = rng.standard_normal((4, 256)).astype(np.float32)
    q, s = ops.quantize(x32, fmt, group_size=64)
    codes, scale = quantize_ref(x32, fmt, 64)
    y = ops.dequantize(torch.from_numpy(q), torch.from_numpy(s), fmt, cols=256, dtype="bfloat16")
    assert y.dtype == torch.bfloat16
    want = ref.round_to_bf16(ref.dequantize_group(codes, scale, fmt, 64))
    assert_same_bits(y.float().numpy(), want, f"{fmt} dequantize to bfloat16")


@pytest.mark.parametrize("fmt", FORMATS)
def test_offset_rows_and_default_group_size(rng, fmt):
    """Rows with large offsets (one-sided groups: uint4's zero point at an end) and the default
    group size GROUP_SIZE_DEFAULT."""
    x32 = (rng.standard_normal((6, 512)) + 10.0 * rng.standard_normal((6, 1))).astype(np.float32)
    q, s = ops.quantize(x32, fmt)
    assert s.shape[1] == 512 // ops.GROUP_SIZE_DEFAULT
    codes, scale = quantize_ref(x32, fmt, ops.GROUP_SIZE_DEFAULT)
    np.testing.assert_array_equal(q, ref.stored_group(codes))
    assert_same_bits(s, scale, "scales", nan_by_position=False)


@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip_error_is_within_half_a_step(rng, fmt):
    """|x - x'| <= scale / 2 (plus fp32 rounding) for every element of a finite group: the codes
    are the nearest ones (uint4: its range covers the group)."""
    x32 = rng.standard_normal((8, 512)).astype(np.float32) * np.float32(3)
    q, s = ops.quantize(x32, fmt, group_size=64)
    y = ops.dequantize(q, s, fmt, cols=512)
    step = (s if fmt == "int4" else s[:, :, 0]).astype(np.float64)
    step = np.repeat(step, 64, axis=1)
    err = np.abs(y.astype(np.float64) - x32)
    # The scale is a / 7 or r / 15 rounded to 8 significant bits (relative change below 2^-8), so
    # inv = 1 / scale maps the group onto at most 7 / (1 - 2^-8) = 7.03 or 15.06 steps. int4: a
    # saturated code is off by at most 0.03 steps, inside the half step. uint4: the rounded zero
    # point moves the grid by up to half a step, and with the range's 0.06 extra steps a code
    # clamped at 15 is off by at most 0.56 steps (RNE(hi * inv) + zp <= r * inv + 1 = 16.06), so
    # the allowance of one whole step covers it as it did with the unrounded scale.
    zp_err = step / 2 if fmt == "uint4" else 0
    assert np.all(err <= step / 2 + zp_err + 1e-6 * np.abs(x32) + 1e-30)
    sq = 10 * np.log10(np.sum(x32.astype(np.float64) ** 2) / np.sum(err**2))
    assert sq >= GROUP_QUANT_SQNR_FLOOR_DB[fmt], sq


def _scale_bits_low_half(fmt, s):
    sc = np.asarray(s if fmt == "int4" else s[..., 0], dtype=np.float32)
    return sc, sc.view(np.uint32) & np.uint32(0xFFFF)


@pytest.mark.parametrize("dtype", FLOAT_DTYPE_PARAMS)
@pytest.mark.parametrize("gs", [32, 64, 128, 256, 1024])
@pytest.mark.parametrize("fmt", FORMATS)
def test_scales_have_at_most_8_significant_bits(rng, fmt, gs, dtype):
    """Every scale the quantizer writes is a bfloat16 value (low 16 bits zero) or NaN: random
    groups of many magnitudes (subnormal to near fp32's max), mixed-sign and one-sided, all zero,
    and groups holding NaN / Inf; the scales are the reference's, bit for bit, and each finite one
    is within 2^-8 (relative) of the unrounded a / 7 or r / 15."""
    rows = 12
    x = rng.standard_normal((rows, 2 * gs)).astype(np.float32)
    mags = [1e-42, 1e-38, 2.0**-100, 1e-20, 1e-3, 1.0, 7.0, 3.0, 1e6, 1e20, 1e37, 3e38]
    with np.errstate(over="ignore"):  # the last row's large elements become +-inf: NaN scales
        x *= np.array(mags, dtype=np.float32)[:, None]  # subnormals, normals, near fp32's max
    x[2, :gs] = np.abs(x[2, :gs])  # one-sided groups: uint4's zp 0 and 15
    x[3, gs:] = -np.abs(x[3, gs:])
    x[4, :gs] = 0.0  # all zero: the floor's scale
    x[5, 3] = np.nan
    x[6, gs + 1] = np.inf
    x[7, :gs] = rng.integers(-7, 8, gs).astype(np.float32)  # small integers: exact bf16 ratios
    x[8, :] = np.float32(1.0) + np.float32(2.0**-20) * np.arange(2 * gs, dtype=np.float32)
    with np.errstate(over="ignore"):  # float16 turns the large rows into +-inf
        xx, x32 = as_input(x, dtype)
    x32 = np.asarray(x32, dtype=np.float32)
    q, s = ops.quantize(xx, fmt, group_size=gs)
    s = to_numpy(s)
    sc, low = _scale_bits_low_half(fmt, s)
    assert np.all((low == 0) | np.isnan(sc)), f"{fmt} gs {gs} {dtype}: {sc[(low != 0) & ~np.isnan(sc)]}"
    assert np.all(np.isnan(sc) | (sc > 0)), f"{fmt} gs {gs} {dtype}"
    codes, want = quantize_ref(x32, fmt, gs)
    assert_same_bits(s, want, f"{fmt} gs {gs} {dtype} scales", nan_by_position=False)
    np.testing.assert_array_equal(to_numpy(q), ref.stored_group(codes))
    xg = x32.reshape(rows, 2, gs).astype(np.float64)
    if fmt == "int4":
        raw = np.maximum(np.abs(xg).max(axis=2), 2.0**-90) / 7
    else:
        raw = np.maximum(np.maximum(xg.max(axis=2), 0) - np.minimum(xg.min(axis=2), 0), 2.0**-90) / 15
    ok = np.isfinite(sc)
    assert np.all(np.abs(sc[ok] / raw[ok] - 1) <= 2.0**-8 + 2.0**-23), f"{fmt} gs {gs} {dtype}"


def test_bf16_rounding_of_the_reference_agrees_with_the_bit_pattern_rounding(rng):
    """The oracle's RN_bf16 (on values: frexp, rint, ldexp) equals rounding the fp32 bit pattern
    to bfloat16 (round_to_bf16) on finite values, ties included."""
    v = np.concatenate([rng.standard_normal(4096).astype(np.float32) * np.float32(10.0) ** rng.integers(-30, 30, 4096),
                        np.array([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 2.0**-90 / 7, 1 / 7, 1 / 15,
                                  0.0, 3e38 / 15], np.float32)]).astype(np.float32)
    assert_same_bits(ref.round_to_8_significant_bits(v), ref.round_to_bf16(v), "RN_bf16")
    assert ref.round_to_8_significant_bits(np.float32(1 + 2**-8)) == 1.0  # tie to even: down
    assert ref.round_to_8_significant_bits(np.float32(1 + 3 * 2**-8)) == np.float32(1 + 2**-6)  # tie: up


@pytest.mark.parametrize("fmt", FORMATS)
def test_any_stored_scale_is_used_as_the_math_says(rng, fmt):
    """Checkpoints from before the 8-bit scales hold arbitrary fp32 scales (e.g. a / 7 unrounded):
    dequantize gives (code - zp) * scale in fp32 bit for bit, weight-only linear of a one-hot x the
    same products, and linear stays within the fp32 bounds of the float64 model."""
    n, k, gs = 5, 128, 32
    w = rng.standard_normal((n, k)).astype(np.float32)
    q, s = ops.quantize(w, fmt, group_size=gs)
    codes = ref.codes_of_stored_group(q, fmt, k)
    s_old = s.copy()
    sc = s_old if fmt == "int4" else s_old[..., 0]
    sc *= np.float32(1 + 2.0**-20)  # low bits set: no bfloat16 value
    sc[0, 0] = np.float32(1.0) / np.float32(7.0)  # the old formula's scale of an all-ones group
    _, low = _scale_bits_low_half(fmt, s_old)
    assert np.all(low != 0)
    want = ref.dequantize_group(codes, s_old, fmt, gs)
    zp = 0 if fmt == "int4" else np.repeat(s_old[..., 1], gs, axis=1)
    by_hand = ((codes - zp).astype(np.float32) * np.repeat(sc, gs, axis=1)).astype(np.float32)
    assert_same_bits(want, by_hand, f"{fmt} model of (code - zp) * scale")
    assert_same_bits(ops.dequantize(q, s_old, fmt, cols=k), want, f"{fmt} dequantize with old scales")
    for j in (0, 37, 127):  # one-hot x: column j of w' itself
        x = np.zeros((1, k), np.float32)
        x[0, j] = 1.0
        y = ops.linear(x, q, s_old, weight_format=fmt, in_features=k, weight_group_size=gs)
        assert_same_bits(y[0], want[:, j], f"{fmt} linear column {j}")
    for name, wf, af in LINEAR_CASES:
        if wf != fmt:
            continue
        x32 = rng.standard_normal((3, k)).astype(np.float32)
        y = ops.linear(x32, q, s_old, weight_format=wf, act_format=af, in_features=k, weight_group_size=gs)
        y_ref, terms = ref.linear_group(x32, codes, s_old, wf, gs, "float32", ref.fmt(af) if af else None)
        assert np.all(np.abs(y.astype(np.float64) - y_ref) <= linear_group_abs_bound(k, k // gs, terms, y_ref,
                                                                                      "float32")), name


def test_int4_known_values():
    """Scales by hand: RN_bf16(a / 7) keeps 8 significant bits (nearest, ties to even), inv =
    1 / scale, code = RNE(x * inv) saturated at +-7."""
    x = np.zeros((1, 128), np.float32)
    x[0, :8] = [7.0, -7.0, 3.5, -3.5, 2.5, 0.49, 100.0 / 14.0, -0.0]  # amax 7.142857 in the first group
    x[0, 32:38] = [7.0, 3.5, 2.5, -1.5, -0.5, 0.0]  # amax 7: scale 1, inv 1, codes are RNE(x)
    x[0, 64] = 7.02734375  # a / 7 = 1 + 2^-8, halfway between 1 and 1 + 2^-7: even, 1
    x[0, 96] = -7.08203125  # a / 7 = 1 + 3 * 2^-8, halfway between 1 + 2^-7 and 1 + 2^-6: even, up
    q, s = ops.quantize(x, "int4", group_size=32)
    codes = ref.codes_of_stored_group(q, "int4", 128)
    # a / 7 = 1.0204082 = 130.6 / 128 -> 131 / 128; 1, 1, 1 + 2^-6 for the others
    np.testing.assert_array_equal(s[0], np.array([131 / 128, 1.0, 1.0, 1.015625], np.float32))
    # inv = 128 / 131 = 0.9771: 6.84, -6.84, 3.42, -3.42, 2.44, 0.48, 6.98, -0
    np.testing.assert_array_equal(codes[0, :8], [7, -7, 3, -3, 2, 0, 7, 0])
    np.testing.assert_array_equal(codes[0, 32:38], [7, 4, 2, -2, 0, 0])  # ties round to even
    assert codes[0, 64] == 7 and codes[0, 96] == -7  # 7.027 and -6.97 (inv = 64 / 65)
    # nibbles are two's complement, low nibble first
    assert q[0, 0] == ((codes[0, 0] & 0xF) | ((codes[0, 1] & 0xF) << 4))
    assert q.shape == (1, 64)  # whole groups of >= 32 codes fill 16-byte rows: no padding
    y = ops.dequantize(q, s, "int4", cols=128)
    assert y[0, 0] == np.float32(7 * 131 / 128) and y[0, 2] == np.float32(3 * 131 / 128)  # exact products
    # a stored 0x8 nibble reads -8 (never written by the quantizer)
    q2 = q.copy()
    q2[0, 0] = 0x88
    y = ops.dequantize(q2, s, "int4", cols=128)
    assert y[0, 0] == np.float32(-8) * s[0, 0] and y[0, 1] == np.float32(-8) * s[0, 0]


def test_uint4_zero_point_zero_is_exact_and_saturation():
    x = np.zeros((3, 32), np.float32)
    x[0, :4] = [-1.5, 13.5, 0.0, 7.25]  # r = 15: scale 1, zp = RNE(1.5) = 2; 13.5 -> 14 + 2 = 16 -> 15
    x[1, :3] = [2.0, 3.0, 0.0]  # all >= 0: lo = 0, zp = 0
    x[2, :3] = [-2.0, -3.0, 0.0]  # all <= 0: hi = 0, zp = 15
    q, s = ops.quantize(x, "uint4", group_size=32)
    codes = ref.codes_of_stored_group(q, "uint4", 32)
    assert (s[0, 0, 0], s[0, 0, 1]) == (1.0, 2.0)
    np.testing.assert_array_equal(codes[0, :4], [0, 15, 2, 9])  # RNE(-1.5) = -2 -> 0; 7.25 -> 7 + 2
    assert s[1, 0, 1] == 0.0 and not np.signbit(s[1, 0, 1]) and s[2, 0, 1] == 15.0
    # r = 3: r / 15 = 0.2 = 1.6 * 2^-3 -> 205 / 128 * 2^-3; -3 * inv = -14.985 -> zp 15
    assert s[1, 0, 0] == s[2, 0, 0] == np.float32(205 / 1024)
    np.testing.assert_array_equal(codes[1, :3], [10, 15, 0])  # RNE(9.99), RNE(14.985)
    np.testing.assert_array_equal(codes[2, :3], [5, 0, 15])  # RNE(-9.99) + 15, RNE(-14.985) + 15
    y = ops.dequantize(q, s, "uint4", cols=32)
    assert np.all(y[:, 4:] == 0) and np.all(y[0, 2:3] == 0)  # zeros come back exactly
    assert y[0, 1] == 13.0  # saturated


def test_nan_inf_zero_and_overflowing_groups():
    x = np.ones((1, 6 * 32), np.float32)
    x[0, 1] = np.nan  # group 0: NaN
    x[0, 32 + 5] = np.inf  # group 1: +inf
    x[0, 64 + 7] = -np.inf  # group 2: -inf
    x[0, 96:128] = 0.0  # group 3: all zero
    x[0, 128], x[0, 129] = 3e38, -3e38  # group 4: hi - lo overflows fp32 (uint4 only)
    for fmt in FORMATS:
        q, s, codes, scale = check_against_reference(x, x, fmt, 32)
        sc = s if fmt == "int4" else s[:, :, 0]
        assert np.isnan(sc[0, :3]).all(), fmt
        assert np.all(codes[0, :96] == 0), fmt
        # the floor: 2^-90 / 7 = 1.142857 * 2^-93 -> 146 / 128 * 2^-93; / 15 -> 137 / 128 * 2^-94
        assert sc[0, 3] == (np.float32(146 * 2.0**-100) if fmt == "int4" else np.float32(137 * 2.0**-101))
        assert np.all(codes[0, 96:128] == 0)
        assert np.isnan(sc[0, 4]) == (fmt == "uint4")
        assert np.isfinite(sc[0, 5]) and np.all(codes[0, 160:] == (7 if fmt == "int4" else 15))
        if fmt == "uint4":
            assert np.all(s[0, [0, 1, 2, 4], 1] == 0)  # bad groups: zp 0
        y = ops.dequantize(q, s, fmt, cols=x.shape[1])
        # all ones: scale RN_bf16(1 / 7) = 146 / 1024 (code 7) or RN_bf16(1 / 15) = 137 / 2048 (code 15)
        one = np.float32(7 * 146 / 1024) if fmt == "int4" else np.float32(15 * 137 / 2048)
        assert np.isnan(y[0, :96]).all() and np.all(y[0, 96:128] == 0) and np.all(y[0, 160:] == one)


# ---------------------------------------------------------------- linear layers

# (name, weight format, act format)
LINEAR_CASES = [("int4wo", "uint4", None), ("int4wo_sym", "int4", None), ("int4dq", "int4", "int8"),
                ("fp8da_int4w", "int4", "fp8_e4m3")]
# (M, K, N): odd M and N
LINEAR_SHAPES = [(1, 128, 33), (7, 256, 5), (3, 384, 17)]


def quantized_weight(rng, n, k, fmt, gs):
    w = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)
    q, s = ops.quantize(w, fmt, group_size=gs)
    return w, q, s, ref.codes_of_stored_group(q, fmt, k)


@pytest.mark.parametrize("dtype", FLOAT_DTYPE_PARAMS)
@pytest.mark.parametrize("gs", GROUP_SIZES)
@pytest.mark.parametrize("case", LINEAR_CASES, ids=[c[0] for c in LINEAR_CASES])
def test_linear_matches_the_float64_model(rng, case, gs, dtype):
    name, wf, af = case
    for m, k, n in LINEAR_SHAPES:
        x, x32 = random_input(rng, (m, k), dtype)
        w, qw, sw, codes = quantized_weight(rng, n, k, wf, gs)
        b32 = rng.standard_normal(n).astype(np.float32)
        for bias in (None, b32):
            y = ops.linear(x, qw, sw, weight_format=wf, act_format=af, in_features=k, weight_group_size=gs,
                           bias=bias)
            assert tuple(y.shape) == (m, n) and str(y.dtype).split(".")[-1] == dtype
            y_ref, terms = ref.linear_group(x32, codes, sw, wf, gs, dtype, ref.fmt(af) if af else None, bias)
            err = np.abs(to_numpy(y).astype(np.float64) - y_ref)
            bound = linear_group_abs_bound(k, k // gs, terms, y_ref, dtype)
            assert np.all(err <= bound), f"{name} {dtype} gs {gs} ({m}, {k}, {n}): max excess {np.max(err - bound)}"
        # the scheme's SQNR against the unquantized product
        y64 = x32.astype(np.float64) @ w.astype(np.float64).T
        sq = 10 * np.log10(np.sum(y64**2) / np.sum((to_numpy(ops.linear(
            x, qw, sw, weight_format=wf, act_format=af, in_features=k)).astype(np.float64) - y64) ** 2))
        assert sq >= GROUP_LINEAR_SQNR_FLOOR_DB[name], f"{name} {dtype} ({m}, {k}, {n}): {sq:.1f} dB"


def test_weight_only_rounds_the_weight_to_x_dtype(rng):
    """f16 x: w' is rounded to f16 before the dot (a weight beyond f16's range becomes inf), f32 x
    takes the fp32 value."""
    k, n = 64, 2
    w = np.zeros((n, k), np.float32)
    w[0, :] = 1.0 / 3.0
    w[1, 0] = 1e6  # x' = code * scale is beyond f16's 65504
    q, s = ops.quantize(w, "int4", group_size=32)
    codes = ref.codes_of_stored_group(q, "int4", k)
    wd = ref.dequantize_group(codes, s, "int4", 32)
    x = np.zeros((1, k), np.float32)
    x[0, 0] = 1.0
    y32 = ops.linear(x, q, s, weight_format="int4", in_features=k)
    assert y32[0, 0] == wd[0, 0] and y32[0, 1] == wd[1, 0]
    y16 = ops.linear(x.astype(np.float16), q, s, weight_format="int4", in_features=k)
    assert y16[0, 0] == np.float16(wd[0, 0]) and np.isinf(y16[0, 1])


@pytest.mark.parametrize("case", LINEAR_CASES, ids=[c[0] for c in LINEAR_CASES])
def test_linear_gelu_and_gated(rng, case):
    name, wf, af = case
    m, k, n, gs = 6, 256, 24, 64
    x, x32 = random_input(rng, (m, k), "float32")
    _, qw, sw, codes = quantized_weight(rng, n, k, wf, gs)
    b = rng.standard_normal(n).astype(np.float32)
    kw = dict(weight_format=wf, act_format=af, in_features=k, bias=b)
    pre_ref, terms = ref.linear_group(x32, codes, sw, wf, gs, "float32", ref.fmt(af) if af else None, b)
    y = ops.linear(x, qw, sw, activation="gelu_tanh", **kw)
    act_ref = gelu_tanh(pre_ref)
    bound = gelu_abs_bound(k + k // gs, terms, pre_ref, act_ref, "float32")
    assert np.all(np.abs(y - act_ref) <= bound), name
    # gated: residual + gate[sample] * v, two samples of three rows
    gate = rng.standard_normal((2, n)).astype(np.float32)
    residual = rng.standard_normal((m, n)).astype(np.float32)
    yg = ops.linear_gated(x, qw, sw, gate, residual, **kw)
    g_rows = np.repeat(gate, m // 2, axis=0).astype(np.float64)
    y_ref = residual + g_rows * pre_ref
    v_err = linear_group_abs_bound(k, k // gs, terms, pre_ref, "float32")
    assert np.all(np.abs(yg - y_ref) <= gated_abs_bound(v_err, pre_ref, g_rows, residual, y_ref, "float32")), name
    # in place: out is the residual itself
    res2 = residual.copy()
    ops.linear_gated(x, qw, sw, gate, res2, out=res2, **kw)
    assert_same_bits(res2, yg, f"{name} gated in place")


@pytest.mark.parametrize("af", ["int8", "fp8_e4m3"])
def test_linear_quantized_equals_linear(rng, af):
    """Pre-quantized activations (cq_linear_quantized) give exactly what linear computes."""
    import torch

    m, k, n, gs = 5, 256, 12, 32
    x = torch.randn(m, k)
    _, qw, sw, _ = quantized_weight(rng, n, k, "int4", gs)
    qw, sw = torch.from_numpy(qw), torch.from_numpy(sw)
    want = ops.linear(x, qw, sw, weight_format="int4", act_format=af, in_features=k, weight_group_size=gs)
    qx, sx = ops.quantize(x, af, "row")
    y = torch.empty(m, n)
    f = ops.format_info
    _C.linear_quantized(qx, sx, qw, sw, None, y, f("int4").id, _C.GRANULARITY_GROUP, f(af).id, _C.GRANULARITY_ROW,
                        k, weight_group_size=gs)
    assert_same_bits(y, want, f"linear_quantized {af}")


def test_uint4_weight_only_with_integer_zero_points_and_nan_groups(rng):
    """A weight group holding NaN makes its outputs NaN; the others stay finite."""
    k, n = 128, 3
    w = rng.standard_normal((n, k)).astype(np.float32)
    w[1, 40] = np.nan
    q, s = ops.quantize(w, "uint4", group_size=32)
    x = rng.standard_normal((2, k)).astype(np.float32)
    y = ops.linear(x, q, s, weight_format="uint4", in_features=k)
    assert np.isnan(y[:, 1]).all() and np.isfinite(y[:, [0, 2]]).all()


# ---------------------------------------------------------------- schemes


def test_scheme_rows():
    wo, sym, dq, fp8 = (SCHEMES[n] for n in ("int4wo", "int4wo_sym", "int4dq", "fp8da_int4w"))
    assert wo.weight_format.name == "uint4" and sym.weight_format.name == "int4"
    assert dq.act_format.name == "int8" and fp8.act_format.name == "fp8_e4m3"
    for s in (wo, sym, dq, fp8):
        assert s.grouped and s.weight_group_size == ops.GROUP_SIZE_DEFAULT == 128
        assert s.c_args == (s.weight_format.id, _C.GRANULARITY_GROUP, s.act_format.id if s.act_format else 0,
                            _C.GRANULARITY_ROW, 128)
    assert (wo.min_compute_capability, dq.min_compute_capability, fp8.min_compute_capability) == (80, 80, 89)
    assert scheme("int4_weight_only") is wo
    assert scheme("int8_dynamic_activation_int4_weight") is dq
    assert scheme("float8_dynamic_activation_int4_weight") is fp8
    assert SCHEMES["int8dq"].c_args[4] == 0 and not SCHEMES["int8dq"].grouped


def test_scheme_group_sizes_and_sizes():
    wo = SCHEMES["int4wo"]
    w64 = wo.with_group_size(64)
    assert w64.weight_group_size == 64 and w64.c_args[4] == 64 and w64 != wo
    assert w64.name == "int4wo_g64" and scheme("int4wo_g64") == w64  # the name rebuilds the variant
    assert wo.with_group_size(128) is wo
    assert wo.scale_shape(10, 256) == (10, 2, 2) and SCHEMES["int4dq"].scale_shape(10, 256) == (10, 2)
    assert wo.n_scales(10, 256) == 40 and w64.n_scales(10, 256) == 80
    assert SCHEMES["int4dq"].weight_bytes(256, 10) == 10 * 128 + 4 * 20
    assert SCHEMES["int8wo"].n_scales(10) == 10
    assert wo.refusal(256, 10) is None
    assert "multiple of the weight group size 128" in wo.refusal(192, 10)
    assert w64.refusal(192, 10) is None
    with pytest.raises(ValueError, match="in_features is required"):
        wo.n_scales(10)
    for bad in (48, 16, 2048, 0):
        with pytest.raises(ValueError, match="group_size"):
            wo.with_group_size(bad)
    with pytest.raises(TypeError, match="group_size"):
        wo.with_group_size(64.0)
    with pytest.raises(ValueError, match="no weight groups"):
        SCHEMES["int8wo"].with_group_size(64)


def test_workspace_and_capabilities_on_the_cpu():
    for name in ("int4wo", "int4dq", "fp8da_int4w"):
        assert ops.linear_workspace_size(SCHEMES[name].c_args, 256, 64, 64, cuda=False) == 0
    assert _C.GRANULARITY_GROUP == 3 and (_C.GROUP_SIZE_MIN, _C.GROUP_SIZE_MAX) == (32, 1024)
    assert ops.format_info("int4").kind == "int" and ops.format_info("uint4").kind == "uint"
    assert ops.format_info("int4").packed and ops.format_info("uint4").bits == 4


# ---------------------------------------------------------------- bad arguments


def raises(exc, *words):
    """pytest.raises whose message must hold every word (the argument's name and value)."""
    return pytest.raises(exc, match=".*".join(map(str, words)))


def test_quantize_refusals():
    x = np.ones((2, 128), np.float32)
    q = np.zeros((2, 64), np.uint8)
    s = np.zeros((2, 4), np.float32)
    G, ROW = _C.GRANULARITY_GROUP, _C.GRANULARITY_ROW
    with raises(ValueError, "group_size = 48", "power of two"):
        ops.quantize(x, "int4", group_size=48)
    with raises(ValueError, "group_size = 2048"):
        ops.quantize(x, "int4", group_size=2048)
    with raises(ValueError, "group_size = 64", "does not divide", "96"):
        ops.quantize(np.ones((2, 96), np.float32), "int4", group_size=64)
    with raises(ValueError, "granularity", "int4"):
        ops.quantize(x, "int4", "row")
    with raises(ValueError, "granularity", "GROUP", "int8"):
        ops.quantize(x, "int8", "group")
    with raises(ValueError, "group_size = 32", "expected 0"):
        ops.quantize(x, "int8", "row", group_size=32)
    # the C checks themselves
    with raises(ValueError, "group_size = 64", "does not divide", "96"):
        _C.quantize(np.ones((2, 96), np.float32), np.zeros((2, 48), np.uint8), np.zeros((2, 1), np.float32), 4, G,
                    group_size=64)
    with raises(ValueError, "static_scale", "GROUP"):
        _C.quantize(x, q, s, 4, G, static_scale=True, group_size=32)
    with raises(ValueError, r"scale has shape \(2, 4\)", r"\[2, 4, 2\]"):
        _C.quantize(x, q, np.zeros((2, 4), np.float32), 5, G, group_size=32)
    with raises(ValueError, r"scale has shape \(2, 3\)", r"\[2, 4\]"):
        _C.quantize(x, q, np.zeros((2, 3), np.float32), 4, G, group_size=32)
    with raises(ValueError, "scale", "contiguous"):
        _C.quantize(x, q, np.zeros((4, 2), np.float32).T, 4, G, group_size=32)
    with raises(ValueError, "q has 2 rows of 128", "64"):
        _C.quantize(x, np.zeros((2, 128), np.uint8), s, 4, G, group_size=32)
    with raises(TypeError, "q"):
        _C.quantize(x, np.zeros((2, 64), np.int8), s, 4, G, group_size=32)
    with raises(ValueError, "granularity = 1", "int4"):
        _C.quantize(x, q, s, 4, ROW, group_size=32)
    with raises(ValueError, "granularity = 7"):
        _C.quantize(x, q, s, 4, 7, group_size=32)


def test_dequantize_refusals():
    q = np.zeros((2, 64), np.uint8)
    with raises(ValueError, r"scale has shape \(2, 3\)", "group"):
        ops.dequantize(q, np.zeros((2, 3), np.float32), "int4", cols=128)
    with raises(ValueError, r"scale has shape \(2, 3\)", r"\[2, 2, 2\]"):
        ops.dequantize(q, np.zeros((2, 3), np.float32), "uint4", cols=128, group_size=64)
    with raises(ValueError, "group_size = 100"):
        ops.dequantize(q, np.zeros((2, 4), np.float32), "int4", cols=128, group_size=100)
    with raises(ValueError, "q has 64 bytes per row", "cols = 256"):
        ops.dequantize(q, np.zeros((2, 8), np.float32), "int4", cols=256)


@pytest.mark.parametrize("fmt", ["int4", "uint4"])
def test_group_scales_in_another_layout_are_refused(rng, fmt):
    """Scales of the right size in the wrong layout ([G, N], as other libraries store them, or one
    row) read every group's scale from another group: refused by shape, with or without a group size."""
    x, q, s = linear_args(rng, k=128, n=4, fmt=fmt, gs=64)  # s: [4, 2] (uint4: [4, 2, 2])
    swapped = np.ascontiguousarray(np.swapaxes(s, 0, 1))
    flat = s.reshape(1, -1)
    for bad in (swapped, flat):
        with raises(ValueError, "w_scale has shape", r"expected fp32 \[4, [2G]"):
            ops.linear(x, q, bad, weight_format=fmt, in_features=128)
        with raises(ValueError, "w_scale has shape", r"expected fp32 \[4, [2G]"):
            ops.linear(x, q, bad, weight_format=fmt, in_features=128, weight_group_size=64)
        with raises(ValueError, "scale has shape", r"expected fp32 \[4, [2G]"):
            ops.dequantize(q, bad, fmt, cols=128)
        with raises(ValueError, "scale has shape", r"expected fp32 \[4, [2G]"):
            ops.dequantize(q, bad, fmt, cols=128, group_size=64)
    y = ops.linear(x, q, s.reshape((2, 2) + s.shape[1:]), weight_format=fmt, in_features=128)  # leading dims: rows
    np.testing.assert_array_equal(y, ops.linear(x, q, s, weight_format=fmt, in_features=128))


def linear_args(rng, k=128, n=4, fmt="int4", gs=32):
    x = rng.standard_normal((3, k)).astype(np.float32)
    q, s = ops.quantize(rng.standard_normal((n, k)).astype(np.float32), fmt, group_size=gs)
    return x, q, s


def test_linear_refusals(rng):
    x, q, s = linear_args(rng)
    xu, qu, su = linear_args(rng, fmt="uint4")
    with raises(ValueError, "act_format int8", "uint4", "not a scheme"):
        ops.linear(xu, qu, su, weight_format="uint4", act_format="int8", in_features=128)
    with raises(ValueError, "act_format fp8_e5m2", "int4"):
        ops.linear(x, q, s, weight_format="int4", act_format="fp8_e5m2", in_features=128)
    with raises(ValueError, "act_granularity = 2", "int4"):
        ops.linear(x, q, s, weight_format="int4", act_format="int8", act_granularity="tensor", in_features=128)
    with raises(ValueError, "weight_group_size = 48"):
        ops.linear(x, q, s, weight_format="int4", in_features=128, weight_group_size=48)
    with raises(ValueError, r"w_scale has shape \(4, 4\)", r"\[4, 2\]"):
        ops.linear(x, q, s, weight_format="int4", in_features=128, weight_group_size=64)
    with raises(ValueError, r"w_scale has shape \(4, 4\)", r"\[4, 4, 2\]"):
        ops.linear(x, q, s, weight_format="uint4", in_features=128, weight_group_size=32)
    with raises(ValueError, "weight_granularity", "int4"):
        ops.linear(x, q, s, weight_format="int4", weight_granularity="row", in_features=128)
    with raises(ValueError, "w has 4 rows of 128", "64"):
        ops.linear(x, np.zeros((4, 128), np.uint8), s, weight_format="int4", in_features=128)
    x96 = rng.standard_normal((3, 96)).astype(np.float32)
    q96 = np.zeros((4, 48), np.uint8)
    with raises(ValueError, "weight_group_size = 64", "does not divide", "in_features = 96"):
        ops.linear(x96, q96, np.zeros((4, 1), np.float32), weight_format="int4", in_features=96,
                   weight_group_size=64)
    # libcquant's own checks, through the extension
    I4, G, ROW, TENSOR = 4, _C.GRANULARITY_GROUP, _C.GRANULARITY_ROW, _C.GRANULARITY_TENSOR
    y = np.empty((3, 4), np.float32)
    with raises(ValueError, "weight_group_size = 0"):
        _C.linear(x, q, s, None, y, I4, G, 0, ROW, 128)
    with raises(ValueError, "weight_granularity = CQ_GRANULARITY_GROUP", "int8"):
        _C.linear(x, np.zeros((4, 128), np.int8), s, None, y, 1, G, 0, ROW, 128, weight_group_size=32)
    with raises(ValueError, "weight_group_size = 32", "expected 0"):
        _C.linear(x, np.zeros((4, 128), np.int8), np.ones(4, np.float32), None, y, 1, ROW, 0, ROW, 128,
                  weight_group_size=32)
    with raises(ValueError, "act_granularity = CQ_GRANULARITY_GROUP"):
        _C.linear(x, np.zeros((4, 128), np.int8), np.ones(4, np.float32), None, y, 1, ROW, 1, G, 128)
    with raises(ValueError, "act_granularity = 2", "int4"):
        _C.linear_min_compute_capability(I4, G, 1, TENSOR, weight_group_size=32)
    with raises(ValueError, "act_format int8", "uint4"):
        _C.linear_min_compute_capability(5, G, 1, ROW, weight_group_size=32)
    assert _C.linear_min_compute_capability(5, G, 0, ROW, weight_group_size=32) == 80
    assert _C.linear_min_compute_capability(I4, G, 1, ROW, weight_group_size=32) == 80
    assert _C.linear_min_compute_capability(I4, G, 2, ROW, weight_group_size=32) == 89


# ---------------------------------------------------------------- CUDA


def cuda_poisoned(torch, shape, dtype, byte=0xA5):
    t = torch.empty(shape, dtype=dtype, device="cuda")
    t.view(torch.uint8).fill_(byte)
    return t


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("gs", [32, 64, 128, 1024])
@pytest.mark.parametrize("fmt", FORMATS)
def test_cuda_quantize_dequantize_bit_identical(torch, rng, fmt, gs, dtype):
    for rows, cols in ((1, gs), (7, 2 * gs), (33, 3072), (4608, 1024)):
        if cols % gs:
            continue
        x32 = (rng.standard_normal((rows, cols)) * np.exp(2 * rng.standard_normal((rows, 1)))
               + rng.standard_normal((rows, 1))).astype(np.float32)
        x32[0, 0] = np.nan if rows > 1 else x32[0, 0]
        if rows > 2 and cols >= 2 * gs:
            x32[2, gs:2 * gs] = 0.0  # an all-zero group
            x32[1, 3] = np.inf
        x = to_framework(x32, dtype, torch)
        q_cpu, s_cpu = ops.quantize(x, fmt, group_size=gs)
        xg = x.cuda()
        for byte in (0xA5, 0x5A):
            q = cuda_poisoned(torch, tuple(q_cpu.shape), torch.uint8, byte)
            s = cuda_poisoned(torch, tuple(s_cpu.shape), torch.float32, byte)
            ops.quantize(xg, fmt, group_size=gs, out=q, scale_out=s)
            assert_same_bits(q.cpu(), q_cpu, f"{fmt} codes ({rows}, {cols}) {dtype}")
            assert_same_bits(s.cpu(), s_cpu, f"{fmt} scales ({rows}, {cols}) {dtype}", nan_by_position=False)
        for out_dtype in ("float32", "float16", "bfloat16"):
            want = ops.dequantize(q_cpu, s_cpu, fmt, cols=cols, dtype=out_dtype)
            y = cuda_poisoned(torch, (rows, cols), getattr(torch, out_dtype), 0x7B)
            ops.dequantize(q_cpu.cuda(), s_cpu.cuda(), fmt, cols=cols, out=y)
            assert_same_bits(y.cpu(), want, f"{fmt} dequantize to {out_dtype} ({rows}, {cols})")


@pytest.mark.cuda
@pytest.mark.parametrize("case", LINEAR_CASES, ids=[c[0] for c in LINEAR_CASES])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_cuda_linear_large_m_against_the_model(torch, rng, case, dtype):
    """M above the GEMV's rows: f32 x takes the decode + cuBLASLt path (w' in fp32, sw = 1 in the
    epilogue), 16-bit x whichever kernel the dispatch picks; both within the fp32 bounds."""
    name, wf, af = case
    m, k, n, gs = 96, 512, 80, 128
    x32 = rng.standard_normal((m, k)).astype(np.float32)
    x = to_framework(x32, dtype, torch)
    x32 = to_numpy(x).astype(np.float32)
    _, qw, sw, codes = quantized_weight(rng, n, k, wf, gs)
    b = rng.standard_normal(n).astype(np.float32)
    y = ops.linear(x.cuda(), torch.from_numpy(qw).cuda(), torch.from_numpy(sw).cuda(), weight_format=wf,
                   act_format=af, in_features=k, bias=torch.from_numpy(b).cuda())
    y_ref, terms = ref.linear_group(x32, codes, sw, wf, gs, dtype, ref.fmt(af) if af else None, b)
    err = np.abs(to_numpy(y.cpu()).astype(np.float64) - y_ref)
    bound = linear_group_abs_bound(k, k // gs, terms, y_ref, dtype, tensor_cores=True, fp8_mma=af == "fp8_e4m3")
    assert np.all(err <= bound), f"{name} {dtype}: max excess {np.max(err - bound)}"
