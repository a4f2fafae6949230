"""Forward attention benchmark: cquant (bf16 and 8-bit) against torch SDPA's FLASH, cuDNN and
EFFICIENT backends, timed in the same run on the same card, on every attention shape of
benchmarks/shapes.json.

Timing: CUDA events around each call, median of --iters after --warmup calls; inputs are
rotated over enough copies that the set exceeds twice the L2 cache, so no call finds its
operands cached by the previous one. cquant reads q, k, v in diffusers' [B, S, H, D] layout;
SDPA gets contiguous [B, H, S, D] tensors (its best case). TFLOP/s counts 4 * B * H * Sq * Skv * D.
Accuracy: relative L2 error and cosine against float64 attention on --check-rows random query rows.

    python benchmarks/bench_attention.py --out benchmarks/results/attention_h100.json
"""

import argparse
import json
import math
import os
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import cquant

HERE = os.path.dirname(os.path.abspath(__file__))
SDPA_BACKENDS = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
                 "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION}


def load_shapes(path):
    out = []
    for a in json.load(open(path))["attention"]:
        out.append(dict(model=a["model"], B=a["B"], H=a["H"], D=a["D"], Sq=a.get("Sq", a.get("S")),
                        Skv=a.get("Skv", a.get("S"))))
    return out


def time_calls(fn, args_list, warmup, iters):
    """Median milliseconds of fn(*args) over iters calls, rotating through args_list."""
    for i in range(warmup):
        fn(*args_list[i % len(args_list)])
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for i in range(iters):
        args = args_list[i % len(args_list)]
        starts[i].record()
        fn(*args)
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


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


def bench_shape(shape, args, cc):
    b, h, d, sq, skv = shape["B"], shape["H"], shape["D"], shape["Sq"], shape["Skv"]
    scale = 1.0 / math.sqrt(d)
    dtype = torch.bfloat16
    bytes_per_set = 2 * (b * sq * h * d + 2 * b * skv * h * d)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    copies = max(1, min(args.max_copies, math.ceil(2 * l2 / bytes_per_set)))
    bshd = [tuple(torch.randn(b, s, h, d, device="cuda", dtype=dtype) for s in (sq, skv, skv)) for _ in range(copies)]
    bhsd = [tuple(t.transpose(1, 2).contiguous() for t in qkv) for qkv in bshd]
    flops = 4.0 * b * h * sq * skv * d
    result = dict(shape, copies=copies, gflop=flops / 1e9, timings={})

    def record(name, ms, acc=None):
        entry = dict(ms=ms, tflops=flops / (ms * 1e-3) / 1e12)
        if acc:
            entry.update(acc)
        result["timings"][name] = entry

    g = torch.Generator(device="cuda").manual_seed(0)
    rows = torch.randperm(sq, device="cuda", generator=g)[:min(sq, args.check_rows)].sort().values
    ref = reference_rows(*bshd[0], scale, rows)

    for name, backend in SDPA_BACKENDS.items():
        def sdpa(q, k, v, backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, scale=scale)
        try:
            out = sdpa(*bhsd[0])
            acc = accuracy(out.transpose(1, 2)[:, rows], ref)
            record(name, time_calls(sdpa, bhsd, args.warmup, args.iters), acc)
        except RuntimeError as e:  # a backend that does not take this shape on this card
            result["timings"][name] = dict(error=str(e).splitlines()[0][:200])

    sm90 = {"CQUANT_ATTN_SM90": "1"}
    mma = {"CQUANT_ATTN_SM90": "0"}  # each variant pins its kernels, whatever the build's default
    variants = [("cquant_bf16", "bf16", mma)] + ([("cquant_int8", "int8", mma)] if cc >= 89 else [])
    if cc == 90 and d <= 128:  # the opt-in wgmma kernels
        variants += [("cquant_bf16_sm90", "bf16", sm90), ("cquant_int8_sm90", "int8", sm90)]
    for name, mode, env in variants:
        def run(q, k, v, mode=mode):
            return cquant.attention(q, k, v, scale=scale, mode=mode)
        saved = {key: os.environ.get(key) for key in ("CQUANT_ATTN_SM90",)}
        for key in saved:
            os.environ.pop(key, None)
        os.environ.update(env)
        try:
            out = run(*bshd[0])
            record(name, time_calls(run, bshd, args.warmup, args.iters), accuracy(out[:, rows], ref))
        except (NotImplementedError, RuntimeError) as e:
            result["timings"][name] = dict(error=str(e).splitlines()[0][:200])
        finally:
            for key, value in saved.items():
                os.environ.pop(key, None)
                if value is not None:
                    os.environ[key] = value

    t = result["timings"]
    for name in list(t):
        for base in ("sdpa_flash", "sdpa_cudnn"):
            if "ms" in t[name] and "ms" in t.get(base, {}):
                t[name][f"speedup_vs_{base}"] = t[base]["ms"] / t[name]["ms"]
    return result


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=os.path.join(HERE, "shapes.json"))
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--max-copies", type=int, default=8)
    p.add_argument("--check-rows", type=int, default=128)
    p.add_argument("--only", default=None, help="substring of the model names to run")
    p.add_argument("--out", default=None, help="write the full results as JSON here")
    args = p.parse_args()

    if not torch.cuda.is_available() or not cquant._C.built_with_cuda():
        sys.exit("needs a CUDA GPU and a CUDA build of cquant")
    major, minor = torch.cuda.get_device_capability()
    cc = 10 * major + minor
    shapes = [s for s in load_shapes(args.shapes) if not args.only or args.only in s["model"]]
    meta = dict(device=torch.cuda.get_device_name(), capability=cc, torch=torch.__version__,
                cuda=torch.version.cuda, cquant=cquant.__version__, warmup=args.warmup, iters=args.iters,
                disabled=os.environ.get("CQUANT_ATTN_DISABLE", ""))
    results = []
    names = list(SDPA_BACKENDS) + ["cquant_bf16"] + (["cquant_int8"] if cc >= 89 else []) + (
        ["cquant_bf16_sm90", "cquant_int8_sm90"] if cc == 90 else [])
    print(f"{meta['device']} (sm_{cc}), torch {meta['torch']}; TFLOP/s (x FLASH, x cuDNN), rel L2 vs fp64")
    for shape in shapes:
        r = bench_shape(shape, args, cc)
        results.append(r)
        label = f"{shape['model']} B{shape['B']} H{shape['H']} Sq{shape['Sq']} Skv{shape['Skv']} D{shape['D']}"
        print(label)
        for name in names:
            e = r["timings"].get(name, {})
            if "ms" not in e:
                print(f"  {name:15s} {e.get('error', 'n/a')}")
                continue
            ratio = "".join(f" x{e[k]:.2f}" if k in e else "  -  " for k in ("speedup_vs_sdpa_flash", "speedup_vs_sdpa_cudnn"))
            print(f"  {name:15s} {e['ms']:8.3f} ms {e['tflops']:7.1f} TFLOP/s{ratio}  rel {e['rel_l2']:.2e} cos {e['cosine']:.6f}")
        torch.cuda.empty_cache()
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, results=results), f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
