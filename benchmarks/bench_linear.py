"""Quantized linear layers against torch's bf16 and 8-bit GEMMs, on the shapes of real models.

For every GEMM shape of benchmarks/shapes.json (groups flux_1024_tokenwise,
flux_conditioning_gemv, zimage_1024_cfg2) and every cquant scheme, times ``cquant.ops.linear``
(activation quantization included) next to, in the same run on the same card:

  torch_bf16            F.linear in bf16 (the layer being replaced; ratios are against it)
  torch_scaled_mm       torch._scaled_mm, fp8 e4m3 row-wise scales, activations pre-quantized
  torch_scaled_mm_dyn   the same with the activation quantization done eagerly in torch
  torch_int_mm          torch._int_mm, int8 x int8 -> int32 (no scales, pre-quantized)

Times are CUDA-event medians after warm-up; inputs and weights rotate over enough copies that
the 50 MB L2 cannot hold them. SQNR (dB) is against float64 of the unquantized layer, on a
subsample of rows. Prints a table (TFLOP/s, GB/s, ratio to bf16, SQNR) and writes JSON.

    python benchmarks/bench_linear.py --out benchmarks/results/linear_h100.json
    python benchmarks/bench_linear.py --quick
"""

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from cquant import ops

HERE = os.path.dirname(os.path.abspath(__file__))
GROUPS = ("flux_1024_tokenwise", "flux_conditioning_gemv", "zimage_1024_cfg2")
# scheme -> (weight format, weight granularity, act format, act granularity)
SCHEMES = {
    "int8wo": ("int8", "row", None, "row"),
    "int8dq": ("int8", "row", "int8", "row"),
    "fp8dqrow": ("fp8_e4m3", "row", "fp8_e4m3", "row"),
    "fp8dq_tensor": ("fp8_e4m3", "tensor", "fp8_e4m3", "tensor"),
    "fp8wo": ("fp8_e4m3", "row", None, "row"),
    "fp6_e3m2": ("fp6_e3m2", "row", None, "row"),
    "fp5_e2m2": ("fp5_e2m2", "row", None, "row"),
    "fp4_e2m1": ("fp4_e2m1", "row", None, "row"),
}
BASELINES = ("torch_bf16", "torch_scaled_mm", "torch_scaled_mm_dyn", "torch_int_mm")
L2_FLUSH_BYTES = 192 << 20  # rotate over at least this much input + weight data
SQNR_ROWS = 64


def load_shapes(groups):
    with open(os.path.join(HERE, "shapes.json")) as f:
        data = json.load(f)["gemm"]
    out = []
    for g in groups:
        for s in data[g]:
            out.append(dict(group=g, M=s["M"], K=s["K"], N=s["N"], note=s.get("note", "")))
    return out


def time_ms(fn, sets, warmup, iters):
    """Median per-call time (ms) of fn(set), rotating over the input sets."""
    for i in range(warmup):
        fn(sets[i % len(sets)])
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for i in range(iters):
        starts[i].record()
        fn(sets[i % len(sets)])
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def sqnr_db(y, ref):
    err = (y.double() - ref).norm().item()
    return float("inf") if err == 0 else 20 * math.log10(ref.norm().item() / err)


def fp8_rowwise(t):
    """torch's eager row-wise e4m3 quantization: codes and fp32 scales [rows, 1]."""
    amax = t.abs().amax(dim=1, keepdim=True).float().clamp_min(1e-12)
    scale = amax / 448.0
    q = (t.float() / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q, scale


def int8_rowwise(t):
    amax = t.abs().amax(dim=1, keepdim=True).float().clamp_min(1e-12)
    scale = amax / 127.0
    return (t.float() / scale).round().clamp(-127, 127).to(torch.int8), scale


def make_sets(m, k, n, count, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    sets = []
    for _ in range(count):
        x = torch.randn(m, k, device="cuda", generator=g, dtype=torch.bfloat16)
        w = (torch.randn(n, k, device="cuda", generator=g) / math.sqrt(k)).to(torch.bfloat16)
        b = (torch.randn(n, device="cuda", generator=g) * 0.1).to(torch.bfloat16)
        sets.append(dict(x=x, w=w, b=b))
    return sets


def bench_shape(shape, schemes, warmup, iters, log):
    m, k, n = shape["M"], shape["K"], shape["N"]
    set_bytes = 2 * (m * k + n * k)
    count = max(2, min(32, -(-L2_FLUSH_BYTES // set_bytes)))
    sets = make_sets(m, k, n, count, seed=m * 7 + k * 3 + n)
    flops = 2.0 * m * n * k
    rows = torch.linspace(0, m - 1, min(m, SQNR_ROWS), device="cuda").long().unique()
    s0 = sets[0]
    ref = F.linear(s0["x"][rows].double(), s0["w"].double(), s0["b"].double())
    results = []

    def record(method, ms, weight_bytes, y=None, extra=None):
        moved = 2 * m * k + weight_bytes + 2 * m * n
        r = dict(group=shape["group"], M=m, K=k, N=n, method=method, ms=ms, tflops=flops / ms / 1e9,
                 gbps=moved / ms / 1e6, sqnr_db=None if y is None else sqnr_db(y[rows], ref))
        if extra:
            r.update(extra)
        results.append(r)
        log(r)

    # torch bf16
    ms = time_ms(lambda s: F.linear(s["x"], s["w"], s["b"]), sets, warmup, iters)
    record("torch_bf16", ms, 2 * n * k, F.linear(s0["x"], s0["w"], s0["b"]))
    bf16_ms = ms

    cap = torch.cuda.get_device_capability()
    if cap >= (8, 9) and k % 16 == 0 and n % 16 == 0:
        for s in sets:
            s["wq8"], s["sw8"] = fp8_rowwise(s["w"])
            s["xq8"], s["sx8"] = fp8_rowwise(s["x"])

        def scaled_mm(s, xq, sx):
            return torch._scaled_mm(xq, s["wq8"].t(), scale_a=sx, scale_b=s["sw8"].t(), bias=s["b"],
                                    out_dtype=torch.bfloat16)

        try:
            ms = time_ms(lambda s: scaled_mm(s, s["xq8"], s["sx8"]), sets, warmup, iters)
            record("torch_scaled_mm", ms, n * k, scaled_mm(s0, s0["xq8"], s0["sx8"]))
            ms = time_ms(lambda s: scaled_mm(s, *fp8_rowwise(s["x"])), sets, warmup, iters)
            record("torch_scaled_mm_dyn", ms, n * k, scaled_mm(s0, *fp8_rowwise(s0["x"])))
        except RuntimeError as e:  # shapes torch's fp8 GEMM does not take
            log(dict(method="torch_scaled_mm", skipped=str(e).splitlines()[0]))
        for s in sets:
            del s["wq8"], s["sw8"], s["xq8"], s["sx8"]
    if m > 16 and k % 8 == 0 and n % 8 == 0:
        for s in sets:
            s["wq"], _ = int8_rowwise(s["w"])
            s["xq"], _ = int8_rowwise(s["x"])
        try:
            ms = time_ms(lambda s: torch._int_mm(s["xq"], s["wq"].t()), sets, warmup, iters)
            record("torch_int_mm", ms, n * k)
        except RuntimeError as e:
            log(dict(method="torch_int_mm", skipped=str(e).splitlines()[0]))
        for s in sets:
            del s["wq"], s["xq"]

    for name in schemes:
        wf, wg, af, ag = SCHEMES[name]
        if af and af.startswith("fp8") and cap < (8, 9):
            log(dict(method=name, skipped="fp8 activations need sm_89+"))
            continue
        for s in sets:
            s["qw"], s["sw"] = ops.quantize(s["w"], wf, wg)
        kw = dict(weight_format=wf, weight_granularity=wg, act_format=af, act_granularity=ag, in_features=k)

        def run(s):
            return ops.linear(s["x"], s["qw"], s["sw"], bias=s["b"], **kw)

        ms = time_ms(run, sets, warmup, iters)
        weight_bytes = s0["qw"].numel() * s0["qw"].element_size() + s0["sw"].numel() * 4
        record(name, ms, weight_bytes, run(s0), dict(ratio_to_bf16=bf16_ms / ms))
        for s in sets:
            del s["qw"], s["sw"]
    for r in results:
        r.setdefault("ratio_to_bf16", bf16_ms / r["ms"])
    del sets
    torch.cuda.empty_cache()
    return results


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="write all results as JSON to this path")
    ap.add_argument("--quick", action="store_true", help="a few shapes, fewer iterations")
    ap.add_argument("--groups", default=",".join(GROUPS), help="comma-separated shape groups")
    ap.add_argument("--schemes", default=",".join(SCHEMES), help="comma-separated cquant schemes")
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--iters", type=int, default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_linear: no CUDA device", file=sys.stderr)
        return 2
    schemes = [s for s in args.schemes.split(",") if s]
    for s in schemes:
        if s not in SCHEMES:
            ap.error(f"unknown scheme {s!r}; expected one of {', '.join(SCHEMES)}")
    shapes = load_shapes([g for g in args.groups.split(",") if g])
    if args.quick:
        keep = {(4608, 3072, 3072), (4608, 3072, 12288), (4608, 15360, 3072), (1, 3072, 18432)}
        shapes = [s for s in shapes if (s["M"], s["K"], s["N"]) in keep]
    warmup = args.warmup if args.warmup is not None else (3 if args.quick else 10)
    iters = args.iters if args.iters is not None else (10 if args.quick else 50)

    device = torch.cuda.get_device_name()
    print(f"# {device}, torch {torch.__version__}, CUDA {torch.version.cuda}; warmup {warmup}, iters {iters}", flush=True)
    print(f"{'shape (MxKxN)':>20} {'method':>20} {'ms':>9} {'TFLOP/s':>8} {'GB/s':>7} {'x bf16':>7} {'SQNR dB':>8}")

    def log(r):
        if "skipped" in r:
            print(f"{'':>20} {r['method']:>20} skipped: {r['skipped']}", flush=True)
            return
        shape = f"{r['M']}x{r['K']}x{r['N']}"
        sq = "" if r["sqnr_db"] is None else f"{r['sqnr_db']:.1f}"
        ratio = r.get("ratio_to_bf16")
        print(f"{shape:>20} {r['method']:>20} {r['ms']:9.4f} {r['tflops']:8.1f} {r['gbps']:7.0f} "
              f"{'' if ratio is None else f'{ratio:.3f}':>7} {sq:>8}", flush=True)

    results = []
    t0 = time.time()
    for shape in shapes:
        results += bench_shape(shape, schemes, warmup, iters, log)
    summary = summarize(results)
    print("\n# ratio to torch bf16 F.linear, M >= 4096 shapes (min / median)")
    for method, (lo, med) in summary.items():
        print(f"{method:>20} {lo:7.3f} {med:7.3f}")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(dict(device=device, torch=torch.__version__, cuda=torch.version.cuda, warmup=warmup,
                           iters=iters, seconds=time.time() - t0, results=results, summary=summary), f, indent=1)
        print(f"# wrote {args.out}")
    return 0


def summarize(results):
    by = {}
    for r in results:
        if r["M"] >= 4096 and r["method"] != "torch_bf16":
            by.setdefault(r["method"], []).append(r["ratio_to_bf16"])
    return {k: (min(v), statistics.median(v)) for k, v in by.items()}


if __name__ == "__main__":
    sys.exit(main())
