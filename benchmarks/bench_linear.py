"""Quantized linear layers against torch's bf16 and 8-bit GEMMs, on the shapes of real models.

For every GEMM shape of benchmarks/shapes.json (groups flux_1024_tokenwise,
flux_conditioning_gemv, zimage_1024_cfg2) and every cquant scheme (cquant.schemes), times
``cquant.ops.linear`` (activation quantization included) interleaved with, on the same card:

  torch_bf16            F.linear in bf16 (the layer being replaced; every ratio is against it)
  torch_scaled_mm       torch._scaled_mm, fp8 e4m3 row-wise scales, activations pre-quantized
  torch_scaled_mm_dyn   the same with the activation quantization done eagerly in torch
  torch_int_mm          torch._int_mm, int8 x int8 -> int32 (no scales, pre-quantized)

Timing (benchmarks/_timing.py): CUDA events, inputs and weights rotating over sets larger than
the L2 cache, every candidate timed in turn in each of --repeats repeats; a time is the median
of the per-repeat medians, "x bf16" the median over repeats of the bf16 time over the
candidate's in the same repeat, with its lowest and highest in parentheses. SQNR (dB) is against
float64 of the unquantized layer on a subsample of rows.

Schemes are any cquant scheme names, with cquant.schemes' suffixes for another group size of a
4-bit scheme ("int4wo_g64"); --group-sizes 32,64,128 times every group-wise scheme at each. --wo-large-m compares the weight-only schemes (WO_LARGE_M: int8wo, fp8wo, fp6_e3m2, fp5_e2m2,
fp4_e2m1) with bf16 alone on the M >= 4096 shapes, whatever kernel the library dispatches there.
--wo-paths times each per-row weight-only scheme three times in the same run, pinned by
CQUANT_WO_DECODE_M and CQUANT_WO_SPLIT_K: "<scheme>" on the sm_90a mixed-input GEMM wherever it
takes the layer, "<scheme>@whole" on the same kernel without its split of K, and
"<scheme>@decoded" on the decoded rows + cuBLASLt. --graph times CUDA-graph replays (one call per
input set): GPU time alone, where the host's per-call cost would otherwise hide small layers.
--epilogue gated times every layer as adaLN-Zero's gated residual, residual + gate * layer(x) with
one sample's gate: torch's F.linear and the unfused multiply-add against ops.linear_gated, which
does it in the layer's epilogue (a GELU epilogue: bench_linear_gelu.py, against torch's fused one).

    python benchmarks/bench_linear.py --out linear.json      # about a minute on an H100
    python benchmarks/bench_linear.py --quick                # 4 shapes, a few seconds
    python benchmarks/bench_linear.py --groups flux_1024_tokenwise --schemes int4wo,int4dq,int4dq_2l,fp8da_int4w,fp8dqrow
    python benchmarks/bench_linear.py --wo-large-m --out linear_wo.json
    python benchmarks/bench_linear.py --groups flux_1024_tokenwise --schemes int8wo,fp8wo --bf16-only --wo-paths
    python benchmarks/bench_linear.py --groups flux_1024_tokenwise --schemes int8wo --bf16-only --graph --epilogue gated
    pytest benchmarks/test_bench_linear.py --benchmark-only   # pytest-benchmark's tables, seconds per call
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
from cquant.demo import comma_list
from cquant.metrics import sqnr_db
from cquant.schemes import SCHEME_NAMES

from _timing import (describe, describe_line, fmt_speedup, graphed, headline, interleaved, require_cuda, rotating,
                     sets_for_l2, text_table, time_calls, wall_time_calls)
from _timing import tflops as tflops_of
from _variants import group_sizes, linear_kwargs, parse, quantize_weight, stored_bytes, with_group_sizes

HERE = os.path.dirname(os.path.abspath(__file__))
GROUPS = ("flux_1024_tokenwise", "flux_conditioning_gemv", "zimage_1024_cfg2")
QUICK_SHAPES = {(4608, 3072, 3072), (4608, 3072, 12288), (4608, 15360, 3072), (1, 3072, 18432)}
BASELINE = "torch_bf16"
SQNR_ROWS = 64
# --wo-large-m: the weight-only schemes whose large-M path moves from a decode pass + cuBLASLt to
# a fused mixed-input kernel; timed at every M >= WO_LARGE_M_MIN_M shape against bf16 alone
WO_LARGE_M = ("int8wo", "fp8wo", "fp6_e3m2", "fp5_e2m2", "fp4_e2m1")
WO_LARGE_M_MIN_M = 4096
# --wo-paths: the switches that pin the weight-only path, and the suffixes of the twins (the
# mixed-input GEMM without its split of K; the decoded rows)
WO_DECODE_M = "CQUANT_WO_DECODE_M"
WO_SPLIT_K = "CQUANT_WO_SPLIT_K"
WO_SWITCHES = (WO_DECODE_M, WO_SPLIT_K)
WHOLE = "@whole"
DECODED = "@decoded"
# --device cpu: a smoke run of the same code on tiny shapes (C reference, host wall time): it
# checks the plumbing, not the speed
EPILOGUES = ("none", "gated")
DEVICE = "cuda"
CPU_SHAPES = [dict(group="cpu_smoke", M=64, K=256, N=128, note=""), dict(group="cpu_smoke", M=1, K=256, N=256, note="")]


def load_shapes(groups):
    with open(os.path.join(HERE, "shapes.json")) as f:
        data = json.load(f)["gemm"]
    return [dict(group=g, M=s["M"], K=s["K"], N=s["N"], note=s.get("note", "")) for g in groups for s in data[g]]


linear_args = linear_kwargs  # ops.linear's keyword arguments for Scheme s and in_features k


def capability():
    if DEVICE == "cpu":
        return 10**6  # the C reference runs every scheme
    major, minor = torch.cuda.get_device_capability()
    return 10 * major + minor


def fp8_rowwise(t):
    """torch's eager row-wise e4m3 quantization: codes and fp32 scales [rows, 1]."""
    scale = t.abs().amax(dim=1, keepdim=True).float().clamp_min(1e-12) / 448.0
    return (t.float() / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), scale


def int8_rowwise(t):
    scale = t.abs().amax(dim=1, keepdim=True).float().clamp_min(1e-12) / 127.0
    return (t.float() / scale).round().clamp(-127, 127).to(torch.int8)


def make_sets(m, k, n, count, seed, epilogue="none"):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    sets = [dict(x=torch.randn(m, k, device=DEVICE, generator=g, dtype=torch.bfloat16),
                 w=(torch.randn(n, k, device=DEVICE, generator=g) / math.sqrt(k)).to(torch.bfloat16),
                 b=(torch.randn(n, device=DEVICE, generator=g) * 0.1).to(torch.bfloat16)) for _ in range(count)]
    if epilogue == "gated":  # adaLN-Zero: one sample's gate over the output features, the block's residual
        for s in sets:
            s["gate"] = torch.randn(1, n, device=DEVICE, generator=g, dtype=torch.bfloat16)
            s["res"] = torch.randn(m, n, device=DEVICE, generator=g, dtype=torch.bfloat16)
    return sets


def torch_epilogue(epilogue):
    """What a diffusers block runs after the layer, unfused: post(set, y)."""
    if epilogue == "gated":
        return lambda s, y: s["res"] + s["gate"] * y
    return lambda s, y: y


def torch_baselines(sets, m, k, n, bf16_only=False, epilogue="none"):
    """{name: (fn(set), weight bytes)} of the torch baselines this card and shape take, each
    followed by the epilogue's unfused ops; each set gets the pre-quantized operands they read."""
    post = torch_epilogue(epilogue)
    out = {BASELINE: (lambda s: post(s, F.linear(s["x"], s["w"], s["b"])), 2 * n * k)}
    if bf16_only:
        return out
    if capability() >= 89 and k % 16 == 0 and n % 16 == 0:
        for s in sets:
            s["wq8"], s["sw8"] = fp8_rowwise(s["w"])
            s["xq8"], s["sx8"] = fp8_rowwise(s["x"])

        def scaled_mm(s, xq, sx):
            return post(s, torch._scaled_mm(xq, s["wq8"].t(), scale_a=sx, scale_b=s["sw8"].t(), bias=s["b"],
                                            out_dtype=torch.bfloat16))

        out["torch_scaled_mm"] = (lambda s: scaled_mm(s, s["xq8"], s["sx8"]), n * k)
        out["torch_scaled_mm_dyn"] = (lambda s: scaled_mm(s, *fp8_rowwise(s["x"])), n * k)
    if m > 16 and k % 8 == 0 and n % 8 == 0 and epilogue == "none":  # int32 out, no bias: no epilogue to add
        for s in sets:
            s["wq"], s["xq"] = int8_rowwise(s["w"]), int8_rowwise(s["x"])
        out["torch_int_mm"] = (lambda s: torch._int_mm(s["xq"], s["wq"].t()), n * k)
    return out


def pinned(fn, env):
    """fn with os.environ holding env at each call. libcquant reads its switches again only when a
    call changes them: the timed loops call one candidate many times in a row, and a reload per call
    would add host time to the small shapes. main() restores the switches."""
    def call(*args):
        if any(os.environ.get(key) != value for key, value in env.items()):
            os.environ.update(env)
            ops.reload_settings()
        return fn(*args)
    return call


def cquant_candidates(sets, names, k, n, log, wo_paths=False, epilogue="none"):
    """{name: (fn(set), weight bytes)} of the cquant variants the card and shape take, weights
    quantized per set; a variant libcquant refuses for this shape (a group size not dividing K)
    is skipped with its reason. wo_paths: per-row weight-only schemes three times, on the
    mixed-input GEMM, on it without its split of K (name + WHOLE) and on the decoded rows (name +
    DECODED). epilogue "gated": ops.linear_gated."""
    out = {}
    for name in names:
        s = parse(name).scheme
        if capability() < s.min_compute_capability:
            log(f"  {name}: skipped, needs sm_{s.min_compute_capability}+")
            continue
        why = s.refusal(k, n)
        if why:
            log(f"  {name}: skipped, {why}")
            continue
        kw = linear_args(s, k)
        try:
            for st in sets:
                st[name] = quantize_weight(s, st["w"])
        except (ValueError, RuntimeError, NotImplementedError) as e:
            log(f"  {name}: skipped, {str(e).splitlines()[0][:120]}")
            for st in sets:
                st.pop(name, None)
            continue
        if epilogue == "gated":
            fn = lambda st, name=name, kw=kw: ops.linear_gated(st["x"], *st[name], st["gate"], st["res"],  # noqa: E731
                                                               bias=st["b"], **kw)
        else:
            fn = lambda st, name=name, kw=kw: ops.linear(st["x"], *st[name], bias=st["b"], **kw)  # noqa: E731
        if wo_paths and s.act_format is None and not parse(name).grouped:
            mixed = str(1 << 30)
            for suffix, env in (("", {WO_DECODE_M: mixed, WO_SPLIT_K: "1"}), (WHOLE, {WO_DECODE_M: mixed, WO_SPLIT_K: "0"}),
                                (DECODED, {WO_DECODE_M: "17", WO_SPLIT_K: "1"})):
                out[name + suffix] = (pinned(fn, env), stored_bytes(*sets[0][name]))
        else:
            out[name] = (fn, stored_bytes(*sets[0][name]))
    return out


def bench_shape(shape, names, args, log):
    m, k, n = shape["M"], shape["K"], shape["N"]
    count = sets_for_l2(2 * (m * k + n * k)) if DEVICE == "cuda" else 2
    sets = make_sets(m, k, n, count, seed=m * 7 + k * 3 + n, epilogue=args.epilogue)
    fns = torch_baselines(sets, m, k, n, args.bf16_only, args.epilogue)
    fns.update(cquant_candidates(sets, names, k, n, log, args.wo_paths, args.epilogue))
    for name in list(fns):  # a shape or format torch's GEMMs (or a cquant path) do not take on this card
        try:
            fns[name][0](sets[0])
        except (RuntimeError, ValueError, NotImplementedError) as e:
            log(f"  {name}: skipped, {str(e).splitlines()[0][:120]}")
            del fns[name]
    if args.graph and DEVICE == "cuda":  # one call per input set, replayed: no host time between kernels
        runs = {name: graphed([lambda st=st, fn=fn: fn(st) for st in sets]) for name, (fn, _) in fns.items()}
    else:
        runs = {name: rotating(fn, sets) for name, (fn, _) in fns.items()}
    timings = interleaved(runs, repeats=args.repeats,
                          warmup=args.warmup, iters=args.iters, baseline=BASELINE,
                          timer=time_calls if DEVICE == "cuda" else wall_time_calls)

    s0 = sets[0]
    rows = torch.linspace(0, m - 1, min(m, SQNR_ROWS), device=DEVICE).long().unique()
    ref = F.linear(s0["x"][rows].double(), s0["w"].double(), s0["b"].double())
    if args.epilogue == "gated":
        ref = s0["res"][rows].double() + s0["gate"].double() * ref
    results = []
    for name, (fn, weight_bytes) in fns.items():
        t = timings[name]
        y = fn(s0)
        moved = 2 * m * k + weight_bytes + 2 * m * n * (2 if args.epilogue == "gated" else 1)  # + the residual
        results.append(dict(group=shape["group"], M=m, K=k, N=n, method=name, **t.as_dict(),
                            tflops=tflops_of(2.0 * m * n * k, t.median), gbps=moved / (t.median * 1e-3) / 1e9,
                            sqnr_db=None if name == "torch_int_mm" else sqnr_db(ref, y[rows])))
    del sets
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return results


def table(results):
    lines = [("shape (MxKxN)", "method", "ms", "ms range", "TFLOP/s", "GB/s", "x bf16 (range)", "SQNR dB")]
    for r in results:
        lines.append((f"{r['M']}x{r['K']}x{r['N']}", r["method"], f"{r['ms']:.4f}", f"{r['ms_min']:.4f}-{r['ms_max']:.4f}",
                      f"{r['tflops']:.1f}", f"{r['gbps']:.0f}",
                      "-" if r["method"] == BASELINE else fmt_speedup(r),
                      "-" if r["sqnr_db"] is None else f"{r['sqnr_db']:.1f}"))
    return text_table(lines)


def summarize(results):
    """{method: (min, median)} of the speed-ups over bf16 on the M >= 4096 shapes."""
    by = {}
    for r in results:
        if r["M"] >= 4096 and r["method"] != BASELINE:
            by.setdefault(r["method"], []).append(r["speedup"])
    return {k: (min(v), statistics.median(v)) for k, v in by.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="write all results as JSON to this path")
    ap.add_argument("--quick", action="store_true", help="4 shapes, 3 short repeats")
    ap.add_argument("--groups", default=",".join(GROUPS), help="comma-separated shape groups of shapes.json")
    ap.add_argument("--schemes", default=None,
                    help="comma-separated cquant scheme names, e.g. int4wo_g64 (default: every scheme of cquant.schemes."
                         "SCHEME_NAMES; --wo-large-m: " + ",".join(WO_LARGE_M) + ")")
    ap.add_argument("--group-sizes", default="",
                    help="comma-separated weight group sizes: every group-wise scheme is timed at each")
    ap.add_argument("--wo-large-m", action="store_true",
                    help=f"weight-only schemes against bf16 alone on the M >= {WO_LARGE_M_MIN_M} shapes")
    ap.add_argument("--wo-paths", action="store_true",
                    help="per-row weight-only schemes on both large-M paths: the mixed-input GEMM and the decoded rows")
    ap.add_argument("--graph", action="store_true",
                    help="time CUDA-graph replays of each candidate's calls: GPU time without the host's per-call cost")
    ap.add_argument("--bf16-only", action="store_true", help="no torch 8-bit baselines, only bf16 F.linear")
    ap.add_argument("--epilogue", default="none", choices=EPILOGUES,
                    help="gated: every layer as residual + gate * layer(x), torch unfused against ops.linear_gated "
                         "(default: %(default)s)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="cpu: a smoke run of the plumbing on two tiny shapes (host wall time, C reference)")
    ap.add_argument("--repeats", type=int, default=None, help="interleaved repeats (default 5, --quick 3)")
    ap.add_argument("--warmup", type=int, default=None, help="calls of each candidate before timing (default 3)")
    ap.add_argument("--iters", type=int, default=None, help="timed calls per candidate and repeat (default 10)")
    args = ap.parse_args(argv)
    if args.schemes is None:
        args.schemes = ",".join(WO_LARGE_M if args.wo_large_m else SCHEME_NAMES)
    try:
        schemes = comma_list(args.schemes, "--schemes", "scheme", "comma-separated scheme names")
        names = with_group_sizes(schemes, group_sizes(args.group_sizes))
        for name in names:
            if parse(name).rank:
                raise ValueError(f"{name}: the low-rank correction belongs to the module (cquant.quantize_); "
                                 "ops.linear has none to time")
    except ValueError as e:
        ap.error(str(e))
    args.bf16_only = args.bf16_only or args.wo_large_m
    try:
        groups = comma_list(args.groups, "--groups", "shape group", "comma-separated shape groups of shapes.json")
    except ValueError as e:
        ap.error(str(e))
    for g in groups:
        if g not in GROUPS and g != "vae_decoder":
            ap.error(f"unknown shape group {g!r}; expected some of {', '.join(GROUPS)}, vae_decoder")
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cuda":
        require_cuda("bench_linear")
    shapes = load_shapes(groups) if DEVICE == "cuda" else CPU_SHAPES
    if args.wo_large_m and DEVICE == "cuda":
        shapes = [s for s in shapes if s["M"] >= WO_LARGE_M_MIN_M]
    if args.quick and DEVICE == "cuda":
        shapes = [s for s in shapes if (s["M"], s["K"], s["N"]) in QUICK_SHAPES]
    args.repeats = args.repeats or (3 if args.quick else 5)
    args.warmup = args.warmup if args.warmup is not None else (2 if args.quick else 3)
    args.iters = args.iters or (5 if args.quick else 10)

    print(f"# {torch.cuda.get_device_name() if DEVICE == 'cuda' else 'CPU smoke run'}: {len(shapes)} shapes x ({len(names)} schemes + torch baselines), "
          f"{args.repeats} interleaved repeats of {args.iters} calls", flush=True)
    results, t0 = [], time.time()
    switches = {key: os.environ.get(key) for key in WO_SWITCHES}
    try:
        for shape in shapes:
            print(f"{shape['M']}x{shape['K']}x{shape['N']} ({shape['group']})", flush=True)
            results += bench_shape(shape, names, args, print)
    finally:  # --wo-paths pins the switches per candidate
        if any(os.environ.get(key) != value for key, value in switches.items()):
            for key, value in switches.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
            ops.reload_settings()
    info = describe()
    print(f"\n# {describe_line(info)}; {args.repeats} repeats x {args.iters} calls, median of medians")
    print(table(results))
    summary = summarize(results)
    if summary:
        print("\n# speed-up over torch bf16 F.linear on the M >= 4096 shapes (lowest / median)")
        print(text_table([("method", "lowest", "median")] +
                         [(k, f"{lo:.2f}x", f"{med:.2f}x") for k, (lo, med) in summary.items()]))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(dict(info=info, args=vars(args), seconds=time.time() - t0, results=results, summary=summary,
                           headline=headline([r for r in results if r["M"] >= 4096], "method", BASELINE,
                                             "median over the M >= 4096 shapes")), f, indent=1)
        print(f"# wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
