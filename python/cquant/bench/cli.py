"""`cquant bench`: measure a grid of schemes and toggles on diffusion transformers, report it.

    cquant bench --quick                                    # a CPU smoke grid on a tiny model (< 1 min)
    cquant bench --model flux-dev --out flux.jsonl --out-dir flux_report
    cquant bench --model flux-dev,sd3-medium --schemes none,fp8dqrow,int4wo --optimize off,on --batch 1,4
    cquant bench --model black-forest-labs/FLUX.1-dev       # a real checkpoint's transformer
    cquant bench --mode pipeline --model flux-dev --schemes none,fp8dqrow --cache off,on
    cquant bench --mode text-encoder --model flux-dev       # fp8 vs bf16 text encoders
    cquant bench --list                                     # the cells and why some are skipped
    cquant bench --report flux.jsonl --out-dir flux_report  # tables and plots from a JSONL alone
"""

from __future__ import annotations

import argparse
import os
import sys

__all__ = ["main", "build_parser"]

# grid axis -> its command-line option
AXIS_OPTIONS = {"model": "--model", "mode": "--mode", "scheme": "--schemes", "fuse_qkv": "--fuse-qkv",
                "attention": "--attention", "optimize": "--optimize", "compile": "--compile", "cache": "--cache",
                "quantize_text_encoder": "--quantize-text-encoder", "dtype": "--dtype", "batch": "--batch"}
# what each grid option's comma list holds (the on / off toggles: "off / on values")
_LISTS_OF = {"model": "model names", "mode": "modes", "scheme": "scheme names", "attention": "attention modes",
             "dtype": "dtypes", "batch": "batch sizes"}


def build_parser():
    p = argparse.ArgumentParser(prog="cquant bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Each grid option takes a comma list; the cells are the product of the values "
                                       "given (within the preset's blocks), minus combinations that cannot run, which "
                                       "are listed with the reason.")
    g = p.add_argument_group("grid (comma lists)")
    g.add_argument("--model", metavar="NAMES", help="flux-dev, flux-schnell, sd3-medium, pixart-sigma, cogvideox-5b, qwen-image (random "
                                   "weights, published architecture), a hub id or a local directory (default: the "
                                   "preset's: flux-dev)")
    g.add_argument("--mode", metavar="MODES", help="step (one transformer call), pipeline (the whole pipeline), or text-encoder (the "
                                  "text-encoder study)")
    g.add_argument("--schemes", metavar="NAMES", help="none, cquant schemes (int8wo, fp8dqrow, int4wo_g64, ...), torchao:int8wo, "
                                     "torchao:int8dq, torchao:fp8dqrow, torchao:int4wo")
    for opt, what in (("--fuse-qkv", "fuse q / k / v projections"), ("--optimize", "cquant.optimize's fused blocks"),
                      ("--compile", "torch.compile"), ("--cache", "FirstBlockCache (pipeline mode)"),
                      ("--quantize-text-encoder", "quantize the text encoders too (pipeline mode)")):
        g.add_argument(opt, metavar="off,on", help=what)
    g.add_argument("--attention", metavar="MODES", help="sdpa (torch), cquant, cquant_int8 (cquant.enable_attention)")
    g.add_argument("--dtype", metavar="DTYPES", help="bf16, fp16")
    g.add_argument("--batch", metavar="SIZES", help="samples per call, e.g. 1,4")
    g.add_argument("--grid", default=None, choices=("default", "quick", "product"),
                   help="preset: default (every cquant scheme and torchao's where it imports, then fusion / "
                        "attention / optimize / compile on a few), "
                        "quick (a tiny model on the CPU) or product (exactly the product of the axes given)")
    g.add_argument("--quick", action="store_true", help="the quick preset: --grid quick on tiny models, short timing")
    r = p.add_argument_group("running")
    r.add_argument("--device", default=None, help="cuda, cuda:1, cpu (default: cuda when available; cpu with --quick)")
    r.add_argument("--repeats", type=int, default=None, help="interleaved repeats, 3-5 (default: 3; 2 with --quick)")
    r.add_argument("--iters", type=int, default=None, help="timed calls per repeat (default: 5; 2 with --quick)")
    r.add_argument("--warmup", type=int, default=None, help="untimed calls first (default: 2; 1 with --quick)")
    r.add_argument("--no-interleave", action="store_true",
                   help="measure the baseline alone first and free it (models that do not fit twice)")
    r.add_argument("--tiny", action="store_true", help="tiny variants of the models (CPU-fast)")
    r.add_argument("--height", type=int, help="image height in pixels (default: the model's)")
    r.add_argument("--width", type=int, help="image width in pixels (default: the model's)")
    r.add_argument("--frames", type=int, help="video frames (default: the model's)")
    r.add_argument("--steps", type=int, help="denoising steps in pipeline mode (default: the pipeline's)")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--retry-errors", action="store_true", help="rerun cells whose last result in --out is an error")
    r.add_argument("--list", action="store_true", help="print the cells and why some are skipped; run nothing")
    o = p.add_argument_group("output")
    o.add_argument("--out", help="results JSONL, appended cell by cell; a rerun resumes where it stopped")
    o.add_argument("--out-dir", help="write report.md and the plots here")
    o.add_argument("--report", metavar="FILE", help="only make the report (tables, plots) from this results JSONL")
    return p


def _axes(args):
    values = {"model": args.model, "mode": args.mode, "scheme": args.schemes, "fuse_qkv": args.fuse_qkv,
              "attention": args.attention, "optimize": args.optimize, "compile": args.compile, "cache": args.cache,
              "quantize_text_encoder": args.quantize_text_encoder, "dtype": args.dtype, "batch": args.batch}
    return {a: v for a, v in values.items() if v is not None}


def _check_counts(p, args):
    for name in ("repeats", "iters"):
        v = getattr(args, name)
        if v is not None and v < 1:
            p.error(f"--{name} must be at least 1, got {v}")
    if args.warmup is not None and args.warmup < 0:
        p.error(f"--warmup must be at least 0, got {args.warmup}")
    for name in ("height", "width", "frames", "steps"):
        v = getattr(args, name)
        if v is not None and v < 1:
            p.error(f"--{name} must be at least 1, got {v}")
    for name in ("height", "width"):
        v = getattr(args, name)
        if v is not None and v % 16:
            p.error(f"--{name} must be a multiple of 16, got {v}")


def _lists(p, args):
    """{axis: [entries]} of the grid options given; refuses one whose comma list names nothing or
    has an empty entry ("1,,4")."""
    from ..demo import comma_list

    try:
        return {axis: comma_list(text, AXIS_OPTIONS[axis], "value",
                                 f"comma-separated {_LISTS_OF.get(axis, 'off / on values')}")
                for axis, text in _axes(args).items()}
    except ValueError as e:
        p.error(str(e))


def _check_out_dir(p, out_dir):
    if out_dir is None:
        return
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        p.error(f"--out-dir {out_dir!r}: exists and is not a directory")
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        p.error(f"--out-dir {out_dir!r}: cannot be made: {e.strerror or e}")


def _report(p, path, out_dir):
    from .report import write_report

    _check_out_dir(p, out_dir)
    try:
        result = write_report(path, out_dir)
    except (OSError, ValueError) as e:
        p.error(f"--report: {e}")
    print(f"wrote {result['markdown']}" + "".join(f"\nwrote {x}" for x in result["plots"]))
    if result["note"]:
        print(result["note"])
    return 0


def _text_encoder(p, args, lists, device):
    """--mode text-encoder: cquant.bench.text_encoder.run_study with the models, schemes, dtype and
    batch (`lists`: the grid options' entries)."""
    for axis in ("fuse_qkv", "attention", "optimize", "compile", "cache", "quantize_text_encoder"):
        if getattr(args, axis) is not None:
            p.error(f"{AXIS_OPTIONS[axis]} does not apply to --mode text-encoder")
    if args.out is not None:
        p.error("--out does not apply to --mode text-encoder: the study writes text_encoder_study.json and .md "
                "to --out-dir")
    for name in ("height", "width", "frames", "steps", "no_interleave", "retry_errors", "tiny"):
        if getattr(args, name) not in (None, False):
            hint = " (--quick runs its tiny encoders on the CPU)" if name == "tiny" else ""
            p.error(f"--{name.replace('_', '-')} does not apply to --mode text-encoder{hint}")
    from ..schemes import scheme_names
    from .grid import DTYPES, check_scheme, parse_axis, torch_dtype
    from .models import resolve_name

    models = lists.get("model", ["flux-dev"])
    for m in models:
        try:
            resolve_name(m)
        except ValueError as e:
            p.error(f"--model: {e}")
    try:
        what = "--schemes" + (f" {args.schemes!r}" if args.schemes else "")
        schemes = scheme_names(lists.get("scheme", ["fp8dqrow", "fp8wo", "int8wo"]), what, canonical=check_scheme)
    except ValueError as e:
        p.error(str(e))
    schemes = [s for s in schemes if s != "none"]  # the study always measures the unquantized encoder
    if any(s.startswith("torchao:") for s in schemes):
        p.error("--schemes: the text-encoder study takes cquant schemes only")
    dtypes = lists.get("dtype", ["bf16"])
    if len(dtypes) != 1 or dtypes[0] not in DTYPES:
        p.error(f"--dtype: the text-encoder study takes one of {', '.join(DTYPES)}, got {args.dtype!r}")
    try:
        batches = parse_axis("batch", args.batch or "1")
    except ValueError as e:
        p.error(f"--batch: {e}")
    if len(batches) != 1:
        p.error(f"--batch: the text-encoder study takes one batch size, got {args.batch!r}")
    if args.list:
        print(f"text-encoder study: models {', '.join(models)}; schemes none, {', '.join(schemes)}; {dtypes[0]}, "
              f"batch {batches[0]}")
        return 0
    from .text_encoder import run_study

    _check_out_dir(p, args.out_dir)
    extra = {k: getattr(args, k) for k in ("warmup", "iters") if getattr(args, k) is not None}
    if args.seed:
        extra["seed"] = args.seed
    rows = run_study(models=tuple(models), schemes=tuple(schemes), dtype=torch_dtype(dtypes[0]), device=device,
                     quick=args.quick, batch=batches[0], repeats=args.repeats or (2 if args.quick else 5),
                     out_dir=args.out_dir, **extra)
    print(f"text-encoder study: {len(rows)} rows" + (f", written to {args.out_dir}" if args.out_dir else ""))
    return 0


def main(argv=None):
    p = build_parser()
    args = p.parse_args(argv)
    _check_counts(p, args)
    lists = _lists(p, args)
    if args.report:
        return _report(p, args.report, args.out_dir or os.path.splitext(args.report)[0] + "_report")
    quick = args.quick or args.grid == "quick"
    preset = "quick" if quick else (args.grid or "default")
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() and not quick else "cpu")
    try:
        torch.device(device)
    except RuntimeError as e:
        p.error(f"--device: {e}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        p.error(f"--device {device}: CUDA is not available here (use --device cpu)")
    if lists.get("mode") == ["text-encoder"]:
        return _text_encoder(p, args, lists, device)
    if "text-encoder" in lists.get("mode", ()):
        p.error("--mode: text-encoder runs alone (its own study), not in a list with step / pipeline")

    from .grid import default_grid, grid_env

    try:
        grid = default_grid(preset, env=grid_env(device), **_axes(args))
    except ValueError as e:
        axis = str(e).split(":")[0].split()[0]
        option = AXIS_OPTIONS.get(axis, "--" + axis.replace("_", "-"))
        p.error(f"{option}: {e}")
    if args.list:
        for cell, reason in grid:
            print(f"{cell.model:<14} {cell.mode:<8} {cell.dtype:<4} b{cell.batch:<3} {cell.label:<40} "
                  f"{'skipped: ' + reason if reason else 'runs'}")
        n = sum(r is None for _, r in grid)
        print(f"{len(grid)} cells, {n} to run, {len(grid) - n} skipped")
        return 0

    from .results import ResultStore
    from .runner import run_grid

    if args.out:
        try:  # a results file that cannot be resumed or written: say so before any cell runs
            ResultStore(args.out)
        except ValueError as e:
            p.error(f"--out: {e}")
    _check_out_dir(p, args.out_dir)
    records = run_grid(grid, device=device, out=args.out, repeats=args.repeats or (2 if quick else 3),
                       iters=args.iters or (2 if quick else 5), warmup=args.warmup if args.warmup is not None else
                       (1 if quick else 2), interleave_baseline=not args.no_interleave, tiny=quick or args.tiny,
                       seed=args.seed, retry_errors=args.retry_errors, progress=True, height=args.height,
                       width=args.width, frames=args.frames, steps=args.steps)
    from .report import markdown, write_report

    if args.out_dir:
        result = write_report(records, args.out_dir)
        print(f"wrote {result['markdown']} and {len(result['plots'])} plots" +
              (f" ({result['note']})" if result["note"] else ""))
    else:
        print(markdown(records))
    failed = [r for r in records if r["status"] == "error"]
    for r in failed:
        print(f"FAILED {r['label']} ({r['model']}, {r['mode']}, {r['dtype']}, batch {r['batch']}): {r['error']}",
              file=sys.stderr)
    return 1 if failed else 0
