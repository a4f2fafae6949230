#!/usr/bin/env python3
"""The study behind the 8-bit attention's accuracy bound (cquant.h, CQ_ATTENTION_INT8_MAX_LOGIT_ERROR).

For DiT-like heads (tests/helpers.dit_attention_inputs: RMS-normalized q, k rows times channel
weights, optional outlier channels) it prints, per head: the logit-error estimate E, whether the
8-bit mode falls back (E > tau), the error of the 8-bit math alone (the NumPy model of
tests/attention_oracle.py) and of what cquant.attention(mode="int8") returns, both against
float64. Tables: logit scale (q times c), key offsets, value offsets; then a random sweep
summarised as the worst error among heads with E <= t, for values with channel means (DiT-like)
and i.i.d. zero-mean values (the worst case of the P and V rounding).

Usage: PYTHONPATH=python python scripts/attention_int8_bound_study.py [--sweep N] [--seed S]
(needs numpy; CPU only; ~1 minute plus ~0.3 s per sweep head)
"""

import argparse
import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import cquant  # noqa: E402
from attention_oracle import attention_f64, attention_int8, cosine, rel_l2  # noqa: E402
from cquant import ops  # noqa: E402
from helpers import dit_attention_inputs  # noqa: E402

TAU = ops.ATTENTION_INT8_MAX_LOGIT_ERROR


def head_rows(q, k, v):
    """One row per head of one call: (E, falls back, 8-bit math (cos, rel), delivered (cos, rel))."""
    scale = 1 / math.sqrt(q.shape[-1])
    ref, _ = attention_f64(q, k, v, scale)
    model, _ = attention_int8(q, k, v, scale)
    out = cquant.attention(q, k, v, mode="int8", scale=scale)
    bound = ops.attention_int8_logit_error(q, k, scale)
    rows = []
    for b in range(q.shape[0]):
        for h in range(q.shape[2]):
            r = ref[b, :, h]
            rows.append((float(bound[b, h]), bool(bound[b, h] > TAU), (cosine(model[b, :, h], r), rel_l2(model[b, :, h], r)),
                         (cosine(out[b, :, h], r), rel_l2(out[b, :, h], r))))
    return rows


def table(title, label, configs, rng, s=1024, d=128, heads=2):
    print(f"\n{title} (D = {d}, Sq = Skv = {s}, {heads} heads each; values with channel means)")
    print(f"| {label} | E | E / tau | path | 8-bit math: cos, rel L2 | returned: cos, rel L2 |")
    print("|---|---|---|---|---|---|")
    for name, kw in configs:
        kw = dict(kw)
        mult = kw.pop("c", 1.0)
        q, k, v = dit_attention_inputs(rng, 1, s, s, heads, d, [[mult] * heads], **kw)
        for e, full, (mc, mr), (oc, orel) in head_rows(q, k, v):
            print(f"| {name} | {e:.4f} | {e / TAU:.2f} | {'full' if full else '8-bit'} | {mc:.5f}, {mr * 100:.2f}% | "
                  f"{oc:.5f}, {orel * 100:.2f}% |")


def sweep(rng, n):
    """Random heads over head dim, lengths, logit scale, outliers, key/value offsets, value kind."""
    rows = []
    for _ in range(n):
        d = int(rng.choice([64, 128]))
        s, skv = int(rng.choice([256, 512, 1024])), int(rng.choice([256, 333, 1024]))
        c = float(np.exp(rng.uniform(0, math.log(8))))
        kw = dict(outliers=int(rng.choice([0, 0, 1, 2, 4])), key_offset=float(rng.choice([0, 5, 20, 100])),
                  key_groups=float(rng.choice([0, 0, 0, 2, 5])), value_offset=float(rng.choice([0, 0, 1, 5, 100])))
        q, k, v = dit_attention_inputs(rng, 1, s, skv, 1, d, [[c]], **kw)
        iid = rng.random() < 0.3
        if iid:  # i.i.d. zero-mean values: every output an incoherent average, the worst case
            v = rng.standard_normal(v.shape).astype(np.float32)
        (e, _, (mc, mr), _), = head_rows(q, k, v)
        rows.append((e, iid, mc, mr))
    e, iid, cos, rel = (np.array(x) for x in zip(*rows))
    for name, sel, bar in (("values with channel means or offsets", ~iid, 0.03), ("i.i.d. zero-mean values", iid, 0.03)):
        print(f"\nSweep, 8-bit math alone, {name} ({sel.sum()} heads; target cos >= 0.999, rel L2 <= {bar * 100:.1f}%)")
        print("| E <= | heads | worst rel L2 | worst cos | over target |")
        print("|---|---|---|---|---|")
        for t in (0.03, 0.04, 0.05, 0.06, 0.08, 0.10, 0.12, 0.15, 0.2, 0.3):
            m = sel & (e <= t)
            if m.any():
                bad = m & ((cos < 0.999) | (rel > bar))
                print(f"| {t:.2f} | {m.sum()} | {rel[m].max() * 100:.2f}% | {cos[m].min():.5f} | {bad.sum()} |")
        bad = sel & ((cos < 0.999) | (rel > bar))
        print(f"smallest E over target: {np.sort(e[bad])[:3].round(4).tolist()}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep", type=int, default=300, help="random heads in the sweep (0: tables only)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    print(f"tau = CQ_ATTENTION_INT8_MAX_LOGIT_ERROR = {TAU:.4f} (log2 units)")
    table("Logit scale: q times c", "c", [(f"{c:g}", dict(c=c)) for c in (1, 1.5, 2, 3, 5, 8, 12, 20, 30)], rng)
    table("Logit scale with 2 outlier channels (weight 4-5) in q and k", "c",
          [(f"{c:g}", dict(c=c, outliers=2)) for c in (0.3, 0.5, 1, 2, 5)], rng)
    table("Key offsets: k + o N(0, 1) per channel (and two key groups)", "o",
          [(f"{o:g}", dict(key_offset=o)) for o in (0, 5, 20, 50, 100)]
          + [(f"{o:g}, c = 5", dict(key_offset=o, c=5)) for o in (0, 100)]
          + [(f"groups {g:g}", dict(key_groups=g)) for g in (1, 2, 5, 10)], rng)
    table("Value offsets: v + o N(0, 1) per channel", "o", [(f"{o:g}", dict(value_offset=o)) for o in (0, 5, 20, 100)]
          + [(f"{o:g}, c = 5", dict(value_offset=o, c=5)) for o in (0, 100)], rng)
    if args.sweep:
        sweep(rng, args.sweep)


if __name__ == "__main__":
    main()
