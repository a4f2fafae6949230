#!/usr/bin/env python3
"""What the 8-bit attention's P . V format costs in accuracy: u8 P at each tile's own max times s8
V (cquant.h's CQ_ATTENTION_INT8) against u8 P at the running max and fp8 e4m3 P and V (the
mode's former format). u8 x s8 products run on int8 tensor cores, exact in int32, at the fp8 rate.

Everything else is the 8-bit math of cquant.h (int8 Q and K per block with K smoothing, the
online softmax over tiles of k_block keys, fp32 steps), the NumPy model of tests/attention_oracle.py
with only the P . V product swapped. Each format's output is compared with float64 attention.
  u8s8_tile_max  cquant.h: P codes RNE(255 exp2(s - tile max)), V codes RNE(127 v / amax) per
                 channel, l the sum of the codes, each tile folded in with beta = exp2(tile max - m)
  u8s8           u8 P at the running max, l the sum of the unrounded p
  u8s8_code_sum  u8 P at the running max, l the sum of the codes / 255
  e4m3           e4m3 P (448 p at the running max) and e4m3 V (448 v / amax per channel), l the
                 sum of the P codes / 448

Usage: PYTHONPATH=python python scripts/attention_pv_format_study.py [--keys 4608] [--queries 128]
(needs numpy and ml_dtypes; CPU only; about a minute)
"""

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from attention_oracle import LOG2E, _e4m3, _fmaf, _int8_blocks, attention_f64, cosine, rel_l2  # noqa: E402
from helpers import dit_attention_inputs  # noqa: E402

FORMATS = ("u8s8_tile_max", "u8s8", "u8s8_code_sum", "e4m3")


def attention_8bit(q, k, v, scale, pv, q_block=32, k_block=128):
    """cquant.h's 8-bit attention of one head (q [Sq, D], k and v [Skv, D], float32) with the
    P . V product in format pv (one of FORMATS)."""
    sq, d = q.shape
    skv = k.shape[0]
    kmean = (k.astype(np.float64).sum(axis=0) / skv).astype(np.float32)
    kc, sk = _int8_blocks(k - kmean, k_block)
    qc, sqs = _int8_blocks(q * (np.float32(scale) * LOG2E), q_block)
    amax = np.maximum(np.abs(v).max(axis=0), np.float32(2.0**-90))
    if pv == "e4m3":
        vcode, p_max, v_max = _e4m3(v * (np.float32(448.0) / amax)), np.float32(448.0), np.float32(448.0)
    else:
        vcode, p_max, v_max = np.rint(v * (np.float32(127.0) / amax)), np.float32(255.0), np.float32(127.0)
    m = np.full(sq, -np.inf, np.float32)
    l = np.zeros(sq, np.float32)
    acc = np.zeros((sq, d), np.float32)
    for j0 in range(0, skv, k_block):
        dots = (qc.astype(np.int64) @ kc[j0:j0 + k_block].astype(np.int64).T).astype(np.float32)
        s = dots * (sqs[:, None] * sk[None, j0:j0 + k_block])
        if pv == "u8s8_tile_max":  # cquant.h, step by step as attention_oracle.attention_int8
            mt = s.max(axis=1)
            mn = np.maximum(m, mt)
            alpha, beta = np.exp2(m - mn), np.exp2(mt - mn)
            pcode = np.rint(np.exp2(s - mt[:, None]) * p_max).astype(np.int64)
            tile_a = pcode @ vcode[j0:j0 + k_block].astype(np.int64)  # exact integers
            l = _fmaf(beta, pcode.sum(axis=1).astype(np.float32), l * alpha)
            acc = _fmaf(beta[:, None], tile_a.astype(np.float32), acc * alpha[:, None])
            m = mn
            continue
        mt = np.maximum(m, s.max(axis=1))
        alpha = np.exp2(m - mt)
        p = np.exp2(s - mt[:, None])
        pcode = _e4m3(p * p_max) if pv == "e4m3" else np.rint(p * p_max)
        code_sum = pv in ("e4m3", "u8s8_code_sum")
        tile_l = pcode.sum(axis=1, dtype=np.float32) / p_max if code_sum else p.sum(axis=1, dtype=np.float32)
        l = l * alpha + tile_l
        # u8 x s8 sums are exact int32 on the tensor cores; float64 here keeps them exact
        acc = acc * alpha[:, None] + (pcode.astype(np.float64) @ vcode[j0:j0 + k_block].astype(np.float64)).astype(np.float32)
        m = mt
    if pv == "u8s8_tile_max":  # l counts codes: out = acc / l * sv, sv = amax / 127
        return acc / l[:, None] * (amax / v_max)[None, :]
    return acc / l[:, None] * (amax / (p_max * v_max))[None, :]


def cases(rng, sq, skv, d):
    """(name, q, k, v) of one head each: i.i.d., DiT-like, peaked, with value offsets."""
    iid = [rng.standard_normal((n, d)).astype(np.float32) for n in (sq, skv, skv)]
    yield "i.i.d. N(0, 1) q, k, v", *iid
    for name, kw in (("DiT-like (values with channel means)", dict(q_mult=[[1.0]])),
                     ("DiT-like, peaked softmax (q x 4)", dict(q_mult=[[4.0]])),
                     ("DiT-like, value offsets 10", dict(q_mult=[[1.0]], value_offset=10.0)),
                     ("DiT-like, key offsets 20", dict(q_mult=[[1.0]], key_offset=20.0))):
        q, k, v = dit_attention_inputs(rng, 1, sq, skv, 1, d, **kw)
        yield name, q[0, :, 0], k[0, :, 0], v[0, :, 0]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keys", type=int, default=4608)
    ap.add_argument("--queries", type=int, default=128)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args()
    scale = args.dim ** -0.5
    print(f"{args.queries} queries x {args.keys} keys, D = {args.dim}; worst of {args.seeds} seeds: "
          "relative L2 / cosine against float64")
    print(f"{'case':40s} " + " ".join(f"{f:>22s}" for f in FORMATS))
    worst = {}
    for seed in range(args.seeds):
        rng = np.random.default_rng(seed)
        for name, q, k, v in cases(rng, args.queries, args.keys, args.dim):
            ref = attention_f64(q[None, :, None], k[None, :, None], v[None, :, None], scale)[0][0, :, 0]
            for f in FORMATS:
                out = attention_8bit(q, k, v, scale, f)
                r, c = rel_l2(out, ref), cosine(out, ref)
                w = worst.setdefault((name, f), [0.0, 1.0])
                w[0], w[1] = max(w[0], r), min(w[1], c)
    for name in dict.fromkeys(n for n, _ in worst):
        print(f"{name:40s} " + " ".join(f"{100 * worst[name, f][0]:10.2f}% / {worst[name, f][1]:.5f}" for f in FORMATS))


if __name__ == "__main__":
    main()
