"""The CUDA quantized linear layer against the C reference and float64.

Every scheme runs on random data with odd sizes and tails (M in 1, 7, 97, 4608; K and N that
are not multiples of 16 where the scheme takes them), bf16 and fp16, with and without bias
(in x's dtype or float32). Outputs are filled with NaN before each run. The float64 reference
applies the quantized math of cquant.h to the codes the CPU produced, so the only differences
are roundings, bounded per element by what each kernel path rounds (tests/tolerances.py,
cuda_linear_abs_bound / cuda_gelu_abs_bound). int8dq is bit-identical to the C reference.
"""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from cquant import _C, ops  # noqa: E402

import tolerances as tol  # noqa: E402

HAS_CUDA = torch.cuda.is_available() and _C.built_with_cuda()
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU and a CUDA build")]


def cc():
    major, minor = torch.cuda.get_device_capability()
    return 10 * major + minor


# scheme name -> (weight format, weight granularity, act format, act granularity)
SCHEMES = {
    "int8wo": ("int8", "row", None, "row"),
    "int8dq": ("int8", "row", "int8", "row"),
    "fp8dqrow": ("fp8_e4m3", "row", "fp8_e4m3", "row"),
    "fp8dq_tensor": ("fp8_e4m3", "tensor", "fp8_e4m3", "tensor"),
    "fp8wo": ("fp8_e4m3", "row", None, "row"),
    "fp6_e3m2": ("fp6_e3m2", "row", None, "row"),
    "fp5_e2m2": ("fp5_e2m2", "row", None, "row"),
    "fp4_e2m1": ("fp4_e2m1", "row", None, "row"),
}
# granularity and format mixes the named schemes do not cover
MIXES = {
    "int8dq_act_tensor": ("int8", "row", "int8", "tensor"),
    "int8dq_w_tensor": ("int8", "tensor", "int8", "row"),
    "fp8_act_row_w_tensor": ("fp8_e4m3", "tensor", "fp8_e4m3", "row"),
    "fp8_act_tensor_w_row": ("fp8_e4m3", "row", "fp8_e4m3", "tensor"),
    "fp8_w_e5m2": ("fp8_e5m2", "row", "fp8_e4m3", "row"),
    "fp8wo_e5m2": ("fp8_e5m2", "row", None, "row"),
    "int8wo_tensor": ("int8", "tensor", None, "row"),
}

SHAPES = [  # (M, K, N)
    (1, 64, 48),
    (7, 80, 136),
    (97, 320, 272),
    (97, 100, 75),  # K and N not multiples of 16
    (33, 1280, 130),  # more K tiles than pipeline stages
    (4608, 256, 384),
]


def needs(act_format):
    if act_format and act_format.startswith("fp8") and cc() < 89:
        pytest.skip("fp8 activations need sm_89+")
    if act_format == "int8" and cc() < 80:
        pytest.skip("int8 activations need sm_80+")


def codes_u8(q):
    return q.view(torch.uint8) if q.dtype != torch.uint8 else q


def quantize_weight(w32, fmt, gran):
    """CPU codes and scales of a float32 weight [N, K]."""
    return ops.quantize(w32, fmt, gran)


def float64_reference(x, qw, sw, bias, wf, af, ag, k):
    """(y, terms, |b|): y = (a @ decode(qw)^T) * sx * sw + b in float64, with a = x or
    decode(quantize(x)), and the sums of |addends| that bound its rounding errors."""
    wfi = ops.format_info(wf)
    wcodes = ops.unpack(qw, wfi.bits, k) if wfi.packed else codes_u8(qw)
    w64 = ops.format_values(wf).astype(np.float64)[wcodes.numpy().astype(np.int64)]
    if af is None:
        a64 = x.double().numpy()
        sx = np.ones((x.shape[0], 1))
    else:
        qx, s = ops.quantize(x, af, ag)
        a64 = ops.format_values(af).astype(np.float64)[codes_u8(qx).numpy().astype(np.int64)]
        sx = s.double().numpy().reshape(-1, 1)
        if sx.shape[0] == 1:
            sx = np.broadcast_to(sx, (x.shape[0], 1))
    sw64 = sw.double().numpy().reshape(1, -1)
    y = (a64 @ w64.T) * sx * sw64
    terms = (np.abs(a64) @ np.abs(w64).T) * np.abs(sx) * np.abs(sw64)
    b_abs = np.zeros((1, w64.shape[0]))
    if bias is not None:
        b64 = bias.double().numpy().reshape(1, -1)
        y, b_abs = y + b64, np.abs(b64)
        terms = terms + b_abs
    return y, terms, b_abs


def assert_within(got, want, bound, what):
    got = got.double().cpu().numpy()
    err = np.abs(got - want)
    worst = np.unravel_index(np.argmax(err - bound), err.shape)
    assert np.all(err <= bound), (f"{what}: |y - y64| = {err[worst]:.3g} > bound {bound[worst]:.3g} at {worst} "
                                  f"(y {got[worst]!r}, y64 {want[worst]!r}; {np.count_nonzero(err > bound)} of "
                                  f"{err.size} over)")


def make_case(m, k, n, dtype, bias_kind, wf, wg, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g) / k**0.5
    qw, sw = quantize_weight(w, wf, wg)
    bias = None
    if bias_kind == "same":
        bias = torch.randn(n, generator=g).to(dtype)
    elif bias_kind == "f32":
        bias = torch.randn(n, generator=g)
    return x, qw, sw, bias


def run_linear(x, qw, sw, bias, wf, wg, af, ag, k, activation=None):
    """ops.linear into a NaN-poisoned output."""
    out = torch.full((x.shape[0], qw.shape[0]), float("nan"), dtype=x.dtype, device=x.device)
    y = ops.linear(x, qw, sw, weight_format=wf, weight_granularity=wg, act_format=af, act_granularity=ag,
                   bias=bias, in_features=k, out=out, activation=activation)
    assert y is out
    return y


def check_scheme(spec, m, k, n, dtype, bias_kind, seed=0, activation=None):
    wf, wg, af, ag = spec
    needs(af)
    x, qw, sw, bias = make_case(m, k, n, dtype, bias_kind, wf, wg, seed)
    dev = "cuda"
    y_gpu = run_linear(x.to(dev), qw.to(dev), sw.to(dev), None if bias is None else bias.to(dev), wf, wg, af, ag, k,
                       activation)
    torch.cuda.synchronize()
    y_gpu = y_gpu.cpu()
    assert not torch.isnan(y_gpu).any(), "output rows or columns were left unwritten (NaN poison)"
    y_cpu = run_linear(x, qw, sw, bias, wf, wg, af, ag, k, activation)
    pre, terms, b_abs = float64_reference(x, qw, sw, bias, wf, af, ag, k)
    dt = str(dtype).split(".")[-1]
    path = tol.cuda_linear_path(af, m)
    what = f"{wf}/{wg} x {af}/{ag} {dt} {m}x{k}x{n} bias={bias_kind} activation={activation} ({path} path)"
    if activation == "gelu_tanh":
        ref = tol.gelu_tanh(pre)
        assert_within(y_cpu, ref, tol.gelu_abs_bound(k, terms, pre, ref, dt), f"C reference, {what}")
        assert_within(y_gpu, ref, tol.cuda_gelu_abs_bound(path, k, terms, b_abs, pre, ref, dt, dt), f"GPU, {what}")
    else:
        assert_within(y_cpu, pre, tol.linear_abs_bound(k, terms, pre, dt), f"C reference, {what}")
        assert_within(y_gpu, pre, tol.cuda_linear_abs_bound(path, k, terms, b_abs, pre, dt, dt), f"GPU, {what}")
    if af == "int8" and wf == "int8" and activation is None:
        # int32 accumulation and the epilogue's order match the C reference exactly
        assert torch.equal(y_gpu, y_cpu), f"int8dq differs from the C reference (max {((y_gpu.float() - y_cpu.float()).abs().max())})"


@pytest.mark.parametrize("bias_kind", [None, "same", "f32"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_scheme_matches_reference(scheme, shape, dtype, bias_kind):
    check_scheme(SCHEMES[scheme], *shape, dtype, bias_kind)


@pytest.mark.parametrize("shape", [(97, 320, 272), (7, 100, 75), (300, 1280, 130)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("mix", list(MIXES))
def test_mixed_granularities_and_formats(mix, shape):
    check_scheme(MIXES[mix], *shape, torch.bfloat16, "same", seed=1)


GELU_SHAPES = [(1, 64, 48), (7, 100, 75), (97, 320, 272), (4608, 256, 384)]  # GEMV, tails, GEMM


@pytest.mark.parametrize("bias_kind", [None, "same"])
@pytest.mark.parametrize("shape", GELU_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_gelu_epilogue(scheme, shape, bias_kind):
    """activation="gelu_tanh": cuBLASLt's GELU epilogue, cquant's own epilogues, the GEMV's pass."""
    check_scheme(SCHEMES[scheme], *shape, torch.bfloat16, bias_kind, seed=5, activation="gelu_tanh")


@pytest.mark.parametrize("m", [7, 97])  # weight-only: the GEMV's pass, cuBLASLt's epilogue
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("scheme", ["int8dq", "fp8dqrow", "int8wo", "fp6_e3m2"])
def test_gelu_epilogue_other_dtypes(scheme, dtype, m):
    """With fp16 and fp32 outputs the bounds are tight enough to tell the tanh GELU from the erf
    one on every path (tests/test_tolerances.py)."""
    check_scheme(SCHEMES[scheme], m, 192, 80, dtype, "same", seed=6, activation="gelu_tanh")


@pytest.mark.parametrize("scheme", ["int8dq", "fp8dqrow", "int8wo"])
def test_float32_activations(scheme):
    check_scheme(SCHEMES[scheme], 97, 192, 80, torch.float32, "same", seed=2)


@pytest.mark.parametrize("scheme", ["int8dq", "fp8dqrow"])
def test_many_tiles_per_block(scheme):
    """More output tiles than SMs: the persistent kernels loop over tiles; N has a tail."""
    check_scheme(SCHEMES[scheme], 4608, 128, 4160, torch.bfloat16, "same", seed=3)


def test_leading_dims_flatten():
    wf, wg, af, ag = SCHEMES["int8dq"]
    x, qw, sw, bias = make_case(2 * 3 * 5, 96, 40, torch.bfloat16, "same", wf, wg, 4)
    x3 = x.reshape(2, 15, 96)
    y = ops.linear(x3.cuda(), qw.cuda(), sw.cuda(), weight_format=wf, act_format=af, bias=bias.cuda())
    assert tuple(y.shape) == (2, 15, 40)
    y_cpu = ops.linear(x3, qw, sw, weight_format=wf, act_format=af, bias=bias)
    assert torch.equal(y.cpu(), y_cpu)


# ---- activation quantization: bit-identical codes and scales ----

def special_rows(rows, cols, dtype, g):
    x = torch.randn(rows, cols, generator=g) * torch.logspace(-3, 3, rows).reshape(-1, 1)
    x[0] = 0.0  # all-zero row: amax floor, codes 0
    if rows > 3:
        x[1, cols // 2] = float("nan")
        x[2, 0] = float("inf")
        x[3, -1] = float("-inf")
    if rows > 5:
        x[4] = -0.0
        x[5, ::2] = -1e-30  # tiny negatives: -0 codes in fp8
    return x.to(dtype)


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("cols", [1, 7, 64, 128, 256, 1000, 3072, 15360, 20000])  # <= 256: a few threads a row
def test_act_quant_bit_identical(fmt, dtype, cols):
    g = torch.Generator().manual_seed(cols)
    rows = 9 if cols > 4000 else 97
    x = special_rows(rows, cols, dtype, g)
    q_cpu, s_cpu = ops.quantize(x, fmt, "row")
    q_gpu = torch.full(tuple(q_cpu.shape), 0x55, dtype=torch.uint8, device="cuda").view(q_cpu.dtype)
    s_gpu = torch.full((rows,), float("nan"), device="cuda")
    ops.quantize(x.cuda(), fmt, "row", out=q_gpu, scale_out=s_gpu)
    torch.cuda.synchronize()
    assert torch.equal(codes_u8(q_gpu).cpu(), codes_u8(q_cpu)), "codes differ from the C reference"
    assert torch.equal(s_gpu.cpu().view(torch.int32), s_cpu.view(torch.int32)), "scales differ bitwise"


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3"])
def test_act_quant_unaligned_input(fmt):
    """x that does not start on a 16-byte boundary takes the scalar kernel, same codes."""
    g = torch.Generator().manual_seed(5)
    flat = torch.randn(33 * 200 + 1, generator=g).to(torch.bfloat16)
    x = flat[1:].view(33, 200)
    q_cpu, s_cpu = ops.quantize(x, fmt, "row")
    q_gpu, s_gpu = ops.quantize(flat.cuda()[1:].view(33, 200), fmt, "row")
    assert torch.equal(codes_u8(q_gpu).cpu(), codes_u8(q_cpu))
    assert torch.equal(s_gpu.cpu().view(torch.int32), s_cpu.view(torch.int32))


def test_nan_rows_propagate_through_linear():
    """A token holding NaN gives a NaN output row (scale NaN, codes 0); the others are finite."""
    wf, wg, af, ag = SCHEMES["fp8dqrow"] if cc() >= 89 else SCHEMES["int8dq"]
    x, qw, sw, bias = make_case(64, 128, 96, torch.bfloat16, None, wf, wg, 6)
    x[5, 7] = float("nan")
    y = run_linear(x.cuda(), qw.cuda(), sw.cuda(), None, wf, wg, af, ag, 128).cpu()
    assert torch.isnan(y[5]).all()
    assert torch.isfinite(torch.cat([y[:5], y[6:]])).all()


# ---- CUDA graphs ----

@pytest.mark.parametrize("activation", [None, "gelu_tanh"])
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_cuda_graph_capture_and_replay(scheme, activation):
    wf, wg, af, ag = SCHEMES[scheme]
    needs(af)
    m, k, n = 300, 256, 208
    x, qw, sw, bias = make_case(m, k, n, torch.bfloat16, "same", wf, wg, 7)
    x, qw, sw, bias = x.cuda(), qw.cuda(), sw.cuda(), bias.cuda()
    kwargs = dict(weight_format=wf, weight_granularity=wg, act_format=af, act_granularity=ag, bias=bias, in_features=k,
                  activation=activation)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: heuristics, module loading
        ops.linear(x, qw, sw, **kwargs)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_static = ops.linear(x, qw, sw, **kwargs)
    for seed in (8, 9):
        x.copy_(torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16))
        y_static.fill_(float("nan"))
        graph.replay()
        y_eager = ops.linear(x, qw, sw, **kwargs)
        torch.cuda.synchronize()
        assert torch.equal(y_static, y_eager), "replayed graph differs from the eager call"


# ---- errors ----

def test_workspace_too_small_is_value_error():
    wf, wg, af, ag = SCHEMES["int8dq"]
    x, qw, sw, _ = make_case(64, 128, 96, torch.bfloat16, None, wf, wg, 10)
    ws = torch.empty(16, dtype=torch.uint8, device="cuda")
    with pytest.raises(ValueError, match="workspace"):
        ops.linear(x.cuda(), qw.cuda(), sw.cuda(), weight_format=wf, act_format=af, workspace=ws)


def test_workspace_size_is_exact_and_sufficient():
    wf, wg, af, ag = SCHEMES["int8dq"]
    need = _C.linear_workspace_size(_fmt(wf), 1, _fmt(af), 1, 100, 97, 75, True)
    x, qw, sw, bias = make_case(97, 100, 75, torch.float16, "same", wf, wg, 11)
    ws = torch.empty(need, dtype=torch.uint8, device="cuda")
    y = ops.linear(x.cuda(), qw.cuda(), sw.cuda(), weight_format=wf, act_format=af, bias=bias.cuda(), workspace=ws)
    assert torch.equal(y.cpu(), ops.linear(x, qw, sw, weight_format=wf, act_format=af, bias=bias))
    assert _C.linear_workspace_size(_fmt("fp4_e2m1"), 1, 0, 1, 3072, 16, 3072, True) == 0  # GEMV: none


def _fmt(name):
    return ops.format_info(name).id


def test_int8_k_limit_on_cuda():
    """int8 x int8 on the GPU accumulates in int32 too: K = CQ_LINEAR_INT8_MAX_K with every code
    127 is exact (127^2 K < 2^31), one more feature is refused like on the CPU."""
    kmax = _C.LINEAR_INT8_MAX_K
    x = torch.ones(3, kmax, device="cuda")
    w = torch.full((2, kmax), 127, dtype=torch.int8)
    w[1] = -127
    sw = torch.ones(2)
    y = ops.linear(x, w.cuda(), sw.cuda(), weight_format="int8", act_format="int8").cpu()
    ref = ops.linear(x.cpu(), w, sw, weight_format="int8", act_format="int8")
    assert torch.equal(y, ref)
    x1 = torch.ones(3, kmax + 1, device="cuda")
    w1 = torch.full((2, kmax + 1), 127, dtype=torch.int8, device="cuda")
    with pytest.raises(NotImplementedError, match="CQ_LINEAR_INT8_MAX_K"):
        ops.linear(x1, w1, sw.cuda(), weight_format="int8", act_format="int8")


@pytest.mark.parametrize("scheme", ["int8dq", "int8wo"])
def test_workspace_overlapping_an_argument_is_refused(scheme):
    """The workspace is written: one that shares bytes with y (or an input) is refused, naming both."""
    wf, wg, af, ag = SCHEMES[scheme]
    m, k, n = 64, 128, 96
    x, qw, sw, _ = make_case(m, k, n, torch.bfloat16, None, wf, wg, 13)
    act = _fmt(af) if af else _C.FORMAT_NONE
    need = _C.linear_workspace_size(_fmt(wf), 1, act, 1, k, m, n, True)
    buf = torch.empty(need + m * n * 2, dtype=torch.uint8, device="cuda")
    y = buf[:m * n * 2].view(torch.bfloat16).view(m, n)
    ws = buf[m * n:m * n + need]  # starts inside y
    with pytest.raises(ValueError, match="workspace overlaps y"):
        _C.linear(x.cuda(), qw.cuda(), sw.cuda(), None, y, _fmt(wf), 1, act, 1, k, ws)


@pytest.mark.skipif(HAS_CUDA and cc() >= 89, reason="the device has fp8 tensor cores")
def test_fp8_activations_below_sm89_raise_not_implemented():
    wf, wg, af, ag = SCHEMES["fp8dqrow"]
    x, qw, sw, _ = make_case(32, 64, 48, torch.bfloat16, None, wf, wg, 12)
    with pytest.raises(NotImplementedError, match=r"sm_89"):
        ops.linear(x.cuda(), qw.cuda(), sw.cuda(), weight_format=wf, act_format=af)


# ---- fallback kernels, forced through the environment in a child process ----

FALLBACK_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, {tests!r})
    import test_linear_cuda as t
    for scheme in {schemes!r}:
        if t.SCHEMES[scheme][2] and t.SCHEMES[scheme][2].startswith("fp8") and t.cc() < 89:
            continue
        for shape in {shapes!r}:
            for dtype in (torch.bfloat16, torch.float32):
                t.check_scheme(t.SCHEMES[scheme], *shape, dtype, "same", seed=13)
            t.check_scheme(t.SCHEMES[scheme], *shape, torch.bfloat16, "same", seed=14, activation="gelu_tanh")
    print("ok")
    """
)

FALLBACKS = {
    # the mma.sync int8 kernel (sm_80/89), on any card
    "CQUANT_DISABLE_WGMMA": ("1", ("int8dq",), ((97, 320, 272), (4608, 128, 1040), (33, 100, 75))),
    # the mma.sync fp8 kernel (sm_89, and shapes cuBLASLt does not take)
    "CQUANT_DISABLE_CUBLASLT_FP8": ("1", ("fp8dqrow", "fp8dq_tensor"), ((97, 320, 272), (4608, 128, 1040), (33, 100, 75))),
    # weight-only GEMM over several weight chunks (1 MiB of dequantized rows each)
    "CQUANT_WO_CHUNK_MB": ("1", ("int8wo", "fp4_e2m1"), ((97, 1280, 1000), (300, 640, 2100))),
}


@pytest.mark.parametrize("env", list(FALLBACKS))
def test_fallback_paths(env):
    """Paths the default H100 dispatch does not take, forced through the environment in a child."""
    value, schemes, shapes = FALLBACKS[env]
    script = FALLBACK_SCRIPT.format(tests=os.path.dirname(os.path.abspath(__file__)), schemes=schemes, shapes=shapes)
    r = subprocess.run([sys.executable, "-c", script], env={**os.environ, env: value}, capture_output=True, text=True,
                       timeout=1200)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr


@pytest.mark.parametrize("scheme", ["int8dq", "fp8dqrow", "fp8dq_tensor"])
@pytest.mark.parametrize("k", [4096, 4100])
def test_weight_off_its_16_byte_boundary(scheme, k):
    """A weight view that starts off a 16-byte boundary was refused by the 8-bit GEMMs (the other
    paths take it): now its rows are copied into the workspace, chunk by chunk of at most 16 MiB
    (N = 4200 rows of K = 4096 take two chunks), as for K % 16 != 0, with the same result as the
    aligned weight (bit for bit for int8, whose sums are exact)."""
    wf, wg, af, ag = SCHEMES[scheme]
    needs(af)
    m, n = 64, 4200
    x, qw, sw, bias = make_case(m, k, n, torch.bfloat16, "same", wf, wg, 21)
    x, sw, bias = x.cuda(), sw.cuda(), bias.cuda()
    raw = qw.view(torch.uint8)
    buf = torch.empty(raw.numel() + 1, dtype=torch.uint8, device="cuda")
    w_off = buf[1:].view(raw.shape)
    w_off.copy_(raw.cuda())
    w_off = w_off.view(qw.dtype)
    assert w_off.data_ptr() % 16 == 1
    kwargs = dict(weight_format=wf, weight_granularity=wg, act_format=af, act_granularity=ag, bias=bias, in_features=k)
    y_off = ops.linear(x, w_off, sw, **kwargs)
    y = ops.linear(x, qw.cuda(), sw, **kwargs)
    torch.cuda.synchronize()
    if af == "int8":
        assert torch.equal(y_off, y)
    pre, terms, b_abs = float64_reference(x.cpu(), qw, sw.cpu(), bias.cpu(), wf, af, ag, k)
    bound = tol.cuda_linear_abs_bound(tol.cuda_linear_path(af, m), k, terms, b_abs, pre, "bfloat16", "bfloat16")
    assert_within(y_off.cpu(), pre, bound, f"{scheme} K={k}, weight off its 16-byte boundary")
    assert_within(y.cpu(), pre, bound, f"{scheme} K={k}, aligned weight")
