"""4-bit weights per group on CUDA (int4wo with int4 / uint4 weights, int4dq, fp8da_int4w): the
GEMV (M <= 16), the mixed-input GEMMs and the dispatch around them, against the C reference run on
CPU copies of the same tensors and against float64 of the same quantized math.

Every GPU output is NaN-poisoned first. Large M runs the GPU on all rows and the reference on a
few (rows of x are independent: per-row activation scales), including the rows around the GEMM's
64- and 128-row tile edges. Bounds: tolerances.py, "4-bit weights per group (CUDA)".
"""

import functools
import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from cquant import _C, ops  # noqa: E402

import tolerances as tol  # noqa: E402

HAS_CUDA = torch.cuda.is_available() and _C.built_with_cuda()
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU and a CUDA build")]

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# scheme -> (weight format, act format)
SCHEMES = {"int4wo": ("int4", None), "uint4wo": ("uint4", None), "int4dq": ("int4", "int8"),
           "fp8da_int4w": ("int4", "fp8_e4m3")}


def cc():
    major, minor = torch.cuda.get_device_capability()
    return 10 * major + minor


def needs(act_format):
    if act_format == "fp8_e4m3" and cc() < 89:
        pytest.skip("fp8 activations need sm_89+")


def dname(dtype):
    return str(dtype).split(".")[-1]


def model_kn():
    """Every distinct (K, N) of the linear shapes in benchmarks/shapes.json."""
    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "shapes.json")
    with open(path) as f:
        gemm = json.load(f)["gemm"]
    return sorted({(e["K"], e["N"]) for shapes in gemm.values() for e in shapes})


@functools.lru_cache(maxsize=4)
def weight(fmt, k, n, gs, seed=0):
    """CPU (q, s) of a random [n, k] weight with rows of different sizes and offsets (zero points
    away from 8 for uint4)."""
    g = torch.Generator().manual_seed(seed * 7919 + 31 * k + n + gs)
    w = torch.randn(n, k, generator=g) * (0.5 + torch.rand(n, 1, generator=g))
    w = (w + 0.7 * torch.randn(n, 1, generator=g)) / k**0.5
    return ops.quantize(w, fmt, group_size=gs)


def nibbles(q, k):
    return ops.unpack(q, 4, k).numpy().astype(np.int64)


@functools.lru_cache(maxsize=2)
def code_values(fmt, k, n, gs, seed=0):
    """int4: the signed codes; uint4: the codes (float64 [n, k])."""
    c = nibbles(weight(fmt, k, n, gs, seed)[0], k)
    return (c - 16 * (c >= 8) if fmt == "int4" else c).astype(np.float64)


@functools.lru_cache(maxsize=2)
def w_prime(fmt, k, n, gs, dtype_name, seed=0):
    """w' of the cached weight (w_prime_of)."""
    return w_prime_of(code_values(fmt, k, n, gs, seed), weight(fmt, k, n, gs, seed)[1], fmt, gs, dtype_name)


def w_prime_of(codes, s, fmt, gs, dtype_name):
    """w' of cquant.h as float64 [n, k] from code values and group scales: x' in fp32 (numpy
    float32 arithmetic rounds each step as the spec does), rounded to x's dtype by torch (round
    to nearest even, f16 overflow to inf)."""
    n, k = codes.shape
    c = codes.astype(np.float32)
    groups = k // gs
    s = s.numpy().reshape(n, groups, -1)
    scale = np.repeat(s[:, :, 0], gs, axis=1)
    if fmt == "uint4":
        x = (c - np.repeat(s[:, :, 1], gs, axis=1)) * scale
    else:
        x = c * scale
    assert x.dtype == np.float32
    return torch.from_numpy(x).to(DTYPES[dtype_name]).double().numpy()


def check_rows(m):
    """Rows of an M-row output held against the reference: all of small M, else the first and last
    ones, the middle and both sides of the 64- and 128-row tile edges."""
    if m <= 24:
        return np.arange(m)
    picked = set(range(8)) | set(range(m - 8, m)) | {m // 2, 63, 64, 127, 128}
    return np.array(sorted(r for r in picked if r < m))


def assert_within(got, want, bound, what):
    got = np.asarray(got, np.float64)
    err = np.abs(got - want)
    bad = ~(err <= bound)
    if bad.any():
        worst = np.unravel_index(np.argmax(np.where(bad, err - np.nan_to_num(bound), -np.inf)), err.shape)
        raise AssertionError(f"{what}: |diff| = {err[worst]:.3g} > bound {bound[worst]:.3g} at {worst} (got "
                             f"{got[worst]!r}, want {want[worst]!r}; {np.count_nonzero(bad)} of {err.size} over)")


def float64_value(x_rows, fmt, af, k, n, gs, bias, dtype_name):
    """(v64, terms, pre-rounding error bound of the CUDA kernels) of rows x_rows (CPU tensor) in
    float64: weight-only v = x w'^T + b, dynamic v = sum_g (a c)_g sw[n, g] sx + b."""
    b64 = np.zeros((1, n)) if bias is None else bias.double().numpy().reshape(1, -1)
    if af is None:
        wp = w_prime(fmt, k, n, gs, dtype_name)
        x64 = x_rows.double().numpy()
        v = x64 @ wp.T + b64
        terms = np.abs(x64) @ np.abs(wp).T + np.abs(b64)
        return v, terms, tol.int4_wo_pre_error(terms, dtype_name)
    qx, sx = ops.quantize(x_rows, af, "row")
    a = ops.format_values(af).astype(np.float64)[qx.view(torch.uint8).numpy().astype(np.int64)]
    sx = sx.double().numpy().reshape(-1, 1)
    c = code_values(fmt, k, n, gs)
    groups = k // gs
    sw = weight(fmt, k, n, gs)[1].double().numpy().reshape(n, groups)
    ag = a.reshape(-1, groups, gs).transpose(1, 0, 2)  # [G, m, gs]
    cg = c.reshape(n, groups, gs).transpose(1, 2, 0)  # [G, gs, n]
    acc = np.matmul(ag, cg)  # [G, m, n]: the group sums, exact in float64
    mag = np.matmul(np.abs(ag), np.abs(cg))
    v = (acc * sw.T[:, None, :]).sum(0) * sx + b64
    terms = (mag * np.abs(sw).T[:, None, :]).sum(0) * np.abs(sx) + np.abs(b64)
    return v, terms, tol.int4_dynamic_pre_error(terms, k, gs, af)


def run(x, q, s, fmt, af, k, gs, bias=None, activation=None, out=None, dtype=None):
    """ops.linear with 4-bit weights into a NaN-poisoned output (or `out`)."""
    if out is None:
        out = torch.full((x.shape[0], q.shape[0]), float("nan"), dtype=x.dtype, device=x.device)
    y = ops.linear(x, q, s, weight_format=fmt, act_format=af, bias=bias, in_features=k, activation=activation,
                   weight_group_size=gs, out=out)
    assert y is out
    return y


def check(y_gpu, x_rows, rows, fmt, af, k, n, gs, bias, activation, what):
    """GPU rows `rows` of y against the C reference of x_rows (CPU) and float64."""
    dt = dname(x_rows.dtype)
    y = y_gpu[torch.as_tensor(rows, device=y_gpu.device)].cpu() if len(rows) != y_gpu.shape[0] else y_gpu.cpu()
    assert not torch.isnan(y).any(), f"{what}: unwritten (NaN-poisoned) outputs"
    q, s = weight(fmt, k, n, gs)
    b_cpu = None if bias is None else bias.cpu()
    ref = ops.linear(x_rows, q, s, weight_format=fmt, act_format=af, bias=b_cpu, in_features=k,
                     activation=activation, weight_group_size=gs)
    pre, terms, pre_err = float64_value(x_rows, fmt, af, k, n, gs, b_cpu, dt)
    y64, ref64 = y.double().numpy(), ref.double().numpy()
    if activation == "gelu_tanh":
        act = tol.gelu_tanh(pre)
        bound = tol.gelu_of_error_bound(pre_err, pre, act, dt)
        assert_within(y64, act, bound, f"GPU vs float64, {what}")
        assert_within(ref64, act, bound, f"C reference vs float64, {what}")
        return
    assert_within(y64, pre, tol.rounded_bound(pre_err, pre, dt), f"GPU vs float64, {what}")
    if af is None:
        vs_ref = tol.int4_wo_abs_bound(terms, ref64, dt, against="reference")
    else:
        vs_ref = tol.int4_dynamic_abs_bound(terms, ref64, k, gs, af, dt, against="reference")
    assert_within(y64, ref64, vs_ref, f"GPU vs C reference, {what}")
    if af == "int8" and cc() != 90 and y_gpu.shape[0] > 256:
        # exact int32 group sums, added in group order with the reference's roundings (the
        # mma.sync kernel where it does not split K, which it never does past 256 rows)
        assert torch.equal(y, ref), f"{what}: int4dq differs from the C reference"


def make_x(m, k, dtype, seed, device="cuda"):
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(m, k, generator=g, device=device, dtype=torch.float32).to(dtype)


def case(scheme, m, k, n, gs, dtype, seed=1, bias_kind=None, activation=None):
    fmt, af = SCHEMES[scheme]
    needs(af)
    q, s = weight(fmt, k, n, gs)
    x = make_x(m, k, dtype, seed + m)
    bias = None
    if bias_kind is not None:
        g = torch.Generator().manual_seed(seed + 17)
        bias = torch.randn(n, generator=g).to(dtype if bias_kind == "same" else torch.float32).cuda()
    y = run(x, q.cuda(), s.cuda(), fmt, af, k, gs, bias, activation)
    torch.cuda.synchronize()
    rows = check_rows(m)
    x_rows = x[torch.as_tensor(rows, device="cuda")].cpu()
    check(y, x_rows, rows, fmt, af, k, n, gs, bias, activation,
          f"{scheme} {dname(dtype)} M={m} K={k} N={n} gs={gs} bias={bias_kind} act={activation}")


@pytest.fixture(params=["mixed", "decode"])
def large_m_path(request, cq_env):
    """The two ways of a weight-only layer past the GEMV (bf16 / f16 x), each taking every M > 16:
    the mixed-input GEMM, or w' dequantized into the workspace and cuBLASLt (CQUANT_GROUP4_DECODE_M;
    by default chosen by rows and shape, group4_decodes in kernels/linear.cu). Dynamic schemes have
    one way."""
    cq_env("CQUANT_GROUP4_DECODE_M", "1000000000" if request.param == "mixed" else "17")
    return request.param


def one_path_only(scheme, large_m_path):
    if large_m_path == "decode" and SCHEMES[scheme][1] is not None:
        pytest.skip("dynamic schemes run the mixed-input GEMM at every M > 16")


# ---------------------------------------------------------------- model shapes

MODEL_M = [1, 7, 16, 17, 64, 333, 4608]


@pytest.mark.parametrize("scheme", list(SCHEMES))
@pytest.mark.parametrize("kn", model_kn(), ids=lambda kn: f"K{kn[0]}xN{kn[1]}")
def test_model_shapes(kn, scheme, large_m_path):
    """Every (K, N) of shapes.json, M from the GEMV to the large GEMM tiles, on both large-M paths."""
    one_path_only(scheme, large_m_path)
    k, n = kn
    gs = 128 if k % 128 == 0 else 64 if k % 64 == 0 else 32
    dtype = torch.float16 if scheme == "uint4wo" else torch.bfloat16
    for m in MODEL_M:
        case(scheme, m, k, n, gs, dtype, bias_kind="same" if m % 2 else None)


# ---------------------------------------------------------------- group sizes, tails, dtypes

@pytest.mark.parametrize("gs", [32, 64, 128, 256])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("scheme", ["int4wo", "uint4wo"])
def test_weight_only_group_sizes_and_tails(scheme, dtype, gs, large_m_path):
    """Every M of the GEMV and past it, N with tails (1, 72, 1000), K of a few groups (K % 64 = 32
    at gs = 32: half a k-tile) and of many."""
    for k in sorted({3 * gs, 768}):
        for n in (1, 72, 1000):
            for m in list(range(1, 18)) + [100]:
                case(scheme, m, k, n, gs, DTYPES[dtype], seed=gs + n)


@pytest.mark.parametrize("gs", [32, 64, 128, 256])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("scheme", ["int4dq", "fp8da_int4w"])
def test_dynamic_group_sizes_and_tails(scheme, dtype, gs):
    """Groups ending inside a k-tile (gs 32, 64), at its end (128) and across tiles (256); K past
    the last whole k-tile (3 gs); y in every dtype."""
    for k in sorted({3 * gs, 768}):
        for n in (72, 1000):
            for m in (1, 7, 16, 17, 100):
                case(scheme, m, k, n, gs, DTYPES[dtype], seed=gs + n + 3)


@pytest.mark.parametrize("n", [1500, 1536])
@pytest.mark.parametrize("bias_kind", ["same", "f32"])
@pytest.mark.parametrize("scheme", ["int4wo", "uint4wo"])
def test_dequantized_rows_in_chunks(scheme, bias_kind, n, cq_env):
    """CQUANT_WO_CHUNK_MB=1: w' is dequantized 512 rows at a time (K = 1024), so the GEMMs write
    y's columns from 512 and 1024 on, with the bias from there: cuBLASLt's own epilogue for a bias
    of y's type where y's rows are 16-byte aligned (N = 1536), the fp32 epilogue for an f32 bias
    or unaligned rows (N = 1500, where cuBLASLt's bias epilogue measured far off). Every column is
    checked, not only the first chunk's."""
    cq_env("CQUANT_WO_CHUNK_MB", "1")
    cq_env("CQUANT_GROUP4_DECODE_M", "17")
    fmt, af = SCHEMES[scheme]
    m, k, gs = 40, 1024, 128
    q, s = weight(fmt, k, n, gs)
    x = make_x(m, k, torch.bfloat16, 31)
    g = torch.Generator().manual_seed(32)
    bias = torch.randn(n, generator=g).to(torch.bfloat16 if bias_kind == "same" else torch.float32).cuda()
    y = run(x, q.cuda(), s.cuda(), fmt, af, k, gs, bias, "gelu_tanh")
    torch.cuda.synchronize()
    rows = check_rows(m)
    check(y, x[torch.as_tensor(rows, device="cuda")].cpu(), rows, fmt, af, k, n, gs, bias, "gelu_tanh",
          f"{scheme} in 512-row chunks bias={bias_kind}")


# ---------------------------------------------------------------- epilogue

@pytest.mark.parametrize("activation", [None, "gelu_tanh"])
@pytest.mark.parametrize("bias_kind", [None, "same", "f32"])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_bias_and_gelu(scheme, dtype, bias_kind, activation, large_m_path):
    one_path_only(scheme, large_m_path)
    for m in (5, 200):
        case(scheme, m, 512, 200, 128, DTYPES[dtype], seed=7, bias_kind=bias_kind, activation=activation)


@pytest.mark.parametrize("activation", [None, "gelu_tanh"])
@pytest.mark.parametrize("scheme", list(SCHEMES))
@pytest.mark.parametrize("m", [4, 16, 96, 300])
def test_gated_residual(m, scheme, activation, large_m_path):
    """residual + gate[sample] * act(v), two samples, into a new output and in place."""
    one_path_only(scheme, large_m_path)
    fmt, af = SCHEMES[scheme]
    needs(af)
    k, n, gs, samples = 256, 136, 64, 2
    dtype = torch.bfloat16
    q, s = weight(fmt, k, n, gs)
    x = make_x(m, k, dtype, 11)
    g = torch.Generator().manual_seed(12)
    gate = torch.randn(samples, n, generator=g).to(dtype)
    residual = torch.randn(m, n, generator=g).to(dtype)
    bias = torch.randn(n, generator=g)
    pre, terms, pre_err = float64_value(x.cpu(), fmt, af, k, n, gs, bias, "bfloat16")
    v = tol.gelu_tanh(pre) if activation else pre
    v_err = tol.gelu_of_error_bound(pre_err, pre, v, "float32") if activation else pre_err
    gate64 = np.repeat(gate.double().numpy(), m // samples, axis=0)
    res64 = residual.double().numpy()
    want = res64 + gate64 * v
    bound = tol.gated_abs_bound(v_err, v, gate64, res64, want, "bfloat16")
    kwargs = dict(weight_format=fmt, act_format=af, bias=bias.cuda(), in_features=k, activation=activation,
                  weight_group_size=gs)
    y = ops.linear_gated(x, q.cuda(), s.cuda(), gate.cuda(), residual.cuda(), **kwargs)
    assert_within(y.cpu().double().numpy(), want, bound, f"{scheme} gated M={m}")
    res_dev = residual.cuda().clone()  # updated in place below
    ops.linear_gated(x, q.cuda(), s.cuda(), gate.cuda(), res_dev, out=res_dev, **kwargs)
    assert torch.equal(res_dev.cpu(), y.cpu()), "in-place residual differs from a separate output"
    ref = ops.linear_gated(x.cpu(), q, s, gate, residual, **dict(kwargs, bias=bias))
    assert_within(ref.double().numpy(), want, bound, f"{scheme} gated C reference M={m}")


@pytest.mark.parametrize("scheme", list(SCHEMES))
@pytest.mark.parametrize("m", [3, 16, 100])
def test_row_strided_output(m, scheme, large_m_path):
    """y a column slice of a wider tensor (rows further apart than N, odd offset): the columns
    outside it stay untouched."""
    one_path_only(scheme, large_m_path)
    fmt, af = SCHEMES[scheme]
    needs(af)
    k, n, gs = 256, 72, 32
    q, s = weight(fmt, k, n, gs)
    x = make_x(m, k, torch.float16, 13)
    wide = torch.full((m, n + 9), 7.0, dtype=torch.float16, device="cuda")
    y = run(x, q.cuda(), s.cuda(), fmt, af, k, gs, out=wide[:, 3:3 + n])
    torch.cuda.synchronize()
    assert (wide[:, :3] == 7).all() and (wide[:, 3 + n:] == 7).all()
    rows = np.arange(m)
    check(y, x.cpu(), rows, fmt, af, k, n, gs, None, None, f"{scheme} column slice M={m}")


@pytest.mark.parametrize("af", ["int8", "fp8_e4m3"])
def test_linear_quantized(af):
    """Activations quantized once (cq_linear_quantized) give what linear gives."""
    needs(af)
    m, k, n, gs = 50, 384, 96, 128
    q, s = weight("int4", k, n, gs)
    x = make_x(m, k, torch.bfloat16, 14)
    qx, sx = ops.quantize(x, af, "row")
    y = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    wf_id, af_id = ops.format_info("int4").id, ops.format_info(af).id
    gran = ops.granularity_id("group"), ops.granularity_id("row")
    nbytes = _C.linear_workspace_size(wf_id, gran[0], af_id, gran[1], k, m, n, True, weight_group_size=gs)
    ws = torch.empty(max(nbytes, 1), dtype=torch.uint8, device="cuda")
    _C.linear_quantized(qx, sx, q.cuda(), s.cuda(), None, y, wf_id, gran[0], af_id, gran[1], k, workspace=ws,
                        stream=torch.cuda.current_stream().cuda_stream, weight_group_size=gs)
    want = run(x, q.cuda(), s.cuda(), "int4", af, k, gs)
    torch.cuda.synchronize()
    assert torch.equal(y, want)


# ---------------------------------------------------------------- layouts, streams, devices

@pytest.mark.parametrize("scheme", list(SCHEMES))
@pytest.mark.parametrize("m", [5, 100])
def test_misaligned_operands(m, scheme):
    """x and w off their 16-byte boundaries: handled (element loads, or the decode path) or
    refused with NotImplementedError naming the operands, never a wrong result."""
    fmt, af = SCHEMES[scheme]
    needs(af)
    k, n, gs = 256, 40, 64
    q, s = weight(fmt, k, n, gs)
    x = make_x(m, k, torch.bfloat16, 15)
    xbuf = torch.empty(m * k + 1, dtype=torch.bfloat16, device="cuda")
    x_off = xbuf[1:].view(m, k)
    x_off.copy_(x)
    wbuf = torch.empty(q.numel() + 1, dtype=torch.uint8, device="cuda")
    w_off = wbuf[1:].view(q.shape)
    w_off.copy_(q.cuda())
    for xx, ww in ((x_off, q.cuda()), (x, w_off), (x_off, w_off)):
        try:
            y = run(xx, ww, s.cuda(), fmt, af, k, gs)
        except NotImplementedError as e:
            assert "16-byte" in str(e) or "aligned" in str(e), e
            continue
        torch.cuda.synchronize()
        check(y, x.cpu(), np.arange(m), fmt, af, k, n, gs, None, None, f"{scheme} misaligned M={m}")


def test_non_contiguous_x_is_refused():
    q, s = weight("int4", 256, 40, 64)
    x = make_x(256, 8, torch.bfloat16, 16).t()
    with pytest.raises((ValueError, BufferError)):
        ops.linear(x, q.cuda(), s.cuda(), weight_format="int4", in_features=256, weight_group_size=64)


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_side_stream(scheme, large_m_path):
    """Work is enqueued on the current stream: a side stream gives the default stream's result."""
    one_path_only(scheme, large_m_path)
    fmt, af = SCHEMES[scheme]
    needs(af)
    k, n, gs = 512, 264, 128
    q, s = weight(fmt, k, n, gs)
    qd, sd = q.cuda(), s.cuda()
    for m in (3, 300):
        x = make_x(m, k, torch.bfloat16, 17)
        want = run(x, qd, sd, fmt, af, k, gs)
        torch.cuda.synchronize()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            y = run(x, qd, sd, fmt, af, k, gs)
        side.synchronize()
        assert torch.equal(y, want), f"{scheme} M={m}: side stream differs"


@pytest.mark.skipif(not HAS_CUDA or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_second_device(scheme):
    fmt, af = SCHEMES[scheme]
    needs(af)
    k, n, gs = 512, 264, 128
    q, s = weight(fmt, k, n, gs)
    for m in (3, 300):
        x = make_x(m, k, torch.bfloat16, 18)
        want = run(x, q.cuda(0), s.cuda(0), fmt, af, k, gs).cpu()
        with torch.cuda.device(1):
            y = run(x.to("cuda:1"), q.to("cuda:1"), s.to("cuda:1"), fmt, af, k, gs)
            torch.cuda.synchronize()
        assert y.device.index == 1 and torch.equal(y.cpu(), want), f"{scheme} M={m}: cuda:1 differs"


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_nan_scale_poisons_its_column(scheme):
    """A NaN group scale makes its output column NaN (weight-only: its weights decode to NaN;
    dynamic: acc_g * NaN); the other columns stay finite."""
    fmt, af = SCHEMES[scheme]
    needs(af)
    k, n, gs = 256, 40, 64
    q, s = weight(fmt, k, n, gs)
    s = s.clone()
    s.view(n, k // gs, -1)[9, 2, 0] = float("nan")
    for m in (2, 100):
        x = make_x(m, k, torch.bfloat16, 19)
        y = run(x, q.cuda(), s.cuda(), fmt, af, k, gs).cpu()
        assert torch.isnan(y[:, 9]).all()
        assert torch.isfinite(torch.cat([y[:, :9], y[:, 10:]], 1)).all()


def exotic_scales(fmt, s, n, k, gs):
    """s with groups the GEMV's 16-bit decode cannot take exactly: every third row's scales below
    bf16's normals, and (uint4) zero points that are fractions or beyond 127."""
    s = s.clone().view(n, k // gs, -1)
    s[0::3, :, 0] *= 2.0**-120
    if fmt == "uint4":
        s[1::3, :, 1] += 0.37
        s[2::3, :, 1] = 3000.0
    return s.reshape(weight(fmt, k, n, gs)[1].shape)


@pytest.mark.parametrize("fmt", ["int4", "uint4"])
def test_gemv_exotic_scales_take_the_plain_decode(fmt):
    """Scales below bf16's normals and (uint4) zero points that are not small integers leave the
    GEMV's 16-bit decode for the fp32 one: same w' as the reference, with x near 2^100."""
    k, n, gs = 256, 48, 32
    q, s = weight(fmt, k, n, gs)
    s = exotic_scales(fmt, s, n, k, gs)
    codes = code_values(fmt, k, n, gs)
    for m in (1, 9):
        x = make_x(m, k, torch.float32, 20) * 2.0**100
        for dtype in (torch.bfloat16, torch.float32):
            dt = dname(dtype)
            xd = x.to(dtype)
            y = run(xd, q.cuda(), s.cuda(), fmt, None, k, gs).cpu()
            ref = ops.linear(xd.cpu(), q, s, weight_format=fmt, in_features=k, weight_group_size=gs)
            wp, x64 = w_prime_of(codes, s, fmt, gs, dt), xd.cpu().double().numpy()
            pre, terms = x64 @ wp.T, np.abs(x64) @ np.abs(wp).T
            what = f"{fmt} exotic scales M={m} {dt}"
            assert_within(y.double().numpy(), pre, tol.rounded_bound(tol.int4_wo_pre_error(terms, dt), pre, dt), what)
            assert_within(y.double().numpy(), ref.double().numpy(),
                          tol.int4_wo_abs_bound(terms, ref.double().numpy(), dt, against="reference"), what)


@pytest.mark.parametrize("fmt", ["int4", "uint4"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_gemv_wide_launch(fmt, dtype):
    """Layers of at least 8 CTAs of 16 rows an SM take the GEMV's wide launch (no step in flight in
    registers, more warps along K): N past that with a tail tile, M on both sides of 8, groups of
    one unit (32) and of four (128), then (bf16, whose range holds their w') exotic scales, which
    take the fp32 decode, on a third of the rows."""
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    k, n = 768, 128 * sms + 5
    scheme = "int4wo" if fmt == "int4" else "uint4wo"
    for gs in (32, 128):
        for m in (1, 2, 8, 9, 16):
            case(scheme, m, k, n, gs, DTYPES[dtype], seed=gs)
    if dtype != "bfloat16":
        return
    gs = 32
    q, s = weight(fmt, k, n, gs)
    s = exotic_scales(fmt, s, n, k, gs)
    wp = w_prime_of(code_values(fmt, k, n, gs), s, fmt, gs, dtype)
    for m in (1, 9):
        xd = make_x(m, k, DTYPES[dtype], 21).cpu()
        y = run(xd.cuda(), q.cuda(), s.cuda(), fmt, None, k, gs).cpu().double().numpy()
        x64 = xd.double().numpy()
        pre, terms = x64 @ wp.T, np.abs(x64) @ np.abs(wp).T
        assert_within(y, pre, tol.rounded_bound(tol.int4_wo_pre_error(terms, dtype), pre, dtype),
                      f"{fmt} {dtype} exotic scales, wide launch M={m}")


@pytest.mark.parametrize("fmt", ["int4", "uint4"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("scales", ["quantizer", "below_f16_normals", "exotic"])
def test_decodes_every_weight_exactly(fmt, dtype, scales, large_m_path):
    """With one-hot rows of x, y[m, n] = w'[n, k_m] exactly (one nonzero product, exact in fp32,
    and w' is already in y's dtype), so the decode of the GEMV (M <= 16) and of the mixed GEMM or
    the dequantized rows (M = 300) is held bit for bit to cquant.h's fp32 math at every nibble
    position of a unit: on the 16-bit path (the quantizer's scales, exact in bf16 and f16), and on
    the fp32 path (scales below f16's normals for f16 x, whose w' are f16 subnormals; exotic ones)."""
    k, n, gs = 512, 72, 64
    q, s = weight(fmt, k, n, gs)
    if scales == "below_f16_normals":  # half the rows: f16 x needs the fp32 path, bf16 x does not
        s = s.clone().view(n, k // gs, -1)
        s[0::2, :, 0] *= 2.0**-20
        s = s.reshape(weight(fmt, k, n, gs)[1].shape)
    elif scales == "exotic":
        s = exotic_scales(fmt, s, n, k, gs)
    wp = w_prime_of(code_values(fmt, k, n, gs), s, fmt, gs, dtype)
    for first in (0, 16, 37, 261):
        cols = (first + 17 * np.arange(16)) % k  # every nibble position of a 32-code unit
        for m in (1, 9, 16, 300):
            hot = cols[np.arange(m) % 16]
            x = torch.zeros(m, k, dtype=DTYPES[dtype])
            x[np.arange(m), hot] = 1.0
            y = run(x.cuda(), q.cuda(), s.cuda(), fmt, None, k, gs).cpu().double().numpy()
            want = wp[:, hot].T
            same = (y == want) | (np.isnan(y) & np.isnan(want))
            assert same.all(), (f"{fmt} {dtype} {scales} M={m}: w' differs at {np.argwhere(~same)[:4].tolist()} "
                                f"(got {y[~same][:4]}, want {want[~same][:4]})")


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_cuda_graph_capture_and_replay(scheme, large_m_path):
    """Nothing allocates or synchronizes (GEMV, GEMM, split-K scratch in the workspace): the layer
    captures into a CUDA graph and its replays equal eager calls."""
    one_path_only(scheme, large_m_path)
    fmt, af = SCHEMES[scheme]
    needs(af)
    k, n, gs = 1024, 520, 64
    q, s = weight(fmt, k, n, gs)
    qd, sd = q.cuda(), s.cuda()
    for m in (3, 40, 300):
        x = make_x(m, k, torch.bfloat16, 21)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the capture
            run(x, qd, sd, fmt, af, k, gs)
        torch.cuda.current_stream().wait_stream(side)
        y_static = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run(x, qd, sd, fmt, af, k, gs, out=y_static)
        for seed in (22, 23):
            x.copy_(make_x(m, k, torch.bfloat16, seed))
            y_static.fill_(float("nan"))
            graph.replay()
            want = run(x, qd, sd, fmt, af, k, gs)
            torch.cuda.synchronize()
            assert torch.equal(y_static, want), f"{scheme} M={m}: replayed graph differs from the eager call"
