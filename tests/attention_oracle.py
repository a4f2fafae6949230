"""Oracles of cquant's attention: float64 softmax attention (NumPy, and torch for some query rows
of device tensors), and the 8-bit mode's quantized math evaluated step by step as cquant.h
writes it (independent of the C code)."""

import numpy as np

LOG2E = np.float32(1.4426950408889634)


def attention_f64(q, k, v, scale):
    """q [B, Sq, H, D], k/v [B, Skv, H, D] (any float arrays) -> out float64 [B, Sq, H, D], lse [B, H, Sq]."""
    q, k, v = (np.asarray(t, dtype=np.float64) for t in (q, k, v))
    s = np.einsum("bihd,bjhd->bhij", q, k) * scale
    m = s.max(axis=-1, keepdims=True)
    p = np.exp(s - m)
    l = p.sum(axis=-1, keepdims=True)
    out = np.einsum("bhij,bjhd->bihd", p / l, v)
    lse = (m + np.log(l))[..., 0]
    return out, lse


def attention_rows_f64(q, k, v, scale, rows):
    """float64 attention of the query rows `rows` of torch tensors [B, S, H, D], on their device:
    out [B, R, H, D], lse [B, H, R] (natural log)."""
    import torch

    q64 = q[:, rows].double().transpose(1, 2)
    k64, v64 = k.double().transpose(1, 2), v.double().transpose(1, 2)
    outs, lses = [], []
    for h in range(q64.shape[1]):  # one head at a time bounds the fp64 score matrix
        s = q64[:, h] @ k64[:, h].transpose(-1, -2) * scale
        lse = torch.logsumexp(s, dim=-1)
        outs.append(torch.exp(s - lse[..., None]) @ v64[:, h])
        lses.append(lse)
    return torch.stack(outs, 2), torch.stack(lses, 1)


def rel_l2(x, ref):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


def cosine(x, ref):
    x, ref = np.asarray(x, np.float64).ravel(), np.asarray(ref, np.float64).ravel()
    return float(x @ ref / (np.linalg.norm(x) * np.linalg.norm(ref)))


def _e4m3(x):
    """x rounded to fp8 e4m3fn (RNE, saturated), as float32: the former P . V format, kept for
    scripts/attention_pv_format_study.py."""
    import ml_dtypes

    return np.asarray(x, np.float32).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)


def _fmaf(a, b, c):
    """fmaf(a, b, c) of float32 arrays: float64 holds a * b exactly (24 + 24 bits), then the sum
    rounds to float64 and to float32 (twice; one rounding in C: the last bit can differ, rarely)."""
    return (np.asarray(a, np.float64) * np.asarray(b, np.float64) + np.asarray(c, np.float64)).astype(np.float32)


def _int8_channels(v):
    """int8 codes (as int64) and scales per column of v [rows, dim] over all rows (cq_quantize's
    math): a column whose amax is not finite gets all-zero codes and a NaN scale."""
    amax = np.abs(v).max(axis=0)
    finite = np.isfinite(amax)
    a = np.maximum(np.where(finite, amax, np.float32(1.0)), np.float32(2.0**-90))  # CQ_AMAX_FLOOR
    inv = np.where(finite, np.float32(127.0) / a, np.float32(0.0)).astype(np.float32)
    with np.errstate(invalid="ignore"):
        x = v * inv[None, :]
    codes = np.clip(np.rint(np.nan_to_num(x, nan=0.0)), -127, 127).astype(np.int64)
    scales = np.where(finite, a / np.float32(127.0), np.float32(np.nan)).astype(np.float32)
    return codes, scales


def _int8_blocks(x, block):
    """int8 codes (as float32) and per-row scales of blocks of `block` rows of x [rows, dim]."""
    rows = x.shape[0]
    codes = np.empty_like(x)
    scales = np.empty(rows, np.float32)
    for r0 in range(0, rows, block):
        blk = x[r0:r0 + block]
        amax = np.float32(max(np.abs(blk).max(), np.float32(2.0**-100)))
        inv = np.float32(127.0) / amax
        codes[r0:r0 + block] = np.clip(np.rint(blk * inv), -127, 127)
        scales[r0:r0 + block] = amax / np.float32(127.0)
    return codes, scales


def attention_int8(q, k, v, scale, q_block=32, k_block=128, smooth=True):
    """The 8-bit mode of cquant.h in NumPy float32 -> out float32 [B, Sq, H, D], lse [B, H, Sq].

    smooth=False leaves out the K smoothing (to show what it buys)."""
    q, k, v = (np.asarray(t, np.float32) for t in (q, k, v))
    b_, sq, h_, d = q.shape
    skv = k.shape[1]
    out = np.empty((b_, sq, h_, d), np.float32)
    lse = np.empty((b_, h_, sq), np.float32)
    qmul = np.float32(scale) * LOG2E
    for b in range(b_):
        for h in range(h_):
            kh = k[b, :, h, :]
            kmean = (kh.astype(np.float64).sum(axis=0) / skv).astype(np.float32)
            if not smooth:
                kmean = np.zeros_like(kmean)
            kc, sk = _int8_blocks(kh - kmean, k_block)
            qs = q[b, :, h, :] * qmul
            qc, sqs = _int8_blocks(qs, q_block)
            vc, sv = _int8_channels(v[b, :, h, :])
            m = np.full(sq, -np.inf, np.float32)
            l = np.zeros(sq, np.float32)
            acc = np.zeros((sq, d), np.float32)
            for j0 in range(0, skv, k_block):
                dots = (qc.astype(np.int64) @ kc[j0:j0 + k_block].astype(np.int64).T).astype(np.float32)
                s = dots * (sqs[:, None] * sk[None, j0:j0 + k_block])
                mt = s.max(axis=1)
                mn = np.maximum(m, mt)
                alpha, beta = np.exp2(m - mn), np.exp2(mt - mn)
                pc = np.rint(np.exp2(s - mt[:, None]) * np.float32(255.0)).astype(np.int64)  # u8 codes
                tile_a, tile_l = pc @ vc[j0:j0 + k_block], pc.sum(axis=1)  # exact integers
                l = _fmaf(beta, tile_l.astype(np.float32), l * alpha)
                acc = _fmaf(beta[:, None], tile_a.astype(np.float32), acc * alpha[:, None])
                m = mn
            out[b, :, h, :] = acc / l[:, None] * sv[None, :]
            lse[b, h, :] = (m + (np.log2(l) - np.log2(np.float32(255.0))) + (qs.astype(np.float64) @ kmean.astype(np.float64))) / LOG2E
    return out, lse


def int8_logit_error(q, k, scale, q_block=32, k_block=128):
    """cquant.h's logit-error estimate E of the 8-bit mode for every head, float64 [B, H]: the
    documented formula evaluated in float64 on the mode's codes and scales (quantized here as the
    mode does, in float32). 0 where there are no queries or no keys."""
    q, k = (np.asarray(t, np.float32) for t in (q, k))
    b_, sq, h_, d = q.shape
    skv = k.shape[1]
    bound = np.zeros((b_, h_))
    if sq == 0 or skv == 0:
        return bound
    qmul = np.float32(scale) * LOG2E
    for b in range(b_):
        for h in range(h_):
            kh = k[b, :, h, :]
            kmean = (kh.astype(np.float64).sum(axis=0) / skv).astype(np.float32)
            kc, sk = _int8_blocks(kh - kmean, k_block)
            qc, sqs = _int8_blocks(q[b, :, h, :] * qmul, q_block)
            sqs, sk = sqs.astype(np.float64), sk.astype(np.float64)
            a, c = sqs.max(), sk.max()
            bq = (sqs * np.sqrt((qc.astype(np.float64) ** 2).sum(axis=1))).max()
            bk = (sk * np.sqrt((kc.astype(np.float64) ** 2).sum(axis=1))).max()
            bound[b, h] = np.sqrt(((c * bq) ** 2 + (a * bk) ** 2) / 12 + d * (a * c) ** 2 / 144)
    return bound
