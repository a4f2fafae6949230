"""The bounds of tests/tolerances.py can fail: fed the output of a plausible wrong kernel, they
reject it, on the data the tests draw; fed the exact result rounded once, they accept it.

The CUDA linear tests (test_linear_cuda.py) run on a GPU machine only; what they would catch is
checked here, on the CPU, with their own data and bounds.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import test_linear_cuda as cuda_tests  # noqa: E402
import tolerances as tol  # noqa: E402


def rounded(v, dtype):
    return torch.from_numpy(np.ascontiguousarray(v)).to(getattr(torch, dtype)).double().numpy()


def case(scheme, m, k, n, dtype, bias_kind, seed):
    wf, wg, af, ag = cuda_tests.SCHEMES[scheme]
    x, qw, sw, bias = cuda_tests.make_case(m, k, n, getattr(torch, dtype), bias_kind, wf, wg, seed)
    pre, terms, b_abs = cuda_tests.float64_reference(x, qw, sw, bias, wf, af, ag, k)
    return pre, terms, b_abs, tol.cuda_linear_path(af, m)


# One configuration of test_linear_cuda's GELU tests per kernel path and epilogue: cquant's own
# (int8dq, the fp8 mma.sync kernel, the GEMV's pass) and cuBLASLt's (weight-only GEMM, fp8).
GELU_CASES = [
    ("int8dq", (97, 320, 272), "bfloat16", "same", 5),
    ("fp8dqrow", (97, 320, 272), "bfloat16", "same", 5),
    ("fp8dqrow", (97, 192, 80), "float32", "same", 6),
    ("int8wo", (7, 100, 75), "bfloat16", "same", 5),
    ("fp6_e3m2", (97, 192, 80), "float16", "same", 6),
    ("int8wo", (97, 192, 80), "float32", "same", 6),
]


@pytest.mark.parametrize("scheme, shape, dtype, bias_kind, seed", GELU_CASES,
                         ids=[f"{c[0]}-{'x'.join(map(str, c[1]))}-{c[2]}" for c in GELU_CASES])
def test_cuda_gelu_bound_tells_erf_from_tanh(scheme, shape, dtype, bias_kind, seed):
    pre, terms, b_abs, path = case(scheme, *shape, dtype, bias_kind, seed)
    want = tol.gelu_tanh(pre)
    bound = tol.cuda_gelu_abs_bound(path, shape[1], terms, b_abs, pre, want, dtype, dtype)
    assert np.all(np.abs(rounded(want, dtype) - want) <= bound), "the exact tanh GELU, rounded once, must pass"
    erf = np.abs(rounded(tol.gelu_erf(pre), dtype) - want)
    assert np.any(erf > bound), f"{path}: an erf GELU would pass this bound"


def test_cpu_gelu_bound_tells_erf_from_tanh(rng):
    """test_linear's GELU check on bfloat16 outputs (pre-activations of a few units)."""
    pre = rng.standard_normal((64, 97)) * 3
    terms = np.abs(pre) * 4 + 1
    want = tol.gelu_tanh(pre)
    bound = tol.gelu_abs_bound(97, terms, pre, want, "bfloat16")
    assert np.all(np.abs(rounded(want, "bfloat16") - want) <= bound)
    assert np.any(np.abs(rounded(tol.gelu_erf(pre), "bfloat16") - want) > bound)


def test_gemv_bound_rejects_weights_rounded_to_bf16():
    """The GEMV decodes weights exactly: one that rounded decode(q) * s to bf16 first (as the
    large-M path may, with its own allowance) is caught."""
    scheme, (m, k, n), dtype = "int8wo", (7, 1025, 97), "bfloat16"
    wf, wg, af, ag = cuda_tests.SCHEMES[scheme]
    x, qw, sw, _ = cuda_tests.make_case(m, k, n, torch.bfloat16, None, wf, wg, 3)
    pre, terms, b_abs, path = case(scheme, m, k, n, dtype, None, 3)
    assert path == "gemv"
    w = qw.double() * sw.double().reshape(-1, 1)
    wrong = rounded((x.double() @ w.to(torch.bfloat16).double().T).numpy(), dtype)
    bound = tol.cuda_linear_abs_bound(path, k, terms, b_abs, pre, dtype, dtype)
    assert np.all(np.abs(rounded(pre, dtype) - pre) <= bound)
    assert np.any(np.abs(wrong - pre) > bound)


def test_gelu_slope_bound_covers_the_largest_slope():
    v = np.linspace(-8, 8, 100001)
    slope = np.abs(tol.gelu_tanh_slope(v))
    assert slope.max() <= tol.GELU_MAX_SLOPE
    # |gelu'(v + d)| <= |gelu'(v)| + |d| max|gelu''|, checked on a grid
    d = 0.05
    assert np.all(np.abs(tol.gelu_tanh_slope(v + d)) <= slope + tol.GELU_MAX_CURVATURE * d + 1e-12)


def test_gemv_bound_rejects_truncated_outputs():
    """Against float64 the GEMV may be off by its fp32 sum error and half an ulp of y: an output
    conversion that truncates instead of rounding to nearest (up to a whole ulp) is caught."""
    rng = np.random.default_rng(0)
    k = 1025
    x = rng.standard_normal((7, k))
    w = rng.standard_normal((97, k)) / np.sqrt(k)
    y64 = x @ w.T
    terms = np.abs(x) @ np.abs(w).T
    bits = y64.astype(np.float32).view(np.uint32)
    truncated = (bits & np.uint32(0xFFFF0000)).view(np.float32).astype(np.float64)  # bfloat16, toward zero
    bound = tol.gemv_wo_abs_bound(terms, y64, "bfloat16")
    assert np.all(np.abs(rounded(y64, "bfloat16") - y64) <= bound)
    assert np.any(np.abs(truncated - y64) > bound)
    # against the C reference (also rounded once) one ulp apart is allowed, two are not
    ref = rounded(y64, "bfloat16")
    ulp = 2.0 ** (np.floor(np.log2(np.abs(ref))) - 7)
    bound_ref = tol.gemv_wo_abs_bound(terms, ref, "bfloat16", against="reference")
    assert np.all(ulp <= bound_ref) and np.any(2 * ulp > bound_ref)


# The 4-bit CUDA tests (test_linear_int4_cuda.py): their float64 bounds accept the exact value
# rounded once and reject plausible wrong kernels, on their own data.

@pytest.mark.parametrize("fmt, dtype", [("int4", "bfloat16"), ("uint4", "float16")])
def test_int4_weight_only_bound_rejects_wrong_decodes(fmt, dtype):
    import test_linear_int4_cuda as int4_tests

    m, k, n, gs = 7, 3072, 200, 128
    x = int4_tests.make_x(m, k, getattr(torch, dtype), 5, device="cpu")
    q, s = int4_tests.weight(fmt, k, n, gs)
    codes = int4_tests.code_values(fmt, k, n, gs)
    # The quantizer's scales have 8 significant bits, so (code - zp) * scale has at most 12 and
    # rounding it to f16 rarely changes it: skipping that rounding shows only with the arbitrary
    # fp32 scales a checkpoint may hold (from before that rounding, or edited), as here.
    s = s.clone()
    (s if fmt == "int4" else s[..., 0]).mul_(1 + 2.0**-8 / 3)  # all 24 bits of the scales used
    x64 = x.double().numpy()
    wp = int4_tests.w_prime_of(codes, s, fmt, gs, dtype)
    pre, terms = x64 @ wp.T, np.abs(x64) @ np.abs(wp).T  # float64_value's weight-only model, no bias
    bound = tol.rounded_bound(tol.int4_wo_pre_error(terms, dtype), pre, dtype)

    def over(w_prime):
        y = rounded(x64 @ w_prime.T, dtype)
        return np.count_nonzero(~(np.abs(y - pre) <= bound))

    assert np.count_nonzero(~(np.abs(rounded(pre, dtype) - pre) <= bound)) == 0
    # w' left in fp32 instead of rounded to x's dtype
    assert over(int4_tests.w_prime_of(codes, s, fmt, gs, "float32")) > 0
    # each group decoded with the previous group's scale (and zero point)
    shifted = s.clone().view(n, k // gs, -1)
    shifted[:, 1:] = shifted[:, :-1].clone()
    assert over(int4_tests.w_prime_of(codes, shifted.reshape(s.shape), fmt, gs, dtype)) > 0.5 * pre.size


@pytest.mark.parametrize("act_format", ["int8", "fp8_e4m3"])
def test_int4_dynamic_bound_rejects_shifted_group_scales(act_format, monkeypatch):
    import test_linear_int4_cuda as int4_tests

    m, k, n, gs = 7, 3072, 200, 128
    x = int4_tests.make_x(m, k, torch.bfloat16, 5, device="cpu")
    pre, terms, err = int4_tests.float64_value(x, "int4", act_format, k, n, gs, None, "bfloat16")
    bound = tol.rounded_bound(err, pre, "bfloat16")
    assert np.count_nonzero(~(np.abs(rounded(pre, "bfloat16") - pre) <= bound)) == 0
    q, s = int4_tests.weight("int4", k, n, gs)
    shifted = s.clone()
    shifted[:, 1:] = s[:, :-1]
    monkeypatch.setattr(int4_tests, "weight", lambda *args, **kw: (q, shifted))
    wrong, _, _ = int4_tests.float64_value(x, "int4", act_format, k, n, gs, None, "bfloat16")
    assert np.count_nonzero(~(np.abs(rounded(wrong, "bfloat16") - pre) <= bound)) > 0.5 * pre.size
