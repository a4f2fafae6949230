"""Weight-only linear layers on CUDA with few rows of x (the GEMV path) and the CUDA
dequantize (the row decoder of the large-batch path), against the C reference on CPU
copies of the same tensors and against float64."""

import functools

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from cquant import ops  # noqa: E402
from tolerances import cuda_linear_abs_bound, gemv_wo_abs_bound  # noqa: E402

pytestmark = pytest.mark.cuda  # conftest.py skips these without a GPU and a CUDA build

SCHEMES = ["int8", "fp8_e4m3", "fp8_e5m2", "fp6_e3m2", "fp6_e2m3", "fp5_e2m2", "fp4_e2m1", "fp3_e1m1", "fp7_e3m3"]
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# (K, N, bias, weight granularity): odd and aligned K, N in {1, 7, 97, 4097}, both biases
SHAPES = [
    (97, 1, True, "row"),
    (97, 97, False, "tensor"),
    (1025, 7, True, "row"),
    (1025, 4097, False, "row"),
    (3072, 97, True, "tensor"),
    (3072, 4097, True, "row"),
    (256, 7, False, "row"),
]


@functools.lru_cache(maxsize=None)
def quantized_weight(fmt, k, n, granularity, seed=0):
    """CPU (q, scale) of a random [n, k] weight, and its exact float64 value decode(q) * scale."""
    g = torch.Generator().manual_seed(seed + 7919 * k + n)
    w = torch.randn(n, k, generator=g, dtype=torch.float32) * (1.0 + torch.rand(n, 1, generator=g))
    q, s = ops.quantize(w, fmt, granularity)
    return q, s, decoded(q, s, fmt, k)


def codes_of(q, fmt, k):
    f = ops.format_info(fmt)
    if f.packed:
        return ops.unpack(q, f.bits, k).numpy()
    return q.view(torch.uint8).numpy()


def decoded(q, s, fmt, k):
    """decode(q) (float32 holds every code exactly) and the scales as a float64 column."""
    dec = ops.format_values(fmt)[codes_of(q, fmt, k)]
    return dec, s.numpy().astype(np.float64).reshape(-1, 1)


def check_close(y, ref, y64, terms, dtype_name, what):
    """y, ref: float64 arrays of the CUDA and reference outputs; terms: sums of |addends|."""
    assert np.isfinite(y).all(), f"{what}: non-finite outputs (unwritten poison?)"
    for name, want, against in (("C reference", ref, "reference"), ("float64", y64, "float64")):
        excess = np.abs(y - want) - gemv_wo_abs_bound(terms, want, dtype_name, against)
        worst = np.unravel_index(excess.argmax(), y.shape)
        assert excess.max() <= 0, (f"{what}: vs {name}, worst excess {excess.max():.3g} at {worst} "
                                   f"(y {y[worst]!r}, {name} {want[worst]!r})")


def assert_near_reference(y, x, q, s, fmt, bias, k, what, columns=slice(None)):
    """The CUDA result y against the C reference of the same inputs and float64 (columns only)."""
    ref = ops.linear(x, q, s, weight_format=fmt, bias=bias, in_features=k)
    dec, s64 = decoded(q, s, fmt, k)
    x64, b64 = x.double().numpy(), np.zeros(q.shape[0]) if bias is None else bias.double().numpy()
    dec = dec.astype(np.float64)
    y64 = (x64 @ dec.T) * s64.T + b64
    terms = (np.abs(x64) @ np.abs(dec).T) * np.abs(s64.T) + np.abs(b64)
    dt = str(y.dtype).split(".")[-1]
    check_close(y.cpu().double().numpy()[:, columns], ref.double().numpy()[:, columns], y64[:, columns],
                terms[:, columns], dt, what)


def run_case(fmt, dtype_name, m, k, n, with_bias, granularity, seed=1):
    dt = DTYPES[dtype_name]
    q, s, (dec, s64) = quantized_weight(fmt, k, n, granularity)
    g = torch.Generator().manual_seed(seed + m)
    x = torch.randn(m, k, generator=g).to(dt)
    bias = (torch.randn(n, generator=g) * 0.5).to(dt) if with_bias else None
    ref = ops.linear(x, q, s, weight_format=fmt, bias=bias, in_features=k)

    out = torch.full((m, n), float("nan"), dtype=dt, device="cuda")
    y = ops.linear(x.cuda(), q.cuda(), s.cuda(), weight_format=fmt, bias=None if bias is None else bias.cuda(),
                   in_features=k, out=out)
    assert y.data_ptr() == out.data_ptr()
    torch.cuda.synchronize()

    x64 = x.double().numpy()
    b64 = bias.double().numpy() if with_bias else np.zeros(n)
    dec = dec.astype(np.float64)
    y64 = (x64 @ dec.T) * s64.T + b64
    bound = (np.abs(x64) @ np.abs(dec).T) * np.abs(s64.T) + np.abs(b64)
    check_close(y.cpu().double().numpy(), ref.double().numpy(), y64, bound, dtype_name,
                f"{fmt} {dtype_name} M={m} K={k} N={n} bias={with_bias} {granularity}")


@pytest.mark.parametrize("m", [1, 2, 7, 16])
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("fmt", SCHEMES)
def test_gemv_matches_reference(fmt, dtype_name, m):
    for k, n, with_bias, granularity in SHAPES:
        run_case(fmt, dtype_name, m, k, n, with_bias, granularity)


@pytest.mark.parametrize("dtype_name", ["float16", "float32"])
@pytest.mark.parametrize("fmt", ["fp7_e5m1", "fp6_e5m0", "fp7_e6m0"])
def test_gemv_formats_beyond_f16(fmt, dtype_name):
    """Formats whose values f16 cannot hold take the split-activation path for f16 x."""
    for m in (1, 9):
        run_case(fmt, dtype_name, m, 1025, 97, True, "row")
        run_case(fmt, dtype_name, m, 512, 33, False, "tensor")


@pytest.mark.parametrize("fmt", ["int8", "fp6_e3m2", "fp4_e2m1"])
def test_gemv_f32_bias_with_16bit_x(fmt):
    k, n, m = 1024, 97, 3
    q, s, _ = quantized_weight(fmt, k, n, "row")
    x = torch.randn(m, k).to(torch.bfloat16)
    b = torch.randn(n)
    y = ops.linear(x.cuda(), q.cuda(), s.cuda(), weight_format=fmt, bias=b.cuda(), in_features=k)
    assert_near_reference(y, x, q, s, fmt, b, k, f"{fmt} f32 bias")


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3", "fp6_e3m2", "fp4_e2m1", "fp5_e2m2"])
def test_gemv_unaligned_operands(fmt):
    """Weight and x views that start off their natural 16-byte boundary take the element paths."""
    k, n, m = 1024, 97, 5
    q, s, _ = quantized_weight(fmt, k, n, "row")
    qb = q.view(torch.uint8)
    wbuf = torch.empty(qb.numel() + 1, dtype=torch.uint8, device="cuda")
    w_off = wbuf[1:].view(qb.shape)
    w_off.copy_(qb.cuda())
    if q.dtype != torch.uint8 and q.dtype != torch.int8:
        w_off = w_off.view(q.dtype)
    elif q.dtype == torch.int8:
        w_off = w_off.view(torch.int8)
    x = torch.randn(m, k).to(torch.bfloat16)
    xbuf = torch.empty(m * k + 1, dtype=torch.bfloat16, device="cuda")
    x_off = xbuf[1:].view(m, k)
    x_off.copy_(x.cuda())
    assert w_off.data_ptr() % 16 and x_off.data_ptr() % 8
    y = ops.linear(x_off, w_off, s.cuda(), weight_format=fmt, in_features=k)
    assert_near_reference(y, x, q, s, fmt, None, k, f"{fmt} unaligned")


@pytest.mark.parametrize("k", [256, 40])  # warps of a tile meet in shared memory; one warp a tile
def test_gemv_nan_propagates(k):
    """A NaN scale makes its output column NaN; an e4m3 NaN code poisons its column."""
    n, m = 33, 2
    q, s, _ = quantized_weight("fp8_e4m3", k, n, "row")
    q, s = q.clone(), s.clone()
    s[3] = float("nan")
    q.view(torch.uint8)[10, 7] = 0x7F
    x = torch.randn(m, k).to(torch.bfloat16)
    ref = ops.linear(x, q, s, weight_format="fp8_e4m3", in_features=k)
    y = ops.linear(x.cuda(), q.cuda(), s.cuda(), weight_format="fp8_e4m3", in_features=k).cpu()
    for col in (3, 10):
        assert torch.isnan(ref[:, col]).all() and torch.isnan(y[:, col]).all()
    finite = [c for c in range(n) if c not in (3, 10)]
    assert_near_reference(y, x, q, s, "fp8_e4m3", None, k, "finite columns", columns=finite)


def test_gemv_cuda_graph_replay():
    """The GEMV enqueues on the current stream without allocating: it captures and replays."""
    fmt, k, n, m = "fp6_e3m2", 3072, 4097, 2
    q, s, _ = quantized_weight(fmt, k, n, "row")
    qd, sd = q.cuda(), s.cuda()
    bias = torch.randn(n).to(torch.bfloat16)
    bd = bias.cuda()
    x_static = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    y_static = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up off the capture
        ops.linear(x_static, qd, sd, weight_format=fmt, bias=bd, in_features=k, out=y_static)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.linear(x_static, qd, sd, weight_format=fmt, bias=bd, in_features=k, out=y_static)
    for seed in range(3):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
        x_static.copy_(x)
        y_static.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_near_reference(y_static, x, q, s, fmt, bias, k, f"graph replay {seed}")


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3", "fp6_e3m2", "fp4_e2m1", "fp5_e2m2", "fp7_e3m3"])
def test_gemv_many_row_tiles(fmt, cq_env):
    """N = 16 * 3 * 132 + 5: on an H100 every CTA of the persistent kernel walks three or more row
    tiles (both partial-sum buffers reused, loads running ahead across tiles), K from one quad
    (one warp a tile) to many (16 warps a tile). CQUANT_GEMV_PERSISTENT=1 takes the persistent
    kernel for shapes and formats the default choice leaves to the per-tile one."""
    cq_env("CQUANT_GEMV_PERSISTENT", "1")
    for k in (97, 1025, 3072):
        for m in (1, 9):
            run_case(fmt, "bfloat16", m, k, 6341, m == 1, "row")


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3", "fp6_e3m2", "fp4_e2m1", "fp3_e1m1"])
def test_gemv_per_tile_kernel(fmt, cq_env):
    """CQUANT_GEMV_PERSISTENT=0 selects the per-tile kernel, the path of GPUs other than sm_90."""
    cq_env("CQUANT_GEMV_PERSISTENT", "0")
    for k, n, with_bias, granularity in SHAPES:
        for m in (1, 9):
            run_case(fmt, "bfloat16", m, k, n, with_bias, granularity)


# ---------------------------------------------------------------- dequantize (row decoder)

DEQUANT_SHAPES = [(1, 1), (7, 97), (97, 1025), (33, 4096), (5, 3072)]


def bits16(t):
    return t.view(torch.int16).cpu().numpy()


@pytest.mark.parametrize("granularity", ["row", "tensor"])
@pytest.mark.parametrize("out_dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("fmt", SCHEMES + ["fp7_e5m1", "fp4_e1m2"])
def test_dequantize_bit_exact(fmt, out_dtype, granularity):
    dt = DTYPES[out_dtype]
    for rows, cols in DEQUANT_SHAPES:
        q, s, _ = quantized_weight(fmt, cols, rows, granularity, seed=3)
        ref = ops.dequantize(q, s, fmt, cols=cols, dtype=out_dtype, granularity=granularity)
        out = torch.full((rows, cols), float("nan"), dtype=dt, device="cuda")
        y = ops.dequantize(q.cuda(), s.cuda(), fmt, cols=cols, granularity=granularity, out=out)
        np.testing.assert_array_equal(bits16(y), bits16(ref), err_msg=f"{fmt} {out_dtype} {rows}x{cols}")


@pytest.mark.parametrize("out_dtype", ["float16", "bfloat16"])
def test_dequantize_specials_bit_exact(out_dtype):
    """NaN scales and codes, values that overflow f16, and unaligned buffers match bit for bit."""
    rows, cols = 9, 200
    q, s, _ = quantized_weight("fp8_e4m3", cols, rows, "row", seed=5)
    q, s = q.clone(), s.clone()
    s[2] = float("nan")
    s[4] = 1e6  # 448 * 1e6 overflows f16 to inf
    q.view(torch.uint8)[6, 11] = 0x7F
    q.view(torch.uint8)[6, 12] = 0xFF
    ref = ops.dequantize(q, s, "fp8_e4m3", dtype=out_dtype)
    qbuf = torch.empty(q.numel() + 1, dtype=torch.uint8, device="cuda")
    q_off = qbuf[1:].view(rows, cols)
    q_off.copy_(q.view(torch.uint8).cuda())
    obuf = torch.full((rows * cols + 1,), float("nan"), dtype=DTYPES[out_dtype], device="cuda")
    out = obuf[1:].view(rows, cols)
    y = ops.dequantize(q_off.view(torch.float8_e4m3fn), s.cuda(), "fp8_e4m3", out=out)
    np.testing.assert_array_equal(bits16(y), bits16(ref))
    assert torch.isnan(y[2]).all().item() and torch.isnan(y[6, 11:13]).all().item()
    if out_dtype == "float16":
        assert torch.isinf(y[4]).any().item()


# ---------------------------------------------------------------- every code, exactly

# Formats with one scale per row (or tensor); the 4-bit group formats have their own tests
# (test_linear_int4_cuda.py, test_int4.py).
ALL_FORMATS = [name for name, f in ops.FORMATS.items() if not f.grouped]


def stored_codes(fmt, codes):
    """CPU tensor of the stored form of uint8 codes [rows, cols] (int8, float8 or packed uint8)."""
    f = ops.format_info(fmt)
    c = torch.from_numpy(np.ascontiguousarray(codes, dtype=np.uint8))
    if f.packed:
        return ops.pack(c, f.bits)
    if f.name == "int8":
        return c.view(torch.int8)
    return c.view(torch.float8_e4m3fn if f.name == "fp8_e4m3" else torch.float8_e5m2)


def code_grid(fmt, cols):
    """One row per code value; row r holds code (r + 3j) mod 2^bits at column j, so every code
    sits at every column (every position of a unit and of an octet)."""
    n = 1 << ops.format_info(fmt).bits
    return (np.arange(n)[:, None] + 3 * np.arange(cols)[None, :]) % n


def row_scales(rng, rows):
    return torch.from_numpy((rng.uniform(0.5, 2.0, rows) * 2.0 ** rng.integers(-6, 7, rows)).astype(np.float32))


@pytest.mark.parametrize("cols", [520, 517])  # 16-byte stores; element stores with a tail
@pytest.mark.parametrize("out_dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_dequantize_every_code_bit_exact(fmt, out_dtype, cols, rng):
    """Every code of every format at every column, NaN and inf codes included, decodes to the
    reference's bits (decode(code) * scale in f32, rounded once)."""
    codes = code_grid(fmt, cols)
    q, s = stored_codes(fmt, codes), row_scales(rng, codes.shape[0])
    ref = ops.dequantize(q, s, fmt, cols=cols, dtype=out_dtype, granularity="row")
    out = torch.full(codes.shape, float("nan"), dtype=DTYPES[out_dtype], device="cuda")
    y = ops.dequantize(q.cuda(), s.cuda(), fmt, cols=cols, granularity="row", out=out)
    np.testing.assert_array_equal(bits16(y), bits16(ref), err_msg=f"{fmt} {out_dtype} cols={cols}")


@pytest.mark.parametrize("fmt", ["fp8_e5m2", "fp8_e4m3"])
def test_dequantize_specials_with_zero_and_inf_scales(fmt):
    """inf * 0 and 0 * inf are NaN with the reference's bits; the other rows stay exact."""
    codes = code_grid(fmt, 64)
    s = torch.ones(codes.shape[0])
    s[::3] = 0.0
    s[1::7] = float("inf")
    q = stored_codes(fmt, codes)
    for out_dtype in ("float16", "bfloat16"):
        ref = ops.dequantize(q, s, fmt, dtype=out_dtype, granularity="row")
        y = ops.dequantize(q.cuda(), s.cuda(), fmt, dtype=out_dtype, granularity="row")
        np.testing.assert_array_equal(bits16(y), bits16(ref), err_msg=f"{fmt} {out_dtype}")


def finite_codes(fmt, codes):
    """codes with the fp8 NaN/inf codes replaced by 0 (one of them anywhere in a row makes the
    whole row NaN: 0 * NaN, 0 * inf)."""
    if fmt == "fp8_e4m3":
        return np.where((codes & 0x7F) == 0x7F, 0, codes)
    if fmt == "fp8_e5m2":
        return np.where((codes & 0x7C) == 0x7C, 0, codes)
    return codes


def one_hot_gemv(fmt, dtype_name, k, m, rng, x_offset=0):
    """x rows are one-hot at consecutive columns, so y[i, n] = decode(w[n, col_i]) * s[n] exactly
    on both sides (the other products are +-0): every finite code at every column is checked bit
    for bit, through the GEMV's decode."""
    dt = DTYPES[dtype_name]
    codes = finite_codes(fmt, code_grid(fmt, k))
    n = codes.shape[0]
    q, s = stored_codes(fmt, codes), row_scales(rng, n)
    qd, sd = q.cuda(), s.cuda()
    xbuf = torch.zeros(m * k + x_offset, dtype=dt, device="cuda")
    xd = xbuf[x_offset:].view(m, k)
    for first in range(0, k, m):
        x = torch.zeros(m, k, dtype=dt)
        for i in range(m):
            if first + i < k:
                x[i, first + i] = 1.0
        xd.copy_(x.cuda())
        ref = ops.linear(x, q, s, weight_format=fmt, in_features=k)
        out = torch.full((m, n), float("nan"), dtype=dt, device="cuda")
        y = ops.linear(xd, qd, sd, weight_format=fmt, in_features=k, out=out)
        np.testing.assert_array_equal(y.cpu().float().numpy(), ref.float().numpy(),
                                      err_msg=f"{fmt} {dtype_name} K={k} columns {first}..{first + m - 1}")


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_gemv_every_code_every_column(fmt, dtype_name, rng):
    """16 x rows (two mma column tiles), K = 512: the aligned 16-byte x path."""
    one_hot_gemv(fmt, dtype_name, 512, 16, rng)


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3", "fp8_e5m2", "fp6_e3m2", "fp4_e2m1", "fp5_e2m2", "fp3_e1m1",
                                 "fp7_e3m3"])
def test_gemv_every_code_eight_rows_and_tails(fmt, rng):
    """8 x rows (one column tile) on the aligned path; then K = 549 with x starting off its
    16-byte boundary: the element-wise x path and the last, partial units."""
    one_hot_gemv(fmt, "bfloat16", 512, 8, rng)
    one_hot_gemv(fmt, "float16", 549, 5, rng, x_offset=1)


def test_gemv_e5m2_infinities():
    """e5m2 inf codes reach the mma as infinities: the same inf/NaN pattern as the reference."""
    k, n, m = 256, 33, 3
    codes = finite_codes("fp8_e5m2", code_grid("fp8_e5m2", k))[:n].copy()
    codes[4, 17] = 0x7C  # +inf
    codes[9, 100] = 0xFC  # -inf
    codes[9, 101] = 0x7C  # +inf: inf - inf = NaN
    q, s = stored_codes("fp8_e5m2", codes), torch.rand(n) + 0.5
    x = torch.rand(m, k).to(torch.bfloat16) + 0.25  # positive: no 0 * inf
    ref = ops.linear(x, q, s, weight_format="fp8_e5m2", in_features=k).float()
    y = ops.linear(x.cuda(), q.cuda(), s.cuda(), weight_format="fp8_e5m2", in_features=k).cpu().float()
    assert torch.isposinf(ref[:, 4]).all() and torch.isnan(ref[:, 9]).all()
    torch.testing.assert_close(y, ref, rtol=2.0**-7, atol=1e-3, equal_nan=True)


# ---------------------------------------------------------------- more than 16 rows: the math of cquant.h

import reference as ref  # noqa: E402
from tolerances import gelu_abs_bound, linear_abs_bound  # noqa: E402


def gelu_tanh64(v):
    return 0.5 * v * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (v + 0.044715 * v**3)))


def check_against_float64(x, q, s, fmt, bias, y, activation, what):
    """|y - float64 of the same codes| within the elementwise fp32 rounding bound of tolerances.py."""
    k = x.shape[-1]
    f = ref.fmt(fmt)
    codes = ref.codes_of_stored(f, q.view(torch.uint8).cpu().numpy(), k)
    b32 = None if bias is None else bias.float().cpu().numpy()
    pre64, terms = ref.linear(x.float().cpu().numpy(), codes, s.cpu().numpy(), f, "row" if s.numel() > 1 else "tensor",
                              None, "row", b32)
    got = y.float().cpu().numpy().astype(np.float64)
    dtype = str(y.dtype).replace("torch.", "")
    if activation:
        want = gelu_tanh64(pre64)
        bound = gelu_abs_bound(k, terms, pre64, want, dtype)
    else:
        want, bound = pre64, linear_abs_bound(k, terms, pre64, dtype)
    err = np.abs(got - want)
    worst = np.unravel_index(np.argmax(err - bound), err.shape)
    assert np.all(err <= bound), (f"{what}: |y - y64| = {err[worst]:.3g} > {bound[worst]:.3g} at {worst} "
                                  f"(y {got[worst]!r}, y64 {want[worst]!r})")


@pytest.mark.parametrize("activation", [None, "gelu_tanh"])
@pytest.mark.parametrize("bias_kind", [None, "same", "f32"])
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_linear_matches_float64(fmt, dtype_name, bias_kind, activation):
    """Both paths, every format, dtype, bias kind and activation: y is the float64 math of
    cquant.h within the fp32 rounding bound. M > 16 (cuBLASLt): decoded codes stay exact (f16
    ones after a power of two, f32 for fp7_e6m0 with f16 x), the scale and the bias enter in
    fp32, GELU before the one rounding; before, decode(q) * scale and an f32 bias were rounded to
    x's dtype. M <= 16 (the GEMV): GELU in the kernel's fp32 epilogue, not on the rounded y."""
    dt = DTYPES[dtype_name]
    for m, k, n, gran in ((5, 160, 72, "row"), (16, 97, 33, "tensor"), (17, 160, 72, "row"), (100, 97, 33, "tensor"),
                          (33, 1024, 200, "row")):
        q, s, _ = quantized_weight(fmt, k, n, gran)
        g = torch.Generator().manual_seed(m + k)
        x = torch.randn(m, k, generator=g).to(dt)
        bias = None if bias_kind is None else (torch.randn(n, generator=g) * 0.5).to(dt if bias_kind == "same" else torch.float32)
        out = torch.full((m, n), float("nan"), dtype=dt, device="cuda")
        y = ops.linear(x.cuda(), q.cuda(), s.cuda(), weight_format=fmt, bias=None if bias is None else bias.cuda(),
                       in_features=k, out=out, activation=activation)
        torch.cuda.synchronize()
        check_against_float64(x, q, s, fmt, bias, y, activation, f"{fmt} {dtype_name} M={m} bias={bias_kind} {activation}")


@pytest.mark.parametrize("dtype_name", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3", "fp6_e3m2", "fp4_e2m1", "fp7_e5m1"])
def test_sixteen_rows_alone_and_in_a_batch_of_seventeen_agree(fmt, dtype_name):
    """The same 16 rows through the GEMV (M = 16) and through the GEMM path (M = 17) compute the same
    fp32 math (cquant.h) and differ only by fp32 summation order: each is within its own path's
    elementwise bound of the float64 value, and with 16-bit outputs all but a few outputs are
    bit-identical (one ulp apart where the fp32 sums straddle a rounding boundary). Rounding
    decode(q) * scale to bf16 before the GEMM changed ~45% of them."""
    dt = DTYPES[dtype_name]
    k, n = 1024, 512
    q, s, (dec, s64) = quantized_weight(fmt, k, n, "row")
    g = torch.Generator().manual_seed(16)
    x17 = torch.randn(17, k, generator=g).to(dt)
    bias = (torch.randn(n, generator=g) * 0.5).to(dt)
    args = dict(weight_format=fmt, bias=bias.cuda(), in_features=k)
    y16 = ops.linear(x17[:16].cuda(), q.cuda(), s.cuda(), **args).cpu().double().numpy()
    y17 = ops.linear(x17.cuda(), q.cuda(), s.cuda(), **args)[:16].cpu().double().numpy()
    x64, b64 = x17[:16].double().numpy(), bias.double().numpy()
    y64 = (x64 @ dec.astype(np.float64).T) * s64.T + b64
    b_abs = np.abs(b64).reshape(1, -1)
    terms = (np.abs(x64) @ np.abs(dec.astype(np.float64)).T) * np.abs(s64.T) + b_abs
    gemv = gemv_wo_abs_bound(terms, y64, dtype_name)
    gemm = cuda_linear_abs_bound("wo_gemm", k, terms, b_abs, y64, dtype_name, dtype_name)
    assert np.all(np.abs(y16 - y64) <= gemv), f"{fmt} {dtype_name}: the GEMV (M = 16) is off the float64 value"
    assert np.all(np.abs(y17 - y64) <= gemm), f"{fmt} {dtype_name}: the GEMM (M = 17) is off the float64 value"
    if dtype_name != "float32":  # fp32 outputs show the summation order in their last bits
        differing = np.mean(y17 != y16)
        assert differing <= 0.1, f"{fmt} {dtype_name}: {differing:.1%} of the outputs differ"


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3", "fp6_e2m3"])
def test_fp16_cancellation_at_64_rows(fmt):
    """tests/test_nn.py's fp16 input whose terms cancel pairwise (x = 60000, weights +-4): the exact
    result fits fp16, and 64 rows (the GEMM path) must stay as close as the GEMV does. Rounding
    decode(q) * scale to fp16 first gave errors of 713 (11.9 for the GEMV)."""
    k, n = 256, 32
    g = torch.Generator().manual_seed(0)
    sign = torch.tensor([1.0, -1.0]).repeat(k // 2)
    w = 4.0 * sign * (1 + 0.01 * torch.rand(n, k, generator=g))
    q, s = ops.quantize(w.half().float(), fmt, "row")
    f = ops.format_info(fmt)
    codes = ops.unpack(q, f.bits, k) if f.packed else q.view(torch.uint8)
    w64 = ops.format_values(fmt).astype(np.float64)[codes.numpy().astype(np.int64)] * s.double().numpy()[:, None]
    for m in (4, 64):
        x = (60000.0 * torch.ones(m, k)).half()
        y = ops.linear(x.cuda(), q.cuda(), s.cuda(), weight_format=fmt, in_features=k).cpu().double().numpy()
        ref64 = x.double().numpy() @ w64.T
        assert np.abs(ref64).max() < 6e4 and np.isfinite(y).all()
        err = np.abs(y - ref64).max()
        assert err <= 2e-3 * np.abs(ref64).max() + 1.0, f"{fmt} M={m}: error {err:.3g}"


def test_many_rows_in_chunks(cq_env):
    """CQUANT_WO_CHUNK_MB=1: the weight is decoded 512 rows at a time (K = 1024) and M is split
    into GEMMs of 256 rows; every chunk's columns and rows land where they belong."""
    cq_env("CQUANT_WO_CHUNK_MB", "1")
    for fmt, dtype_name in (("fp6_e3m2", "bfloat16"), ("int8", "float16"), ("fp7_e6m0", "float16"),
                            ("fp4_e2m1", "float32")):
        dt = DTYPES[dtype_name]
        m, k, n = 600, 1024, 1500
        q, s, _ = quantized_weight(fmt, k, n, "row")
        g = torch.Generator().manual_seed(3)
        x = torch.randn(m, k, generator=g).to(dt)
        bias = torch.randn(n, generator=g)
        y = ops.linear(x.cuda(), q.cuda(), s.cuda(), weight_format=fmt, bias=bias.cuda(), in_features=k,
                       activation="gelu_tanh")
        torch.cuda.synchronize()
        check_against_float64(x, q, s, fmt, bias, y, "gelu_tanh", f"{fmt} {dtype_name} in chunks")
