"""The 8-bit attention's accuracy bound (cquant.h): the per-head logit-error estimate E is the
documented formula, heads with E above CQ_ATTENTION_INT8_MAX_LOGIT_ERROR are computed in full
precision (bit for bit the full-precision result), the others with the 8-bit math, and either
way every head of peaked-softmax and offset inputs meets the mode's accuracy targets."""

import math

import numpy as np
import pytest

import cquant
from attention_oracle import attention_f64, attention_int8, cosine, int8_logit_error, rel_l2
from cquant import ops
from helpers import dit_attention_inputs
from tolerances import (ATTN_INT8_BOUND_REL, ATTN_INT8_MIN_COSINE, ATTN_INT8_REL_L2, ATTN_INT8_TYPICAL_BOUND_FRACTION,
                        ATTN_INT8_VS_NUMPY_REL_L2)

TAU = ops.ATTENTION_INT8_MAX_LOGIT_ERROR

# Inputs of the study behind the threshold (helpers.dit_attention_inputs), B = 2, H = 3. q_mult
# 1 gives a plain head (E ~ 0.4 tau), 8 and 30 peaked ones (E ~ 3 tau and ~ 12 tau); outlier
# channels and two groups of keys with different offsets give E above tau at q_mult 1, a common
# key offset (removed by the smoothing) and value offsets do not move E.
PEAKED = [[1, 8, 1], [30, 1, 8]]
CASES = {
    "peaked": dict(q_mult=PEAKED),
    "key_offset_100": dict(q_mult=[[1, 1, 10], [1, 10, 1]], key_offset=100.0),
    "value_offset_100": dict(q_mult=[[1, 10, 1], [1, 1, 10]], value_offset=100.0),
    "outlier_channels": dict(q_mult=[[1, 1, 1], [1, 0.15, 1]], outliers=2),
    "key_groups": dict(q_mult=[[1, 1, 1], [1, 1, 1]], key_groups=5.0),
}


def _inputs(rng, case, d=128, sq=256, skv=256):
    return dit_attention_inputs(rng, 2, sq, skv, 3, d, **CASES[case])


def _per_head(out, ref):
    """(cosine, rel L2) of every head of [B, S, H, D] outputs."""
    b, _, h, _ = out.shape
    return [[(cosine(out[i, :, j], ref[i, :, j]), rel_l2(out[i, :, j], ref[i, :, j])) for j in range(h)]
            for i in range(b)]


# ---------------------------------------------------------------- the estimate


@pytest.mark.parametrize("blocks", [(32, 64), (7, 5), (1, 16), (128, 128)])
@pytest.mark.parametrize("case", ["peaked", "key_offset_100", "outlier_channels"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_estimate_is_the_documented_formula(rng, blocks, case, dtype):
    qb, kb = blocks
    q, k, _ = (t.astype(dtype) for t in _inputs(rng, case, d=72, sq=77, skv=150))
    scale = 0.11
    got = ops.attention_int8_logit_error(q, k, scale, q_block=qb, k_block=kb)
    assert got.dtype == np.float32 and got.shape == (2, 3)
    np.testing.assert_allclose(got, int8_logit_error(q, k, scale, q_block=qb, k_block=kb), rtol=ATTN_INT8_BOUND_REL)


def test_estimate_of_torch_bfloat16_inputs(rng):
    torch = pytest.importorskip("torch")
    q, k, _ = (torch.from_numpy(t).to(torch.bfloat16) for t in _inputs(rng, "peaked", d=64, sq=40, skv=70))
    got = ops.attention_int8_logit_error(q, k, 0.125)
    assert isinstance(got, torch.Tensor) and got.dtype == torch.float32
    want = int8_logit_error(q.float().numpy(), k.float().numpy(), 0.125)
    np.testing.assert_allclose(got.numpy(), want, rtol=ATTN_INT8_BOUND_REL)


def test_estimate_grows_with_the_logit_scale(rng):
    """Linear in the scale of q: sq and the scaled code norms of Q grow with it, K's stay."""
    q, k, _ = _inputs(rng, "peaked", d=64, sq=64, skv=64)
    e1 = ops.attention_int8_logit_error(q, k, 0.125)
    e3 = ops.attention_int8_logit_error(q * 4, k, 0.125)
    np.testing.assert_allclose(e3, 4 * e1, rtol=ATTN_INT8_BOUND_REL)


def test_estimate_without_queries_or_keys_is_zero(rng):
    q, k, _ = _inputs(rng, "peaked", d=16, sq=5, skv=6)
    assert not ops.attention_int8_logit_error(q[:, :0], k, 0.25).any()
    assert not ops.attention_int8_logit_error(q, k[:, :0], 0.25).any()


def test_estimate_bad_arguments(rng):
    q, k, _ = _inputs(rng, "peaked", d=16, sq=5, skv=6)
    with pytest.raises(ValueError, match="q has shape .*expected 4 dims"):
        ops.attention_int8_logit_error(q[0], k, 0.25)
    with pytest.raises(ValueError, match="k has shape"):
        ops.attention_int8_logit_error(q, k[:, :, :2], 0.25)
    with pytest.raises(TypeError, match="one dtype"):
        ops.attention_int8_logit_error(q, k.astype(np.float16), 0.25)
    with pytest.raises(ValueError, match="finite softmax scale"):
        ops.attention_int8_logit_error(q, k, float("inf"))
    with pytest.raises(ValueError, match="block sizes"):
        ops.attention_int8_logit_error(q, k, 0.25, q_block=-2)
    with pytest.raises(ValueError, match="bound must have shape"):
        cquant._C.attention_int8_logit_error(q, k, np.empty((2, 2), np.float32), 0.25)
    with pytest.raises(TypeError, match="bound has dtype float64"):
        cquant._C.attention_int8_logit_error(q, k, np.empty((2, 3), np.float64), 0.25)


def test_typical_inputs_stay_in_8_bits(rng):
    """The inputs of the mode's other tests (randn q, k, any common key offset, head dims 40 to
    128), RMSNorm q, k with weights near 1 (Flux-like) and LayerNorm q, k with a bias
    (CogVideoX-like): E well below the threshold, so the 8-bit math computes them."""
    inputs = []
    for d in (40, 64, 72, 128):
        for offset in (0.0, 20.0, 50.0):
            q, k = rng.standard_normal((2, 2, 333, 2, d)).astype(np.float32)
            inputs.append((q, k + offset * rng.standard_normal((1, 1, 2, d)).astype(np.float32)))
        q, k, _ = dit_attention_inputs(rng, 1, 512, 512, 4, d, [[1, 1, 1, 1]])
        inputs.append((q, k))
    for _ in range(3):
        x = rng.standard_normal((2, 1, 512, 4, 64))
        x = (x - x.mean(-1, keepdims=True)) / x.std(-1, keepdims=True)
        x = x * np.abs(1 + 0.2 * rng.standard_normal((2, 1, 1, 4, 64))) + 0.3 * rng.standard_normal((2, 1, 1, 4, 64))
        inputs.append(tuple(x.astype(np.float32)))
    for q, k in inputs:
        bound = ops.attention_int8_logit_error(q, k, q.shape[-1] ** -0.5)
        assert bound.max() <= ATTN_INT8_TYPICAL_BOUND_FRACTION * TAU, (q.shape, bound)


# ---------------------------------------------------------------- the fallback


@pytest.mark.parametrize("case", list(CASES))
def test_every_head_meets_the_targets_and_falls_back_where_the_bound_says(rng, case):
    """Peaked softmax, key and value offsets, outlier channels: each head is either computed in
    full precision (E > tau: bit for bit the full-precision result, lse too) or with the 8-bit
    math (E <= tau: the NumPy model of it), and meets cosine >= 0.999 and rel L2 <= 3% against
    float64 either way."""
    q, k, v = _inputs(rng, case)
    scale = 1 / math.sqrt(q.shape[-1])
    out, lse = cquant.attention(q, k, v, mode="int8", scale=scale, return_lse=True)
    full, full_lse = cquant.attention(q, k, v, mode="bf16", scale=scale, return_lse=True)
    ref, _ = attention_f64(q, k, v, scale)
    falls_back = ops.attention_int8_logit_error(q, k, scale) > TAU
    assert (falls_back == (int8_logit_error(q, k, scale) > TAU)).all()
    for b, row in enumerate(_per_head(out, ref)):
        for h, (cos, rel) in enumerate(row):
            assert cos >= ATTN_INT8_MIN_COSINE and rel <= ATTN_INT8_REL_L2, (case, b, h, cos, rel)
            same = np.array_equal(out[b, :, h], full[b, :, h]) and np.array_equal(lse[b, h], full_lse[b, h])
            assert same == bool(falls_back[b, h]), (case, b, h)
    if case == "key_groups" or case == "outlier_channels":
        assert falls_back.sum() >= 5  # these inputs are what the bound exists for
    else:
        assert falls_back.any() and not falls_back.all()  # both paths in one call
    if not falls_back.all():
        model, model_lse = attention_int8(q, k, v, scale)
        for b, h in zip(*np.nonzero(~falls_back)):
            assert rel_l2(out[b, :, h], model[b, :, h]) <= ATTN_INT8_VS_NUMPY_REL_L2, (case, b, h)
            assert np.abs(lse[b, h] - model_lse[b, h]).max() <= 1e-4 * np.abs(model_lse[b, h]).max()


def test_the_8_bit_math_alone_would_miss_the_targets(rng):
    """The fallen-back heads of the peaked and outlier inputs, computed with the 8-bit math
    anyway (the NumPy model): far outside the targets, which is why they fall back."""
    worst = 0.0
    for case in ("peaked", "outlier_channels"):
        q, k, v = _inputs(rng, case)
        scale = 1 / math.sqrt(q.shape[-1])
        ref, _ = attention_f64(q, k, v, scale)
        model, _ = attention_int8(q, k, v, scale)
        falls_back = ops.attention_int8_logit_error(q, k, scale) > TAU
        for b, h in zip(*np.nonzero(falls_back)):
            worst = max(worst, rel_l2(model[b, :, h], ref[b, :, h]))
    assert worst > ATTN_INT8_REL_L2


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_fallback_computes_in_the_inputs_dtype(rng, dtype):
    torch = pytest.importorskip("torch")
    q, k, v = (torch.from_numpy(t).to(getattr(torch, dtype)) for t in _inputs(rng, "peaked", d=64, sq=100, skv=90))
    out = cquant.attention(q, k, v, mode="int8")
    full = cquant.attention(q, k, v, mode="bf16")
    falls_back = torch.from_numpy(ops.attention_int8_logit_error(q, k, 0.125).numpy() > TAU)
    assert out.dtype == q.dtype and falls_back.any() and not falls_back.all()
    for b, h in zip(*np.nonzero(falls_back.numpy())):
        assert torch.equal(out[b, :, h], full[b, :, h])


def test_non_finite_inputs_fall_back(rng):
    """An infinite q makes its head's scale, so its estimate, NaN: the head runs the
    full-precision math (whatever it gives such inputs), the others keep the 8-bit one."""
    q, k, v = _inputs(rng, "peaked", d=64, sq=40, skv=50)
    q[0, 3, 0, 5] = np.inf
    bound = ops.attention_int8_logit_error(q, k, 0.125)
    assert np.isnan(bound[0, 0]) and np.isfinite(bound[1]).all()
    out = cquant.attention(q, k, v, mode="int8")
    full = cquant.attention(q, k, v, mode="bf16")
    np.testing.assert_array_equal(out[0, :, 0], full[0, :, 0])
    assert not np.array_equal(out[1, :, 1], full[1, :, 1])  # q_mult 1: 8-bit
