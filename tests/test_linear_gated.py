"""The gated-residual linear layer (cq_linear_gated) and column-slice outputs of the linear ops, on
the CPU, every scheme of cquant.schemes.SCHEMES.

Two checks per case: bit for bit against the composition the header defines (the layer's fp32
value v, read from the same layer run with float32 inputs of the same values, then
round(residual + gate * v) in fp32), and against float64 evaluation of the same quantized math
(tests/reference.py) within the rounding bound of tolerances.gated_abs_bound.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from cquant import _C, ops, torch_ops  # noqa: E402
from cquant.schemes import SCHEMES  # noqa: E402
from helpers import ungrouped_schemes  # noqa: E402

import reference as ref  # noqa: E402
import tolerances as tol  # noqa: E402
from helpers import bits  # noqa: E402

DTYPES = ["float32", "float16", "bfloat16"]
K, N = 48, 24
# (M, G): rows of x and samples among them; GEMV-sized and GEMM-sized M, tails of 16
MG = [(1, 1), (5, 1), (5, 5), (16, 1), (16, 2), (17, 1), (33, 3), (100, 1), (100, 2)]
GELU = _C.ACTIVATION_GELU_TANH


def tensor(a32, dtype):
    return torch.from_numpy(np.ascontiguousarray(a32, dtype=np.float32)).to(getattr(torch, dtype))


def values(t):
    """float64 values of a float tensor (exact for every float dtype)."""
    return t.detach().double().numpy()


def weight(rng, scheme, n=N, k=K):
    """(codes, scales) of a random N(0, 1/K) weight [n, k] quantized for the scheme."""
    w = torch.from_numpy((rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32))
    return torch_ops.quantize(w, scheme.weight_format.id, scheme.c_args[1])


def bias_of(rng, kind, dtype, n=N):
    if kind == "none":
        return None
    return tensor(rng.standard_normal(n), "float32" if kind == "f32" else dtype)


def v_reference(scheme, x, qw, sw, bias, activation):
    """float64 v [M, N] of the layer's quantized math and the bound on the C reference's fp32 v."""
    k = int(x.shape[-1])
    wf = ref.fmt(scheme.weight_format.name)
    af = ref.fmt(scheme.act_format.name) if scheme.act_format else None
    codes = ref.codes_of_stored(wf, qw.view(torch.uint8).numpy(), k)
    x32 = values(x).reshape(-1, k).astype(np.float32)
    pre, terms = ref.linear(x32, codes, sw.numpy(), wf, scheme.weight_granularity, af, scheme.act_granularity,
                            None if bias is None else values(bias))
    err = tol.gamma(k + tol.LINEAR_EXTRA_ROUNDINGS) * terms
    if activation == GELU:
        v = tol.gelu_tanh(pre)
        return v, tol.gelu_of_error_bound(err, pre, v, "float32")
    return pre, err


def fp32_value(scheme, x, qw, sw, bias, activation):
    """The layer's fp32 value v before its rounding: the same layer on float32 copies of x and bias
    (same values, so the same activation codes and the same fp32 arithmetic), [M, N] float32."""
    b = None if bias is None else bias.float()
    y = torch.ops.cquant.linear(x.float(), qw, sw, b, *scheme.c_args[:4], int(x.shape[-1]), activation)
    return y.reshape(-1, y.shape[-1]).numpy()


def composed(v32, gate, residual, rows_per_sample, dtype):
    """round(residual + gate[g(m)] * v) with one fp32 product and one fp32 sum (cquant.h)."""
    g32 = values(gate).astype(np.float32)[np.arange(v32.shape[0]) // rows_per_sample]
    r32 = values(residual).reshape(v32.shape).astype(np.float32)
    return tensor(r32 + g32 * v32, dtype)


def gated(scheme, x, qw, sw, bias, gate, residual, activation, *, out=None, direct=False):
    args = (x, qw, sw, bias, gate, residual, *scheme.c_args[:4], int(x.shape[-1]), activation)
    if out is not None:  # in place: the residual is the output
        _C.linear_gated(x, qw, sw, bias, gate, residual, out, *scheme.c_args[:4], int(x.shape[-1]), activation=activation)
        return out
    return (torch_ops.DIRECT if direct else torch_ops.DISPATCHED).linear_gated(*args)


@pytest.mark.parametrize("bias_kind", ["none", "same", "f32"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scheme_name", ungrouped_schemes(SCHEMES))
def test_gated_matches_composition_and_float64(rng, scheme_name, dtype, bias_kind):
    scheme = SCHEMES[scheme_name]
    if bias_kind == "f32" and dtype == "float32":
        pytest.skip("a float32 bias is the same-dtype case for float32 outputs")
    qw, sw = weight(rng, scheme)
    bias = bias_of(rng, bias_kind, dtype)
    for i, (m, g) in enumerate(MG):
        for activation in (_C.ACTIVATION_NONE, GELU):
            in_place = (i + activation) % 2 == 1
            what = f"{scheme_name} {dtype} bias={bias_kind} M={m} G={g} act={activation} in_place={in_place}"
            shape = (g, m // g, K) if i % 3 == 2 else (m, K)  # 3-D inputs [samples, rows, K] too
            x = tensor(rng.standard_normal(shape), dtype)
            gate = tensor(rng.standard_normal((g, N)), dtype if i % 2 else "float32")
            residual = tensor(rng.standard_normal((*shape[:-1], N)), dtype)
            r0 = residual.clone()
            y = gated(scheme, x, qw, sw, bias, gate, residual, activation, out=residual if in_place else None,
                      direct=i % 2 == 0)
            assert y.dtype == x.dtype and tuple(y.shape) == (*shape[:-1], N), what
            if not in_place:
                assert torch.equal(residual, r0), what  # an input apart from y is only read

            want = composed(fp32_value(scheme, x, qw, sw, bias, activation), gate, r0, m // g, dtype)
            np.testing.assert_array_equal(bits(y.reshape(m, N)), bits(want), err_msg=what)

            v64, v_err = v_reference(scheme, x, qw, sw, bias, activation)
            g64 = values(gate)[np.arange(m) // (m // g)]
            r64 = values(r0).reshape(m, N)
            y64 = r64 + g64 * v64
            err = np.abs(values(y).reshape(m, N) - y64)
            bound = tol.gated_abs_bound(v_err, v64, g64, r64, y64, dtype)
            worst = np.unravel_index(np.argmax(err - bound), err.shape)
            assert np.all(err <= bound), f"{what}: |y - y64| = {err[worst]:.3g} > {bound[worst]:.3g} at {worst}"


def test_gated_numpy_array_api(rng):
    """ops.linear_gated on NumPy arrays: a new y, or the residual updated in place."""
    scheme = SCHEMES["int8dq"]
    x = rng.standard_normal((6, K)).astype(np.float16)
    qw, sw = ops.quantize(rng.standard_normal((N, K)).astype(np.float32), "int8")
    gate = rng.standard_normal((2, N)).astype(np.float32)
    residual = rng.standard_normal((6, N)).astype(np.float16)
    kw = dict(weight_format="int8", act_format="int8")
    y = ops.linear_gated(x, qw, sw, gate, residual, **kw)
    assert isinstance(y, np.ndarray) and y.dtype == np.float16
    v = ops.linear(x.astype(np.float32), qw, sw, **kw)
    want = (residual.astype(np.float32) + gate[np.arange(6) // 3] * v).astype(np.float16)
    np.testing.assert_array_equal(y.view(np.uint16), want.view(np.uint16))
    r = residual.copy()
    assert ops.linear_gated(x, qw, sw, gate, r, out=r, **kw) is r
    np.testing.assert_array_equal(r.view(np.uint16), want.view(np.uint16))
    assert scheme.c_args[2] == _C.FORMAT_INT8


# ---------------------------------------------------------------- column slices of y

SENTINEL = -12345.0


def wide(rows_shape, n_full, dtype):
    return torch.full((*rows_shape, n_full), SENTINEL, dtype=getattr(torch, dtype))


def assert_only_slice_written(full, a, b, what):
    outside = torch.cat([full[..., :a], full[..., b:]], dim=-1)
    assert torch.all(outside == SENTINEL), f"{what}: columns outside [{a}, {b}) were written"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scheme_name", ungrouped_schemes(SCHEMES))
def test_linear_into_column_slice(rng, scheme_name, dtype):
    scheme = SCHEMES[scheme_name]
    qw, sw = weight(rng, scheme)
    bias = bias_of(rng, "same", dtype)
    for m in (1, 5, 16, 17, 33, 100):
        for rows_shape in ((m,), (1, m)) if m % 2 else ((m,), (2, m // 2)):
            what = f"{scheme_name} {dtype} rows {rows_shape}"
            x = tensor(rng.standard_normal((*rows_shape, K)), dtype)
            want = torch.ops.cquant.linear(x, qw, sw, bias, *scheme.c_args[:4], K, 0)
            full = wide(rows_shape, N + 13, dtype)
            a = 5
            torch.ops.cquant.linear_out(x, qw, sw, bias, full[..., a:a + N], *scheme.c_args[:4], K)
            np.testing.assert_array_equal(bits(full[..., a:a + N]), bits(want), err_msg=what)
            assert_only_slice_written(full, a, a + N, what)
            full2 = wide(rows_shape, 2 * N, dtype)  # two layers side by side, the direct body
            torch_ops.DIRECT.linear_out(x, qw, sw, bias, full2[..., N:], *scheme.c_args[:4], K, GELU)
            torch_ops.DIRECT.linear_out(x, qw, sw, bias, full2[..., :N], *scheme.c_args[:4], K)
            np.testing.assert_array_equal(bits(full2[..., :N]), bits(want), err_msg=what)
            np.testing.assert_array_equal(
                bits(full2[..., N:]), bits(torch.ops.cquant.linear(x, qw, sw, bias, *scheme.c_args[:4], K, GELU)),
                err_msg=what)


@pytest.mark.parametrize("scheme_name", [n for n in ungrouped_schemes(SCHEMES) if SCHEMES[n].dynamic])
def test_linear_quantized_into_column_slice(rng, scheme_name):
    scheme = SCHEMES[scheme_name]
    qw, sw = weight(rng, scheme)
    for m in (1, 17, 100):
        x = tensor(rng.standard_normal((m, K)), "bfloat16")
        xc, xs = torch_ops.quantize(x, scheme.c_args[2], scheme.c_args[3])
        want = torch.ops.cquant.linear_quantized(xc, xs, qw, sw, None, *scheme.c_args[:4], K, torch.bfloat16)
        full = wide((m,), N + 7, "bfloat16")
        _C.linear_quantized(xc, xs, qw, sw, None, full[:, 7:], *scheme.c_args[:4], K)
        np.testing.assert_array_equal(bits(full[:, 7:]), bits(want))
        assert_only_slice_written(full, 7, N + 7, f"{scheme_name} M={m}")
        full = wide((m,), N + 7, "bfloat16")  # the torch op, with the GELU
        torch.ops.cquant.linear_quantized_out(xc, xs, qw, sw, None, full[:, :N], *scheme.c_args[:4], K, GELU)
        want = torch.ops.cquant.linear_quantized(xc, xs, qw, sw, None, *scheme.c_args[:4], K, torch.bfloat16, GELU)
        np.testing.assert_array_equal(bits(full[:, :N]), bits(want))
        assert_only_slice_written(full, 0, N, f"{scheme_name} M={m}, linear_quantized_out")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scheme_name", ["int8wo", "int8dq", "fp8dqrow", "fp8dq", "fp6_e3m2"])
def test_gated_into_column_slice(rng, scheme_name, dtype):
    """y a column slice; the residual a column slice of another tensor, or the same slice (in place)."""
    scheme = SCHEMES[scheme_name]
    qw, sw = weight(rng, scheme)
    for m, g in ((1, 1), (16, 2), (17, 1), (100, 2)):
        x = tensor(rng.standard_normal((m, K)), dtype)
        gate_full = tensor(rng.standard_normal((g, 3 * N)), dtype)
        gate = gate_full[:, N:2 * N]  # a chunk of the modulation vector: rows 3N apart
        residual = tensor(rng.standard_normal((m, N)), dtype)
        want = torch.ops.cquant.linear_gated(x, qw, sw, None, gate.contiguous(), residual, *scheme.c_args[:4], K)
        res_full = wide((m,), N + 3, dtype)
        res_full[:, 3:] = residual
        full = wide((m,), N + 9, dtype)
        _C.linear_gated(x, qw, sw, None, gate, res_full[:, 3:], full[:, 2:2 + N], *scheme.c_args[:4], K)
        np.testing.assert_array_equal(bits(full[:, 2:2 + N]), bits(want))
        assert_only_slice_written(full, 2, 2 + N, f"{scheme_name} M={m}")
        # in place on a column slice, and the torch op reading a sliced residual and gate
        _C.linear_gated(x, qw, sw, None, gate, res_full[:, 3:], res_full[:, 3:], *scheme.c_args[:4], K)
        np.testing.assert_array_equal(bits(res_full[:, 3:]), bits(want))
        assert torch.all(res_full[:, :3] == SENTINEL)
        res_full[:, 3:] = residual
        y = torch.ops.cquant.linear_gated(x, qw, sw, None, gate, res_full[:, 3:], *scheme.c_args[:4], K)
        np.testing.assert_array_equal(bits(y), bits(want))


def test_numpy_out_column_slice(rng):
    x = rng.standard_normal((7, K)).astype(np.float32)
    qw, sw = ops.quantize(rng.standard_normal((N, K)).astype(np.float32), "fp8_e4m3")
    want = ops.linear(x, qw, sw, weight_format="fp8_e4m3", act_format="fp8_e4m3")
    full = np.full((7, N + 4), SENTINEL, np.float32)
    assert ops.linear(x, qw, sw, weight_format="fp8_e4m3", act_format="fp8_e4m3", out=full[:, 4:]).base is full
    np.testing.assert_array_equal(full[:, 4:], want)
    assert np.all(full[:, :4] == SENTINEL)


# ---------------------------------------------------------------- bad inputs

F32 = np.float32


def _w():
    return np.zeros((N, K), np.int8), np.ones(N, F32)


def gated_np(x=None, gate=None, residual=None, y=None, w=None, act=0):
    """_C.linear_gated on NumPy arrays (int8 weight-only), any argument replaced."""
    x = np.ones((4, K), F32) if x is None else x
    gate = np.ones((2, N), F32) if gate is None else gate
    residual = np.ones((4, N), F32) if residual is None else residual
    y = np.zeros((4, N), F32) if y is None else y
    qw, sw = _w() if w is None else w
    return _C.linear_gated(x, qw, sw, None, gate, residual, y, _C.FORMAT_INT8, _C.GRANULARITY_ROW, act,
                           _C.GRANULARITY_ROW, K)


def linear_np(y):
    qw, sw = _w()
    return _C.linear(np.ones((4, K), F32), qw, sw, None, y, _C.FORMAT_INT8, _C.GRANULARITY_ROW, 0,
                     _C.GRANULARITY_ROW, K)


def overlapping_rows(rows, cols, stride):
    base = np.zeros(rows * cols + 64, F32)
    return np.lib.stride_tricks.as_strided(base, (rows, cols), (stride * 4, 4))


_BIG = np.zeros((4, 2 * N + 4), F32)

BAD = [
    ("G does not divide M", ValueError, "gate has 3 rows", lambda: gated_np(gate=np.ones((3, N), F32))),
    ("gate columns", ValueError, "gate has 23 columns", lambda: gated_np(gate=np.ones((2, N - 1), F32))),
    ("gate 1-D", ValueError, "gate has 1 dims", lambda: gated_np(gate=np.ones(N, F32))),
    ("gate 3-D", ValueError, "gate has 3 dims", lambda: gated_np(gate=np.ones((2, 1, N), F32))),
    ("gate dtype", TypeError, "gate has dtype int8", lambda: gated_np(gate=np.ones((2, N), np.int8))),
    ("gate strided columns", ValueError, "gate has strides", lambda: gated_np(gate=np.ones((2, 2 * N), F32)[:, ::2])),
    ("residual shape", ValueError, "residual has", lambda: gated_np(residual=np.ones((4, N + 1), F32))),
    ("residual rows", ValueError, "residual has", lambda: gated_np(residual=np.ones((2, N), F32))),
    ("residual dims", ValueError, "residual has 3 dims", lambda: gated_np(residual=np.ones((2, 2, N), F32))),
    ("residual dtype", TypeError, "residual has dtype float16", lambda: gated_np(residual=np.ones((4, N), np.float16))),
    ("residual partly over y", ValueError, "residual overlaps y",
     lambda: gated_np(residual=_BIG[:, 1:N + 1], y=_BIG[:, :N])),
    ("residual at y's address, other strides", ValueError, "residual overlaps y",
     lambda: gated_np(residual=np.lib.stride_tricks.as_strided(_BIG, (4, N), (4 * N, 4)), y=_BIG[:, :N])),
    ("y rows overlap", ValueError, "rows overlap", lambda: gated_np(y=overlapping_rows(4, N, N - 1))),
    ("y rows overlap (linear)", ValueError, "rows overlap", lambda: linear_np(overlapping_rows(4, N, 3))),
    ("y zero row stride", ValueError, "rows overlap",
     lambda: linear_np(np.lib.stride_tricks.as_strided(np.zeros(N, F32), (4, N), (0, 4)))),
    ("y rows not one stride apart", ValueError, "not one stride apart",
     lambda: _linear_3d(np.zeros((2, 5, N + 3), F32)[:, :2, :N])),
    ("y last dim strided", ValueError, "last dim contiguous", lambda: linear_np(np.zeros((4, 2 * N), F32)[:, ::2])),
    ("y reversed rows", ValueError, "negative stride", lambda: linear_np(np.zeros((4, N), F32)[::-1])),
    ("gate inside y", ValueError, "y overlaps gate",
     lambda: gated_np(gate=_BIG[:2, :N], y=_BIG[:, :N])),
]


def _linear_3d(y):
    qw, sw = _w()
    return _C.linear(np.ones((2, 2, K), F32), qw, sw, None, y, _C.FORMAT_INT8, _C.GRANULARITY_ROW, 0,
                     _C.GRANULARITY_ROW, K)


@pytest.mark.parametrize("exc, match, fn", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_input(exc, match, fn):
    with pytest.raises(exc, match=match):
        fn()


# ---------------------------------------------------------------- torch.library

def test_ops_pass_opcheck(rng):
    """Schemas, fake kernels and the declared mutation of y agree with what the ops do."""
    scheme = SCHEMES["fp8dqrow"]
    qw, sw = weight(rng, scheme)
    x = tensor(rng.standard_normal((2, 3, K)), "bfloat16")
    gate = tensor(rng.standard_normal((2, N)), "bfloat16")
    residual = tensor(rng.standard_normal((2, 3, N)), "bfloat16")
    bias = bias_of(rng, "f32", "bfloat16")
    torch.library.opcheck(torch.ops.cquant.linear_gated.default,
                          (x, qw, sw, bias, gate, residual, *scheme.c_args[:4], K, 0))
    full = torch.zeros(2, 3, 2 * N, dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.cquant.linear_out.default,
                          (x, qw, sw, bias, full[..., N:], *scheme.c_args[:4], K, GELU))
    xc, xs = torch_ops.quantize(x, scheme.c_args[2], scheme.c_args[3])
    torch.library.opcheck(torch.ops.cquant.linear_quantized_out.default,
                          (xc.view(2, 3, -1), xs, qw, sw, bias, full[..., :N], *scheme.c_args[:4], K, GELU))


def test_fullgraph_trace_of_side_by_side_layers(rng):
    """torch.compile (aot_eager: dynamo and AOTAutograd, no C++ compiler) of two layers writing
    column slices of one buffer and a gated layer reading it: one graph, the eager numbers."""
    scheme = SCHEMES["int8dq"]
    qa, sa = weight(rng, scheme)
    qb, sb = weight(rng, scheme)
    qo, so = weight(rng, scheme, n=N, k=2 * N)
    args = scheme.c_args[:4]

    def block(x, gate, residual):
        both = torch.empty((*x.shape[:-1], 2 * N), dtype=x.dtype)
        torch.ops.cquant.linear_out(x, qa, sa, None, both[..., :N], *args, K)
        torch.ops.cquant.linear_out(x, qb, sb, None, both[..., N:], *args, K, GELU)
        return torch.ops.cquant.linear_gated(both, qo, so, None, gate, residual, *args, 2 * N)

    x = tensor(rng.standard_normal((2, 5, K)), "float32")
    gate = tensor(rng.standard_normal((2, N)), "float32")
    residual = tensor(rng.standard_normal((2, 5, N)), "float32")
    torch._dynamo.reset()
    got = torch.compile(block, fullgraph=True, backend="aot_eager")(x, gate, residual)
    torch._dynamo.reset()
    assert torch.equal(got, block(x, gate, residual))


@pytest.mark.parametrize("scheme_name", ["int8wo", "int8dq", "fp8dqrow", "fp6_e3m2"])
def test_cuda_gated_bound_accepts_the_reference_and_rejects_a_wrong_gate(rng, scheme_name):
    """tolerances.cuda_gated_abs_bound (test_linear_gated_cuda.py, run on GPU machines) on CPU data:
    the C reference passes it on every path it may stand for; the gate of the wrong sample fails."""
    scheme = SCHEMES[scheme_name]
    m, g, dtype = 32, 2, "bfloat16"
    qw, sw = weight(rng, scheme)
    x = tensor(rng.standard_normal((m, K)), dtype)
    bias = bias_of(rng, "same", dtype)
    gate = tensor(rng.standard_normal((g, N)), dtype)
    residual = tensor(rng.standard_normal((m, N)), dtype)
    import test_linear_gated_cuda as cuda_tests

    for activation in (0, GELU):
        y64, bound = cuda_tests.bound_of(scheme, x, qw, sw, bias, gate, residual, activation)
        y = torch.ops.cquant.linear_gated(x, qw, sw, bias, gate, residual, *scheme.c_args[:4], K, activation)
        assert np.all(np.abs(values(y) - y64) <= bound)
        wrong = torch.ops.cquant.linear_gated(x, qw, sw, bias, gate.flip(0), residual, *scheme.c_args[:4], K, activation)
        assert np.any(np.abs(values(wrong) - y64) > bound)
