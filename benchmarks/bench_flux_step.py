"""One denoising step of the full-size FLUX.1-dev transformer: bfloat16 eager against cquant schemes.

Random weights with the published architecture (python/cquant/data/model_configs.json), 1024x1024
(4096 image tokens + 512 text tokens), batch 1 (--batch: more samples, each with its own
timestep). Beside bfloat16 eager it measures each variant of --schemes, written

    NAME[@ATTENTION][+optimize][+graph][+compile][:unfused]

NAME is bf16 or a cquant scheme variant (int8wo, int8dq, fp8dqrow, fp6_e3m2, int4wo, int4dq,
int4dq_2l, fp8da_int4w, ...; with cquant.schemes' suffixes "_gG" for another group size of a 4-bit scheme
and "_rR" for a rank-R low-rank correction, e.g. int4wo_g64_r32); @cquant / @cquant_int8
route attention through cquant's kernels (cquant.enable_attention) instead of torch's SDPA;
+optimize installs cquant's fused blocks (cquant.optimize), +graph does so with cuda_graph=True
(each input shape captured once, then replayed); +compile wraps the model in torch.compile (its
compile time is reported); ":unfused" quantizes with fuse_activations=False, so the MLPs' GELU
runs as torch's own kernel. For each it measures:

  step ms          CUDA events around each step; each variant's steps interleaved with the
                   bfloat16 model's (benchmarks/_timing.py: --repeats repeats of --iters steps
                   of each after --warmup), the median of the per-repeat medians
  vs bf16          the median over repeats of bfloat16's step time over the variant's in the
                   same repeat, with its range (a ratio below 1: faster than bfloat16)
  weights GB       torch.cuda.memory_allocated() of the model on the GPU
  stored GB        the model's bytes as users see them (diffusers' get_memory_footprint): every
                   parameter and buffer in its stored form (codes, scales, low-rank factors,
                   biases, the layers left in bfloat16), 1 GB = 1e9 bytes; SIZE_TARGETS_GB
                   lists the sizes a scheme must not exceed on flux-dev (checked, printed)
  quantize peak GB peak memory_allocated while cquant.quantize_(model, scheme, device="cuda")
                   moves and quantizes a model whose bfloat16 weights start on the CPU
  SQNR dB          of the step's output against a float32 forward of the same weights
                   (the bfloat16 master weights upcast, TF32 off), bfloat16 eager's beside it
  compile s        +compile: wall time of the first call (tracing and compiling)
  GEMM / attention / other ms
                   the step's GPU kernel time split by kernel name (torch.profiler)

Memory plan for an 80 GB H100: the bfloat16 master weights (24 GB) stay on the CPU; the float32
reference (48 GB) runs alone on the GPU once and only its output is kept; then the bfloat16
model stays on the GPU (24 GB) while each variant is built beside it (12 GB or less), timed
interleaved with it and freed before the next.

    python benchmarks/bench_flux_step.py --out flux_step.json      # ~2 minutes on an H100
    python benchmarks/bench_flux_step.py --schemes FUSED_SET       # the fused-block comparison
    python benchmarks/bench_flux_step.py --quick                   # 6 of the 57 blocks
    python benchmarks/bench_flux_step.py --schemes INT4_SET        # the 4-bit schemes beside fp8dqrow
    python benchmarks/bench_flux_step.py --sizes                   # stored GB of every variant, no GPU
                                                                   # (meta tensors; seconds)

A small smoke run that works on a CPU (no profile, no GPU memory figures):

    python benchmarks/bench_flux_step.py --device cpu --override num_layers=1 num_single_layers=1 \\
        --height 128 --width 128 --text-tokens 32 --iters 1 --warmup 0
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import platform
import re
import sys
import time
import traceback
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cquant.bench import models  # noqa: E402
from cquant.bench.models import build_master, materialize  # noqa: E402,F401  (int4_quality_study imports them from here)
from cquant.bench.models import flux_inputs as make_inputs  # noqa: E402
from cquant.demo import comma_list  # noqa: E402
from cquant.metrics import sqnr_db  # noqa: E402
from _variants import config as variant_config  # noqa: E402
from _variants import module_bytes  # noqa: E402
from _variants import parse as parse_scheme_variant  # noqa: E402

from _timing import describe, fmt_speedup, headline, interleaved, text_table, time_calls, wall_time_calls  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_SCHEMES = ("int8wo", "int8dq", "fp8dqrow", "fp6_e3m2", "int4wo", "int4dq", "int4dq_2l", "fp8da_int4w")
# --schemes INT4_SET: the 4-bit schemes (group sizes, a low-rank correction) beside fp8dqrow
INT4_SET = ("fp8dqrow", "int4wo", "int4wo_g64", "int4wo_r32", "int4dq", "int4dq_2l", "fp8da_int4w")
# Stored size (GB, 1e9 bytes) a variant must not exceed on --model (checked where it is measured)
SIZE_TARGETS_GB = {("flux-dev", "int4wo"): 6.8}
# --schemes FUSED_SET: what cquant.optimize is measured against (compiled stacks included)
FUSED_SET = ("bf16+compile", "fp8dqrow", "fp8dqrow+optimize", "fp8dqrow@cquant_int8+optimize", "int8dq+optimize",
             "fp8dqrow+compile")
# "<scheme or bf16>@<attention>" variants run the model's attention through cquant's kernels
ATTENTION_MODES = {"cquant": "bf16", "cquant_int8": "int8"}
FLAGS = ("optimize", "graph", "compile")


def parse_variant(text):
    """{scheme (None for bf16), attention, optimize, graph, compile, fused_gelu} of a --schemes entry."""
    spec, _, suffix = text.partition(":")
    if suffix not in ("", "unfused"):
        raise SystemExit(f"unknown suffix in {text!r}; expected ':unfused' or nothing")
    head, *flags = spec.split("+")
    name, _, attn = head.partition("@")
    for f in flags:
        if f not in FLAGS:
            raise SystemExit(f"unknown flag +{f} in {text!r}; expected {', '.join('+' + f for f in FLAGS)}")
    if attn and attn not in ATTENTION_MODES:
        raise SystemExit(f"unknown attention {attn!r} in {text!r}; expected one of {', '.join(ATTENTION_MODES)}")
    if name != "bf16":
        try:
            variant_config(parse_scheme_variant(name))
        except ValueError as e:
            raise SystemExit(f"--schemes: {e}")
    return dict(scheme=None if name == "bf16" else name, attention=attn or "sdpa",
                optimize="optimize" in flags or "graph" in flags, graph="graph" in flags,
                compile="compile" in flags, fused_gelu=suffix != "unfused")

# Kernel name -> bucket of the GPU time split (first match wins; the rest is "other").
KERNEL_BUCKETS = (
    ("attention", re.compile(r"flash|fmha|attention|attn|sdpa|softmax_?warp", re.I)),
    ("gemm", re.compile(r"gemm|gemv|cutlass|nvjet|xmma|wgmma|cublas|matmul|_mm_|sm\d+_.*tensorop|"
                        r"cq_linear|linear_kernel|ampere_.*_(s|h|bf)\d+|hopper", re.I)),
)


# ---------------------------------------------------------------- model


def load_config(name, overrides):
    """The constructor arguments of a Flux model of python/cquant/data/model_configs.json, changed
    by `overrides` ("key=JSON")."""
    try:
        if models.model_info(name)["class"] != "FluxTransformer2DModel":
            raise SystemExit(f"--model {name!r} is a {models.model_info(name)['class']}; this benchmark runs Flux "
                             "transformers")
        return models.load_config(name, overrides)
    except ValueError as e:
        raise SystemExit(f"--model / --override: {e}")


# ---------------------------------------------------------------- measurements


def step(model, inputs):
    with torch.no_grad():
        return model(**inputs)[0]


def time_against_bf16(name, model, bf16_model, inputs, args, device):
    """{name: Timing, "bf16": Timing}: steps of the two models interleaved (see the docstring)."""
    cands = {"bf16": lambda: step(bf16_model, inputs)}
    if name != "bf16":
        cands[name] = lambda: step(model, inputs)
    return interleaved(cands, repeats=args.repeats, warmup=args.warmup, iters=args.iters, baseline="bf16",
                       timer=time_calls if device.type == "cuda" else wall_time_calls)


def kernel_split(model, inputs):
    """{gemm, attention, other: ms} of one step's GPU kernels, and the top kernels."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step(model, inputs)
        torch.cuda.synchronize()
    buckets = {"gemm": 0.0, "attention": 0.0, "other": 0.0}
    kernels = []
    for e in prof.key_averages():
        if getattr(e, "device_type", None) != DeviceType.CUDA:
            continue  # CPU ops: their kernels are listed (and counted) on their own
        us = getattr(e, "self_device_time_total", None)
        if us is None:
            us = getattr(e, "self_cuda_time_total", 0.0)
        if not us:
            continue
        bucket = next((b for b, rx in KERNEL_BUCKETS if rx.search(e.key)), "other")
        buckets[bucket] += us / 1e3
        kernels.append((us / 1e3, bucket, e.key, e.count))
    kernels.sort(reverse=True)
    top = [dict(ms=round(ms, 3), bucket=b, calls=c, kernel=k[:160]) for ms, b, k, c in kernels[:15]]
    return {k: round(v, 3) for k, v in buckets.items()}, top


def gb(n):
    return n / 1e9


def free():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def build_variant(master, v, device, extra, base):
    """The model of one parsed variant: bf16, or the master quantized layer by layer onto the
    device; then cquant's attention, its fused blocks, torch.compile as asked. Fills `extra`."""
    import cquant

    if v["scheme"] is None:
        model = materialize(master, device, torch.bfloat16)
    else:
        model = copy.deepcopy(master)
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        cquant.quantize_(model, variant_config(v["scheme"]), device=device, progress=False,
                         fuse_activations=v["fused_gelu"])
        extra["quantize_s"] = round(time.perf_counter() - t0, 2)
        if device.type == "cuda":
            extra["quantize_peak_gb"] = gb(torch.cuda.max_memory_allocated() - base)
        s = cquant.summary(model)
        extra.update(layers_quantized=s.count("quantized"), layers_skipped=s.skipped)
    if v["attention"] != "sdpa":
        cquant.enable_attention(model, ATTENTION_MODES[v["attention"]])
    if v["optimize"]:
        report = cquant.optimize(model, cuda_graph=v["graph"])
        extra["optimized"] = str(report)
    if v["compile"]:
        model = torch.compile(model)
    return model


def measure(name, model, bf16_model, inputs, ref, args, device, extra, base_bytes=0):
    """The row of one variant; base_bytes: GPU memory allocated before the variant was built."""
    t0 = time.perf_counter()
    out = step(model, inputs)  # the first call: compiles (+compile) or captures (+graph)
    if device.type == "cuda":
        torch.cuda.synchronize()
    if extra.get("compile"):
        extra["compile_s"] = round(time.perf_counter() - t0, 1)
    row = dict(variant=name, sqnr_db=sqnr_db(ref, out), **extra)
    del out
    t = time_against_bf16(name, model, bf16_model, inputs, args, device)
    row.update(t[name].as_dict() if name in t else t["bf16"].as_dict())
    row["step_ms"] = row["ms"]
    row["bf16_ms_repeats"] = t["bf16"].repeat_medians
    if device.type == "cuda":
        row["weights_gb"] = gb(torch.cuda.memory_allocated() - base_bytes)
        torch.cuda.reset_peak_memory_stats()
        step(model, inputs)
        row["step_peak_gb"] = gb(torch.cuda.max_memory_allocated() - base_bytes)
        if not args.no_profile:
            row["gpu_ms"], row["top_kernels"] = kernel_split(model, inputs)
    else:
        row["weights_gb"] = gb(sum(t.nbytes for t in list(model.parameters()) + list(model.buffers())))
    row["stored_gb"] = gb(module_bytes(model))
    row.update(size_check(args, extra.get("scheme"), row["stored_gb"]))
    ratio = "" if name == "bf16" else f" (bf16 / {name}: {fmt_speedup(row)})"
    print(f"  {name}: step {row['step_ms']:.1f} ms{ratio}, SQNR {row['sqnr_db']:.2f} dB, weights {row['weights_gb']:.2f} GB, "
          f"stored {row['stored_gb']:.3f} GB{size_note(row)}", flush=True)
    return row


def size_check(args, scheme_name, stored_gb):
    """{size_target_gb, size_ok} where SIZE_TARGETS_GB has a target for this model and scheme
    variant (the full published model only: --override changes its size), else {}."""
    target = SIZE_TARGETS_GB.get((args.model, scheme_name))
    if target is None or args.override:
        return {}
    return dict(size_target_gb=target, size_ok=stored_gb <= target)


def size_note(row):
    if "size_ok" not in row:
        return ""
    return f" ({'within' if row['size_ok'] else 'OVER'} the {row['size_target_gb']} GB target)"


# ---------------------------------------------------------------- report


def table(rows):
    head = ("variant", "step ms", "step ms range", "bf16 / variant", "weights GB", "stored GB", "quant peak GB",
            "SQNR dB", "compile s", "GEMM ms", "attn ms", "other ms")
    lines = [head]
    for r in rows:
        if "error" in r:
            lines.append((r["variant"], "failed", r["error"][:60], *("-",) * (len(head) - 3)))
            continue
        split = r.get("gpu_ms") or {}
        lines.append((
            r["variant"], f"{r['step_ms']:.1f}", f"{r['ms_min']:.1f}-{r['ms_max']:.1f}",
            "-" if r["variant"] == "bf16" else fmt_speedup(r),
            f"{r['weights_gb']:.2f}",
            f"{r['stored_gb']:.3f}{'' if r.get('size_ok', True) else ' OVER'}",
            f"{r['quantize_peak_gb']:.2f}" if r.get("quantize_peak_gb") is not None else "-",
            f"{r['sqnr_db']:.2f}",
            f"{r['compile_s']:.0f}" if r.get("compile_s") is not None else "-",
            *(f"{split[k]:.1f}" if k in split else "-" for k in ("gemm", "attention", "other")),
        ))
    return text_table(lines)


def meta_sizes(args, variants):
    """Rows {variant, layers_quantized, layers_left, stored_gb, stored_gib, ...} of the model in bf16
    and quantized by each scheme variant, built on the meta device (cquant plans and swaps in
    empty layers: the stored tensors' shapes and dtypes without their data)."""
    import diffusers

    from cquant.quantize import plan, swap_in

    config = load_config(args.model, args.override)
    names = [None] + list(dict.fromkeys(v["scheme"] for v in variants.values() if v["scheme"] is not None))
    rows = []
    for name in names:
        with torch.device("meta"):
            model = diffusers.FluxTransformer2DModel(**config).to(torch.bfloat16)
        n_linear = sum(1 for m in model.modules() if isinstance(m, torch.nn.Linear))
        quantized = 0
        if name is not None:
            p = plan(model, variant_config(name), allow_meta=True)
            swap_in(model, p.layers, empty=True, progress=False)
            quantized = len(p.layers)
        nbytes = module_bytes(model)
        row = dict(variant=name or "bf16", layers_quantized=quantized, layers_left=n_linear - quantized,
                   stored_gb=gb(nbytes), stored_gib=nbytes / 2**30)
        row.update(size_check(args, name, row["stored_gb"]))
        rows.append(row)
        del model
    return rows


def sizes_table(rows):
    lines = [("variant", "linear quantized", "linear left", "stored GB", "stored GiB", "target GB")]
    for r in rows:
        target = f"<= {r['size_target_gb']}: {'ok' if r['size_ok'] else 'OVER'}" if "size_ok" in r else "-"
        lines.append((r["variant"], str(r["layers_quantized"]), str(r["layers_left"]), f"{r['stored_gb']:.3f}",
                      f"{r['stored_gib']:.3f}", target))
    return text_table(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="flux-dev", help="a Flux entry of python/cquant/data/model_configs.json (default: %(default)s)")
    p.add_argument("--override", nargs="*", default=[], metavar="KEY=JSON",
                   help="change config entries, e.g. num_layers=1 (for smoke runs)")
    p.add_argument("--schemes", default=",".join(DEFAULT_SCHEMES),
                   help="comma-separated variants beside bf16 eager, each NAME[@ATTENTION][+optimize][+graph]"
                        "[+compile][:unfused] (see the module docstring), or FUSED_SET for "
                        f"{','.join(FUSED_SET)}, or INT4_SET for {','.join(INT4_SET)} (default: %(default)s)")
    p.add_argument("--height", type=int, default=1024)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--text-tokens", type=int, default=512)
    p.add_argument("--batch", type=int, default=1, help="samples per step, each at its own timestep")
    p.add_argument("--warmup", type=int, default=2, help="steps of each model before timing (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats (default: %(default)s)")
    p.add_argument("--iters", type=int, default=3, help="timed steps of each model per repeat (default: %(default)s)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--ref-device", default=None, help="where the float32 reference runs (default: --device)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--init-std", type=float, default=0.02, help="std of the random Linear weights")
    p.add_argument("--no-profile", action="store_true", help="skip the torch.profiler kernel split")
    p.add_argument("--out", default=None, help="write every number (and the top kernels) as JSON here")
    p.add_argument("--sizes", action="store_true",
                   help="only the stored size of bf16 and of each --schemes variant, computed on meta tensors "
                        "(no weights, no GPU; seconds), checked against SIZE_TARGETS_GB")
    p.add_argument("--quick", action="store_true",
                   help="a smoke run at full width and 1024x1024: 2 double + 4 single blocks, fp8dqrow only (or "
                        "--schemes), 2 repeats of 2 steps, no profile")
    args = p.parse_args(argv)
    if args.quick:
        args.override = ["num_layers=2", "num_single_layers=4", *args.override]
        if args.schemes == ",".join(DEFAULT_SCHEMES):
            args.schemes = "fp8dqrow"
        args.repeats, args.iters, args.warmup, args.no_profile = 2, 2, 1, True
    try:
        args.variants = comma_list(args.schemes, "--schemes", "variant",
                                   "comma-separated variants NAME[@ATTENTION][+optimize][+graph][+compile][:unfused], "
                                   "FUSED_SET or INT4_SET")
    except ValueError as e:
        p.error(str(e))
    sets = {"FUSED_SET": FUSED_SET, "INT4_SET": INT4_SET}
    args.variants = [v for entry in args.variants for v in sets.get(entry, [entry])]
    if args.batch < 1:
        p.error("--batch must be at least 1")
    if args.height % 16 or args.width % 16:
        p.error("--height and --width must be multiples of 16")
    return args


def main(argv=None):
    args = parse_args(argv)
    warnings.simplefilter("ignore")
    import cquant
    import diffusers

    diffusers.utils.logging.set_verbosity_error()
    if args.sizes:  # no device needed: meta tensors
        rows = meta_sizes(args, {v: parse_variant(v) for v in args.variants})
        print(f"{args.model} transformer{' ' + ' '.join(args.override) if args.override else ''}: stored bytes of "
              "every parameter and buffer (1 GB = 1e9 bytes), as get_memory_footprint() counts them")
        print(sizes_table(rows))
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as f:
                json.dump(dict(info=dict(model=args.model, override=args.override), sizes=rows), f, indent=2)
        return rows
    device = torch.device(args.device)
    ref_device = torch.device(args.ref_device or args.device)
    if device.type == "cuda" and not cquant._C.built_with_cuda():
        raise SystemExit("cquant was built without CUDA; rebuild with nvcc on PATH")
    variants = {v: parse_variant(v) for v in args.variants}
    torch.backends.cuda.matmul.allow_tf32 = False  # the reference is true float32
    torch.backends.cudnn.allow_tf32 = False

    config = load_config(args.model, args.override)
    t0 = time.perf_counter()
    master = build_master(config, args.seed, args.init_std, device)
    n_params = sum(p.numel() for p in master.parameters())
    n_linear = sum(1 for m in master.modules() if isinstance(m, torch.nn.Linear))
    tokens = (args.height // 16) * (args.width // 16)
    print(f"{args.model}: {n_params / 1e9:.3f} B parameters, {n_linear} linear layers, {tokens} image + "
          f"{args.text_tokens} text tokens; master weights ready in {time.perf_counter() - t0:.0f} s", flush=True)

    # 1. float32 reference, alone on its device; keep only the output
    t0 = time.perf_counter()
    ref_model = materialize(master, ref_device, torch.float32)
    ref_inputs = make_inputs(config, args.height, args.width, args.text_tokens, ref_device, torch.float32, args.seed + 1,
                             args.batch)
    ref = step(ref_model, ref_inputs).float().cpu()
    del ref_model, ref_inputs
    free()
    print(f"  float32 reference in {time.perf_counter() - t0:.0f} s (output rms {float(ref.pow(2).mean().sqrt()):.3g})",
          flush=True)

    inputs = make_inputs(config, args.height, args.width, args.text_tokens, device, torch.bfloat16, args.seed + 1,
                         args.batch)
    rows = []

    # 2. bfloat16 eager: it stays on the device, the baseline every variant is interleaved with
    bf16_model = materialize(master, device, torch.bfloat16)
    rows.append(measure("bf16", bf16_model, bf16_model, inputs, ref, args, device,
                        dict(scheme=None, quantize_peak_gb=None)))

    # 3. each variant: bf16, or a scheme quantized layer by layer onto the device from bfloat16
    #    weights on the CPU; then cquant's attention, its fused blocks, torch.compile as asked
    for variant, v in variants.items():
        free()
        base = torch.cuda.memory_allocated() if device.type == "cuda" else 0
        extra = dict(scheme=v["scheme"], attention=v["attention"], fused_gelu=v["fused_gelu"], optimize=v["optimize"],
                     cuda_graph=v["graph"], compile=v["compile"], quantize_peak_gb=None)
        model = None
        try:  # one variant failing (quantizing, optimizing or running) must not lose the others' numbers
            model = build_variant(master, v, device, extra, base)
            rows.append(measure(variant, model, bf16_model, inputs, ref, args, device, extra, base))
        except Exception as e:
            print(f"  {variant}: FAILED: {type(e).__name__}: {e}", flush=True)
            traceback.print_exc()
            rows.append(dict(variant=variant, error=f"{type(e).__name__}: {e}", **extra))
        del model
        torch._dynamo.reset()
    del bf16_model
    free()

    info = dict(describe(), model=args.model, config=config, parameters=n_params, height=args.height,
                width=args.width, image_tokens=tokens, text_tokens=args.text_tokens, batch=args.batch, torch_device=str(device),
                device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else
                (platform.processor() or platform.machine() or "cpu"), diffusers=diffusers.__version__,
                reference="float32 forward of the same (bfloat16) weights, TF32 off", warmup=args.warmup,
                repeats=args.repeats, iters=args.iters, init_std=args.init_std, seed=args.seed)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(dict(info=info, results=rows, headline=headline(rows, "variant", "bf16", "one step")), f, indent=2)
    print()
    print(f"{args.model} transformer, one step at {args.width}x{args.height} ({tokens} + {args.text_tokens} tokens), "
          f"batch {args.batch}, {info['device_name']}; SQNR against float32")
    print(table(rows))
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
