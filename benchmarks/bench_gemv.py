"""Weight-only GEMV (x [M, K] with M <= 16) against torch bf16 F.linear on the same GPU.

For every GEMM shape with M <= 16 in shapes.json and every weight-only scheme, times
cquant's ops.linear and torch's bf16 F.linear in the same run, each captured in a CUDA
graph (so host overhead does not hide the kernel) cycling through enough weight copies
that the working set is several times the L2 cache. Reports the median time per call,
the weight bandwidth (stored weight bytes / time), its share of a device-to-device copy
measured in the same run, and the speed-up over bf16.

    python benchmarks/bench_gemv.py --out benchmarks/results/gemv_h100.json
"""

import argparse
import json
import math
import os
import statistics
import sys

import torch
import torch.nn.functional as F

from cquant import ops

SCHEMES = ["int8", "fp8_e4m3", "fp8_e5m2", "fp7_e3m3", "fp6_e3m2", "fp6_e2m3", "fp5_e2m2", "fp4_e2m1", "fp3_e1m1"]
HERE = os.path.dirname(os.path.abspath(__file__))
WORKING_SET_BYTES = 256 << 20  # > 5x the 50 MB L2 of an H100
MAX_COPIES = 256
MIN_CALLS_PER_GRAPH = 20


def gemv_shapes(path):
    """(group, M, K, N, note) of every GEMM with M <= 16, deduplicated."""
    with open(path) as f:
        data = json.load(f)
    seen, out = set(), []
    for group, rows in data["gemm"].items():
        for r in rows:
            key = (r["M"], r["K"], r["N"])
            if r["M"] <= 16 and key not in seen:
                seen.add(key)
                out.append((group, r["M"], r["K"], r["N"], r.get("note", "")))
    return out


def time_graph(fn_calls, replays, warmup=3):
    """Median milliseconds of one call: each call in fn_calls captured once into a graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in fn_calls:  # first calls outside the capture (cuBLAS picks its kernels here)
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fn_calls:
            fn()
    for _ in range(warmup):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / len(fn_calls))
    del graph
    return statistics.median(times)


def copy_bandwidth(nbytes=1 << 30, replays=20):
    """Device-to-device copy: (bytes read + bytes written) / time, in bytes/s."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = time_graph([lambda: dst.copy_(src)], replays)
    return 2 * nbytes / (ms * 1e-3)


def n_copies(nbytes):
    return max(2, min(MAX_COPIES, math.ceil(WORKING_SET_BYTES / nbytes)))


def calls_cycling(make_call, copies):
    n = max(len(copies), MIN_CALLS_PER_GRAPH)
    return [make_call(copies[i % len(copies)]) for i in range(n)]


def bench_shape(m, k, n, schemes, dtype, replays):
    torch.manual_seed(0)
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    rows = []

    w_bytes = w.numel() * w.element_size()
    copies = [w.clone() for _ in range(n_copies(w_bytes))]
    xb = x.to(torch.bfloat16)
    ms_bf16 = time_graph(calls_cycling(lambda wc: (lambda: F.linear(xb, wc)), copies), replays)
    del copies

    for fmt in schemes:
        q, s = ops.quantize(w, fmt)
        q_bytes = q.numel() * q.element_size()
        copies = [(q.clone(), s.clone()) for _ in range(n_copies(q_bytes))]
        y = torch.empty(m, n, device="cuda", dtype=dtype)
        ms = time_graph(calls_cycling(
            lambda qs: (lambda: ops.linear(x, qs[0], qs[1], weight_format=fmt, in_features=k, out=y)), copies), replays)
        rows.append({"scheme": fmt, "weight_bytes": q_bytes, "us": ms * 1e3, "bf16_us": ms_bf16 * 1e3,
                     "weight_gbps": q_bytes / (ms * 1e-3) / 1e9, "bf16_weight_gbps": w_bytes / (ms_bf16 * 1e-3) / 1e9,
                     "ratio_vs_bf16": ms_bf16 / ms, "copies": len(copies)})
        del copies, q, s
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="path of the JSON results")
    ap.add_argument("--shapes", default=os.path.join(HERE, "shapes.json"))
    ap.add_argument("--schemes", default=",".join(SCHEMES), help="comma-separated weight formats")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                    help="dtype of x and y for cquant (the baseline is always bf16)")
    ap.add_argument("--replays", type=int, default=50, help="timed graph replays per measurement")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_gemv needs a CUDA GPU")
    dtype = getattr(torch, args.dtype)
    schemes = [s for s in args.schemes.split(",") if s]

    props = torch.cuda.get_device_properties(0)
    copy_bw = copy_bandwidth()
    print(f"{props.name}: device-to-device copy {copy_bw / 1e9:.0f} GB/s (read + write)")
    results = {"device": props.name, "sm_count": props.multi_processor_count, "torch": torch.__version__,
               "x_dtype": args.dtype, "copy_gbps": copy_bw / 1e9, "shapes": []}
    header = f"{'shape (M x K x N)':<22}{'scheme':<10}{'us':>8}{'GB/s':>8}{'% copy':>8}{'bf16 us':>9}{'x bf16':>8}"
    print(header)
    print("-" * len(header))
    for group, m, k, n, note in gemv_shapes(args.shapes):
        rows = bench_shape(m, k, n, schemes, dtype, args.replays)
        for r in rows:
            r["pct_copy"] = 100.0 * r["weight_gbps"] * 1e9 / copy_bw
            print(f"{f'{m} x {k} x {n}':<22}{r['scheme']:<10}{r['us']:>8.2f}{r['weight_gbps']:>8.0f}"
                  f"{r['pct_copy']:>7.0f}%{r['bf16_us']:>9.2f}{r['ratio_vs_bf16']:>7.2f}x")
        results["shapes"].append({"group": group, "M": m, "K": k, "N": n, "note": note, "results": rows})
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
