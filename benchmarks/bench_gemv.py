"""Weight-only GEMV (x [M, K] with M <= 16) against torch bf16 F.linear on the same GPU.

For every GEMM shape with M <= 16 in shapes.json and every weight-only scheme (cquant.schemes),
times cquant's ops.linear and torch's bf16 F.linear interleaved (benchmarks/_timing.py), each
as a CUDA graph of calls (so host overhead does not hide the kernel) cycling through enough
weight copies that the working set is several times the L2 cache. Reports the median time per
call, the weight bandwidth (stored weight bytes / time) and its share of a device-to-device copy
measured in the same run, and the speed-up over bf16 (median over repeats, with its range).
Stored weight bytes are the codes and their fp32 scales (for 4-bit weights N * K / 2 + the
group scales: [N, K / group] for int4, [N, K / group, 2] with the zero points for uint4).
Schemes are cquant scheme names ("int4wo_g64": group size 64); --group-sizes 32,64,128 times
every group-wise scheme at each.

    python benchmarks/bench_gemv.py --out gemv.json     # ~20 s on an H100
    python benchmarks/bench_gemv.py --quick
    python benchmarks/bench_gemv.py --schemes int4wo,int8wo,fp8wo --group-sizes 32,64,128
    python benchmarks/bench_gemv.py --device cpu        # a smoke run of the plumbing on tiny shapes
    pytest benchmarks/test_bench_gemv.py --benchmark-only   # pytest-benchmark's tables, seconds per call
"""

import argparse
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

from cquant import ops
from cquant.demo import comma_list

from _timing import (describe, describe_line, fmt_speedup, graphed, headline, interleaved, l2_bytes, require_cuda,
                     text_table, time_calls, wall_time_calls)
from _variants import group_sizes, linear_kwargs, parse, quantize_weight, weight_only_names, with_group_sizes

HERE = os.path.dirname(os.path.abspath(__file__))
WEIGHT_ONLY = weight_only_names()
BASELINE = "torch_bf16"
MIN_CALLS_PER_GRAPH = 20
MAX_COPIES = 256
QUICK_SHAPES = {(1, 3072, 18432), (1, 3072, 3072)}
# --device cpu: the same code on tiny shapes (host wall time, no graphs); checks the plumbing only
DEVICE = "cuda"
CPU_SHAPES = [("cpu_smoke", 1, 256, 512, ""), ("cpu_smoke", 4, 512, 256, "")]


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


def n_copies(nbytes):
    """Copies of a weight whose total is several L2 caches (at least 2)."""
    if DEVICE == "cpu":
        return 2
    return max(2, min(MAX_COPIES, math.ceil(5 * l2_bytes() / nbytes)))


def sequence(calls):
    """(run, len(calls)) like _timing.graphed, for the CPU: the calls one after another."""
    def run():
        for fn in calls:
            fn()
    return run, len(calls)


def graph_cycling(make_call, copies):
    """A graph of calls cycling through the copies (at least MIN_CALLS_PER_GRAPH calls)."""
    n = max(len(copies), MIN_CALLS_PER_GRAPH)
    return (graphed if DEVICE == "cuda" else sequence)([make_call(copies[i % len(copies)]) for i in range(n)])


def timer():
    return time_calls if DEVICE == "cuda" else wall_time_calls


def copy_gbps(args, nbytes=1 << 30):
    """Device-to-device copy: (bytes read + bytes written) / time, in GB/s."""
    if DEVICE == "cpu":
        nbytes = 1 << 24
    src = torch.empty(nbytes, dtype=torch.uint8, device=DEVICE).random_()
    dst = torch.empty_like(src)
    run = (graphed if DEVICE == "cuda" else sequence)([lambda: dst.copy_(src)])
    t = interleaved({"copy": run}, repeats=args.repeats, warmup=1, iters=args.iters, timer=timer())
    return 2 * nbytes / (t["copy"].median * 1e-3) / 1e9


@torch.no_grad()
def bench_shape(m, k, n, names, dtype, args):
    torch.manual_seed(0)
    x = torch.randn(m, k, device=DEVICE, dtype=dtype)
    xb = x.to(torch.bfloat16)
    w = torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16)
    w_bytes = w.numel() * w.element_size()
    keep = [[w.clone() for _ in range(n_copies(w_bytes))]]
    cands = {BASELINE: graph_cycling(lambda wc: (lambda: F.linear(xb, wc)), keep[0])}
    sizes = {BASELINE: (w_bytes, 0, len(keep[0]))}
    for name in names:
        sch = parse(name).scheme
        why = sch.refusal(k, n)
        if why:
            print(f"  {name}: skipped, {why}", flush=True)
            continue
        try:
            q, s = quantize_weight(sch, w)
            kw = linear_kwargs(sch, k)
            y = torch.empty(m, n, device=DEVICE, dtype=dtype)
            ops.linear(x, q, s, out=y, **kw)  # a shape or group size the library refuses: skipped, with why
        except (ValueError, RuntimeError, NotImplementedError) as e:
            print(f"  {name}: skipped, {str(e).splitlines()[0][:120]}", flush=True)
            continue
        q_bytes, s_bytes = q.numel() * q.element_size(), s.numel() * s.element_size()
        copies = [(q.clone(), s.clone()) for _ in range(n_copies(q_bytes + s_bytes))]
        keep.append(copies)
        cands[name] = graph_cycling(lambda qs, kw=kw, y=y: (lambda: ops.linear(x, qs[0], qs[1], out=y, **kw)), copies)
        sizes[name] = (q_bytes, s_bytes, len(copies))
    t = interleaved(cands, repeats=args.repeats, warmup=2, iters=args.iters, baseline=BASELINE, timer=timer())
    rows = []
    for name, (code_bytes, scale_bytes, ncopies) in sizes.items():
        ms = t[name].median
        nbytes = code_bytes + scale_bytes
        rows.append(dict(scheme=name, weight_bytes=nbytes, code_bytes=code_bytes, scale_bytes=scale_bytes,
                         copies=ncopies, us=ms * 1e3, **t[name].as_dict(), weight_gbps=nbytes / (ms * 1e-3) / 1e9))
    del keep, cands
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="path of the JSON results")
    ap.add_argument("--quick", action="store_true", help="2 shapes, 3 short repeats")
    ap.add_argument("--shapes", default=os.path.join(HERE, "shapes.json"))
    ap.add_argument("--schemes", default=",".join(WEIGHT_ONLY),
                    help="comma-separated weight-only schemes, any fpB_eEmM too (default: %(default)s)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                    help="dtype of x and y for cquant (the baseline is always bf16)")
    ap.add_argument("--group-sizes", default="",
                    help="comma-separated weight group sizes: every group-wise scheme is timed at each")
    ap.add_argument("--repeats", type=int, default=None, help="interleaved repeats (default 5, --quick 3)")
    ap.add_argument("--iters", type=int, default=None, help="timed graph replays per candidate and repeat (default 10)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="cpu: a smoke run of the plumbing on two tiny shapes (host wall time, C reference)")
    args = ap.parse_args(argv)
    try:
        schemes = comma_list(args.schemes, "--schemes", "scheme", "comma-separated weight-only scheme names")
        names = with_group_sizes(schemes, group_sizes(args.group_sizes))
        for name in names:
            v = parse(name)
            if v.scheme.dynamic:
                raise ValueError(f"{name} quantizes activations; the GEMV path is for weight-only schemes")
            if v.rank:
                raise ValueError(f"{name}: the low-rank correction belongs to the module (cquant.quantize_)")
    except ValueError as e:
        ap.error(str(e))
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cuda":
        require_cuda("bench_gemv")
    args.repeats = args.repeats or (3 if args.quick else 5)
    args.iters = args.iters or (5 if args.quick else 10)
    dtype = getattr(torch, args.dtype)
    shapes = gemv_shapes(args.shapes) if DEVICE == "cuda" else CPU_SHAPES
    if args.quick and DEVICE == "cuda":
        shapes = [s for s in shapes if s[1:4] in QUICK_SHAPES]

    t0 = time.time()
    copy = copy_gbps(args)
    results = {"copy_gbps": copy, "x_dtype": args.dtype, "shapes": []}
    lines = [("shape (MxKxN)", "scheme", "weight MB", "us", "us range", "GB/s", "% copy", "x bf16 (range)")]
    for group, m, k, n, note in shapes:
        print(f"{m}x{k}x{n} ({group})", flush=True)
        rows = bench_shape(m, k, n, names, dtype, args)
        for r in rows:
            r["pct_copy"] = 100.0 * r["weight_gbps"] / copy
            lines.append((f"{m}x{k}x{n}", r["scheme"], f"{r['weight_bytes'] / 1e6:.2f}", f"{r['us']:.2f}",
                          f"{r['ms_min'] * 1e3:.2f}-{r['ms_max'] * 1e3:.2f}",
                          f"{r['weight_gbps']:.0f}", f"{r['pct_copy']:.0f}%",
                          "-" if r["scheme"] == BASELINE else fmt_speedup(r)))
        results["shapes"].append({"group": group, "M": m, "K": k, "N": n, "note": note, "results": rows})
    info = describe()
    print(f"\n# weight-only GEMV, x {args.dtype}; {describe_line(info)}; device-to-device copy {copy:.0f} GB/s "
          f"(read + write); {args.repeats} repeats x {args.iters} graph replays")
    print(text_table(lines))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            rows = [r for s in results["shapes"] for r in s["results"]]
            json.dump(dict(info=info, args=vars(args), seconds=time.time() - t0, **results,
                           headline=headline(rows, "scheme", BASELINE, "median over shapes")), f, indent=1)
        print(f"# wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
