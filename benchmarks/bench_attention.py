"""Forward attention benchmark: cquant (bf16 and 8-bit) against torch SDPA's FLASH, cuDNN and
EFFICIENT backends, interleaved on the same card, on every attention shape of
benchmarks/shapes.json.

Timing (benchmarks/_timing.py): CUDA events around each call, inputs rotating over enough copies
that the set exceeds twice the L2 cache, every candidate timed in turn in each repeat; a time
is the median of the per-repeat medians, "x FLASH" / "x cuDNN" the median over repeats of that
backend's time over the candidate's in the same repeat. cquant reads q, k, v in diffusers'
[B, S, H, D] layout; SDPA gets contiguous [B, H, S, D] tensors (its best case). TFLOP/s counts
4 * B * H * Sq * Skv * D. Accuracy: relative L2 error and cosine against float64 attention on
--check-rows random query rows.

    python benchmarks/bench_attention.py --out attention.json     # ~1 minute on an H100
    python benchmarks/bench_attention.py --quick
    pytest benchmarks/test_bench_attention.py --benchmark-only   # pytest-benchmark's tables, seconds per call
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
from torch.nn.attention import SDPBackend, sdpa_kernel

import cquant

from _timing import (describe, describe_line, headline, interleaved, l2_bytes, require_cuda, rotating, text_table,
                     with_env)
from _timing import tflops as tflops_of

HERE = os.path.dirname(os.path.abspath(__file__))
SDPA_BACKENDS = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
                 "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION}
BASELINE = "sdpa_flash"
QUICK_MODELS = ("flux-dev 1024x1024", "pixart-sigma 1024x1024 self")


def load_shapes(path):
    with open(path) as f:
        return [dict(model=a["model"], B=a["B"], H=a["H"], D=a["D"], Sq=a.get("Sq", a.get("S")),
                     Skv=a.get("Skv", a.get("S"))) for a in json.load(f)["attention"]]


def reference_rows(q, k, v, scale, rows):
    q64 = q[:, rows].double().transpose(1, 2)
    k64, v64 = k.double().transpose(1, 2), v.double().transpose(1, 2)
    outs = []
    for h in range(q64.shape[1]):
        s = q64[:, h] @ k64[:, h].transpose(-1, -2) * scale
        outs.append(torch.softmax(s, dim=-1) @ v64[:, h])
    return torch.stack(outs, 2)


def accuracy(out_rows, ref):
    x, r = out_rows.double().flatten(), ref.flatten()
    return dict(rel_l2=((x - r).norm() / r.norm()).item(), cosine=(x @ r / (x.norm() * r.norm())).item())


def variants(cc, d):
    """(name, mode, env) of the cquant kernels this card runs; each pins its kernels."""
    mma = {"CQUANT_ATTN_SM90": "0"}
    out = [("cquant_bf16", "bf16", mma)] + ([("cquant_int8", "int8", mma)] if cc >= 89 else [])
    if cc == 90 and d <= 128:  # the sm_90a wgmma kernels
        sm90 = {"CQUANT_ATTN_SM90": "1"}
        out += [("cquant_bf16_sm90", "bf16", sm90), ("cquant_int8_sm90", "int8", sm90)]
    return out


@torch.no_grad()
def bench_shape(shape, args, cc):
    b, h, d, sq, skv = shape["B"], shape["H"], shape["D"], shape["Sq"], shape["Skv"]
    scale = 1.0 / math.sqrt(d)
    bytes_per_set = 2 * (b * sq * h * d + 2 * b * skv * h * d)
    copies = max(2, min(args.max_copies, math.ceil(2 * l2_bytes() / bytes_per_set)))
    bshd = [tuple(torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for s in (sq, skv, skv))
            for _ in range(copies)]
    bhsd = [tuple(t.transpose(1, 2).contiguous() for t in qkv) for qkv in bshd]
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = torch.randperm(sq, device="cuda", generator=g)[:min(sq, args.check_rows)].sort().values
    ref = reference_rows(*bshd[0], scale, rows)

    fns, acc, errors = {}, {}, {}
    for name, backend in SDPA_BACKENDS.items():
        def sdpa(q, k, v, backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, scale=scale)
        fns[name] = (sdpa, bhsd, lambda out: out.transpose(1, 2))
    for name, mode, env in variants(cc, d):
        fns[name] = (with_env(lambda q, k, v, mode=mode: cquant.attention(q, k, v, scale=scale, mode=mode), env), bshd,
                     lambda out: out)
    for name in list(fns):  # a backend that does not take this shape on this card
        fn, sets, to_bshd = fns[name]
        try:
            acc[name] = accuracy(to_bshd(fn(*sets[0]))[:, rows], ref)
        except (RuntimeError, NotImplementedError) as e:
            errors[name] = str(e).splitlines()[0][:200]
            del fns[name]

    base = BASELINE if BASELINE in fns else next(iter(fns))
    t = interleaved({name: rotating(lambda qkv, fn=fn: fn(*qkv), sets) for name, (fn, sets, _) in fns.items()},
                    repeats=args.repeats,
                    warmup=args.warmup, iters=args.iters, baseline=base)
    flops = 4.0 * b * h * sq * skv * d
    timings = {}
    for name in fns:
        e = dict(**t[name].as_dict(), tflops=tflops_of(flops, t[name].median), **acc[name])
        for other in ("sdpa_flash", "sdpa_cudnn"):
            if other in t:
                ratios = [o / c for o, c in zip(t[other].repeat_medians, t[name].repeat_medians)]
                e[f"x_{other}"] = dict(median=statistics.median(ratios), min=min(ratios), max=max(ratios))
        timings[name] = e
    timings.update({name: dict(error=msg) for name, msg in errors.items()})
    del bshd, bhsd
    torch.cuda.empty_cache()
    return dict(shape, copies=copies, gflop=flops / 1e9, timings=timings)


def fmt_ratio(r):
    return "-" if r is None else f"{r['median']:.2f}x ({r['min']:.2f}-{r['max']:.2f})"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="write the full results as JSON here")
    p.add_argument("--quick", action="store_true", help="2 shapes, 3 short repeats")
    p.add_argument("--shapes", default=os.path.join(HERE, "shapes.json"))
    p.add_argument("--only", default=None, help="substring of the model names to run")
    p.add_argument("--repeats", type=int, default=None, help="interleaved repeats (default 5, --quick 3)")
    p.add_argument("--warmup", type=int, default=None, help="calls of each candidate before timing (default 3)")
    p.add_argument("--iters", type=int, default=None, help="timed calls per candidate and repeat (default 5)")
    p.add_argument("--max-copies", type=int, default=8)
    p.add_argument("--check-rows", type=int, default=128)
    args = p.parse_args(argv)
    require_cuda("bench_attention")
    args.repeats = args.repeats or (3 if args.quick else 5)
    args.warmup = args.warmup if args.warmup is not None else (2 if args.quick else 3)
    args.iters = args.iters or (3 if args.quick else 5)
    major, minor = torch.cuda.get_device_capability()
    cc = 10 * major + minor
    shapes = [s for s in load_shapes(args.shapes) if (not args.only or args.only in s["model"]) and
              (not args.quick or s["model"] in QUICK_MODELS)]

    t0, results = time.time(), []
    lines = [("shape", "kernel", "ms", "ms range", "TFLOP/s", "x FLASH (range)", "x cuDNN (range)", "rel L2", "cosine")]
    for shape in shapes:
        label = f"{shape['model']} B{shape['B']} H{shape['H']} Sq{shape['Sq']} Skv{shape['Skv']} D{shape['D']}"
        print(label, flush=True)
        r = bench_shape(shape, args, cc)
        results.append(r)
        for name, e in r["timings"].items():
            if "error" in e:
                lines.append((label, name, e["error"][:60], "", "", "", "", "", ""))
                continue
            lines.append((label, name, f"{e['ms']:.3f}", f"{e['ms_min']:.3f}-{e['ms_max']:.3f}", f"{e['tflops']:.0f}",
                          fmt_ratio(e.get("x_sdpa_flash")), fmt_ratio(e.get("x_sdpa_cudnn")), f"{e['rel_l2']:.2e}",
                          f"{e['cosine']:.6f}"))
    info = dict(describe(), capability_int=cc, disabled=os.environ.get("CQUANT_ATTN_DISABLE", ""))
    print(f"\n# forward attention, bf16; {describe_line(info)}; {args.repeats} repeats x {args.iters} calls; "
          "accuracy against float64")
    print(text_table(lines))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            rows = [dict(kernel=name, speedup=e["x_sdpa_flash"]["median"]) for r in results
                    for name, e in r["timings"].items() if "x_sdpa_flash" in e]
            json.dump(dict(info=info, args=vars(args), seconds=time.time() - t0, results=results,
                           headline=headline(rows, "kernel", "sdpa_flash", "median over shapes")), f, indent=1)
        print(f"# wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
