"""Two-level int4 (int4dq_2l) on CUDA: quantize and dequantize bit for bit as the C reference, and
the layers (linear, linear_quantized, linear_gated) equal to the C reference bit for bit without
GELU: the acc is an exact int32 and the epilogue is int8dq's ((acc * sx) * s1 + b, then the gated
residual, each step rounded), on the sm_90a kernel and on the fallback that decodes q8 = s2 * code
into the workspace for int8dq's GEMM. With GELU the kernels evaluate it their own way
(cquant.h): within tolerances.gelu_abs_bound of float64. Every GPU output is NaN-poisoned first.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from cquant import _C, ops  # noqa: E402

import reference as ref  # noqa: E402
import tolerances as tol  # noqa: E402

HAS_CUDA = torch.cuda.is_available() and _C.built_with_cuda()
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU and a CUDA build")]

TL = "two_level"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
MS = [1, 16, 17, 33, 100, 512, 4608]


def weight(k, n, gs, seed=0):
    """CPU (q, s) of a random [n, k] weight whose groups differ in size (every s2 from 1 to 16)."""
    g = torch.Generator().manual_seed(seed * 7919 + 31 * k + n + gs)
    w = torch.randn(n, k, generator=g) * (0.5 + torch.rand(n, 1, generator=g))
    w = w * 2.0 ** torch.randint(-5, 1, (1, k // gs), generator=g).repeat_interleave(gs, 1)
    return ops.quantize(w / k**0.5, "int4", TL, group_size=gs)


def make_x(m, k, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g).to(dtype)


def kw(k, gs, **extra):
    return dict(weight_format="int4", weight_granularity=TL, act_format="int8", in_features=k, weight_group_size=gs,
                **extra)


def poisoned(m, n, dtype, width=None):
    return torch.full((m, width or n), float("nan"), dtype=dtype, device="cuda")


# ---------------------------------------------------------------- quantize / dequantize


@pytest.mark.parametrize("gs", [32, 64, 128, 256, 512, 1024])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_quantize_and_dequantize_are_the_c_reference(dtype, gs):
    rows, cols = 67, max(4 * gs, 1024)
    x = make_x(rows, cols, DTYPES[dtype], gs)
    x[3, 5], x[9, 0], x[10] = float("nan"), float("inf"), 0.0
    q, s = ops.quantize(x, "int4", TL, group_size=gs)
    qg, sg = ops.quantize(x.cuda(), "int4", TL, group_size=gs)
    assert torch.equal(qg.cpu(), q)
    assert torch.equal(torch.isnan(sg.cpu()), torch.isnan(s)) and torch.equal(torch.nan_to_num(sg.cpu()), torch.nan_to_num(s))
    s_bad = s.clone()
    s_bad[1, 1], s_bad[2, 2], s_bad[4, 1] = float("nan"), 2.5, 0.0  # bad, bad, valid
    for out in DTYPES:
        want = ops.dequantize(q, s_bad, "int4", cols=cols, dtype=out, granularity=TL)
        got = ops.dequantize(q.cuda(), s_bad.cuda(), "int4", cols=cols, dtype=out, granularity=TL)
        assert torch.equal(torch.isnan(got.cpu()), torch.isnan(want))
        assert torch.equal(torch.nan_to_num(got.cpu().float()), torch.nan_to_num(want.float())), out


# ---------------------------------------------------------------- layers


def check_layer(m, k, n, gs, dtype, bias_kind=None, seed=1):
    q, s = weight(k, n, gs, seed)
    x = make_x(m, k, dtype, seed + m)
    bias = None
    if bias_kind:
        bias = torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(dtype if bias_kind == "same" else
                                                                                torch.float32)
    want = ops.linear(x, q, s, bias=bias, **kw(k, gs))
    y = ops.linear(x.cuda(), q.cuda(), s.cuda(), bias=None if bias is None else bias.cuda(), out=poisoned(m, n, dtype),
                   **kw(k, gs))
    what = f"M={m} K={k} N={n} gs={gs} {dtype} bias={bias_kind}"
    assert torch.equal(y.cpu(), want), f"linear {what} differs from the C reference"
    # caller-given codes, as norm_modulate writes them
    qx, sx = ops.quantize(x, "int8", "row")
    yq = poisoned(m, n, dtype)
    f = ops.format_info
    args = (f("int4").id, _C.GRANULARITY_TWO_LEVEL, f("int8").id, _C.GRANULARITY_ROW)
    ws = torch.empty(ops.linear_workspace_size(args + (gs,), k, m, n, cuda=True), dtype=torch.uint8, device="cuda")
    _C.linear_quantized(qx.cuda(), sx.cuda(), q.cuda(), s.cuda(), None if bias is None else bias.cuda(), yq, *args, k,
                        workspace=ws, weight_group_size=gs)
    assert torch.equal(yq.cpu(), ops.linear(x, q, s, bias=bias, **kw(k, gs))), f"linear_quantized {what}"


@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("gs", [32, 128, 1024])
def test_linear_is_the_c_reference(gs, m):
    for k, n in ((2 * max(gs, 128), 33), (3072, 3072)):
        if m == 4608 and n == 33:
            continue
        check_layer(m, k, n, gs, torch.bfloat16, "same" if m % 2 else None)


@pytest.mark.parametrize("k, gs", [(96, 32), (160, 32), (224, 32), (192, 64), (320, 64)])
def test_k_not_a_multiple_of_the_kernels_stage(k, gs):
    """K past the last 128-column stage: the stage's groups past K read the row's last multiplier
    for codes the kernel reads as zeros."""
    for m in (3, 260):
        check_layer(m, k, 136, gs, torch.bfloat16, "same")


@pytest.mark.parametrize("bias_kind", [None, "same", "f32"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_dtypes_and_bias_kinds(dtype, bias_kind):
    for m in (5, 200):
        check_layer(m, 512, 201, 64, DTYPES[dtype], bias_kind)


def test_many_rows_decode_in_chunks():
    """N past one workspace chunk of decoded rows (16 MiB / K): the fallback GEMMs chunk by chunk."""
    check_layer(40, 1024, 16384 + 77, 128, torch.bfloat16, "f32")


@pytest.mark.parametrize("m", [4, 18, 300])
def test_gelu_gated_and_column_slices(m):
    k, n, gs, dtype = 512, 136, 128, torch.bfloat16
    q, s = weight(k, n, gs)
    x = make_x(m, k, dtype, 11)
    g = torch.Generator().manual_seed(12)
    gate = torch.randn(2, n, generator=g).to(dtype)
    residual = torch.randn(m, n, generator=g).to(dtype)
    bias = torch.randn(n, generator=g)
    dev = dict(w=q.cuda(), s=s.cuda(), b=bias.cuda())
    # gated: bit for bit as the C reference, into a new output and in place
    want = ops.linear_gated(x, q, s, gate, residual, bias=bias, **kw(k, gs))
    y = ops.linear_gated(x.cuda(), dev["w"], dev["s"], gate.cuda(), residual.cuda(), bias=dev["b"], **kw(k, gs))
    assert torch.equal(y.cpu(), want)
    res = residual.cuda().clone()
    ops.linear_gated(x.cuda(), dev["w"], dev["s"], gate.cuda(), res, out=res, bias=dev["b"], **kw(k, gs))
    assert torch.equal(res.cpu(), want)
    # y into a column slice of a wider tensor
    full = poisoned(m, n, dtype, width=n + 24)
    ops.linear(x.cuda(), dev["w"], dev["s"], bias=dev["b"], out=full[:, 8:8 + n], **kw(k, gs))
    assert torch.equal(full[:, 8:8 + n].cpu(), ops.linear(x, q, s, bias=bias, **kw(k, gs)))
    assert torch.isnan(full[:, :8]).all() and torch.isnan(full[:, 8 + n:]).all()
    # GELU: the kernels' own evaluation, within the bound of float64
    xc, sx = ops.quantize(x, "int8", "row")
    codes = ref.codes_of_stored_group(q.numpy(), "int4", k)
    pre, terms, _ = ref.linear_two_level(xc.numpy(), sx.numpy(), codes, s.numpy(), gs, bias.numpy())
    act = tol.gelu_tanh(pre)
    yg = ops.linear(x.cuda(), dev["w"], dev["s"], bias=dev["b"], activation="gelu_tanh", **kw(k, gs))
    bound = tol.gelu_abs_bound(0, terms, pre, act, "bfloat16")
    assert np.all(np.abs(yg.cpu().double().numpy() - act) <= bound)


def test_bad_multipliers_poison_exactly_their_columns():
    m, k, n, gs = 100, 512, 72, 128
    q, s = weight(k, n, gs)
    s = s.clone()
    s[3, 2], s[10, 1], s[20, 4], s[30, 3], s[40, 1] = float("nan"), 2.5, 17.0, -1.0, 0.0
    x = make_x(m, k, torch.bfloat16, 3)
    want = ops.linear(x, q, s, **kw(k, gs))
    y = ops.linear(x.cuda(), q.cuda(), s.cuda(), out=poisoned(m, n, torch.bfloat16), **kw(k, gs))
    nan_cols = torch.isnan(y.cpu()).all(0)
    assert nan_cols.nonzero().flatten().tolist() == [3, 10, 20, 30]
    assert torch.equal(torch.nan_to_num(y.cpu()), torch.nan_to_num(want))
    # a row of non-finite weights: s1 NaN, its column NaN
    w = torch.randn(4, k)
    w[2, 7] = float("inf")
    q2, s2 = ops.quantize(w.cuda(), "int4", TL, group_size=gs)
    y2 = ops.linear(x.cuda(), q2, s2, **kw(k, gs))
    assert torch.isnan(y2[:, 2]).all() and torch.isfinite(y2[:, [0, 1, 3]]).all()


# ---------------------------------------------------------------- streams and devices

SIDE_MS = [3, 300, 1024]


def test_side_stream():
    """Work is enqueued on the current stream: on a side stream the layer still gives the C
    reference bit for bit."""
    k, n, gs = 1024, 264, 128
    q, s = weight(k, n, gs)
    qd, sd = q.cuda(), s.cuda()
    for m in SIDE_MS:
        x = make_x(m, k, torch.bfloat16, 40 + m)
        want = ops.linear(x, q, s, **kw(k, gs))
        xd = x.cuda()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            y = ops.linear(xd, qd, sd, out=poisoned(m, n, torch.bfloat16), **kw(k, gs))
        side.synchronize()
        assert torch.equal(y.cpu(), want), f"M={m}: side stream differs from the C reference"


@pytest.mark.skipif(not HAS_CUDA or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_second_device():
    k, n, gs = 1024, 264, 128
    q, s = weight(k, n, gs)
    for m in SIDE_MS:
        x = make_x(m, k, torch.bfloat16, 50 + m)
        want = ops.linear(x, q, s, **kw(k, gs))
        with torch.cuda.device(1):
            y = ops.linear(x.to("cuda:1"), q.to("cuda:1"), s.to("cuda:1"), **kw(k, gs))
            torch.cuda.synchronize()
        assert y.device.index == 1 and torch.equal(y.cpu(), want), f"M={m}: cuda:1 differs from the C reference"
