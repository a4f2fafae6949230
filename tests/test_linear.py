"""The quantized linear layer on the CPU, every scheme.

Two checks per case: against the float64 evaluation of the same quantized math
(tests/reference.py decoding the codes cquant stored; only fp32 rounding may differ, bounded
in tolerances.py), and the SQNR against the unquantized float64 product x W^T (floors per
scheme in tolerances.py).
"""

import numpy as np
import pytest

from cquant import ops

import reference as ref
from helpers import FLOAT_DTYPE_PARAMS, bits, is_torch, random_input, sqnr_db, to_framework, to_numpy, torch_module
from tolerances import LINEAR_REL_L2, LINEAR_SQNR_FLOOR_DB, gelu_abs_bound, linear_abs_bound

# scheme: (weight format, weight granularity, activation format or None, activation granularity)
SCHEMES = {
    "int8wo": ("int8", "row", None, "row"),
    "int8wo_tensor": ("int8", "tensor", None, "row"),
    "int8dq": ("int8", "row", "int8", "row"),
    "int8dq_tensor": ("int8", "tensor", "int8", "tensor"),
    "fp8dqrow": ("fp8_e4m3", "row", "fp8_e4m3", "row"),
    "fp8dq_tensor": ("fp8_e4m3", "tensor", "fp8_e4m3", "tensor"),
    "fp8wo_e4m3": ("fp8_e4m3", "row", None, "row"),
    "fp8wo_e5m2": ("fp8_e5m2", "row", None, "row"),
    "fp6_e3m2": ("fp6_e3m2", "row", None, "row"),
    "fp6_e2m3": ("fp6_e2m3", "row", None, "row"),
    "fp5_e2m2": ("fp5_e2m2", "row", None, "row"),
    "fp4_e2m1": ("fp4_e2m1", "row", None, "row"),
    "fp3_e1m1": ("fp3_e1m1", "row", None, "row"),
    "fp3_e2m0": ("fp3_e2m0", "row", None, "row"),
    "fp5_e3m1": ("fp5_e3m1", "row", None, "row"),
    "fp7_e3m3": ("fp7_e3m3", "row", None, "row"),
}
assert set(SCHEMES) == set(LINEAR_SQNR_FLOOR_DB)

# (x shape [..., K], N): odd sizes, tails of the 8-wide dot, a 3-D and a 4-D input
SHAPES = [((1, 1), 1), ((7, 97), 33), ((3, 1025), 7), ((1, 7), 97), ((2, 3, 97), 5), ((2, 1, 3, 16), 9)]
SQNR_SHAPES = [(16, 1025, 97), (7, 97, 33)]  # the (M, K, N) LINEAR_SQNR_FLOOR_DB was measured on
MIN_OUTPUTS_FOR_L2 = 64  # a norm-wise error needs enough outputs to be one


def dtype_of(a):
    return str(a.dtype).split(".")[-1]


def run_linear(x, w, scheme, bias=None, **kw):
    """(y, qw, sw): quantize w [N, K] for the scheme and run ops.linear on x [..., K]."""
    wf, wg, af, ag = SCHEMES[scheme]
    qw, sw = ops.quantize(w, wf, wg)
    y = ops.linear(x, qw, sw, weight_format=wf, weight_granularity=wg, act_format=af, act_granularity=ag,
                   bias=bias, in_features=int(x.shape[-1]), **kw)
    return y, qw, sw


def check_quantized_math(x32, qw, sw, scheme, y, bias32, out_dtype, what):
    """|y - float64 evaluation of the same codes| within the fp32 rounding bound."""
    wf, wg, af, ag = SCHEMES[scheme]
    k = x32.shape[-1]
    x2 = x32.reshape(-1, k)
    codes = ref.codes_of_stored(ref.fmt(wf), to_numpy(qw), k)
    y64, terms = ref.linear(x2, codes, to_numpy(sw), ref.fmt(wf), wg, ref.fmt(af) if af else None, ag, bias32)
    got = to_numpy(y).astype(np.float64).reshape(y64.shape)
    err = np.abs(got - y64)
    bound = linear_abs_bound(k, terms, y64, out_dtype)
    worst = np.unravel_index(np.argmax(err - bound), err.shape)
    assert np.all(err <= bound), (f"{what}: |y - y64| = {err[worst]:.3g} > bound {bound[worst]:.3g} at {worst} "
                                  f"(y {got[worst]!r}, y64 {y64[worst]!r})")
    if y64.size >= MIN_OUTPUTS_FOR_L2:
        rel = np.linalg.norm(got - y64) / np.linalg.norm(y64)
        assert rel <= LINEAR_REL_L2[out_dtype], f"{what}: relative L2 error {rel:.3g}"


@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPE_PARAMS)
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_linear_matches_quantized_math(rng, scheme, dtype, with_bias):
    for x_shape, n in SHAPES:
        k = x_shape[-1]
        what = f"{scheme} {dtype} x{x_shape} N={n} bias={with_bias}"
        x, x32 = random_input(rng, x_shape, dtype)
        w, _ = random_input(rng, (n, k), dtype)  # weights in the activations' framework and dtype
        b, b32 = random_input(rng, (n,), dtype) if with_bias else (None, None)
        y, qw, sw = run_linear(x, w, scheme, bias=b)
        assert type(y) is type(x), what  # numpy in, numpy out; torch in, torch out
        assert dtype_of(y) == dtype and tuple(y.shape) == x_shape[:-1] + (n,), what
        assert type(qw) is type(x) and type(sw) is type(x)
        check_quantized_math(x32, qw, sw, scheme, y, b32, dtype, what)


def gelu_tanh64(v):
    return 0.5 * v * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (v + 0.044715 * v**3)))


@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPE_PARAMS)
@pytest.mark.parametrize("scheme", ["int8wo", "int8dq", "fp8dqrow", "fp8dq_tensor", "fp6_e3m2", "fp4_e2m1"])
def test_linear_gelu_matches_quantized_math(rng, scheme, dtype, with_bias):
    """activation="gelu_tanh" gives gelu(x W^T + b) of the same quantized math, within the rounding bound."""
    wf, wg, af, ag = SCHEMES[scheme]
    for x_shape, n in SHAPES:
        k = x_shape[-1]
        x, x32 = random_input(rng, x_shape, dtype)
        w, _ = random_input(rng, (n, k), dtype)
        b, b32 = random_input(rng, (n,), dtype) if with_bias else (None, None)
        y, qw, sw = run_linear(x, w, scheme, bias=b, activation="gelu_tanh")
        codes = ref.codes_of_stored(ref.fmt(wf), to_numpy(qw), k)
        pre64, terms = ref.linear(x32.reshape(-1, k), codes, to_numpy(sw), ref.fmt(wf), wg,
                                  ref.fmt(af) if af else None, ag, b32)
        y64 = gelu_tanh64(pre64)
        got = to_numpy(y).astype(np.float64).reshape(y64.shape)
        err, bound = np.abs(got - y64), gelu_abs_bound(k, terms, pre64, y64, dtype)
        worst = np.unravel_index(np.argmax(err - bound), err.shape)
        assert np.all(err <= bound), (f"{scheme} {dtype} x{x_shape}: |y - gelu(y64)| = {err[worst]:.3g} > "
                                      f"{bound[worst]:.3g} (pre-activation {pre64[worst]!r})")


def test_linear_rejects_unknown_activation(rng):
    x, _ = random_input(rng, (3, 16), "float32")
    with pytest.raises(ValueError, match="activation"):
        run_linear(x, x[:4], "int8wo", activation="relu")


@pytest.mark.parametrize("dtype", FLOAT_DTYPE_PARAMS)
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_linear_sqnr_above_floor(rng, scheme, dtype):
    for m, k, n in SQNR_SHAPES:
        x, x32 = random_input(rng, (m, k), dtype)
        w32 = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)
        w = to_framework(w32, "float32", torch_module() if is_torch(x) else None)
        y, _, _ = run_linear(x, w, scheme)
        exact = x32.astype(np.float64) @ w32.astype(np.float64).T
        db = sqnr_db(exact, to_numpy(y))
        assert db >= LINEAR_SQNR_FLOOR_DB[scheme], f"{scheme} {dtype} ({m}, {k}, {n}): {db:.2f} dB"


@pytest.mark.parametrize("dtype", [pytest.param("float16"), pytest.param("bfloat16", marks=pytest.mark.torch)])
@pytest.mark.parametrize("scheme", ["int8dq", "fp8dqrow", "fp6_e3m2"])
def test_float32_bias_with_16_bit_activations(rng, scheme, dtype):
    x, x32 = random_input(rng, (5, 97), dtype)
    w, _ = random_input(rng, (11, 97), dtype)
    b32 = rng.standard_normal(11).astype(np.float32)
    b = to_framework(b32, "float32", torch_module() if is_torch(x) else None)
    y, qw, sw = run_linear(x, w, scheme, bias=b)
    assert dtype_of(y) == dtype
    check_quantized_math(x32, qw, sw, scheme, y, b32, dtype, f"{scheme} float32 bias")


@pytest.mark.parametrize("dtype", FLOAT_DTYPE_PARAMS)
@pytest.mark.parametrize("scheme", ["int8wo", "int8dq", "fp8dqrow", "fp8dq_tensor", "fp4_e2m1"])
def test_out_buffer_and_leading_dims(rng, scheme, dtype):
    x, x32 = random_input(rng, (2, 3, 97), dtype)
    w, _ = random_input(rng, (13, 97), dtype)
    y0, qw, sw = run_linear(x, w, scheme)
    out = y0 * 0
    _fill_nan(out)
    wf, wg, af, ag = SCHEMES[scheme]
    y = ops.linear(x, qw, sw, weight_format=wf, weight_granularity=wg, act_format=af, act_granularity=ag,
                   in_features=97, out=out)
    assert y is out and tuple(out.shape) == (2, 3, 13)
    np.testing.assert_array_equal(bits(out), bits(y0))
    # the 3-D result is the 2-D result of the flattened rows
    y2, _, _ = run_linear(x.reshape(6, 97), w, scheme)
    np.testing.assert_array_equal(bits(y2).reshape(2, 3, 13), bits(y0))


def _fill_nan(a):
    if is_torch(a):
        a.fill_(float("nan"))
    else:
        a.fill(np.nan)


def test_torch_activations_with_numpy_weights(torch, rng):
    """Tensors cross as DLPack: any mix of producers works, the result follows x."""
    w32 = rng.standard_normal((9, 33)).astype(np.float32)
    qw, sw = ops.quantize(w32, "fp8_e4m3")  # NumPy: uint8 codes
    x = torch.randn(4, 33, generator=torch.Generator().manual_seed(int(rng.integers(1 << 31))))
    y = ops.linear(x, qw, sw, weight_format="fp8_e4m3", act_format="fp8_e4m3")
    assert isinstance(y, torch.Tensor) and y.dtype == torch.float32 and tuple(y.shape) == (4, 9)
    y_np = ops.linear(x.numpy(), qw, sw, weight_format="fp8_e4m3", act_format="fp8_e4m3")
    assert isinstance(y_np, np.ndarray)
    np.testing.assert_array_equal(y.numpy(), y_np)


def test_weight_granularity_defaults_to_tensor_for_one_scale(rng):
    x, x32 = random_input(rng, (3, 40), "float32")
    w, _ = random_input(rng, (6, 40), "float32")
    qw, sw = ops.quantize(w, "int8", "tensor")
    y_default = ops.linear(x, qw, sw, weight_format="int8")
    y_tensor = ops.linear(x, qw, sw, weight_format="int8", weight_granularity="tensor")
    np.testing.assert_array_equal(y_default, y_tensor)
    check_quantized_math(x32, qw, sw, "int8wo_tensor", y_default, None, "float32", "default granularity")


@pytest.mark.parametrize("scheme", ["int8wo", "int8dq", "fp8dqrow", "fp8dq_tensor", "fp6_e2m3"])
def test_nonfinite_inputs_give_nan_outputs(rng, scheme):
    """A NaN/Inf in an activation row or a weight row makes exactly the outputs it feeds NaN."""
    m, k, n = 5, 64, 7
    x32 = rng.standard_normal((m, k)).astype(np.float32)
    w32 = (rng.standard_normal((n, k)) / 8).astype(np.float32)
    _, _, af, ag = SCHEMES[scheme]
    # dynamic schemes: an Inf makes the group's scale NaN; weight-only ones use x as it is
    # (an Inf would give +-Inf outputs, IEEE-correctly), so they get a NaN
    x32[1, 3] = np.inf if af is not None else np.nan
    w32[4, 10] = np.inf
    y, _, _ = run_linear(x32, w32, scheme)
    nan = np.isnan(y)
    expect = np.zeros((m, n), bool)
    expect[:, 4] = True  # weight row 4 has scale NaN (its codes are 0)
    if af is not None and ag == "tensor":
        expect[:] = True  # one bad activation makes the activation tensor's scale NaN
    else:
        expect[1] = True
    np.testing.assert_array_equal(nan, expect)
