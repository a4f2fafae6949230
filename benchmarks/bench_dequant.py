"""Row decoder of the large-batch weight-only path (ops.dequantize into bf16) against a
device-to-device copy, on the weight shapes of the large-M layers of shapes.json.

For each weight [N, K] and weight-only format, times ``ops.dequantize(q, s, fmt, out=bf16)``
-- what ops.linear runs before its bf16 GEMM when M > 16 -- captured in CUDA graphs that
cycle through enough weight copies to defeat the L2 cache. Reports the median time, the
bytes moved (packed codes read + bf16 written) per second, and their share of a
device-to-device copy measured in the same run.

    python benchmarks/bench_dequant.py --out benchmarks/results/dequant_h100.json
"""

import argparse
import json
import os
import sys

import torch

from bench_gemv import copy_bandwidth, n_copies, time_graph

from cquant import ops

SCHEMES = ["int8", "fp8_e4m3", "fp6_e3m2", "fp5_e2m2", "fp4_e2m1"]
HERE = os.path.dirname(os.path.abspath(__file__))


def weight_shapes(path, min_m=17):
    """(N, K) of every GEMM with M >= min_m, deduplicated, largest first."""
    with open(path) as f:
        data = json.load(f)
    seen = set()
    for rows in data["gemm"].values():
        for r in rows:
            if r["M"] >= min_m and r["K"] >= 256 and r["N"] >= 256:
                seen.add((r["N"], r["K"]))
    return sorted(seen, key=lambda nk: -nk[0] * nk[1])


def bench_shape(n, k, schemes, replays):
    torch.manual_seed(0)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(n, k, device="cuda", dtype=torch.bfloat16)
    rows = []
    for fmt in schemes:
        q, s = ops.quantize(w, fmt)
        q_bytes = q.numel() * q.element_size()
        moved = q_bytes + out.numel() * out.element_size()
        copies = [(q.clone(), s.clone()) for _ in range(n_copies(q_bytes))]
        calls = [(lambda qs: (lambda: ops.dequantize(qs[0], qs[1], fmt, cols=k, out=out)))(c) for c in copies]
        ms = time_graph(calls, replays)
        rows.append({"scheme": fmt, "us": ms * 1e3, "bytes_moved": moved, "gbps": moved / (ms * 1e-3) / 1e9,
                     "copies": len(copies)})
        del copies, q, s
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="path of the JSON results")
    ap.add_argument("--shapes", default=os.path.join(HERE, "shapes.json"))
    ap.add_argument("--schemes", default=",".join(SCHEMES), help="comma-separated weight formats")
    ap.add_argument("--replays", type=int, default=30, help="timed graph replays per measurement")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_dequant needs a CUDA GPU")
    schemes = [s for s in args.schemes.split(",") if s]
    props = torch.cuda.get_device_properties(0)
    copy_bw = copy_bandwidth()
    print(f"{props.name}: device-to-device copy {copy_bw / 1e9:.0f} GB/s (read + write)")
    results = {"device": props.name, "torch": torch.__version__, "copy_gbps": copy_bw / 1e9, "shapes": []}
    header = f"{'weight (N x K)':<18}{'scheme':<10}{'us':>9}{'GB/s':>8}{'% copy':>8}"
    print(header)
    print("-" * len(header))
    for n, k in weight_shapes(args.shapes):
        rows = bench_shape(n, k, schemes, args.replays)
        for r in rows:
            r["pct_copy"] = 100.0 * r["gbps"] * 1e9 / copy_bw
            print(f"{f'{n} x {k}':<18}{r['scheme']:<10}{r['us']:>9.1f}{r['gbps']:>8.0f}{r['pct_copy']:>7.0f}%")
        results["shapes"].append({"N": n, "K": k, "results": rows})
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
