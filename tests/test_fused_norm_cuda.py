"""The fused norm ops on CUDA against the C reference (test_fused_norm.py holds the reference
against float64 and diffusers).

The kernels compute every element with the C reference's operations one for one; only the order
of the row sums (mean, variance, sum of squares) differs. So: every CUDA output is within the
same float64 bound as the reference, 16-bit outputs are within one unit in the last place of the
reference's, quantized outputs are exactly quantize() of the op's own float output on the GPU,
and codes are within one step of the reference's wherever the row scales agree (to 2^-16).
Outputs are poisoned first, so a position the kernel forgot to write (or wrote outside its
rows) shows.

Run on a GPU machine: pytest -m cuda tests/test_fused_norm_cuda.py
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from cquant import _C, torch_ops  # noqa: E402

import test_fused_norm as cpu  # noqa: E402
from helpers import bits  # noqa: E402

pytestmark = pytest.mark.cuda

EPS = cpu.EPS
POISON = cpu.POISON


def cuda_view(t):
    """t on the GPU as the same view of a copy of its storage: strides and the storage offset
    (so its 16-byte alignment) are kept, where .cuda() would make chunks contiguous."""
    if t is None:
        return None
    flat = t.as_strided((t.untyped_storage().nbytes() // t.element_size(),), (1,), 0)
    return flat.cuda().as_strided(t.shape, t.stride(), t.storage_offset())


def steps(a_bits, b_bits, width):
    """Distance in representable values between sign-magnitude patterns of `width` bits."""
    sign = 1 << (width - 1)

    def key(x):
        x = x.astype(np.int64)
        return np.where(x & sign, -(x & (sign - 1)), x & (sign - 1))

    return np.abs(key(a_bits) - key(b_bits))


def ulps(gpu, ref):
    """Units in the last place between two 16-bit float tensors (NaN positions must agree)."""
    g, r = bits(gpu), bits(ref)
    nan_g, nan_r = np.isnan(gpu.float().cpu().numpy()), np.isnan(ref.float().cpu().numpy())
    assert np.array_equal(nan_g, nan_r), "NaN positions differ"
    return np.where(nan_g, 0, steps(g, r, 16))


def code_steps(gpu, ref, fmt):
    g, r = bits(gpu).astype(np.int64), bits(ref).astype(np.int64)
    if fmt == "int8":
        return np.abs(np.where(g > 127, g - 256, g) - np.where(r > 127, r - 256, r))
    return steps(g, r, 8)


def poison(t, value=POISON):
    if t.dtype in (torch.int8, torch.uint8):
        t.fill_(0x5A)
    else:
        t.fill_(value)
    return t


# ---------------------------------------------------------------- norm_modulate

NM_SHAPES = [(1, 1, 72), (2, 77, 200), (1, 333, 3000), (2, 4097, 3072), (1, 7, 16384), (2, 5, 7), (1, 3, 8200)]


def nm_case(seed, shape, dtype, layout):
    """CPU inputs: x, and scale / shift as chunks of a modulation vector; layout "misaligned"
    puts x and scale one element off their 16-byte boundaries (the kernels' other paths)."""
    gen = torch.Generator().manual_seed(seed)
    b, s, d = shape
    x = cpu.hidden_states(gen, b, s, d, dtype)
    emb, scale, shift = cpu.modulation(gen, b, d, dtype)
    if layout == "misaligned":
        buf = torch.empty(x.numel() + 1, dtype=x.dtype)
        buf[1:] = x.reshape(-1)
        x = buf[1:].view(b, s, d)
        wide = torch.cat([torch.zeros(b, 1, dtype=emb.dtype), emb], dim=1)
        scale = wide[:, 1 + d:1 + 2 * d]
    elif layout == "f32-modulation":
        scale, shift = scale.float(), shift.float().contiguous()
    return x, scale, shift


def run_gpu(x, scale, shift, norm, fmt):
    out, out_scale = torch_ops.DIRECT.norm_modulate(cuda_view(x), cuda_view(scale), cuda_view(shift), cpu.NORMS[norm],
                                                    EPS, fmt)
    torch.cuda.synchronize()
    return out, out_scale


@pytest.mark.parametrize("dtype", cpu.DTYPES)
@pytest.mark.parametrize("norm", list(cpu.NORMS))
@pytest.mark.parametrize("shape", NM_SHAPES, ids=["x".join(map(str, s)) for s in NM_SHAPES])
@pytest.mark.parametrize("layout", ["chunks", "misaligned", "f32-modulation", "no-modulation"])
def test_norm_modulate_cuda_matches_reference(seed, dtype, norm, shape, layout):
    x, scale, shift = nm_case(seed, shape, dtype, layout)
    if layout == "no-modulation":
        scale = shift = None
    want, _ = cpu.run_norm_modulate(x, scale, shift, norm)
    got, got_scale = run_gpu(x, scale, shift, norm, _C.FORMAT_NONE)
    assert got.dtype == want.dtype and got.shape == want.shape and got_scale.shape == (0,)
    got = got.cpu()
    v, bound = cpu.norm_modulate_bound(x, scale, shift, norm, dtype)
    err = np.abs(cpu.f64(got) - v)
    assert np.all(err <= bound), f"worst error / bound {(err / bound).max():.3g}"
    # Without cancellation (RMSNorm, no shift) a different order of the fp32 row sums moves an
    # element by at most one unit of its dtype. Elsewhere x - mu or n * (1 + scale) + shift can
    # cancel, and the same fp32 difference is many units of a result near zero: the float64
    # bound above is the check there.
    if dtype != "float32" and norm == "rms" and layout == "no-modulation":
        assert ulps(got, want).max() <= 1


@pytest.mark.parametrize("dtype", cpu.DTYPES)
@pytest.mark.parametrize("norm", list(cpu.NORMS))
@pytest.mark.parametrize("fmt", list(cpu.FORMATS))
@pytest.mark.parametrize("shape", NM_SHAPES, ids=["x".join(map(str, s)) for s in NM_SHAPES])
@pytest.mark.parametrize("layout", ["chunks", "misaligned"])
def test_norm_modulate_cuda_quantized(seed, dtype, norm, fmt, shape, layout):
    x, scale, shift = nm_case(seed, shape, dtype, layout)
    b, s, d = shape
    x[0, 0, d // 2] = float("nan")
    if s > 2:
        x[-1, 1, 0] = float("inf")
        x[0, 2] = 0.0
    code = cpu.FORMATS[fmt]
    t, _ = run_gpu(x, scale, shift, norm, _C.FORMAT_NONE)
    q, qs = run_gpu(x, scale, shift, norm, code)
    # exactly quantize() of the kernel's own t (the GPU quantizer matches the reference bit for bit)
    want_q, want_s = torch_ops.quantize(t, code, _C.GRANULARITY_ROW)
    torch.cuda.synchronize()
    assert np.array_equal(bits(q).reshape(b * s, d), bits(want_q))
    assert np.array_equal(np.isnan(qs.cpu().numpy()), np.isnan(want_s.cpu().numpy()))
    finite = ~np.isnan(want_s.cpu().numpy())
    assert np.array_equal(bits(qs)[finite], bits(want_s)[finite])
    assert np.isnan(qs[0].item()) and not bits(q)[0, 0].any()
    # and within one step of the reference's codes wherever the row scales agree: to 2^-16
    # relative, x * (1 / scale) moves by far less than a step, so rounding can flip one step at
    # most (16-bit rows mostly have the same scale bits; fp32 rows differ in the last bits
    # whenever the row sums do)
    ref_q, ref_s = cpu.run_norm_modulate(x, scale, shift, norm, code)
    gs, rs = qs.cpu().double().numpy(), ref_s.double().numpy()
    close = (np.abs(gs - rs) <= 2.0**-16 * np.abs(rs)) | (np.isnan(gs) & np.isnan(rs))
    assert close.mean() > 0.5, "row scales of the GPU and the reference mostly agree"
    assert code_steps(q.cpu().reshape(b * s, d)[close], ref_q.reshape(b * s, d)[close], fmt).max() <= 1


def test_norm_modulate_cuda_writes_every_element_and_nothing_else(seed):
    """Through the extension, into poisoned views inside larger buffers."""
    x, scale, shift = (cuda_view(t) for t in nm_case(seed, (2, 33, 200), "bfloat16", "chunks"))
    n = 2 * 33 * 200
    for fmt, dtype in ((_C.FORMAT_NONE, torch.bfloat16), (_C.FORMAT_INT8, torch.int8)):
        buf = poison(torch.empty(n + 64, dtype=dtype, device="cuda"))
        sbuf = torch.full((2 * 33 + 2,), POISON, device="cuda")
        before, sbefore = buf.clone(), sbuf.clone()
        out = buf[32:32 + n].view(2, 33, 200)
        out_scale = sbuf[1:-1] if fmt else None
        _C.norm_modulate(x, scale, shift, out, out_scale, _C.NORM_LAYER, EPS, fmt)
        want, want_s = torch_ops.DIRECT.norm_modulate(x, scale, shift, _C.NORM_LAYER, EPS, fmt)
        torch.cuda.synchronize()
        assert torch.equal(out, want)
        assert torch.equal(buf[:32], before[:32]) and torch.equal(buf[-32:], before[-32:])
        if fmt:
            assert torch.equal(out_scale, want_s)
            assert torch.equal(sbuf[[0, -1]], sbefore[[0, -1]])
        else:
            assert torch.equal(sbuf, sbefore)


# ---------------------------------------------------------------- qk_norm_rope

QK_CASES = cpu.QK_CASES + [
    (1, 4097, 24, 128, 4097 + 512, 512),  # Flux's image stream after 512 text tokens
    (2, 65, 3, 250, 70, 5),  # D not a whole number of vectors: the pair-wise path
]


def qk_inputs(seed, case, dtype, layout):
    gen = torch.Generator().manual_seed(seed)
    b, s, h, d, s_total, off = case
    if layout == "misaligned":  # views one element off 16-byte boundaries: the pair-wise path
        qkv = (torch.randn(b, s, 3 * h * d + 2, generator=gen) * 2.0).to(cpu.tdtype(dtype))
        q, k, v = [qkv[..., 1 + i * h * d:1 + (i + 1) * h * d].unflatten(-1, (h, d)) for i in range(3)]
    else:
        q, k, v = cpu.qkv_views(gen, b, s, h, d, dtype)
    qw = (1 + 0.2 * torch.randn(d, generator=gen)).to(cpu.tdtype(dtype))
    kw = (1 + 0.2 * torch.randn(d, generator=gen)).float()
    _, (cos, sin) = cpu.rope_tables(s_total, d)
    return q, k, v, qw, kw, cos, sin


def run_qk(q, k, v, qw, kw, cos, sin, rms, off, outs, dispatched=False):
    fn = torch_ops.DISPATCHED.qk_norm_rope if dispatched else torch_ops.DIRECT.qk_norm_rope
    fn(q, k, v, qw, kw, cos, sin, *outs, rms, EPS, off)


@pytest.mark.parametrize("dtype", cpu.DTYPES)
@pytest.mark.parametrize("case", QK_CASES, ids=["x".join(map(str, c)) for c in QK_CASES])
@pytest.mark.parametrize("variant", ["norm+weight+rope", "rope", "norm"])
@pytest.mark.parametrize("layout", ["separate", "bhsd", "misaligned"])
def test_qk_norm_rope_cuda_matches_reference(seed, dtype, case, variant, layout):
    b, s, h, d, s_total, off = case
    q, k, v, qw, kw, cos, sin = qk_inputs(seed, case, dtype, layout)
    rms = "norm" in variant
    if "weight" not in variant:
        qw = kw = None
    if "rope" not in variant:
        cos = sin = None
    out_layout = "bhsd" if layout == "bhsd" else "separate"
    ref = cpu.poisoned_outputs(b, s_total, h, d, dtype, out_layout)
    run_qk(q, k, v, qw, kw, cos, sin, rms, off, ref)
    cu = cuda_view
    for dispatched in (False, True):
        outs = [cu(t) for t in cpu.poisoned_outputs(b, s_total, h, d, dtype, out_layout)]
        run_qk(cu(q), cu(k), cu(v), cu(qw), cu(kw), cu(cos), cu(sin), rms, off, outs, dispatched)
        torch.cuda.synchronize()
        qo, ko, vo = (t.cpu() for t in outs)
        cpu.check_qk(qo, q, qw, cos, sin, rms, off, dtype)
        cpu.check_qk(ko, k, kw, cos, sin, rms, off, dtype)
        assert torch.equal(vo, ref[2])
        # the rotation's a*c - b*z can cancel (many units of a result near zero for one fp32
        # difference): one unit of the C reference only holds without it
        if dtype != "float32" and cos is None:
            assert ulps(qo, ref[0]).max() <= 1 and ulps(ko, ref[1]).max() <= 1


@pytest.mark.parametrize("d", [7, 1, 33])
def test_qk_norm_only_cuda_takes_any_head_dim(seed, d):
    gen = torch.Generator().manual_seed(seed)
    q, k, _ = cpu.qkv_views(gen, 2, 5, 3, d, "bfloat16")
    ref = cpu.poisoned_outputs(2, 5, 3, d, "bfloat16")
    torch_ops.DIRECT.qk_norm_rope(q, k, None, None, None, None, None, ref[0], ref[1], None, True, EPS, 0)
    outs = [t.cuda() for t in cpu.poisoned_outputs(2, 5, 3, d, "bfloat16")]
    torch_ops.DIRECT.qk_norm_rope(cuda_view(q), cuda_view(k), None, None, None, None, None, outs[0], outs[1], None,
                                  True, EPS, 0)
    torch.cuda.synchronize()
    assert ulps(outs[0].cpu(), ref[0]).max() <= 1 and ulps(outs[1].cpu(), ref[1]).max() <= 1
    assert torch.all(outs[2] == POISON)


def test_qk_norm_rope_cuda_refuses_head_dims_past_256():
    q = torch.randn(1, 2, 1, 258, device="cuda")
    outs = [torch.empty(1, 2, 1, 258, device="cuda") for _ in range(2)]
    with pytest.raises(NotImplementedError, match="head dims up to 256"):
        torch_ops.DIRECT.qk_norm_rope(q, q.clone(), None, None, None, None, None, outs[0], outs[1], None, True, EPS, 0)


def test_fused_ops_capture_in_a_cuda_graph(seed):
    """No allocation, no synchronization: both ops record into a CUDA graph and replay."""
    x, scale, shift = (cuda_view(t) for t in nm_case(seed, (1, 64, 3072), "bfloat16", "chunks"))
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (cuda_view(t) for t in cpu.qkv_views(gen, 1, 64, 4, 128, "bfloat16"))
    _, (cos, sin) = cpu.rope_tables(64, 128)
    cos, sin = cos.cuda(), sin.cuda()
    qw = torch.ones(128, dtype=torch.bfloat16, device="cuda")
    outs = [torch.empty(1, 64, 4, 128, dtype=torch.bfloat16, device="cuda") for _ in range(3)]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the capture
        torch_ops.DIRECT.norm_modulate(x, scale, shift, _C.NORM_LAYER, EPS, _C.FORMAT_FP8_E4M3)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        codes, codes_scale = torch_ops.DIRECT.norm_modulate(x, scale, shift, _C.NORM_LAYER, EPS, _C.FORMAT_FP8_E4M3)
        torch_ops.DIRECT.qk_norm_rope(q, k, v, qw, qw, cos, sin, *outs, True, EPS, 0)
    for t in outs:
        t.fill_(0)
    graph.replay()
    torch.cuda.synchronize()
    want_q, want_s = torch_ops.DIRECT.norm_modulate(x, scale, shift, _C.NORM_LAYER, EPS, _C.FORMAT_FP8_E4M3)
    assert torch.equal(codes, want_q) and torch.equal(codes_scale, want_s)
    assert torch.equal(outs[2], v)
