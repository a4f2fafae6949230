"""The fused DiT block ops on the CPU (the C reference): norm_modulate and qk_norm_rope.

Each is held against a float64 evaluation of cquant.h's formula on the same rounded inputs, with
the elementwise bounds of tolerances.py (derived from the fp32 roundings), and against diffusers'
unfused modules (AdaLayerNormZero's LayerNorm + modulation, RMSNorm + apply_rotary_emb) in bf16
and fp16. Quantized outputs are compared bit for bit with quantize of the op's own float output.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from cquant import _C, torch_ops  # noqa: E402

import tolerances as tol  # noqa: E402
from helpers import bits  # noqa: E402

DTYPES = ["float32", "float16", "bfloat16"]
HALF_DTYPES = ["bfloat16", "float16"]
NORMS = {"layer": _C.NORM_LAYER, "rms": _C.NORM_RMS}
FORMATS = {"int8": _C.FORMAT_INT8, "fp8_e4m3": _C.FORMAT_FP8_E4M3}
EPS = 1e-6
POISON = 7.0  # what rows of the outputs outside [seq_offset, seq_offset + S) hold before and after


def tdtype(name):
    return getattr(torch, name)


def f64(t):
    return t.detach().double().numpy() if t is not None else None


# ---------------------------------------------------------------- norm_modulate


def hidden_states(gen, b, s, d, dtype):
    """Activations like a DiT block's: N(0, 1) with per-channel offsets and per-token magnitudes."""
    x = torch.randn(b, s, d, generator=gen) * torch.exp(0.5 * torch.randn(b, s, 1, generator=gen))
    x += 0.5 * torch.randn(d, generator=gen)
    return x.to(tdtype(dtype))


def modulation(gen, b, d, dtype, chunks=6):
    """The adaLN modulation vector [B, 6 D] of a block; scale and shift are strided chunks of it."""
    emb = (0.3 * torch.randn(b, chunks * d, generator=gen)).to(tdtype(dtype))
    shift, scale = emb.chunk(chunks, dim=1)[:2]
    return emb, scale, shift


def norm_modulate_64(x, scale, shift, norm):
    """cquant.h's norm_modulate in float64: (v, n, 1 + scale, shift, mean |x| per row, rstd per row)."""
    x = f64(x)
    d = x.shape[-1]
    mu = x.mean(-1, keepdims=True) if norm == "layer" else 0.0
    c = x - mu
    rstd = 1.0 / np.sqrt((c * c).mean(-1, keepdims=True) + np.float64(np.float32(EPS)))
    n = c * rstd
    b = x.shape[0]
    ops = np.ones((b, 1, d)) if scale is None else 1.0 + f64(scale)[:, None, :]
    sh = np.zeros((b, 1, d)) if shift is None else f64(shift)[:, None, :]
    return n * ops + sh, n, ops, sh, np.abs(x).mean(-1, keepdims=True), rstd


def norm_modulate_bound(x, scale, shift, norm, dtype):
    v, n, ops, sh, mean_abs, rstd = norm_modulate_64(x, scale, shift, norm)
    pre = tol.norm_modulate_pre_error(x.shape[-1], mean_abs, rstd, n, ops, sh, norm == "layer")
    return v, tol.rounded_bound(pre, v, dtype)


def run_norm_modulate(x, scale, shift, norm, out_format=_C.FORMAT_NONE, dispatched=False):
    ops = torch_ops.DISPATCHED if dispatched else torch_ops.DIRECT
    return ops.norm_modulate(x, scale, shift, NORMS[norm], EPS, out_format)


SHAPES = [(1, 1, 72), (2, 77, 200), (1, 333, 72), (2, 3, 3000), (1, 5, 3072), (2, 1, 7)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm", list(NORMS))
@pytest.mark.parametrize("shape", SHAPES, ids=["x".join(map(str, s)) for s in SHAPES])
@pytest.mark.parametrize("mod", ["both", "scale", "shift", "none"])
def test_norm_modulate_matches_float64(seed, dtype, norm, shape, mod):
    gen = torch.Generator().manual_seed(seed)
    b, s, d = shape
    x = hidden_states(gen, b, s, d, dtype)
    _, scale, shift = modulation(gen, b, d, dtype)
    scale = scale if mod in ("both", "scale") else None
    shift = shift if mod in ("both", "shift") else None
    out, out_scale = run_norm_modulate(x, scale, shift, norm)
    assert out.shape == x.shape and out.dtype == x.dtype and out_scale.shape == (0,)
    v, bound = norm_modulate_bound(x, scale, shift, norm, dtype)
    err = np.abs(f64(out) - v)
    assert np.all(err <= bound), f"max error {err.max():.3g}, worst error / bound {(err / bound).max():.3g}"


def test_norm_modulate_bound_has_teeth(seed):
    """A plausible wrong kernel (the unbiased variance, or eps outside the square root) fails the
    float64 bound that the right one passes."""
    gen = torch.Generator().manual_seed(seed)
    x = 1e-3 * hidden_states(gen, 2, 33, 72, "float32")  # small rows: eps matters
    _, scale, shift = modulation(gen, 2, 72, "float32")
    v, bound = norm_modulate_bound(x, scale, shift, "layer", "float32")
    assert np.all(np.abs(f64(run_norm_modulate(x, scale, shift, "layer")[0]) - v) <= bound)
    xd = f64(x)
    c = xd - xd.mean(-1, keepdims=True)
    ops, sh = 1.0 + f64(scale)[:, None, :], f64(shift)[:, None, :]
    unbiased = c / np.sqrt((c * c).sum(-1, keepdims=True) / 71 + EPS) * ops + sh
    eps_outside = c / (np.sqrt((c * c).mean(-1, keepdims=True)) + EPS) * ops + sh
    for wrong in (unbiased, eps_outside):
        assert np.any(np.abs(wrong.astype(np.float32) - v) > bound)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm", list(NORMS))
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("shape", [(2, 77, 200), (1, 9, 3072), (2, 4, 72)], ids=["2x77x200", "1x9x3072", "2x4x72"])
def test_norm_modulate_quantized_is_quantize_of_its_output(seed, dtype, norm, fmt, shape):
    gen = torch.Generator().manual_seed(seed)
    b, s, d = shape
    x = hidden_states(gen, b, s, d, dtype)
    x[0, 0, d // 2] = float("nan")  # a row holding NaN: scale NaN, codes 0
    if s > 2:
        x[-1, 1, 3] = float("inf")  # and Inf
        x[0, 2] = 0.0  # all zeros: LayerNorm gives 0, the shift alone remains
    _, scale, shift = modulation(gen, b, d, dtype)
    t, _ = run_norm_modulate(x, scale, shift, norm)
    want_q, want_s = torch_ops.quantize(t, FORMATS[fmt], _C.GRANULARITY_ROW)
    for dispatched in (False, True):
        q, qs = run_norm_modulate(x, scale, shift, norm, FORMATS[fmt], dispatched=dispatched)
        assert q.dtype == want_q.dtype and q.shape == (b, s, d) and qs.shape == (b * s,)
        assert np.array_equal(bits(q).reshape(b * s, d), bits(want_q))
        assert np.array_equal(np.isnan(qs.numpy()), np.isnan(want_s.numpy()))
        assert np.isnan(qs[0].item()) and not bits(q)[0, 0].any()
        finite = ~np.isnan(want_s.numpy())
        assert np.array_equal(bits(qs)[finite], bits(want_s)[finite])


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_norm_modulate_quantized_zero_rows_take_the_amax_floor(fmt):
    """A row of t all zero (RMSNorm of zeros, no shift) has amax 0: its scale comes from CQ_AMAX_FLOOR."""
    x = torch.zeros(1, 2, 16, dtype=torch.bfloat16)
    q, qs = run_norm_modulate(x, None, None, "rms", FORMATS[fmt])
    want_q, want_s = torch_ops.quantize(torch.zeros(2, 16, dtype=torch.bfloat16), FORMATS[fmt], _C.GRANULARITY_ROW)
    assert np.array_equal(bits(qs), bits(want_s)) and not bits(q).any()
    assert qs[0].item() == pytest.approx(2.0**-90 / (127 if fmt == "int8" else 448), rel=1e-6)


@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("shape", [(2, 77, 200), (1, 64, 3072), (2, 5, 72)], ids=["2x77x200", "1x64x3072", "2x5x72"])
def test_norm_modulate_matches_diffusers_ada_layer_norm_zero(seed, dtype, shape):
    """AdaLayerNormZero's norm(x) * (1 + scale_msa[:, None]) + shift_msa[:, None], with scale and
    shift the op reads in place as chunks of the block's modulation vector."""
    from diffusers.models.normalization import AdaLayerNormZero

    gen = torch.Generator().manual_seed(seed)
    b, s, d = shape
    torch.manual_seed(seed)
    block = AdaLayerNormZero(d).to(tdtype(dtype))
    x = hidden_states(gen, b, s, d, dtype)
    temb = torch.randn(b, d, generator=gen).to(tdtype(dtype))
    with torch.no_grad():
        want = block(x, emb=temb)[0]
        emb = block.linear(block.silu(temb))
    shift, scale = emb.chunk(6, dim=1)[:2]
    assert scale.stride() == (6 * d, 1)
    out, _ = run_norm_modulate(x, scale, shift, "layer")
    v, n, ops, sh, mean_abs, rstd = norm_modulate_64(x, scale, shift, "layer")
    pre = tol.norm_modulate_pre_error(d, mean_abs, rstd, n, ops, sh, True)
    bound = tol.unfused_modulate_abs_bound(pre, n, ops, v, dtype)
    err = np.abs(f64(out) - f64(want))
    assert np.all(err <= bound), f"max error {err.max():.3g}, worst error / bound {(err / bound).max():.3g}"


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_rms_modulate_matches_diffusers_rmsnorm(seed, dtype):
    from diffusers.models.normalization import RMSNorm

    gen = torch.Generator().manual_seed(seed)
    b, s, d = 2, 33, 200
    x = hidden_states(gen, b, s, d, dtype)
    _, scale, shift = modulation(gen, b, d, dtype)
    want = RMSNorm(d, eps=EPS, elementwise_affine=False)(x) * (1 + scale[:, None]) + shift[:, None]
    out, _ = run_norm_modulate(x, scale, shift, "rms")
    v, n, ops, sh, mean_abs, rstd = norm_modulate_64(x, scale, shift, "rms")
    pre = tol.norm_modulate_pre_error(d, mean_abs, rstd, n, ops, sh, False)
    err = np.abs(f64(out) - f64(want))
    assert np.all(err <= tol.unfused_modulate_abs_bound(pre, n, ops, v, dtype))


def test_norm_modulate_samples_take_their_own_modulation(seed):
    """B = 2 with different scale / shift per sample equals two B = 1 calls."""
    gen = torch.Generator().manual_seed(seed)
    x = hidden_states(gen, 2, 7, 200, "bfloat16")
    _, scale, shift = modulation(gen, 2, 200, "bfloat16")
    both, _ = run_norm_modulate(x, scale, shift, "layer")
    for i in range(2):
        one, _ = run_norm_modulate(x[i:i + 1], scale[i:i + 1], shift[i:i + 1], "layer")
        assert torch.equal(both[i:i + 1], one)
    assert not torch.equal(both[0], run_norm_modulate(x[:1], scale[1:], shift[1:], "layer")[0][0])


def test_norm_modulate_takes_non_contiguous_x_and_broadcast_modulation(seed):
    """The torch op makes x contiguous (the C op needs it) and reads a zero-stride scale in place."""
    gen = torch.Generator().manual_seed(seed)
    x = hidden_states(gen, 2, 6, 72, "float16")
    scale = (0.1 * torch.randn(1, 72, generator=gen)).half().expand(2, 72)
    want, _ = run_norm_modulate(x, scale.contiguous(), None, "layer")
    got, _ = run_norm_modulate(x.transpose(0, 1).contiguous().transpose(0, 1), scale, None, "layer")
    assert torch.equal(got, want)


def test_norm_modulate_empty_input():
    out, s = run_norm_modulate(torch.empty(2, 0, 8, dtype=torch.bfloat16), None, None, "layer", _C.FORMAT_INT8)
    assert out.shape == (2, 0, 8) and out.dtype == torch.int8 and s.shape == (0,)


# ---------------------------------------------------------------- qk_norm_rope


def rope_tables(s_total, d, theta=10000.0):
    """Flux's cos / sin (diffusers' get_1d_rotary_pos_embed, repeat_interleave_real), [S_total, D]
    each, and cquant's [S_total, D / 2] (one entry per pair)."""
    from diffusers.models.embeddings import get_1d_rotary_pos_embed

    cos, sin = get_1d_rotary_pos_embed(d, np.arange(s_total), theta=theta, use_real=True, repeat_interleave_real=True)
    return (cos.float(), sin.float()), (cos[:, ::2].float().contiguous(), sin[:, ::2].float().contiguous())


def qkv_views(gen, b, s, h, d, dtype):
    """q, k, v [B, S, H, D] as views of one fused projection output [B, S, 3 H D] (strided)."""
    qkv = (torch.randn(b, s, 3 * h * d, generator=gen) * 2.0 + 0.3).to(tdtype(dtype))
    return [t.unflatten(-1, (h, d)) for t in qkv.chunk(3, dim=-1)]


def qk_64(x, w, cos, sin, rms_norm, seq_offset):
    """cquant.h's qk_norm_rope of one tensor in float64: (out rows [B, S, H, D], terms)."""
    a = f64(x)
    d = a.shape[-1]
    if rms_norm:
        a = a / np.sqrt((a * a).mean(-1, keepdims=True) + np.float64(np.float32(EPS)))
        if w is not None:
            a = a * f64(w)
    if cos is None:
        return a, np.abs(a)
    s = a.shape[1]
    c = f64(cos)[seq_offset:seq_offset + s][None, :, None, :]
    z = f64(sin)[seq_offset:seq_offset + s][None, :, None, :]
    a0, a1 = a[..., 0::2], a[..., 1::2]
    out = np.empty_like(a)
    out[..., 0::2] = a0 * c - a1 * z
    out[..., 1::2] = a0 * z + a1 * c
    terms = np.empty_like(a)
    terms[..., 0::2] = np.abs(a0 * c) + np.abs(a1 * z)
    terms[..., 1::2] = np.abs(a0 * z) + np.abs(a1 * c)
    return out, terms


def poisoned_outputs(b, s_total, h, d, dtype, layout="separate"):
    """q_out, k_out, v_out [B, S_total, H, D] filled with POISON: separate tensors, or the heads of
    one [B, S_total, 3, H, D] buffer (strided, interleaved per token), or transposed views of
    [B, H, S_total, D] tensors (the layout SDPA reads)."""
    if layout == "separate":
        return [torch.full((b, s_total, h, d), POISON, dtype=tdtype(dtype)) for _ in range(3)]
    if layout == "bhsd":
        return [torch.full((b, h, s_total, d), POISON, dtype=tdtype(dtype)).transpose(1, 2) for _ in range(3)]
    raise ValueError(layout)


def check_qk(out, x, w, cos, sin, rms_norm, seq_offset, dtype):
    s = x.shape[1]
    want, terms = qk_64(x, w, cos, sin, rms_norm, seq_offset)
    got = f64(out[:, seq_offset:seq_offset + s])
    bound = tol.rounded_bound(tol.qk_norm_rope_pre_error(x.shape[-1], terms), want, dtype)
    err = np.abs(got - want)
    assert np.all(err <= bound), f"max error {err.max():.3g}, worst error / bound {(err / bound).max():.3g}"
    outside = torch.cat([out[:, :seq_offset], out[:, seq_offset + s:]], dim=1)
    assert torch.all(outside == POISON), "rows outside [seq_offset, seq_offset + S) were written"


QK_CASES = [  # (B, S, H, D, S_total, seq_offset)
    (1, 1, 1, 64, 1, 0),
    (2, 77, 3, 128, 77, 0),
    (1, 33, 2, 72, 40, 7),
    (2, 5, 2, 256, 12, 6),
    (1, 9, 24, 128, 20, 11),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", QK_CASES, ids=["x".join(map(str, c)) for c in QK_CASES])
@pytest.mark.parametrize("variant", ["norm+weight+rope", "norm+rope", "rope", "norm+weight", "copy"])
@pytest.mark.parametrize("layout", ["separate", "bhsd"])
def test_qk_norm_rope_matches_float64(seed, dtype, case, variant, layout):
    gen = torch.Generator().manual_seed(seed)
    b, s, h, d, s_total, off = case
    q, k, v = qkv_views(gen, b, s, h, d, dtype)
    rms_norm = "norm" in variant
    qw = kw = None
    if "weight" in variant:
        qw = (1 + 0.2 * torch.randn(d, generator=gen)).to(tdtype(dtype))
        kw = (1 + 0.2 * torch.randn(d, generator=gen)).float()  # weights need not share the inputs' dtype
    cos = sin = None
    if "rope" in variant:
        _, (cos, sin) = rope_tables(s_total, d)
    qo, ko, vo = poisoned_outputs(b, s_total, h, d, dtype, layout)
    for fn in (torch_ops.DIRECT.qk_norm_rope, torch_ops.DISPATCHED.qk_norm_rope):
        fn(q, k, v, qw, kw, cos, sin, qo, ko, vo, rms_norm, EPS, off)
        check_qk(qo, q, qw, cos, sin, rms_norm, off, dtype)
        check_qk(ko, k, kw, cos, sin, rms_norm, off, dtype)
        assert torch.equal(vo[:, off:off + s], v)
        check_qk(vo, v, None, None, None, False, off, dtype)
    if variant == "copy":
        assert torch.equal(qo[:, off:off + s], q) and torch.equal(ko[:, off:off + s], k)


@pytest.mark.parametrize("d", [7, 1])
def test_qk_norm_only_takes_any_head_dim(seed, d):
    gen = torch.Generator().manual_seed(seed)
    q, k, _ = qkv_views(gen, 2, 5, 3, d, "bfloat16")
    qo, ko, _ = poisoned_outputs(2, 5, 3, d, "bfloat16")
    torch_ops.DIRECT.qk_norm_rope(q, k, None, None, None, None, None, qo, ko, None, True, EPS, 0)
    check_qk(qo, q, None, None, None, True, 0, "bfloat16")
    check_qk(ko, k, None, None, None, True, 0, "bfloat16")


def test_qk_norm_rope_bound_has_teeth(seed):
    """Rotating the other way (sin negated), or pairing the halves (unbind dim -2) instead of
    neighbours, fails the bound the right rotation passes."""
    gen = torch.Generator().manual_seed(seed)
    q, _, _ = qkv_views(gen, 1, 9, 2, 64, "float32")
    _, (cos, sin) = rope_tables(9, 64)
    want, terms = qk_64(q, None, cos, sin, True, 0)
    bound = tol.rounded_bound(tol.qk_norm_rope_pre_error(64, terms), want, "float32")
    wrong, _ = qk_64(q, None, cos, -sin, True, 0)
    assert np.any(np.abs(wrong - want) > bound)
    a = qk_64(q, None, None, None, True, 0)[0]
    c, z = f64(cos)[None, :, None, :], f64(sin)[None, :, None, :]
    halves = np.concatenate([a[..., :32] * c - a[..., 32:] * z, a[..., :32] * z + a[..., 32:] * c], -1)
    assert np.any(np.abs(halves - want) > bound)


@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("d", [128, 64])
def test_qk_norm_rope_matches_diffusers_joint_attention(seed, dtype, d):
    """Flux's joint attention: the text and image streams each normed (their own RMSNorm weights)
    and rotated by their rows of one table, written by two calls into one [B, S_txt + S_img, H, D]
    buffer; diffusers concatenates and rotates unfused."""
    from diffusers.models.embeddings import apply_rotary_emb
    from diffusers.models.normalization import RMSNorm

    gen = torch.Generator().manual_seed(seed)
    b, h, s_txt, s_img = 2, 3, 17, 50
    s_total = s_txt + s_img
    (cos_full, sin_full), (cos, sin) = rope_tables(s_total, d)
    norms = {}
    for name in ("q", "k", "q_txt", "k_txt"):
        norms[name] = RMSNorm(d, eps=EPS).to(tdtype(dtype))
        with torch.no_grad():
            norms[name].weight.copy_(1 + 0.2 * torch.randn(d, generator=gen))
    img = qkv_views(gen, b, s_img, h, d, dtype)
    txt = qkv_views(gen, b, s_txt, h, d, dtype)
    with torch.no_grad():
        want = {}
        for i, name in enumerate("qk"):
            joint = torch.cat([norms[name + "_txt"](txt[i]), norms[name](img[i])], dim=1)
            want[name] = apply_rotary_emb(joint, (cos_full, sin_full), sequence_dim=1)
    qo, ko, vo = poisoned_outputs(b, s_total, h, d, dtype)
    torch_ops.DIRECT.qk_norm_rope(*txt, norms["q_txt"].weight, norms["k_txt"].weight, cos, sin, qo, ko, vo, True, EPS, 0)
    torch_ops.DIRECT.qk_norm_rope(*img, norms["q"].weight, norms["k"].weight, cos, sin, qo, ko, vo, True, EPS, s_txt)
    assert torch.equal(vo, torch.cat([txt[2], img[2]], dim=1))
    for i, (name, out) in enumerate((("q", qo), ("k", ko))):
        ref_parts = [qk_64(txt[i], norms[name + "_txt"].weight, cos, sin, True, 0),
                     qk_64(img[i], norms[name].weight, cos, sin, True, s_txt)]
        ref = np.concatenate([p[0] for p in ref_parts], 1)
        terms = np.concatenate([p[1] for p in ref_parts], 1)
        pre = tol.qk_norm_rope_pre_error(d, terms)
        err = np.abs(f64(out) - f64(want[name]))
        bound = tol.unfused_qk_abs_bound(pre, terms, ref, dtype)
        assert np.all(err <= bound), f"{name}: worst error / bound {(err / bound).max():.3g}"


def test_qk_norm_rope_requires_grad_outputs_are_written_in_place(seed):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = qkv_views(gen, 1, 4, 2, 8, "float32")
    qo, ko, vo = (t.requires_grad_() for t in poisoned_outputs(1, 4, 2, 8, "float32"))
    with torch.no_grad():
        torch_ops.DIRECT.qk_norm_rope(q, k, v, None, None, None, None, qo, ko, vo, False, EPS, 0)
    assert torch.equal(qo.detach(), q) and torch.equal(vo.detach(), v)


def test_fused_ops_pass_torch_library_opcheck(seed):
    """Schemas, fakes and the declared mutations agree with what the ops do."""
    gen = torch.Generator().manual_seed(seed)
    x = hidden_states(gen, 2, 5, 16, "bfloat16")
    _, scale, shift = modulation(gen, 2, 16, "bfloat16")
    for fmt in (_C.FORMAT_NONE, _C.FORMAT_INT8, _C.FORMAT_FP8_E4M3):
        torch.library.opcheck(torch.ops.cquant.norm_modulate.default, (x, scale, shift, _C.NORM_LAYER, EPS, fmt))
    q, k, v = qkv_views(gen, 2, 5, 2, 8, "bfloat16")
    _, (cos, sin) = rope_tables(7, 8)
    qo, ko, vo = poisoned_outputs(2, 7, 2, 8, "bfloat16")
    torch.library.opcheck(torch.ops.cquant.qk_norm_rope.default,
                          (q, k, v, None, None, cos, sin, qo, ko, vo, True, EPS, 2))


# ---------------------------------------------------------------- bad inputs


def _nm(x=None, scale=None, shift=None, norm=_C.NORM_LAYER, eps=EPS, fmt=_C.FORMAT_NONE):
    x = torch.randn(2, 3, 8, dtype=torch.bfloat16) if x is None else x
    return lambda: torch_ops.DIRECT.norm_modulate(x, scale, shift, norm, eps, fmt)


def _nm_c(out=None, out_scale=None, fmt=_C.FORMAT_NONE, x=None):
    """The extension's norm_modulate with caller-given outputs."""
    x = torch.randn(2, 3, 8) if x is None else x
    out = torch.empty(2, 3, 8) if out is None else out
    return lambda: _C.norm_modulate(x, None, None, out, out_scale, _C.NORM_LAYER, EPS, fmt)


def _qk(d=8, s=3, s_total=5, off=0, rope=True, q_dtype=torch.float32, k_dtype=torch.float32, weights=False,
        rms_norm=True, out_dtype=torch.float32, cos_dtype=torch.float32, cos_rows=None, drop=(), outs=None,
        w_shape=None):
    q = torch.randn(1, s, 2, d, dtype=q_dtype)
    k = torch.randn(1, s, 2, d, dtype=k_dtype)
    v = torch.randn(1, s, 2, d, dtype=q_dtype)
    cos = torch.randn(s_total if cos_rows is None else cos_rows, d // 2, dtype=cos_dtype) if rope else None
    sin = torch.randn_like(cos) if rope else None
    w = torch.ones(w_shape or (d,)) if weights else None
    qo, ko, vo = outs if outs is not None else [torch.empty(1, s_total, 2, d, dtype=out_dtype) for _ in range(3)]
    args = dict(q_in=q, k_in=k, v_in=v, q_weight=w, k_weight=w, cos=cos, sin=sin, q_out=qo, k_out=ko, v_out=vo)
    for name in drop:
        args[name] = None
    return lambda: torch_ops.DIRECT.qk_norm_rope(*args.values(), rms_norm, EPS, off)


def _overlapping_outs():
    buf = torch.empty(1, 6, 2, 8)
    return buf[:, :5], buf[:, 1:], torch.empty(1, 5, 2, 8)


BAD = [
    ("x-2d", ValueError, "x has 2 dims", _nm(x=torch.randn(3, 8))),
    ("x-int8", TypeError, "x has dtype int8", _nm(x=torch.ones(2, 3, 8, dtype=torch.int8))),
    ("scale-shape", ValueError, "scale", _nm(scale=torch.randn(2, 9, dtype=torch.bfloat16))),
    ("shift-batch", ValueError, "shift", _nm(shift=torch.randn(3, 8, dtype=torch.bfloat16))),
    ("scale-3d", ValueError, "scale has 3 dims", _nm(scale=torch.randn(2, 1, 8, dtype=torch.bfloat16))),
    ("scale-int", TypeError, "scale has dtype int32", _nm(scale=torch.ones(2, 8, dtype=torch.int32))),
    ("norm", ValueError, "norm = 3", _nm(norm=3)),
    ("eps-negative", ValueError, "eps", _nm(eps=-1.0)),
    ("eps-nan", ValueError, "eps", _nm(eps=float("nan"))),
    ("out-format", ValueError, "out_format = 3", _nm(fmt=_C.FORMAT_FP8_E5M2)),
    ("out-overlaps-x", ValueError, "overlaps", (lambda x: _nm_c(out=x, x=x))(torch.randn(2, 3, 8))),
    ("out-dtype", TypeError, "out has dtype", _nm_c(out=torch.empty(2, 3, 8, dtype=torch.float16))),
    ("out-shape", ValueError, "out has shape", _nm_c(out=torch.empty(2, 4, 8))),
    ("out-scale-missing", ValueError, "out_scale is required",
     _nm_c(out=torch.empty(2, 3, 8, dtype=torch.int8), fmt=_C.FORMAT_INT8)),
    ("out-scale-size", ValueError, "out_scale has 5 elements",
     _nm_c(out=torch.empty(2, 3, 8, dtype=torch.int8), out_scale=torch.empty(5), fmt=_C.FORMAT_INT8)),
    ("out-scale-unwanted", ValueError, "out_scale is given", _nm_c(out_scale=torch.empty(6))),
    ("x-strided-c", ValueError, "x is not contiguous", _nm_c(x=torch.randn(3, 2, 8).transpose(0, 1))),
    ("rope-odd-d", ValueError, "head_dim = 7 is odd", _qk(d=7)),
    ("offset-past-end", ValueError, "seq_offset = 3", _qk(off=3)),
    ("offset-negative", ValueError, "seq_offset = -1", _qk(off=-1)),
    ("k-dtype", TypeError, "k_in has dtype", _qk(k_dtype=torch.float16)),
    ("out-dtype-qk", TypeError, "q_out has dtype", _qk(out_dtype=torch.float16)),
    ("cos-dtype", TypeError, "cos has dtype", _qk(cos_dtype=torch.float16)),
    ("cos-rows", ValueError, "cos has", _qk(cos_rows=4)),
    ("cos-without-sin", ValueError, "cos is given without sin", _qk(drop=("sin",))),
    ("v-without-v-out", ValueError, "v_in is given without v_out", _qk(drop=("v_out",))),
    ("weight-without-norm", ValueError, "q_weight is given but rms_norm is 0", _qk(weights=True, rms_norm=False)),
    ("weight-size", ValueError, "q_weight has", _qk(weights=True, w_shape=(9,))),
    ("outs-overlap", ValueError, "overlaps", _qk(outs=_overlapping_outs())),
    ("out-self-overlap", ValueError, "elements do not alias",
     _qk(outs=(torch.empty(1, 5, 1, 8).expand(1, 5, 2, 8), torch.empty(1, 5, 2, 8), torch.empty(1, 5, 2, 8)))),
    ("out-last-dim-strided", ValueError, "stride 2 in its last dim",
     _qk(outs=(torch.empty(1, 5, 2, 16)[..., ::2], torch.empty(1, 5, 2, 8), torch.empty(1, 5, 2, 8)))),
]


@pytest.mark.parametrize("name, exc, match, fn", BAD, ids=[b[0] for b in BAD])
def test_bad_inputs_raise_clear_errors(name, exc, match, fn):
    with pytest.raises(exc, match=match):
        fn()


def test_qk_output_overlapping_its_input_is_refused():
    q = torch.randn(1, 4, 2, 8)
    k = torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match="q_out overlaps q_in"):
        torch_ops.DIRECT.qk_norm_rope(q, k, None, None, None, None, None, q, torch.empty_like(k), None, True, EPS, 0)

