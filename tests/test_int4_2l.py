"""Two-level int4 (granularity "two_level", scheme int4dq_2l) on the CPU.

quantize / dequantize compare bit for bit with the NumPy model in tests/reference.py
(quantize_two_level / dequantize_two_level). The layers are int8dq's math on the weight rows
q8 = s2 * code with sw = s1, so the C reference must equal reference.linear_two_level's fp32
evaluation bit for bit, and its float64 one within tolerances.two_level_linear_abs_bound.
Damaged multipliers poison exactly their group (dequantize) or output column (linear), and every
scheme the layout cannot run is refused with a message naming the argument.
"""

import numpy as np
import pytest

from cquant import _C, ops
from cquant.schemes import SCHEMES, scheme

import reference as ref
from helpers import FLOAT_DTYPE_PARAMS, assert_same_bits, from_values, random_input, to_numpy
from tolerances import (INT4_GAUSSIAN_LAYER_SQNR_FLOOR_DB, gated_abs_bound, gelu_abs_bound, gelu_tanh,
                        two_level_linear_abs_bound)

GROUP_SIZES = [32, 64, 128, 256, 512, 1024]
TL = "two_level"


def quantize(x, gs):
    return ops.quantize(x, "int4", TL, group_size=gs)


def linear(x, qw, sw, k, gs, **kw):
    return ops.linear(x, qw, sw, weight_format="int4", weight_granularity=TL, act_format="int8", in_features=k,
                      weight_group_size=gs, **kw)


def quantized_weight(rng, n, k, gs):
    w = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)
    q, s = quantize(w, gs)
    return w, q, s, ref.codes_of_stored_group(q, "int4", k)


# ---------------------------------------------------------------- quantize / dequantize


@pytest.mark.parametrize("dtype", FLOAT_DTYPE_PARAMS)
@pytest.mark.parametrize("gs", GROUP_SIZES)
def test_quantize_and_dequantize_match_the_reference(rng, gs, dtype):
    import torch

    for rows, cols in ((1, gs), (5, 4 * gs), (3, max(gs, 1024))):
        x, x32 = random_input(rng, (rows, cols), dtype, spread=2.0)
        # groups of very different sizes: every multiplier from 1 to 16 appears
        x32 = x32 * np.float32(2.0) ** rng.integers(-6, 1, (1, cols // gs)).repeat(gs, axis=1).astype(np.float32)
        x = from_values(x32, dtype) if dtype != "float32" else x32
        x32 = to_numpy(x).astype(np.float32)
        q, s = quantize(x, gs)
        codes, scale = ref.quantize_two_level(x32, gs)
        assert tuple(q.shape) == (rows, ref.packed_row_bytes(4, cols)) and tuple(s.shape) == (rows, 1 + cols // gs)
        np.testing.assert_array_equal(to_numpy(q), ref.stored_group(codes), err_msg="stored bytes")
        assert_same_bits(to_numpy(s), scale, "scales", nan_by_position=False)
        s2 = scale[:, 1:]
        assert np.all((s2 >= 1) & (s2 <= 16) & (s2 == np.round(s2)))
        want = ref.dequantize_two_level(codes, scale, gs)
        qt, st = (torch.from_numpy(np.ascontiguousarray(to_numpy(a))) for a in (q, s))  # bfloat16 needs torch
        for out_dtype in ("float32", "float16", "bfloat16"):
            y = ops.dequantize(qt, st, "int4", cols=cols, dtype=out_dtype, granularity=TL)
            assert_same_bits(to_numpy(y).astype(np.float64), ref.round_to(want, out_dtype), f"dequantize {out_dtype}")
        # the group size is read from the [rows, 1 + G] scales when not given
        y = ops.dequantize(q, s, "int4", cols=cols, granularity=TL, group_size=gs)
        assert_same_bits(y, ops.dequantize(q, s, "int4", cols=cols, granularity=TL), "group size from the scales")


def test_rows_with_nan_or_inf_store_nan_s1_unit_multipliers_and_zero_codes(rng):
    gs, cols = 32, 128
    x = rng.standard_normal((4, cols)).astype(np.float32)
    x[1, 70], x[2, 3], x[3, :] = np.nan, -np.inf, 0.0
    q, s = quantize(x, gs)
    codes, scale = ref.quantize_two_level(x, gs)
    assert_same_bits(s, scale, "scales")
    assert np.isnan(s[1:3, 0]).all() and np.all(s[1:3, 1:] == 1)
    assert not to_numpy(q)[1:3].any()
    # an all-zero row takes s1 from the amax floor: finite, codes 0
    assert s[3, 0] == np.float32(2.0**-90) / np.float32(112) and not to_numpy(q)[3].any()
    y = ops.dequantize(q, s, "int4", cols=cols, granularity=TL)
    assert np.isnan(y[1:3]).all() and np.isfinite(y[[0, 3]]).all() and not y[3].any()


def test_the_0x8_nibble_reads_minus_8_everywhere(rng):
    """cq_quantize never writes 0x8; stored, it is -8: with s2 = 16 a q8 of -128."""
    k, gs = 64, 32
    q = np.zeros((2, ref.packed_row_bytes(4, k)), np.uint8)
    q[:, 0] = 0x78  # codes 8 (-8) and 7
    q[1, 20] = 0x88
    s = np.array([[0.5, 16, 3], [0.25, 1, 16]], np.float32)
    codes = ref.codes_of_stored_group(q, "int4", k)
    assert codes[0, 0] == -8 and codes[1, 40] == -8
    y = ops.dequantize(q, s, "int4", cols=k, granularity=TL)
    assert y[0, 0] == -8 * 16 * 0.5 and y[1, 40] == -8 * 16 * 0.25 and y[1, 41] == -8 * 16 * 0.25
    assert_same_bits(y, ref.dequantize_two_level(codes, s, gs), "0x8 dequantize")
    a = np.full((3, k), 127, np.int8)
    a[1] = -128
    sx = np.array([1.0, 0.5, 2.0], np.float32)
    y = np.zeros((3, 2), np.float32)
    _C.linear_quantized(a, sx, q, s, None, y, ops.format_info("int4").id, _C.GRANULARITY_TWO_LEVEL,
                        ops.format_info("int8").id, _C.GRANULARITY_ROW, k, weight_group_size=gs)
    assert_same_bits(y, ref.linear_two_level(a, sx, codes, s, gs)[2], "0x8 linear")


@pytest.mark.parametrize("bad", [np.nan, 2.5, 17.0, -1.0, np.inf, -np.inf])
def test_a_damaged_multiplier_poisons_exactly_its_group_and_output_column(rng, bad):
    m, k, n, gs = 4, 256, 5, 64
    _, qw, sw, codes = quantized_weight(rng, n, k, gs)
    x = rng.standard_normal((m, k)).astype(np.float32)
    y0, d0 = linear(x, qw, sw, k, gs), ops.dequantize(qw, sw, "int4", cols=k, granularity=TL)
    sw = sw.copy()
    sw[2, 1 + 1] = bad  # row 2, group 1
    d = ops.dequantize(qw, sw, "int4", cols=k, granularity=TL)
    group = np.zeros_like(d, bool)
    group[2, gs:2 * gs] = True
    assert np.isnan(d[group]).all() and np.array_equal(d[~group], d0[~group])
    y = linear(x, qw, sw, k, gs)
    assert np.isnan(y[:, 2]).all()
    assert_same_bits(np.delete(y, 2, axis=1), np.delete(y0, 2, axis=1), "the other columns")


def test_a_zero_multiplier_is_valid_and_zeroes_its_group(rng):
    m, k, n, gs = 3, 128, 4, 32
    _, qw, sw, codes = quantized_weight(rng, n, k, gs)
    sw = sw.copy()
    sw[1, 3] = 0.0
    d = ops.dequantize(qw, sw, "int4", cols=k, granularity=TL)
    assert not d[1, 2 * gs:3 * gs].any() and np.isfinite(d).all()
    x = rng.standard_normal((m, k)).astype(np.float32)
    xc, sx = ops.quantize(x, "int8", "row")
    y = linear(x, qw, sw, k, gs)
    assert np.isfinite(y).all()
    assert_same_bits(y, ref.linear_two_level(xc, sx, codes, sw, gs)[2], "s2 = 0")


# ---------------------------------------------------------------- linear layers

# (M, K in groups, N): odd N, M from 1 to a few hundred
LINEAR_SHAPES = [(1, 1, 33), (7, 2, 5), (130, 3, 17), (300, 1, 3)]


def bias_of(rng, n, kind, dtype):
    """None, an f32 bias, or one in x's dtype; with its values as float32."""
    if kind is None:
        return None, None
    b32 = rng.standard_normal(n).astype(np.float32)
    if kind == "float32":
        return b32, b32
    vals = ref.round_to(b32, dtype).astype(np.float32)
    return from_values(vals, dtype), vals


@pytest.mark.parametrize("dtype", FLOAT_DTYPE_PARAMS)
@pytest.mark.parametrize("gs", GROUP_SIZES)
def test_linear_matches_the_fp32_and_float64_models(rng, gs, dtype):
    for m, groups, n in LINEAR_SHAPES:
        k = groups * gs
        x, x32 = random_input(rng, (m, k), dtype)
        w, qw, sw, codes = quantized_weight(rng, n, k, gs)
        xc, sx = ref.quantize(x32, ref.fmt("int8"), "row")
        xc = ref.decode(ref.fmt("int8"), xc).astype(np.int64)
        for kind in (None, "float32", "x"):
            bias, bvals = bias_of(rng, n, kind, dtype)
            y = linear(x, qw, sw, k, gs, bias=bias)
            assert tuple(y.shape) == (m, n) and str(y.dtype).split(".")[-1] == dtype
            y64, terms, y32 = ref.linear_two_level(xc, sx, codes, sw, gs, bvals)
            got = to_numpy(y).astype(np.float64)
            assert_same_bits(got, ref.round_to(y32, dtype), f"gs {gs} {dtype} ({m}, {k}, {n}) bias {kind}")
            bound = two_level_linear_abs_bound(terms, y64, dtype)
            assert np.all(np.abs(got - y64) <= bound), f"({m}, {k}, {n}): max excess {np.max(np.abs(got - y64) - bound)}"


@pytest.mark.parametrize("gs", [32, 128, 1024])
def test_linear_gelu_gated_and_quantized(rng, gs):
    import torch

    m, k, n = 6, 2 * gs, 23
    x, x32 = random_input(rng, (m, k), "float32")
    _, qw, sw, codes = quantized_weight(rng, n, k, gs)
    b = rng.standard_normal(n).astype(np.float32)
    xc, sx = ops.quantize(x, "int8", "row")
    pre64, terms, pre32 = ref.linear_two_level(xc, sx, codes, sw, gs, b)
    # GELU in the epilogue
    y = linear(x, qw, sw, k, gs, bias=b, activation="gelu_tanh")
    act = gelu_tanh(pre64)
    assert np.all(np.abs(y - act) <= gelu_abs_bound(0, terms, pre64, act, "float32"))
    # gated: residual + gate[sample] * v, two samples of three rows; and in place
    gate = rng.standard_normal((2, n)).astype(np.float32)
    residual = rng.standard_normal((m, n)).astype(np.float32)
    kw = dict(weight_format="int4", weight_granularity=TL, act_format="int8", in_features=k, weight_group_size=gs,
              bias=b)
    yg = ops.linear_gated(x, qw, sw, gate, residual, **kw)
    g_rows = np.repeat(gate, m // 2, axis=0).astype(np.float64)
    want = residual + g_rows * pre64
    v_err = two_level_linear_abs_bound(terms, pre64, "float32")
    assert np.all(np.abs(yg - want) <= gated_abs_bound(v_err, pre64, g_rows, residual, want, "float32"))
    assert_same_bits(yg, residual + gate.repeat(m // 2, axis=0) * pre32, "gated: one product, one sum")
    res2 = residual.copy()
    ops.linear_gated(x, qw, sw, gate, res2, out=res2, **kw)
    assert_same_bits(res2, yg, "gated in place")
    # caller-given codes (what norm_modulate writes), -128 included, give what linear computes
    plain = linear(x, qw, sw, k, gs, bias=b)
    yq = torch.empty(m, n)
    f = ops.format_info
    args = (f("int4").id, _C.GRANULARITY_TWO_LEVEL, f("int8").id, _C.GRANULARITY_ROW, k)
    _C.linear_quantized(torch.from_numpy(xc), torch.from_numpy(sx), torch.from_numpy(qw), torch.from_numpy(sw),
                        torch.from_numpy(b), yq, *args, weight_group_size=gs)
    assert_same_bits(yq, plain, "linear_quantized")
    xc2 = xc.copy()
    xc2[0, :] = -128
    _C.linear_quantized(torch.from_numpy(xc2), torch.from_numpy(sx), torch.from_numpy(qw), torch.from_numpy(sw),
                        None, yq, *args, weight_group_size=gs)
    assert_same_bits(yq, ref.linear_two_level(xc2, sx, codes, sw, gs)[2], "linear_quantized with -128")


def test_gaussian_layer_sqnr(rng):
    """One Linear(1024, 256), N(0, 1) weights and x, group 128: the weight's rounding sets the SQNR."""
    k, n = 1024, 256
    w, qw, sw, _ = quantized_weight(rng, n, k, 128)
    x = rng.standard_normal((64, k)).astype(np.float32)
    y64 = x.astype(np.float64) @ w.astype(np.float64).T
    y = linear(x, qw, sw, k, 128).astype(np.float64)
    sq = 10 * np.log10(np.sum(y64**2) / np.sum((y - y64) ** 2))
    assert sq >= INT4_GAUSSIAN_LAYER_SQNR_FLOOR_DB["int4dq_2l"], f"{sq:.2f} dB"


# ---------------------------------------------------------------- refusals


def raises(exc, *words):
    return pytest.raises(exc, match=".*".join(map(str, words)))


def test_other_activations_are_refused_naming_the_argument(rng):
    k, n, gs = 128, 4, 32
    _, qw, sw, _ = quantized_weight(rng, n, k, gs)
    x = rng.standard_normal((2, k)).astype(np.float32)
    kw = dict(weight_format="int4", weight_granularity=TL, in_features=k, weight_group_size=gs)
    with raises(NotImplementedError, "act_format none", "TWO_LEVEL", "int8 activations"):
        ops.linear(x, qw, sw, **kw)
    with raises(NotImplementedError, "act_format fp8_e4m3", "TWO_LEVEL"):
        ops.linear(x, qw, sw, act_format="fp8_e4m3", **kw)
    with raises(NotImplementedError, "act_granularity = 2", "CQ_GRANULARITY_ROW"):
        ops.linear(x, qw, sw, act_format="int8", act_granularity="tensor", **kw)


def test_two_level_is_int4_only_and_computed_from_the_data(rng):
    x = rng.standard_normal((2, 128)).astype(np.float32)
    with raises(ValueError, "granularity", "two-level", "int4 only"):
        ops.quantize(x, "uint4", TL, group_size=32)
    with raises(ValueError, "granularity = CQ_GRANULARITY_TWO_LEVEL", "int8", "groups are for the 4-bit"):
        ops.quantize(x, "int8", TL, group_size=32)
    with raises(ValueError, "static_scale"):
        ops.quantize(x, "int4", TL, group_size=32, scale=np.ones((2, 5), np.float32))
    with raises(ValueError, "group_size = 48"):
        quantize(x, 48)
    with raises(ValueError, "group_size = 256", "does not divide"):
        quantize(x, 256)


def test_scale_shapes_are_checked(rng):
    k, n, gs = 128, 4, 32
    _, qw, sw, _ = quantized_weight(rng, n, k, gs)
    x = rng.standard_normal((2, k)).astype(np.float32)
    with raises(ValueError, "w_scale has shape", r"\[4, 5\]", "s1"):
        linear(x, qw, np.ones((n, 4), np.float32), k, gs)
    q = np.zeros((2, 64), np.uint8)
    with raises(ValueError, "scale has shape", r"\[2, 5\]"):
        _C.dequantize(q, np.ones((2, 4), np.float32), np.zeros((2, 128), np.float32), ops.format_info("int4").id,
                      _C.GRANULARITY_TWO_LEVEL, group_size=32)


def test_k_beyond_the_int32_bound_is_refused():
    k, gs = _C.LINEAR_INT8_MAX_K + 1, 1024  # 131072
    qw = np.zeros((1, k // 2), np.uint8)
    sw = np.ones((1, 1 + k // gs), np.float32)
    x = np.zeros((1, k), np.float32)
    with raises(NotImplementedError, "x has 131072 features", "two-level", "131071"):
        linear(x, qw, sw, k, gs)
    assert linear(x[:, : k - gs], qw[:, : (k - gs) // 2], sw[:, :-1], k - gs, gs).shape == (1, 1)


# ---------------------------------------------------------------- the scheme


def test_scheme_row_config_and_sizes():
    s = SCHEMES["int4dq_2l"]
    assert s.weight_format.name == "int4" and s.act_format.name == "int8" and s.grouped
    assert s.c_args == (ops.format_info("int4").id, _C.GRANULARITY_TWO_LEVEL, ops.format_info("int8").id,
                        _C.GRANULARITY_ROW, 128)
    assert s.min_compute_capability == _C.MIN_CC_INT8_DYNAMIC == 80
    assert s.scale_shape(10, 256) == (10, 3) and s.weight_bytes(256, 10) == 10 * 128 + 4 * 30
    g64 = s.with_group_size(64)
    assert g64.name == "int4dq_2l_g64" and scheme("int4dq_2l_g64") == g64 and g64.scale_shape(10, 256) == (10, 5)
    assert "multiple of the weight group size 128" in s.refusal(192, 10)
    import cquant

    cfg = cquant.Int8DynamicActivationInt4TwoLevelWeightConfig(32)
    assert cfg.name == "int4dq_2l_g32" and cfg.scheme() == s.with_group_size(32)
    assert cquant.configs.config_for_scheme(s.with_group_size(32)) == cfg
    assert cquant.configs.config_for_scheme(SCHEMES["int4dq"]) == cquant.Int8DynamicActivationInt4WeightConfig()
    assert cquant.config_from_name("int4dq_2l", group_size=256) == cquant.Int8DynamicActivationInt4TwoLevelWeightConfig(256)
    assert ops.linear_workspace_size(s.c_args, 256, 64, 64, cuda=False) == 0
