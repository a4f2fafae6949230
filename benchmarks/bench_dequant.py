"""Row decoder of the large-batch weight-only path (ops.dequantize into bf16) against a bf16
device-to-device copy of the same weight, on the weight shapes of the large-M layers of
shapes.json.

For each weight [N, K] and weight-only scheme (cquant.schemes), times
``ops.dequantize(q, s, fmt, out=bf16)`` -- what ops.linear runs before its bf16 GEMM when
M > 16 -- interleaved with ``out.copy_(w_bf16)`` (benchmarks/_timing.py), each as CUDA graphs
that cycle through enough weight copies to defeat the L2 cache. Reports the median time, the
bytes moved (codes read + bf16 written) per second, and the speed-up over the copy (which
moves more: it reads 2 bytes a weight where the decoder reads 1 or less).

    python benchmarks/bench_dequant.py --out dequant.json      # ~15 s on an H100
    python benchmarks/bench_dequant.py --quick
    pytest benchmarks/test_bench_dequant.py --benchmark-only   # pytest-benchmark's tables, seconds per call
"""

import argparse
import json
import os
import sys
import time

import torch

from cquant import ops
from cquant.demo import comma_list
from cquant.schemes import scheme

from _timing import describe, describe_line, fmt_speedup, headline, interleaved, require_cuda, text_table
from bench_gemv import WEIGHT_ONLY, graph_cycling, n_copies

HERE = os.path.dirname(os.path.abspath(__file__))
BASELINE = "bf16_copy"


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


@torch.no_grad()
def bench_shape(n, k, names, args):
    torch.manual_seed(0)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(n, k, device="cuda", dtype=torch.bfloat16)
    out_bytes = out.numel() * out.element_size()
    keep = [[w.clone() for _ in range(n_copies(out_bytes))]]
    cands = {BASELINE: graph_cycling(lambda wc: (lambda: out.copy_(wc)), keep[0])}
    moved = {BASELINE: 2 * out_bytes}
    for name in names:
        fmt = scheme(name).weight_format.name
        q, s = ops.quantize(w, fmt)
        q_bytes = q.numel() * q.element_size()
        copies = [(q.clone(), s.clone()) for _ in range(n_copies(q_bytes))]
        keep.append(copies)
        cands[name] = graph_cycling(lambda qs, fmt=fmt: (lambda: ops.dequantize(qs[0], qs[1], fmt, cols=k, out=out)),
                                    copies)
        moved[name] = q_bytes + out_bytes
    t = interleaved(cands, repeats=args.repeats, warmup=2, iters=args.iters, baseline=BASELINE)
    rows = [dict(scheme=name, us=t[name].median * 1e3, bytes_moved=moved[name], **t[name].as_dict(),
                 gbps=moved[name] / (t[name].median * 1e-3) / 1e9) for name in cands]
    del keep, cands
    torch.cuda.empty_cache()
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="path of the JSON results")
    ap.add_argument("--quick", action="store_true", help="the largest weight only, 3 short repeats")
    ap.add_argument("--shapes", default=os.path.join(HERE, "shapes.json"))
    ap.add_argument("--schemes", default=",".join(WEIGHT_ONLY),
                    help="comma-separated weight-only schemes, any fpB_eEmM too (default: %(default)s)")
    ap.add_argument("--repeats", type=int, default=None, help="interleaved repeats (default 5, --quick 3)")
    ap.add_argument("--iters", type=int, default=None, help="timed graph replays per candidate and repeat (default 10)")
    args = ap.parse_args(argv)
    try:
        names = comma_list(args.schemes, "--schemes", "scheme", "comma-separated weight-only scheme names")
        for name in names:
            if scheme(name).dynamic:
                ap.error(f"{name} quantizes activations; the row decoder serves weight-only schemes")
    except ValueError as e:
        ap.error(str(e))
    require_cuda("bench_dequant")
    args.repeats = args.repeats or (3 if args.quick else 5)
    args.iters = args.iters or (5 if args.quick else 10)
    shapes = weight_shapes(args.shapes)[:1 if args.quick else None]

    t0, results = time.time(), []
    lines = [("weight (NxK)", "scheme", "us", "us range", "GB/s", "x copy (range)")]
    for n, k in shapes:
        print(f"{n}x{k}", flush=True)
        rows = bench_shape(n, k, names, args)
        for r in rows:
            lines.append((f"{n}x{k}", r["scheme"], f"{r['us']:.1f}", f"{r['ms_min'] * 1e3:.1f}-{r['ms_max'] * 1e3:.1f}",
                          f"{r['gbps']:.0f}", "-" if r["scheme"] == BASELINE else fmt_speedup(r)))
        results.append({"N": n, "K": k, "results": rows})
    info = describe()
    print(f"\n# weight decoding into bf16; {describe_line(info)}; {args.repeats} repeats x {args.iters} graph replays")
    print(text_table(lines))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            rows = [r for s in results for r in s["results"]]
            json.dump(dict(info=info, args=vars(args), seconds=time.time() - t0, shapes=results,
                           headline=headline(rows, "scheme", BASELINE, "median over weight shapes")), f, indent=1)
        print(f"# wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
