"""CPU tests of cquant's fused attention: the C reference against float64 NumPy attention, the
8-bit mode against its accuracy targets and an independent NumPy evaluation of its math,
argument checks, the torch custom op, and the diffusers backend on tiny transformers."""

import math
import warnings

import numpy as np
import pytest

import cquant
from cquant import ops
from helpers import run_fresh_python, under_asan
from attention_oracle import attention_f64, attention_int8, cosine, rel_l2
from tolerances import (ATTN_INT8_CONSTANT_VALUES_REL, ATTN_INT8_LSE_ABS, ATTN_INT8_MIN_COSINE, ATTN_INT8_REL_L2,
                        ATTN_INT8_REL_L2_IID, ATTN_INT8_VS_NUMPY_REL_L2,
                        ATTN_MODEL_FULL_REL_L2, ATTN_MODEL_INT8_REL_L2, ATTN_REF_LSE_ABS, ATTN_REF_REL_L2)


# (B, Sq, Skv, H, D): odd lengths, self and cross attention, every head dim family.
SHAPES = [
    (1, 1, 1, 1, 64),
    (2, 77, 77, 3, 64),
    (1, 333, 77, 2, 72),
    (1, 77, 333, 2, 128),
    (2, 33, 97, 2, 40),
    (1, 5, 7, 1, 8),
]


def _qkv(rng, b, sq, skv, h, d, dtype=np.float32):
    q = rng.standard_normal((b, sq, h, d)).astype(dtype)
    k = rng.standard_normal((b, skv, h, d)).astype(dtype)
    v = rng.standard_normal((b, skv, h, d)).astype(dtype)
    return q, k, v


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_full_numpy_vs_float64(rng, shape, dtype):
    b, sq, skv, h, d = shape
    q, k, v = _qkv(rng, b, sq, skv, h, d, np.dtype(dtype))
    scale = 1.0 / math.sqrt(d)
    out, lse = cquant.attention(q, k, v, return_lse=True)
    ref, ref_lse = attention_f64(q, k, v, scale)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert lse.dtype == np.float32 and lse.shape == (b, h, sq)
    assert rel_l2(out, ref) <= ATTN_REF_REL_L2[dtype]
    assert np.abs(lse - ref_lse).max() <= ATTN_REF_LSE_ABS * max(1.0, np.abs(ref_lse).max())


@pytest.mark.per_build
@pytest.mark.parametrize("shape", SHAPES[1:4])
def test_full_bfloat16_torch_vs_float64(rng, shape):
    torch = pytest.importorskip("torch")
    b, sq, skv, h, d = shape
    q, k, v = (torch.from_numpy(t).to(torch.bfloat16) for t in _qkv(rng, b, sq, skv, h, d))
    scale = 0.3
    out = cquant.attention(q, k, v, scale=scale)
    assert out.dtype == torch.bfloat16 and tuple(out.shape) == (b, sq, h, d)
    ref, _ = attention_f64(*(t.float().numpy() for t in (q, k, v)), scale)
    assert rel_l2(out.float().numpy(), ref) <= ATTN_REF_REL_L2["bfloat16"]


def test_strided_views_and_out(rng):
    """q, k, v read straight from a packed qkv projection; out written into a wider buffer."""
    b, s, h, d = 2, 77, 3, 72
    qkv = rng.standard_normal((b, s, 3, h, d)).astype(np.float32)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    assert not q.flags.c_contiguous
    big = np.full((b, s, h + 2, d), np.nan, np.float32)
    out = big[:, :, 1:h + 1]
    res = cquant.attention(q, k, v, out=out, scale=0.2)
    assert res is out
    ref, _ = attention_f64(q, k, v, 0.2)
    assert rel_l2(out, ref) <= ATTN_REF_REL_L2["float32"]
    assert np.isnan(big[:, :, 0]).all() and np.isnan(big[:, :, h + 1]).all()


def test_large_scores_stay_finite(rng):
    q, k, v = _qkv(rng, 1, 33, 65, 2, 64)
    out, lse = cquant.attention(q * 30, k * 30, v, return_lse=True)
    ref, ref_lse = attention_f64(q * 30, k * 30, v, 1 / 8)
    assert np.isfinite(out).all()
    assert rel_l2(out, ref) <= ATTN_REF_REL_L2["float32"]
    assert np.abs(lse - ref_lse).max() <= ATTN_REF_LSE_ABS * np.abs(ref_lse).max()


def test_nan_input_propagates(rng):
    q, k, v = _qkv(rng, 1, 7, 9, 1, 64)
    k[0, 3, 0, 5] = np.nan
    out = cquant.attention(q, k, v)
    assert np.isnan(out).all()


# ---------------------------------------------------------------- 8-bit reference


INT8_SHAPES = [(1, 77, 333, 2, 64), (2, 333, 77, 1, 72), (1, 97, 97, 2, 128), (1, 1, 1, 1, 64), (1, 65, 129, 1, 40)]


@pytest.mark.parametrize("shape", INT8_SHAPES)
@pytest.mark.parametrize("key_offset", [0.0, 20.0])
@pytest.mark.parametrize("values", ["channel_means", "iid"])
def test_int8_reference_accuracy(rng, shape, key_offset, values):
    b, sq, skv, h, d = shape
    q, k, v = _qkv(rng, b, sq, skv, h, d)
    # Keys with large per-channel offsets (the case K smoothing exists for): without it the
    # int8 scale of K would be set by the offsets and the scores lose most of their bits.
    k = k + (key_offset * rng.standard_normal((1, 1, h, d))).astype(np.float32)
    if values == "channel_means":
        v = v + rng.standard_normal((1, 1, h, d)).astype(np.float32)
    scale = 1.0 / math.sqrt(d)
    out, lse = cquant.attention(q, k, v, mode="int8", return_lse=True)
    ref, ref_lse = attention_f64(q, k, v, scale)
    assert cosine(out, ref) >= ATTN_INT8_MIN_COSINE
    assert rel_l2(out, ref) <= (ATTN_INT8_REL_L2 if values == "channel_means" else ATTN_INT8_REL_L2_IID)
    assert np.abs(lse - ref_lse).max() <= ATTN_INT8_LSE_ABS * max(1.0, np.abs(ref_lse).max())


@pytest.mark.per_build
@pytest.mark.parametrize("blocks", [(32, 64), (1, 16), (7, 5), (128, 128)])
@pytest.mark.parametrize("scale", [0.17, -0.1])
def test_int8_reference_is_the_documented_math(rng, blocks, scale):
    """Heads within the accuracy bound (all of them here) follow the documented 8-bit math."""
    qb, kb = blocks
    q, k, v = _qkv(rng, 2, 77, 150, 2, 72)
    k += 3.0 * rng.standard_normal((1, 1, 2, 72)).astype(np.float32)
    assert (ops.attention_int8_logit_error(q, k, scale, q_block=qb, k_block=kb) <= ops.ATTENTION_INT8_MAX_LOGIT_ERROR).all()
    out, lse = cquant.attention(q, k, v, mode="int8", scale=scale, q_block=qb, k_block=kb, return_lse=True)
    ref, ref_lse = attention_int8(q, k, v, scale, q_block=qb, k_block=kb)
    assert rel_l2(out, ref) <= ATTN_INT8_VS_NUMPY_REL_L2
    assert np.abs(lse - ref_lse).max() <= 1e-4 * np.abs(ref_lse).max()


@pytest.mark.parametrize("shape", [(1, 5, 333, 2, 64), (2, 40, 150, 1, 72), (1, 3, 1, 2, 8)])
def test_int8_constant_values_come_back(rng, shape):
    """Every key's value the same (per channel): whatever the softmax weights, the 8-bit output
    is that value, since l sums the same rounded P codes that weight the values."""
    b, sq, skv, h, d = shape
    q, k, _ = _qkv(rng, b, sq, skv, h, d)
    c = rng.uniform(0.5, 2.0, (1, 1, h, d)).astype(np.float32) * rng.choice([-1.0, 1.0], (1, 1, h, d)).astype(np.float32)
    v = np.broadcast_to(c, (b, skv, h, d)).copy()
    out = cquant.attention(q, k, v, mode="int8", scale=0.3)
    err = np.abs(out - np.broadcast_to(c, out.shape)) / np.abs(c)
    assert err.max() <= ATTN_INT8_CONSTANT_VALUES_REL


def test_int8_non_finite_value_channel(rng):
    """A value channel holding inf or NaN (cquant.h): its codes are all 0 and its scale NaN, so
    that channel's outputs are NaN; the other channels keep the 8-bit math."""
    q, k, v = _qkv(rng, 1, 40, 150, 2, 16)
    v[0, 7, 0, 3], v[0, 100, 1, 9] = np.inf, np.nan
    out = cquant.attention(q, k, v, mode="int8", scale=0.25)
    ref, _ = attention_int8(q, k, v, 0.25)
    bad = np.zeros(out.shape, bool)
    bad[:, :, 0, 3] = bad[:, :, 1, 9] = True
    assert (np.isnan(out) == bad).all() and (np.isnan(ref) == bad).all()
    assert rel_l2(out[~bad], ref[~bad]) <= ATTN_INT8_VS_NUMPY_REL_L2


def test_int8_scores_are_exact_past_the_int32_range():
    """The C reference sums the Q.K codes exactly for any head dim: at D = 140000 the sum of
    127^2 products passes 2^31 (in int32 it wrapped, and the 8-bit mode picked the other key)."""
    d = 140000
    q = np.full((1, 1, 1, d), 0.2, np.float32)
    k = np.full((1, 2, 1, d), 0.2, np.float32)
    k[0, 1] = -0.2
    v = np.zeros((1, 2, 1, d), np.float32)
    v[0, :, 0, 0] = [1.0, -1.0]
    scale = float(np.log(2.0))  # logits q . k in log2 units: +-5600, so key 0 takes all weight
    assert ops.attention_int8_logit_error(q, k, scale) <= ops.ATTENTION_INT8_MAX_LOGIT_ERROR  # not a fallback
    out = cquant.attention(q, k, v, scale=scale, mode="int8")
    assert out[0, 0, 0, 0] == pytest.approx(1.0, rel=ATTN_INT8_CONSTANT_VALUES_REL)  # one value code times its scale


def test_int8_smoothing_matters(rng):
    """Keys with a large common offset: the same quantized math without K smoothing misses the
    accuracy bar by far, cquant's (smoothed) 8-bit mode meets it."""
    q, k, v = _qkv(rng, 1, 64, 256, 1, 64)
    k = k + 50.0 * rng.standard_normal((1, 1, 1, 64)).astype(np.float32)
    ref, _ = attention_f64(q, k, v, 0.125)
    out = cquant.attention(q, k, v, mode="int8", scale=0.125)
    assert rel_l2(out, ref) <= ATTN_INT8_REL_L2_IID and cosine(out, ref) >= ATTN_INT8_MIN_COSINE
    unsmoothed, _ = attention_int8(q, k, v, 0.125, smooth=False)
    assert rel_l2(unsmoothed, ref) > 3 * ATTN_INT8_REL_L2_IID


def test_int8_float16_and_bfloat16(rng):
    torch = pytest.importorskip("torch")
    q, k, v = _qkv(rng, 1, 77, 97, 2, 64)
    ref, _ = attention_f64(q, k, v, 0.125)
    for dt in (torch.float16, torch.bfloat16):
        out = cquant.attention(*(torch.from_numpy(t).to(dt) for t in (q, k, v)), mode="int8")
        assert out.dtype == dt
        assert cosine(out.float().numpy(), ref) >= ATTN_INT8_MIN_COSINE


# ---------------------------------------------------------------- bad inputs


def test_bad_inputs_raise(rng):
    q, k, v = _qkv(rng, 1, 7, 9, 2, 64)
    with pytest.raises(ValueError, match="q has shape .7, 2, 64.; expected 4 dims"):
        cquant.attention(q[0], k, v)
    with pytest.raises(ValueError, match="k has shape"):
        cquant.attention(q, k[:, :, :1], v)
    with pytest.raises(ValueError, match="v has shape"):
        cquant.attention(q, k, v[:, :5])
    with pytest.raises(TypeError, match="one dtype"):
        cquant.attention(q, k.astype(np.float16), v)
    with pytest.raises(TypeError, match="q has dtype int32"):
        cquant.attention(q.astype(np.int32), k.astype(np.int32), v.astype(np.int32))
    with pytest.raises(ValueError, match="mode must be"):
        cquant.attention(q, k, v, mode="int4")
    with pytest.raises(ValueError, match="finite softmax scale"):
        cquant.attention(q, k, v, scale=float("nan"))
    with pytest.raises(ValueError, match="q_block must be a positive int"):
        cquant.attention(q, k, v, mode="int8", q_block=0)
    with pytest.raises(ValueError, match="out has shape"):
        cquant.attention(q, k, v, out=np.empty((1, 7, 2, 32), np.float32))
    with pytest.raises(TypeError, match="out has dtype float16"):
        cquant.attention(q, k, v, out=np.empty(q.shape, np.float16))
    with pytest.raises(ValueError, match="stride .* in its last dim"):
        cquant.attention(q[..., ::2], k[..., ::2], v[..., ::2])
    with pytest.raises(ValueError, match="out overlaps q"):
        cquant.attention(q, k, v, out=q)
    with pytest.raises(ValueError, match="k .* and v .* must be"):
        cquant.attention(q[:, :0], k[:, :, :1], v)  # shapes are checked when there is nothing to compute too
    ro = np.empty(q.shape, np.float32)
    ro.flags.writeable = False
    with pytest.raises((ValueError, BufferError), match="read-only|readonly"):
        cquant.attention(q, k, v, out=ro)


def _strided_out(shape, strides_elems, dtype=np.float32):
    """A writable [B, Sq, H, D] view with the given element strides over a buffer of its own."""
    itemsize = np.dtype(dtype).itemsize
    span = 1 + sum((n - 1) * st for n, st in zip(shape, strides_elems))
    buf = np.zeros(span, dtype)
    return np.lib.stride_tricks.as_strided(buf, shape, [st * itemsize for st in strides_elems], writeable=True)


@pytest.mark.parametrize("mode", [cquant._C.ATTENTION_FULL, cquant._C.ATTENTION_INT8])
@pytest.mark.parametrize("strides", [(0, 16, 8, 1), (56, 0, 8, 1), (112, 16, 0, 1), (56, 8, 4, 1), (56, 8, 7, 1)],
                         ids=["batch 0", "seq 0", "heads 0", "heads interleaved", "heads overlap by one"])
def test_outputs_whose_elements_alias_are_refused(rng, mode, strides):
    """An output whose strides make different elements share memory (zero or overlapping strides)
    would be written by several threads at once: refused, whatever the mode."""
    q, k, v = _qkv(rng, 2, 7, 5, 2, 8)
    out = _strided_out((2, 7, 2, 8), strides)
    with pytest.raises(ValueError, match="out has stride .* share memory"):
        cquant._C.attention(q, k, v, out, 0.3, mode)


def test_outputs_with_gaps_are_fine(rng):
    q, k, v = _qkv(rng, 2, 7, 5, 2, 8)
    out = _strided_out((2, 7, 2, 8), (7 * 2 * 16, 2 * 16, 16, 1))
    cquant._C.attention(q, k, v, out, 0.3, cquant._C.ATTENTION_FULL)
    np.testing.assert_array_equal(out, cquant.attention(q, k, v, scale=0.3))


@pytest.mark.parametrize("mode", ["bf16", "int8"])
@pytest.mark.parametrize("shape", [(0, 7, 5, 2, 8), (2, 0, 5, 2, 8), (2, 7, 5, 0, 8), (0, 0, 0, 0, 8)])
def test_empty_batch_sequence_or_heads_do_nothing(rng, mode, shape):
    """libcquant itself (cq_attention): nothing to compute, no error (it raised)."""
    b, sq, skv, h, d = shape
    q, k, v = _qkv(rng, b, sq, skv, h, d)
    out, lse = np.empty((b, sq, h, d), np.float32), np.empty((b, h, sq), np.float32)
    m = cquant._C.ATTENTION_INT8 if mode == "int8" else cquant._C.ATTENTION_FULL
    cquant._C.attention(q, k, v, out, 0.25, m, lse=lse)
    assert cquant._C.attention_workspace_size(m, b, h, sq, skv, d, False) == 0


def test_arguments_are_named_and_blocks_take_numpy_ints(rng):
    """A non-array is a TypeError naming it (was an AttributeError); a block past int32 a ValueError
    naming it (was an OverflowError naming nothing); NumPy ints are ints, as elsewhere."""
    q, k, v = _qkv(rng, 1, 7, 9, 2, 16)
    with pytest.raises(TypeError, match="q: expected an array"):
        cquant.attention(q.tolist(), k, v)
    with pytest.raises(TypeError, match="v: expected an array"):
        cquant.attention(q, k, None)
    with pytest.raises(ValueError, match="k_block must be a positive int"):
        cquant.attention(q, k, v, mode="int8", k_block=2**31)
    got = cquant.attention(q, k, v, mode="int8", q_block=np.int64(4), k_block=np.int32(8))
    np.testing.assert_array_equal(got, cquant.attention(q, k, v, mode="int8", q_block=4, k_block=8))


def test_empty_attention_checks_out_as_the_full_one_does(rng):
    """With no keys nothing is computed, yet out must still be q's dtype and writable: it was
    filled with zeros whatever its dtype, and a read-only array failed inside NumPy's assignment."""
    q, k, v = _qkv(rng, 1, 7, 0, 2, 16)
    with pytest.raises(TypeError, match="out has dtype int32"):
        cquant.attention(q, k, v, out=np.ones(q.shape, np.int32))
    ro = np.ones(q.shape, np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="out is read-only"):
        cquant.attention(q, k, v, out=ro)


@pytest.mark.raises_in_torch_op
@pytest.mark.parametrize("bad", ["mode", "scale", "q_block", "int32", "mixed"])
@pytest.mark.parametrize("shape", [(0, 5, 7), (1, 0, 7), (1, 5, 0)])
def test_empty_torch_attention_checks_its_arguments(bad, shape):
    """With no batch, queries or keys the torch op computes nothing, yet refuses what it refuses
    when there is work (a mode, scale, block or dtype libcquant does not take) instead of returning."""
    torch = pytest.importorskip("torch")
    b, sq, skv = shape
    dtypes = {"int32": (torch.int32,) * 3, "mixed": (torch.float32, torch.float16, torch.float32)}
    q, k, v = (torch.zeros(b, n, 2, 16, dtype=dt)
               for n, dt in zip((sq, skv, skv), dtypes.get(bad, (torch.float32,) * 3)))
    mode = 9 if bad == "mode" else 1
    scale = float("nan") if bad == "scale" else 0.25
    q_block = -1 if bad == "q_block" else 0
    exc, match = (TypeError, "dtypes") if bad in dtypes else (ValueError, bad)
    with pytest.raises(exc, match=match):
        torch.ops.cquant.attention(q, k, v, scale, mode, True, q_block, 0)


def test_empty_attention_checks_dtypes(rng):
    q, k, v = _qkv(rng, 1, 7, 0, 2, 16, np.int32)
    with pytest.raises(TypeError, match="dtypes int32"):
        cquant.attention(q, k, v)


@pytest.mark.parametrize("mode", ["bf16", "int8"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_no_keys_give_zero_output_and_minus_infinite_lse(rng, mode, dtype):
    """Skv = 0: the softmax sums are empty, so out = 0 and lse = log 0 = -inf (cquant.h), in
    libcquant as in the Python wrapper."""
    q, k, v = _qkv(rng, 2, 7, 0, 3, 16, np.dtype(dtype))
    out, lse = np.full(q.shape, 5.0, dtype), np.zeros((2, 3, 7), np.float32)
    m = cquant._C.ATTENTION_INT8 if mode == "int8" else cquant._C.ATTENTION_FULL
    cquant._C.attention(q, k, v, out, 0.25, m, lse=lse)  # libcquant itself, as the Python wrapper does
    assert not out.any() and np.all(lse == -np.inf)


def test_bad_lse_raises(rng):
    q, k, v = _qkv(rng, 1, 7, 9, 2, 64)
    out = np.empty_like(q)
    with pytest.raises(ValueError, match="lse must have shape"):
        cquant._C.attention(q, k, v, out, 0.1, cquant._C.ATTENTION_FULL, lse=np.empty((1, 7, 2), np.float32))
    with pytest.raises(TypeError, match="lse has dtype float64"):
        cquant._C.attention(q, k, v, out, 0.1, cquant._C.ATTENTION_FULL, lse=np.empty((1, 2, 7), np.float64))
    with pytest.raises(ValueError, match="mode = 5"):
        cquant._C.attention(q, k, v, out, 0.1, 5)
    with pytest.raises(ValueError, match="block sizes"):
        cquant._C.attention(q, k, v, out, 0.1, cquant._C.ATTENTION_INT8, q_block=-1)


def test_workspace_size():
    assert cquant.attention_workspace_size("bf16", 2, 24, 4096, 4096, 128, cuda=False) == 0
    assert cquant.attention_workspace_size("int8", 2, 24, 4096, 4096, 128, cuda=False) == 0
    assert cquant.attention_workspace_size("int8", 0, 24, 4096, 4096, 128, cuda=False) == 0  # empty: none
    with pytest.raises(ValueError, match="sizes >= 0 and head_dim >= 1"):
        cquant.attention_workspace_size("int8", -1, 24, 4096, 4096, 128, cuda=False)
    with pytest.raises(ValueError, match="sizes >= 0 and head_dim >= 1"):
        cquant.attention_workspace_size("int8", 2, 24, 4096, 4096, 0, cuda=False)


# ---------------------------------------------------------------- torch op


def test_torch_custom_op_and_opcheck(rng):
    torch = pytest.importorskip("torch")
    q, k, v = (torch.from_numpy(t) for t in _qkv(rng, 2, 33, 17, 2, 64))
    op = cquant.register_attention_op()
    out, lse = op(q, k, v, 0.125, 0, True, 0, 0)
    ref, ref_lse = attention_f64(q.numpy(), k.numpy(), v.numpy(), 0.125)
    assert rel_l2(out.numpy(), ref) <= ATTN_REF_REL_L2["float32"]
    assert np.abs(lse.numpy() - ref_lse).max() <= ATTN_REF_LSE_ABS * np.abs(ref_lse).max()
    torch.library.opcheck(op, (q, k, v, 0.125, 0, True, 0, 0))
    torch.library.opcheck(op, (q, k, v, 0.125, 1, False, 32, 64))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_fullgraph(rng, backend):
    torch = pytest.importorskip("torch")
    if backend == "inductor" and under_asan():
        pytest.skip("inductor's compile step initialises CUDA, which aborts under an ASan-preloaded interpreter")
    q, k, v = (torch.from_numpy(t) for t in _qkv(rng, 1, 33, 40, 2, 64))

    def f(q, k, v):
        o, lse = cquant.attention(q * 2.0, k, v, scale=0.1, return_lse=True)
        return o + 1.0, lse

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend=backend)
    o, lse = compiled(q, k, v)
    eo, else_ = f(q, k, v)
    torch.testing.assert_close(o, eo)
    torch.testing.assert_close(lse, else_)


def test_torch_noncontiguous_inputs(rng):
    torch = pytest.importorskip("torch")
    qkv = torch.from_numpy(rng.standard_normal((1, 40, 3, 2, 64)).astype(np.float32))
    q, k, v = qkv.unbind(2)
    out = cquant.attention(q, k, v)
    ref, _ = attention_f64(q.numpy(), k.numpy(), v.numpy(), 0.125)
    assert rel_l2(out.numpy(), ref) <= ATTN_REF_REL_L2["float32"]


# ---------------------------------------------------------------- diffusers backend


def tiny_flux(torch):
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    model = FluxTransformer2DModel(patch_size=1, in_channels=8, num_layers=1, num_single_layers=1,
                                   attention_head_dim=32, num_attention_heads=2, joint_attention_dim=32,
                                   pooled_projection_dim=16, axes_dims_rope=[8, 12, 12]).eval()
    b, hw, t = 2, 35, 7
    inputs = dict(hidden_states=torch.randn(b, hw, 8), encoder_hidden_states=torch.randn(b, t, 32),
                  pooled_projections=torch.randn(b, 16), timestep=torch.rand(b), img_ids=torch.randn(hw, 3),
                  txt_ids=torch.randn(t, 3))
    return model, inputs


def tiny_flux_cfg(torch):
    """tiny_flux's batch the way classifier-free guidance makes one: one latent and timestep, two
    text conditions, so the samples differ only through the text tokens they attend to."""
    model, inputs = tiny_flux(torch)
    for name in ("hidden_states", "timestep"):
        inputs[name][1] = inputs[name][0]
    return model, inputs


def tiny_cogvideox(torch):
    """CogVideoX's joint attention at toy size: 13 text tokens in front of 3 latent frames of 5 x 5
    patches (88 tokens, past one 64-key block), head dim 64 as in CogVideoX; batch 2 of different
    samples at different timesteps."""
    from tiny_models import build

    model = build("cogvideox", attention_head_dim=64, max_text_seq_length=13, sample_width=10, sample_height=10)
    inputs = dict(hidden_states=torch.randn(2, 3, 4, 10, 10), encoder_hidden_states=torch.randn(2, 13, 64),
                  timestep=torch.tensor([10, 500]))
    return model, inputs


def tiny_cogvideox_rope(torch):
    """tiny_cogvideox as CogVideoX 1.5 has it: temporal patches of 2 latent frames and the 3D
    rotary embedding (computed as the pipeline does) instead of positional embeddings; a CFG
    batch: one latent and timestep, two text conditions."""
    from diffusers.models.embeddings import get_3d_rotary_pos_embed
    from tiny_models import build

    model = build("cogvideox", attention_head_dim=64, max_text_seq_length=13, sample_width=10, sample_height=10,
                  patch_size_t=2, use_rotary_positional_embeddings=True)
    latent = torch.randn(1, 6, 4, 10, 10)  # 3 temporal patches of 5 x 5: 75 video tokens after 13 text tokens
    rope = get_3d_rotary_pos_embed(embed_dim=64, crops_coords=None, grid_size=(5, 5), temporal_size=3,
                                   grid_type="slice", max_size=(5, 5))
    inputs = dict(hidden_states=torch.cat([latent, latent]), encoder_hidden_states=torch.randn(2, 13, 64),
                  timestep=torch.tensor([500, 500]), image_rotary_emb=rope)
    return model, inputs


def enable_attention_everywhere(model, mode):
    """cquant.enable_attention, asserting that it left no attention layer to its own processor
    (the model is set back to native attention first: set_attention_backend also sets diffusers'
    process-wide backend, which later tests would otherwise run)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cquant.enable_attention(model, mode)
    kept = [str(w.message) for w in caught if "keep their own attention" in str(w.message)]
    wrong = [f"{name}: {type(module.processor).__name__}" for name, module in model.named_modules()
             if getattr(module, "processor", None) is not None and not _runs_cquant(module.processor, mode)]
    if kept or wrong:
        model.set_attention_backend("native")
    assert not kept, kept
    assert not wrong, wrong


def _runs_cquant(processor, mode):
    """Whether an attention processor runs cquant's attention in `mode`: one of cquant's processors,
    or a dispatcher processor set to cquant's backend."""
    from cquant.attention_backend import CQuantAttnProcessor, CQuantCogVideoXAttnProcessor

    if isinstance(processor, (CQuantAttnProcessor, CQuantCogVideoXAttnProcessor)):
        return processor.mode == mode
    backend = getattr(processor, "_attention_backend", None)
    return backend is not None and backend.value == ("cquant_int8" if mode == "int8" else "cquant")


def tiny_pixart(torch):
    from diffusers import PixArtTransformer2DModel

    torch.manual_seed(0)
    model = PixArtTransformer2DModel(sample_size=8, num_layers=1, patch_size=2, attention_head_dim=72,
                                     num_attention_heads=2, caption_channels=32, in_channels=4, cross_attention_dim=144,
                                     out_channels=8, attention_bias=True, activation_fn="gelu-approximate",
                                     num_embeds_ada_norm=1000, norm_type="ada_norm_single",
                                     norm_elementwise_affine=False, norm_eps=1e-6,
                                     use_additional_conditions=False).eval()
    inputs = dict(hidden_states=torch.randn(2, 4, 8, 8), encoder_hidden_states=torch.randn(2, 9, 32),
                  timestep=torch.tensor([10, 500]))
    return model, inputs


def _model_rel(torch, model, inputs, ref):
    with torch.no_grad():
        out = model(**inputs).sample
    return rel_l2(out.float().numpy(), ref.float().numpy())


@pytest.mark.parametrize("make", [tiny_flux, tiny_flux_cfg, tiny_pixart, tiny_cogvideox, tiny_cogvideox_rope])
def test_diffusers_backend_matches_default(make):
    torch = pytest.importorskip("torch")
    pytest.importorskip("diffusers")
    model, inputs = make(torch)
    with torch.no_grad():
        ref = model(**inputs).sample
    enable_attention_everywhere(model, "bf16")
    full = _model_rel(torch, model, inputs, ref)
    assert full <= ATTN_MODEL_FULL_REL_L2["float32"]
    enable_attention_everywhere(model, "int8")
    int8 = _model_rel(torch, model, inputs, ref)
    assert int8 <= ATTN_MODEL_INT8_REL_L2
    assert int8 > 10 * full  # the 8-bit kernels really ran
    model.set_attention_backend("native")


@pytest.mark.parametrize("make", [tiny_flux_cfg, tiny_cogvideox_rope])
@pytest.mark.parametrize("mode", ["bf16", "int8"])
def test_diffusers_cfg_batch_matches_per_sample_runs(make, mode):
    """Each sample of a CFG batch comes out as when it runs alone through the same backend (its
    attention depends on its own tokens only; a kernel that read the other sample's keys, values
    or 8-bit statistics would move it by about the 5% the two samples differ)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("diffusers")
    model, inputs = make(torch)
    enable_attention_everywhere(model, mode)
    shared = ("_ids", "image_rotary_emb")  # positions, the same for every sample
    try:
        with torch.no_grad():
            both = model(**inputs).sample
            for i in range(2):
                alone = model(**{k: (v if k.endswith(shared) else v[i:i + 1]) for k, v in inputs.items()}).sample
                assert rel_l2(alone.numpy(), both[i:i + 1].numpy()) <= ATTN_MODEL_FULL_REL_L2["float32"], i
        assert rel_l2(both[0].numpy(), both[1].numpy()) > 100 * ATTN_MODEL_FULL_REL_L2["float32"]  # they differ
    finally:
        model.set_attention_backend("native")


def test_diffusers_set_attention_backend_by_name():
    torch = pytest.importorskip("torch")
    pytest.importorskip("diffusers")
    model, inputs = tiny_flux(torch)
    with torch.no_grad():
        ref = model(**inputs).sample
    model.set_attention_backend("cquant")
    assert _model_rel(torch, model, inputs, ref) <= ATTN_MODEL_FULL_REL_L2["float32"]
    model.set_attention_backend("cquant_int8")
    assert ATTN_MODEL_FULL_REL_L2["float32"] < _model_rel(torch, model, inputs, ref) <= ATTN_MODEL_INT8_REL_L2
    model.set_attention_backend("native")


@pytest.mark.parametrize("make", [tiny_flux, tiny_cogvideox])
def test_routed_model_under_inference_mode_deepcopy_and_save(make, tmp_path):
    """What users do with a model whose attention runs in cquant: inference_mode, deepcopy (the copy
    keeps cquant's attention and its own processors), and a state_dict round trip through torch.save."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("diffusers")
    import copy

    model, inputs = make(torch)
    with torch.no_grad():
        native = model(**inputs).sample
    cquant.enable_attention(model, "int8")
    with torch.no_grad():
        want = model(**inputs).sample
    assert not torch.equal(want, native)  # the 8-bit path ran
    with torch.inference_mode():
        assert torch.equal(model(**inputs).sample, want)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        assert torch.equal(twin(**inputs).sample, want)
    procs = lambda m: [x.processor for x in m.modules() if hasattr(x, "processor")]
    assert all(a is not b for a, b in zip(procs(model), procs(twin)))
    torch.save(model.state_dict(), tmp_path / "w.pt")
    fresh, _ = make(torch)
    fresh.load_state_dict(torch.load(tmp_path / "w.pt"))
    cquant.enable_attention(fresh, "int8")
    with torch.no_grad():
        assert torch.equal(fresh(**inputs).sample, want)


def test_enable_attention_changes_only_that_model():
    """diffusers' set_attention_backend also sets the process-wide default; enable_attention keeps
    that default, so another model's layers (no backend of their own) still run native attention."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("diffusers")
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    routed, _ = tiny_flux(torch)
    other, inputs = tiny_flux(torch)
    default = _AttentionBackendRegistry.get_active_backend()[0]
    with torch.no_grad():
        before = other(**inputs).sample
        cquant.enable_attention(routed, "int8")
        assert _AttentionBackendRegistry.get_active_backend()[0] == default
        assert torch.equal(other(**inputs).sample, before)
        assert _model_rel(torch, routed, inputs, before) > ATTN_MODEL_FULL_REL_L2["float32"]  # routed runs 8-bit


def test_diffusers_bfloat16_model():
    torch = pytest.importorskip("torch")
    pytest.importorskip("diffusers")
    model, inputs = tiny_pixart(torch)
    model = model.to(torch.bfloat16)
    inputs = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v) for k, v in inputs.items()}
    with torch.no_grad():
        ref = model(**inputs).sample
    cquant.enable_attention(model, "bf16")
    assert _model_rel(torch, model, inputs, ref) <= ATTN_MODEL_FULL_REL_L2["bfloat16"]


def test_diffusers_mask_falls_back_with_warning():
    torch = pytest.importorskip("torch")
    pytest.importorskip("diffusers")
    from cquant import attention_backend

    model, inputs = tiny_pixart(torch)
    mask = torch.ones(2, 9)
    mask[0, 5:] = 0
    inputs["encoder_attention_mask"] = mask
    with torch.no_grad():
        ref = model(**inputs).sample
    cquant.enable_attention(model, "int8")
    attention_backend._warned.discard("attention masks are not supported")
    with pytest.warns(RuntimeWarning, match="attention masks are not supported"):
        with torch.no_grad():
            out = model(**inputs).sample
    # self-attention (no mask) ran in 8 bits, cross-attention (masked) natively
    assert rel_l2(out.numpy(), ref.numpy()) <= ATTN_MODEL_INT8_REL_L2


@pytest.mark.pure_python
@pytest.mark.parametrize("fused", [False, True], ids=["CogVideoXAttnProcessor2_0", "fused qkv"])
@pytest.mark.parametrize("make", [tiny_cogvideox, tiny_cogvideox_rope])
def test_cogvideox_processor_is_an_exact_copy(make, fused, monkeypatch):
    """cquant's CogVideoX processor is diffusers' (or its fused-QKV variant) with the attention
    call swapped: given diffusers' native attention instead of cquant's, the model gives the very
    same output, rotary embedding included (which the rope model's output depends on)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("diffusers")
    from cquant import attention_backend

    model, inputs = make(torch)
    if fused:
        model.fuse_qkv_projections()
    with torch.no_grad():
        ref = model(**inputs).sample
        if "image_rotary_emb" in inputs:
            assert not torch.equal(ref, model(**{**inputs, "image_rotary_emb": None}).sample)
    enable_attention_everywhere(model, "int8")
    dispatch = attention_backend._dispatch_module()
    native = dispatch._AttentionBackendRegistry._backends[dispatch.AttentionBackendName.NATIVE]
    processors = {module.processor for module in model.modules() if hasattr(module, "processor")}
    assert len(processors) == 1  # one shared by every layer
    processor = processors.pop()
    assert type(processor) is attention_backend.CQuantCogVideoXAttnProcessor and processor.fused == fused
    monkeypatch.setitem(dispatch._AttentionBackendRegistry._backends, processor._attention_backend, native)
    with torch.no_grad():
        assert torch.equal(model(**inputs).sample, ref)


@pytest.mark.parametrize("make", [tiny_pixart, tiny_cogvideox])
def test_cquant_processors_follow_set_attention_backend_and_pickle(make, tmp_path):
    """Layers given cquant's processors obey the model's set_attention_backend and
    reset_attention_backend as diffusers' own processors do: another backend (or none) gives the
    stock model's output exactly, "cquant_int8" the 8-bit one; and the whole model pickles."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("diffusers")
    model, inputs = make(torch)

    def out(m):
        with torch.no_grad():
            return m(**inputs).sample

    ref = out(model)
    enable_attention_everywhere(model, "int8")
    int8 = out(model)
    assert not torch.equal(int8, ref)
    try:
        model.set_attention_backend("native")
        assert torch.equal(out(model), ref)
        model.set_attention_backend("cquant_int8")
        assert torch.equal(out(model), int8)
        model.reset_attention_backend()
        assert torch.equal(out(model), ref)
        cquant.enable_attention(model, "int8")
        torch.save(model, tmp_path / "model.pt")
        loaded = torch.load(tmp_path / "model.pt", weights_only=False)
        assert torch.equal(out(loaded), int8)
    finally:
        model.set_attention_backend("native")


def test_fuse_qkv_after_enable_attention_keeps_cquant_attention():
    """cquant.fuse_qkv_ after enable_attention: diffusers gives CogVideoX its fused processor,
    whose cquant counterpart takes over in the same mode (as fusing first, then enabling, gives);
    PixArt's fused processor has none, which a warning says."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("diffusers")
    from cquant.attention_backend import CQuantCogVideoXAttnProcessor

    first_fused, inputs = tiny_cogvideox(torch)
    cquant.fuse_qkv_(first_fused)
    enable_attention_everywhere(first_fused, "int8")
    then_fused, _ = tiny_cogvideox(torch)
    enable_attention_everywhere(then_fused, "int8")
    cquant.fuse_qkv_(then_fused)
    processors = {m.processor for m in then_fused.modules() if hasattr(m, "processor")}
    assert [(type(p), p.fused, p.mode) for p in processors] == [(CQuantCogVideoXAttnProcessor, True, "int8")]
    with torch.no_grad():
        assert torch.equal(then_fused(**inputs).sample, first_fused(**inputs).sample)

    pixart, _ = tiny_pixart(torch)
    enable_attention_everywhere(pixart, "int8")
    with pytest.warns(RuntimeWarning, match="FusedAttnProcessor2_0"):
        cquant.fuse_qkv_(pixart)


def test_cogvideox_mask_falls_back_with_warning():
    """A mask (through attention_kwargs) goes to diffusers' native attention, prepared as diffusers'
    processor prepares it: the 8-bit mode then gives the stock model's output."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("diffusers")
    from cquant import attention_backend

    model, inputs = tiny_cogvideox(torch)
    mask = torch.ones(2, 1, 13 + 75, dtype=torch.bool)
    mask[0, :, 7:13] = False  # sample 0: its last 6 text tokens are padding
    inputs["attention_kwargs"] = {"attention_mask": mask}
    with torch.no_grad():
        ref = model(**inputs).sample
    enable_attention_everywhere(model, "int8")
    attention_backend._warned.discard("attention masks are not supported")
    try:
        with pytest.warns(RuntimeWarning, match="attention masks are not supported"):
            with torch.no_grad():
                out = model(**inputs).sample
    finally:
        model.set_attention_backend("native")
    assert rel_l2(out.numpy(), ref.numpy()) <= ATTN_MODEL_FULL_REL_L2["float32"]


def test_enable_attention_rejects_other_objects():
    pytest.importorskip("diffusers")
    with pytest.raises(TypeError, match="diffusers model"):
        cquant.enable_attention(object(), "bf16")
    torch = pytest.importorskip("torch")
    model, _ = tiny_flux(torch)
    with pytest.raises(ValueError, match="mode must be"):
        cquant.enable_attention(model, "fp4")
    from diffusers import AutoencoderKL

    no_attention = AutoencoderKL(block_out_channels=(16,), latent_channels=4, norm_num_groups=8,
                                 mid_block_add_attention=False)
    with pytest.warns(RuntimeWarning, match="AutoencoderKL has no attention layer"):
        cquant.enable_attention(no_attention, "bf16")
    # a pipeline: its transformer is routed, as cquant.optimize takes one
    import types

    from cquant import attention_backend

    pipe = types.SimpleNamespace(transformer=model)
    assert cquant.enable_attention(pipe, "int8") is pipe
    try:
        backends = {getattr(m.processor, "_attention_backend", None) for m in model.modules() if hasattr(m, "processor")}
        assert backends == {attention_backend._dispatch_module().AttentionBackendName("cquant_int8")}
    finally:
        model.set_attention_backend("native")
    with pytest.raises(TypeError, match="or a pipeline with such a .transformer, got SimpleNamespace"):
        cquant.enable_attention(types.SimpleNamespace(transformer=None), "bf16")


def test_import_hooks_register_op_and_backends_in_a_fresh_process():
    """cquant imported before torch and diffusers: the op and the backends still exist by the first call,
    including a first call inside torch.compile."""
    pytest.importorskip("torch")
    pytest.importorskip("diffusers")
    code = ("import cquant, torch\n"
            "f = torch.compile(lambda q, k, v: cquant.attention(q, k, v), fullgraph=True, backend='aot_eager')\n"
            "q = torch.randn(1, 9, 2, 64)\n"
            "assert f(q, q, q).shape == (1, 9, 2, 64)\n"
            "from diffusers.models.attention_dispatch import AttentionBackendName as N\n"
            "print(N('cquant').value, N('cquant_int8').value)\n")
    assert run_fresh_python(code).split() == ["cquant", "cquant_int8"]


@pytest.mark.raises_in_torch_op
def test_backward_through_cquant_attention_says_it_is_inference_only():
    """Training through a model whose attention runs in cquant fails at backward with cquant's
    reason (not torch's "no autograd formula was registered", which reads as a bug to fix)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("diffusers")
    model, inputs = tiny_pixart(torch)
    model.train()
    cquant.enable_attention(model, "bf16")
    out = model(**inputs).sample
    with pytest.raises(NotImplementedError, match="cquant attention has no backward pass.*inference-only"):
        out.square().mean().backward()


def test_routed_model_pickle_loads_in_a_process_without_cquant(tmp_path):
    """torch.save of a whole model whose layers run cquant's attention (a dispatcher model and one
    with cquant's processors) loads with torch.load in a process that never imported cquant, and
    computes what it did."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("diffusers")
    for i, make in enumerate((tiny_flux, tiny_pixart)):
        model, inputs = make(torch)
        cquant.enable_attention(model, "int8")
        with torch.no_grad():
            out = model(**inputs).sample
        torch.save((model, inputs, out), tmp_path / f"{i}.pt")
    code = ("import sys, torch\n"
            "for i in range(2):\n"
            f"    model, inputs, out = torch.load({str(tmp_path)!r} + f'/{{i}}.pt', weights_only=False)\n"
            "    with torch.no_grad():\n"
            "        assert torch.equal(model(**inputs).sample, out), i\n"
            "print('ok')\n")
    assert run_fresh_python(code).split() == ["ok"]


@pytest.mark.parametrize("framework", ["numpy", "torch"])
@pytest.mark.parametrize("b, sq, skv", [(0, 7, 9), (2, 0, 9), (2, 7, 0), (0, 0, 0)])
def test_empty_batch_or_sequence_gives_an_empty_result(rng, framework, b, sq, skv):
    q, k, v = _qkv(rng, 2, 7, 9, 2, 16)
    q, k, v = q[:b, :sq], k[:b, :skv], v[:b, :skv]
    if framework == "torch":
        torch = pytest.importorskip("torch")
        q, k, v = (torch.from_numpy(np.ascontiguousarray(t)) for t in (q, k, v))
    for mode in ("bf16", "int8"):
        out, lse = cquant.attention(q, k, v, mode=mode, return_lse=True)
        assert tuple(out.shape) == (b, sq, 2, 16) and tuple(lse.shape) == (b, 2, sq)
        assert (np.asarray(out) == 0).all() and (np.asarray(lse) == -np.inf).all()  # no keys: SDPA's 0


def test_diffusers_backend_takes_empty_calls_without_fallback():
    torch = pytest.importorskip("torch")
    pytest.importorskip("diffusers")
    from cquant import attention_backend

    for mode in (0, 1):
        fn = attention_backend._backend_fn(mode)
        for b, sq, skv in [(0, 5, 6), (1, 0, 6), (1, 5, 0)]:
            q, k, v = torch.randn(b, sq, 2, 16), torch.randn(b, skv, 2, 16), torch.randn(b, skv, 2, 16)
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                out = fn(q, k, v)
            assert out.shape == (b, sq, 2, 16) and not out.any()


@pytest.mark.raises_in_torch_op
def test_diffusers_backend_falls_back_when_the_kernels_refuse(monkeypatch):
    torch = pytest.importorskip("torch")
    pytest.importorskip("diffusers")
    from cquant import attention_backend, ops

    def refuse(*args, **kwargs):
        raise NotImplementedError("the CUDA 8-bit attention takes batch * heads up to 65535; got 70000")

    monkeypatch.setattr(ops, "attention_into", refuse)
    monkeypatch.setattr(attention_backend, "_warned", set())
    q, k, v = (torch.randn(2, 5, 2, 16) for _ in range(3))
    native = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)
    fn = attention_backend._backend_fn(1)
    with pytest.warns(RuntimeWarning, match="the kernels refuse it .*batch \\* heads up to 65535"):
        out = fn(q, k, v)
    torch.testing.assert_close(out, native)


@pytest.mark.cuda
def test_diffusers_backend_many_heads_in_8_bit_mode_cuda():
    """batch * heads above a CUDA grid's 65535 rows: the kernels take it or the call falls back; never an error."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("diffusers")
    from cquant import attention_backend

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 40000, 16, generator=g).to("cuda", torch.bfloat16) for _ in range(3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fallback's warning, if the kernels refuse
        out = attention_backend._backend_fn(1)(q, k, v)
    ref = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2).float() for t in (q, k, v)))
    assert rel_l2(out.float().cpu().numpy(), ref.transpose(1, 2).cpu().numpy()) <= ATTN_INT8_REL_L2_IID  # i.i.d. values
