"""The gated-residual linear layer (cq_linear_gated) and column-slice outputs on CUDA, every path:
the weight-only GEMV (M <= 16) and GEMM (M > 16), the int8 GEMMs, cuBLASLt's fp8 GEMM (sm_90+,
N % 16 == 0: the gate folded into its per-row scales and bias, the residual as its C matrix) and
the fp8 mma.sync kernel (other N, a GELU, sm_89).

Each case runs on CUDA into NaN-poisoned outputs and on the CPU (the C reference), and both are held
against float64 of the same quantized math within the rounding bound of each path
(tolerances.cuda_gated_abs_bound); int8dq without GELU matches the C reference bit for bit.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from cquant import _C, torch_ops  # noqa: E402
from cquant.schemes import SCHEMES  # noqa: E402
from helpers import ungrouped_schemes  # noqa: E402

import tolerances as tol  # noqa: E402
from test_linear_gated import v_reference  # noqa: E402

HAS_CUDA = torch.cuda.is_available() and _C.built_with_cuda()
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU and a CUDA build")]
GELU = _C.ACTIVATION_GELU_TANH

# (M, K, N, G): the GEMV and its edge (M = 16), the GEMMs just past it, N % 16 == 0 (cuBLASLt's
# fp8 GEMM) and not (mma.sync), K not a multiple of 16 (padded weight rows), several samples
SHAPES = [
    (1, 64, 48, 1),
    (16, 64, 48, 2),
    (17, 64, 48, 1),
    (100, 96, 80, 2),
    (33, 100, 75, 3),
    (256, 128, 130, 2),
    (512, 256, 384, 4),
]


def cc():
    major, minor = torch.cuda.get_device_capability()
    return 10 * major + minor


def needs(scheme):
    if scheme.act_format is not None and scheme.act_format.name.startswith("fp8") and cc() < 89:
        pytest.skip("fp8 activations need sm_89+")


def path_of(scheme, m):
    return tol.cuda_linear_path(scheme.act_format.name if scheme.act_format else None, m)


def make(rng, scheme, m, k, n, g, dtype, bias_kind):
    t = lambda a, dt=dtype: torch.from_numpy(np.asarray(a, np.float32)).to(dt)  # noqa: E731
    x = t(rng.standard_normal((m, k)))
    w = torch.from_numpy((rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32))
    qw, sw = torch_ops.quantize(w, scheme.weight_format.id, scheme.c_args[1])
    bias = None if bias_kind is None else t(rng.standard_normal(n), torch.float32 if bias_kind == "f32" else dtype)
    gate = t(rng.standard_normal((g, n)))
    residual = t(rng.standard_normal((m, n)))
    return x, qw, sw, bias, gate, residual


def cuda(*ts):
    return [None if t is None else t.cuda() for t in ts]


def with_workspace(op, *args, c_args, k, **kw):
    """_C.linear_gated / linear_quantized (op) with the workspace cq_linear_workspace_size asks for,
    on torch's current stream (as the torch ops call them)."""
    x, y = args[0], args[-1]
    m = x.numel() // x.shape[-1]
    nbytes = _C.linear_workspace_size(*c_args, k, m, int(y.shape[-1]), True)
    ws = torch.empty(nbytes, dtype=torch.uint8, device=x.device) if nbytes else None
    op(*args, *c_args, k, workspace=ws, stream=torch_ops._stream(x), **kw)


def run_gated(scheme, x, qw, sw, bias, gate, residual, activation, in_place):
    """The gated layer into a NaN-poisoned y, or in place on a copy of the residual."""
    k = int(x.shape[-1])
    if in_place:
        y = residual.clone()
        with_workspace(_C.linear_gated, x, qw, sw, bias, gate, y, y, c_args=scheme.c_args[:4], k=k,
                       activation=activation)
        return y
    y = torch.full(residual.shape, float("nan"), dtype=x.dtype, device=x.device)
    with_workspace(_C.linear_gated, x, qw, sw, bias, gate, residual, y, c_args=scheme.c_args[:4], k=k,
                   activation=activation)
    return y


def bound_of(scheme, x, qw, sw, bias, gate, residual, activation):
    """(y64, bound) of the CUDA path the layer takes."""
    m, k = x.shape
    n = qw.shape[0]
    v64, _ = v_reference(scheme, x, qw, sw, bias, activation)
    pre64, _ = v_reference(scheme, x, qw, sw, bias, 0)
    terms = _terms(scheme, x, qw, sw, bias)
    b_abs = np.zeros((1, n)) if bias is None else np.abs(bias.double().numpy()).reshape(1, -1)
    g64 = gate.double().numpy()[np.arange(m) // (m // gate.shape[0])]
    r64 = residual.double().numpy()
    y64 = r64 + g64 * v64
    dt = str(x.dtype).split(".")[-1]
    bound = tol.cuda_gated_abs_bound(path_of(scheme, m), k, terms, b_abs, pre64, v64, g64, r64, y64, dt, dt,
                                     gelu=activation == GELU)
    return y64, bound


def _terms(scheme, x, qw, sw, bias):
    """sum of |addends| of each output (what rounding errors scale with), from tests/reference.py."""
    import reference as ref

    k = int(x.shape[-1])
    wf = ref.fmt(scheme.weight_format.name)
    af = ref.fmt(scheme.act_format.name) if scheme.act_format else None
    codes = ref.codes_of_stored(wf, qw.view(torch.uint8).numpy(), k)
    _, terms = ref.linear(x.float().numpy(), codes, sw.numpy(), wf, scheme.weight_granularity, af,
                          scheme.act_granularity, None if bias is None else bias.double().numpy())
    return terms


def assert_within(got, want, bound, what):
    got = got.double().cpu().numpy().reshape(want.shape)
    err = np.abs(got - want)
    worst = np.unravel_index(np.argmax(err - bound), err.shape)
    assert np.all(err <= bound), (f"{what}: |y - y64| = {err[worst]:.3g} > bound {bound[worst]:.3g} at {worst} "
                                  f"(y {got[worst]!r}, y64 {want[worst]!r}; {np.count_nonzero(err > bound)} of "
                                  f"{err.size} over)")


@pytest.mark.parametrize("bias_kind", [None, "same", "f32"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("scheme_name", ungrouped_schemes(SCHEMES))
def test_gated_matches_reference(rng, scheme_name, shape, dtype, bias_kind):
    scheme = SCHEMES[scheme_name]
    needs(scheme)
    m, k, n, g = shape
    x, qw, sw, bias, gate, residual = make(rng, scheme, m, k, n, g, dtype, bias_kind)
    for activation in (0, GELU):
        for in_place in (False, True):
            what = (f"{scheme_name} {dtype} {m}x{k}x{n} G={g} bias={bias_kind} act={activation} in_place={in_place} "
                    f"({path_of(scheme, m)} path)")
            y_gpu = run_gated(scheme, *cuda(x, qw, sw, bias, gate, residual), activation, in_place)
            torch.cuda.synchronize()
            y_gpu = y_gpu.cpu()
            assert not torch.isnan(y_gpu).any(), f"{what}: outputs left unwritten (NaN poison)"
            y_cpu = run_gated(scheme, x, qw, sw, bias, gate, residual, activation, in_place)
            y64, bound = bound_of(scheme, x, qw, sw, bias, gate, residual, activation)
            assert_within(y_gpu, y64, bound, f"GPU, {what}")
            if scheme_name == "int8dq" and activation == 0:
                assert torch.equal(y_gpu, y_cpu), f"{what}: int8dq differs from the C reference"


@pytest.mark.parametrize("scheme_name", ["int8dq", "fp8dqrow", "fp8dq", "int8wo"])
def test_gated_float32_outputs(rng, scheme_name):
    """f32 y: cuBLASLt's fp8 GEMM does not take it (mma.sync), the weight-only GEMM keeps its fp32 D
    in the workspace (the residual may be y)."""
    scheme = SCHEMES[scheme_name]
    needs(scheme)
    for m, k, n, g in ((7, 64, 48, 1), (100, 96, 80, 2)):
        x, qw, sw, bias, gate, residual = make(rng, scheme, m, k, n, g, torch.float32, "same")
        y64, bound = bound_of(scheme, x, qw, sw, bias, gate, residual, 0)
        for in_place in (False, True):
            y = run_gated(scheme, *cuda(x, qw, sw, bias, gate, residual), 0, in_place).cpu()
            assert_within(y, y64, bound, f"{scheme_name} f32 M={m} in_place={in_place}")


@pytest.mark.parametrize("scheme_name", ungrouped_schemes(SCHEMES))
def test_column_slices_on_every_path(rng, scheme_name):
    """linear, linear_quantized and linear_gated into column slices of wider tensors: the slice holds
    the layer's result, the columns around it are untouched."""
    scheme = SCHEMES[scheme_name]
    needs(scheme)
    for m, k, n, g in ((5, 64, 48, 1), (16, 64, 48, 2), (100, 96, 80, 2), (33, 100, 75, 3)):
        x, qw, sw, bias, gate, residual = make(rng, scheme, m, k, n, g, torch.bfloat16, "same")
        xg, qwg, swg, bg, gg, rg = cuda(x, qw, sw, bias, gate, residual)
        path = path_of(scheme, m)
        what = f"{scheme_name} M={m} N={n} ({path} path)"
        exact = path in ("gemv", "int8")  # same kernels and order whatever the row stride
        # linear
        full = torch.full((m, n + 24), -7.0, dtype=torch.bfloat16, device="cuda")
        torch.ops.cquant.linear_out(xg, qwg, swg, bg, full[:, 8:8 + n], *scheme.c_args[:4], k)
        dense = torch.ops.cquant.linear(xg, qwg, swg, bg, *scheme.c_args[:4], k)
        torch.cuda.synchronize()
        assert torch.all(full[:, :8] == -7) and torch.all(full[:, 8 + n:] == -7), f"{what}: linear wrote outside"
        if exact:
            assert torch.equal(full[:, 8:8 + n], dense), f"{what}: linear slice differs"
        else:
            assert torch.allclose(full[:, 8:8 + n].float(), dense.float(), rtol=2 ** -6, atol=1e-2), what
        # linear_gated, the residual a slice of another tensor and the gate a chunk of a wider one
        gfull = torch.cat([gg, gg, gg], dim=1)
        rfull = torch.full((m, n + 3), -5.0, dtype=torch.bfloat16, device="cuda")
        rfull[:, 3:] = rg
        yfull = torch.full((m, n + 24), -7.0, dtype=torch.bfloat16, device="cuda")
        with_workspace(_C.linear_gated, xg, qwg, swg, bg, gfull[:, n:2 * n], rfull[:, 3:], yfull[:, 8:8 + n],
                       c_args=scheme.c_args[:4], k=k)
        torch.cuda.synchronize()
        assert torch.all(yfull[:, :8] == -7) and torch.all(yfull[:, 8 + n:] == -7), f"{what}: gated wrote outside"
        y64, bound = bound_of(scheme, x, qw, sw, bias, gate, residual, 0)
        assert_within(yfull[:, 8:8 + n], y64, bound, f"gated slice, {what}")
        # in place on the residual's slice
        with_workspace(_C.linear_gated, xg, qwg, swg, bg, gfull[:, n:2 * n], rfull[:, 3:], rfull[:, 3:],
                       c_args=scheme.c_args[:4], k=k)
        torch.cuda.synchronize()
        assert torch.all(rfull[:, :3] == -5), f"{what}: in-place gated wrote outside"
        assert_within(rfull[:, 3:], y64, bound, f"gated in place on a slice, {what}")
        # linear_quantized into a slice (dynamic schemes, K % 16 == 0)
        if scheme.dynamic and k % 16 == 0:
            xc, xs = torch_ops.quantize(xg, scheme.c_args[2], scheme.c_args[3])
            qfull = torch.full((m, n + 24), -7.0, dtype=torch.bfloat16, device="cuda")
            with_workspace(_C.linear_quantized, xc, xs, qwg, swg, bg, qfull[:, 8:8 + n], c_args=scheme.c_args[:4],
                           k=k)
            torch.cuda.synchronize()
            assert torch.all(qfull[:, :8] == -7) and torch.all(qfull[:, 8 + n:] == -7), what
            assert torch.allclose(qfull[:, 8:8 + n].float(), dense.float(), rtol=2 ** -6, atol=1e-2), what


@pytest.mark.parametrize("scheme_name", ["int8wo", "fp8dqrow", "int8dq"])
def test_gated_three_dim_and_torch_op(rng, scheme_name):
    """[B, S, K] inputs with a gate per sample through the torch op (out of place)."""
    scheme = SCHEMES[scheme_name]
    needs(scheme)
    b, s, k, n = 2, 40, 64, 96
    x, qw, sw, bias, gate, residual = make(rng, scheme, b * s, k, n, b, torch.bfloat16, "same")
    xg, qwg, swg, bg, gg, rg = cuda(x, qw, sw, bias, gate, residual)
    y = torch.ops.cquant.linear_gated(xg.view(b, s, k), qwg, swg, bg, gg, rg.view(b, s, n), *scheme.c_args[:4], k)
    assert tuple(y.shape) == (b, s, n) and y.is_cuda
    y64, bound = bound_of(scheme, x, qw, sw, bias, gate, residual, 0)
    assert_within(y.reshape(b * s, n), y64, bound, scheme_name)


@pytest.mark.parametrize("scheme_name", ["fp8dqrow", "int8dq", "int8wo", "fp6_e3m2"])
def test_gated_cuda_graph_capture_and_replay(rng, scheme_name):
    """The gated layer (cuBLASLt's per-sample GEMMs and the fold kernels included) in a CUDA graph,
    updating the residual in place: a replay equals the eager call."""
    scheme = SCHEMES[scheme_name]
    needs(scheme)
    m, k, n, g = 256, 128, 256, 2
    x, qw, sw, bias, gate, residual = cuda(*make(rng, scheme, m, k, n, g, torch.bfloat16, "same"))
    r0 = residual.clone()

    def call():
        with_workspace(_C.linear_gated, x, qw, sw, bias, gate, residual, residual, c_args=scheme.c_args[:4], k=k)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    residual.copy_(r0)
    graph.replay()
    replayed = residual.clone()
    residual.copy_(r0)
    call()
    torch.cuda.synchronize()
    assert torch.equal(replayed, residual), "replayed graph differs from the eager call"


def test_gated_workspace_size_is_sufficient(rng):
    """cq_linear_workspace_size covers the gated call (its folded scales and bias included)."""
    scheme = SCHEMES["fp8dqrow"]
    needs(scheme)
    m, k, n, g = 64, 128, 96, 2
    x, qw, sw, bias, gate, residual = cuda(*make(rng, scheme, m, k, n, g, torch.bfloat16, "same"))
    need = _C.linear_workspace_size(*scheme.c_args[:4], k, m, n, True)
    ws = torch.empty(need, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(residual)
    _C.linear_gated(x, qw, sw, bias, gate, residual, y, *scheme.c_args[:4], k, workspace=ws)
    want = torch.ops.cquant.linear_gated(x, qw, sw, bias, gate, residual, *scheme.c_args[:4], k)
    torch.cuda.synchronize()
    assert torch.equal(y, want)
    with pytest.raises(ValueError, match="workspace"):
        _C.linear_gated(x, qw, sw, bias, gate, residual, y, *scheme.c_args[:4], k, workspace=ws[:need - 256])
