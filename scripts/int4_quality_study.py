#!/usr/bin/env python3
"""How much accuracy the 4-bit schemes keep on a FLUX.1-dev-architecture transformer, and what
the low-rank correction of the quantization error buys per rank.

Random weights with the published architecture (python/cquant/data/model_configs.json; --blocks D,S
keeps fewer double / single blocks), bfloat16 master weights, one denoising step at --height x
--width. Everything is measured as SQNR (dB) against float32 of the same weights (TF32 off):

  per layer   every linear layer of the studied blocks (--layer-blocks; default the first, middle
              and last of each stack) and the embedders / output layers: the float32 model's
              input to that layer (--rows token rows of it) goes through the layer quantized
              alone (cquant.quantize_ of a torch.nn.Linear holding the bfloat16 weight, run in
              bfloat16) and through the float32 layer in float64; "bf16" is the unquantized layer
              in bfloat16, the floor every scheme sits under
  end to end  the transformer's output with every layer quantized (cquant.quantize_ of the whole
              model), against the float32 model's; stored GB as users count them (every
              parameter and buffer in its stored form, 1 GB = 1e9 bytes)
  low rank    for the --rank-schemes (default int4wo), ranks --ranks (default 0, 8, 16, 32, 64):
              the same per-layer and end-to-end SQNR, the gain over rank 0, the extra bytes
  synthetic   random weights have no low-rank structure: their 4-bit rounding error is close
              to white noise, which no small rank captures. So the per-rank study runs again on
              synthetic layers at Flux's GEMM shapes whose weights have low-rank structure
              (a rank-32 component with a decaying spectrum holding 70% of the energy, plus
              Gaussian noise) and outlier input channels (1% of the columns scaled x8), fed
              activations with outlier channels (another 1% scaled x10)

Schemes are cquant scheme names: "int4wo" (uint4, group 128), "int4wo_g32" (group 32),
"int4dq" (int8 activations x int4 weights), "int4dq_2l" (the same with two-level scales), "fp8da_int4w", "fp8dqrow", "int4wo_r32" (rank 32).

    python scripts/int4_quality_study.py --out benchmarks/results/int4_quality_h100.json   # GPU
    python scripts/int4_quality_study.py --quick --out /tmp/int4_quality.json              # CPU, tiny

--out writes the JSON and a markdown report beside it (same name, .md).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
import warnings

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "benchmarks"))
from bench_flux_step import build_master, load_config, make_inputs, materialize, step  # noqa: E402
from _variants import config as variant_config  # noqa: E402
from _variants import module_bytes, parse, with_rank  # noqa: E402

from cquant.demo import comma_list  # noqa: E402
from cquant.metrics import sqnr_db  # noqa: E402

SCHEMES = ("int4wo_g32", "int4wo_g64", "int4wo", "int4dq", "int4dq_2l", "fp8da_int4w", "fp8dqrow")
RANK_SCHEMES = ("int4wo",)
RANKS = (0, 8, 16, 32, 64)
# Flux-dev GEMM shapes (K, N) of benchmarks/shapes.json for the synthetic per-rank study
SYNTHETIC_SHAPES = ((3072, 3072), (3072, 12288), (12288, 3072), (15360, 3072))
SYNTHETIC_ROWS = 512
# --quick: a Flux transformer a CPU runs in seconds (every K a multiple of 32; ranks up to 64 fit)
QUICK_OVERRIDES = ["num_layers=1", "num_single_layers=1", "num_attention_heads=4", "attention_head_dim=32",
                   "joint_attention_dim=128", "pooled_projection_dim=64", "axes_dims_rope=[8,12,12]"]
QUICK_SYNTHETIC_SHAPES = ((128, 256), (256, 128))
# the synthetic weights: low-rank component, its share of the energy, outlier channels
STRUCT_RANK, STRUCT_SHARE, STRUCT_DECAY = 32, 0.7, 0.9
W_OUTLIER_FRACTION, W_OUTLIER_SCALE = 0.01, 8.0
X_OUTLIER_FRACTION, X_OUTLIER_SCALE = 0.01, 10.0


# ---------------------------------------------------------------- variants


def variant_names(schemes, rank_schemes, ranks):
    """The variants to measure: every scheme at rank 0, then each rank scheme at each rank > 0."""
    out = list(schemes)
    for s in rank_schemes:
        if s not in out:
            out.append(s)
        out += [with_rank(s, r) for r in ranks if r]
    return out


def quantize_linear(weight, bias, name, device):
    """The layer [N, K] = weight (bfloat16) quantized by variant `name` on `device`, or the
    reason it is not (the scheme refuses the shape)."""
    lin = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    lin.weight = torch.nn.Parameter(weight.to(device, torch.bfloat16), requires_grad=False)
    if bias is not None:
        lin.bias = torch.nn.Parameter(bias.to(device, torch.bfloat16), requires_grad=False)
    import cquant
    from cquant.nn import QuantizedLinear
    from cquant.quantize import plan

    cfg = variant_config(name)
    refused = plan(lin, cfg).report.get("")
    if refused:
        return None, refused[1][:160]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cquant.quantize_(lin, cfg)
    except (ValueError, RuntimeError, NotImplementedError) as e:
        return None, str(e).splitlines()[0][:160]
    if not isinstance(lin, QuantizedLinear):
        return None, "left unquantized"
    return lin, None


# ---------------------------------------------------------------- per layer


def studied_blocks(n, spec):
    """Indices of the blocks of a stack of n whose layers are studied: "all", or a list of indices
    and first / middle / last (parse_args checked each)."""
    if n == 0:
        return []
    if spec == "all":
        return list(range(n))
    named = {"first": 0, "middle": n // 2, "last": n - 1}
    out = []
    for item in spec:
        i = named[item] if item in named else int(item)
        if not 0 <= i < n:
            raise SystemExit(f"--layer-blocks: block {i} is not among the {n} blocks of a stack")
        if i not in out:
            out.append(i)
    return out


def studied_layers(model, spec):
    """{fqn: Linear} of the layers studied one by one: those of the chosen double and single
    blocks, and every linear layer outside the blocks (embedders, output)."""
    stacks = {"transformer_blocks": studied_blocks(len(model.transformer_blocks), spec),
              "single_transformer_blocks": studied_blocks(len(model.single_transformer_blocks), spec)}
    out = {}
    for fqn, mod in model.named_modules():
        if not isinstance(mod, torch.nn.Linear):
            continue
        parts = fqn.split(".")
        if parts[0] in stacks and int(parts[1]) not in stacks[parts[0]]:
            continue
        out[fqn] = mod
    return out


def layer_kind(fqn):
    """The layer's name with the block index replaced by '*'."""
    parts = fqn.split(".")
    if parts[0] in ("transformer_blocks", "single_transformer_blocks"):
        parts[1] = "*"
    return ".".join(parts)


def capture_inputs(ref_model, layers, inputs, rows):
    """(output of the float32 model, {fqn: float32 input rows on the CPU}): up to `rows` token
    rows of each studied layer's input, evenly spaced (its first call)."""
    got, handles = {}, []

    def hook(fqn):
        def fn(mod, args):
            if fqn in got:
                return
            x = args[0].detach().reshape(-1, args[0].shape[-1])
            idx = torch.linspace(0, x.shape[0] - 1, min(rows, x.shape[0]), device=x.device).round().long().unique()
            got[fqn] = x[idx].float().cpu()
        return fn

    mods = dict(ref_model.named_modules())
    for fqn in layers:
        handles.append(mods[fqn].register_forward_pre_hook(hook(fqn)))
    try:
        out = step(ref_model, inputs).float().cpu()
    finally:
        for h in handles:
            h.remove()
    missing = [f for f in layers if f not in got]
    if missing:
        raise RuntimeError(f"the float32 forward never called {missing[:3]}")
    return out, got


@torch.no_grad()
def per_layer(master, layers, xs, names, device, log):
    """One row per (layer, variant): SQNR of the layer's output against float64 of the float32
    layer on the captured rows, stored bytes (codes, scales, low-rank factors, bias)."""
    rows = []
    for i, fqn in enumerate(layers):
        mod = master.get_submodule(fqn)
        w, b = mod.weight.detach(), mod.bias.detach() if mod.bias is not None else None
        x = xs[fqn].to(device)
        ref = F.linear(x.double(), w.to(device).double(), b.to(device).double() if b is not None else None)
        n, k = w.shape
        common = dict(layer=fqn, kind=layer_kind(fqn), K=k, N=n, rows=x.shape[0])
        y = F.linear(x.to(torch.bfloat16), w.to(device), b.to(device) if b is not None else None)
        bf16_bytes = w.numel() * 2 + (b.numel() * 2 if b is not None else 0)
        rows.append(dict(common, variant="bf16", sqnr_db=sqnr_db(ref, y), bytes=bf16_bytes))
        for name in names:
            lin, why = quantize_linear(w, b, name, device)
            if lin is None:
                rows.append(dict(common, variant=name, skipped=why))
                continue
            y = lin(x.to(torch.bfloat16))
            rows.append(dict(common, variant=name, sqnr_db=sqnr_db(ref, y), bytes=module_bytes(lin)))
            del lin
        log(f"  [{i + 1}/{len(layers)}] {fqn} ({k} -> {n}): " + ", ".join(
            f"{r['variant']} {r['sqnr_db']:.1f}" for r in rows[-len(names) - 1:] if "sqnr_db" in r))
    return rows


# ---------------------------------------------------------------- synthetic layers


def structured_layer(k, n, rows, seed, device):
    """(weight [N, K] float32, x [rows, K] float32): a weight with low-rank structure and outlier
    input channels, activations with outlier channels (see the module docstring)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    r = min(STRUCT_RANK, n, k)
    u, v = torch.randn(n, r, generator=g), torch.randn(r, k, generator=g)
    low = (u * STRUCT_DECAY ** torch.arange(r, dtype=torch.float32)) @ v
    low *= math.sqrt(STRUCT_SHARE) / low.std()
    w = low + math.sqrt(1 - STRUCT_SHARE) * torch.randn(n, k, generator=g)
    cols = torch.randperm(k, generator=g)
    w[:, cols[: max(1, int(W_OUTLIER_FRACTION * k))]] *= W_OUTLIER_SCALE
    x = torch.randn(rows, k, generator=g)
    x[:, cols[-max(1, int(X_OUTLIER_FRACTION * k)):]] *= X_OUTLIER_SCALE
    return (w / math.sqrt(k)).to(device), x.to(device)


@torch.no_grad()
def synthetic(shapes, names, rows, device, log):
    """One row per (shape, variant) on structured weights: SQNR against float64, stored bytes."""
    out = []
    for i, (k, n) in enumerate(shapes):
        w32, x32 = structured_layer(k, n, rows, seed=1000 + i, device=device)
        w = w32.to(torch.bfloat16)  # the layer as stored in bfloat16, the reference of its float32 upcast
        ref = F.linear(x32.double(), w.double())
        common = dict(K=k, N=n, rows=rows)
        out.append(dict(common, variant="bf16", sqnr_db=sqnr_db(ref, F.linear(x32.to(torch.bfloat16), w)),
                        bytes=w.numel() * 2))
        for name in names:
            lin, why = quantize_linear(w, None, name, device)
            if lin is None:
                out.append(dict(common, variant=name, skipped=why))
                continue
            out.append(dict(common, variant=name, sqnr_db=sqnr_db(ref, lin(x32.to(torch.bfloat16))),
                            bytes=module_bytes(lin)))
            del lin
        log(f"  synthetic {k} -> {n}: " + ", ".join(f"{r['variant']} {r['sqnr_db']:.1f}" for r in out[-len(names) - 1:]
                                                    if "sqnr_db" in r))
    return out


# ---------------------------------------------------------------- end to end


@torch.no_grad()
def end_to_end(master, names, inputs, ref_out, device, log):
    """One row per variant (and bf16): SQNR of the transformer's output, stored bytes, layers
    quantized. The bfloat16 model stays on the device; each variant is a copy of it quantized
    in place there (cquant.quantize_)."""
    import copy

    import cquant
    from cquant.quantize import quantized_layers

    bf16 = materialize(master, device, torch.bfloat16)
    rows = [dict(variant="bf16", sqnr_db=sqnr_db(ref_out, step(bf16, inputs)), bytes=module_bytes(bf16),
                 layers_quantized=0)]
    log(f"  bf16: SQNR {rows[0]['sqnr_db']:.2f} dB, {rows[0]['bytes'] / 1e9:.3f} GB")
    for name in names:
        t0 = time.perf_counter()
        model = copy.deepcopy(bf16)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                cquant.quantize_(model, variant_config(name), progress=False)
            out = step(model, inputs)
            row = dict(variant=name, sqnr_db=sqnr_db(ref_out, out), bytes=module_bytes(model),
                       layers_quantized=len(quantized_layers(model)), seconds=round(time.perf_counter() - t0, 1))
        except (ValueError, RuntimeError, NotImplementedError) as e:
            row = dict(variant=name, skipped=f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
        rows.append(row)
        del model
        free(device)
        log(f"  {name}: " + (f"SQNR {row['sqnr_db']:.2f} dB, {row['bytes'] / 1e9:.3f} GB, {row['layers_quantized']} "
                             f"layers, {row['seconds']} s" if "sqnr_db" in row else f"skipped: {row['skipped']}"))
    del bf16
    free(device)
    return rows


def free(device):
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------- summaries


def _median(xs):
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return statistics.median(xs) if xs else None


def layer_summary(rows, names):
    """{variant: {median_db, min_db, worst_layer, layers, skipped, bytes}} over the studied layers."""
    out = {}
    for name in ["bf16", *names]:
        got = [r for r in rows if r["variant"] == name and "sqnr_db" in r]
        if not got:
            out[name] = dict(layers=0, skipped=sum(1 for r in rows if r["variant"] == name))
            continue
        worst = min(got, key=lambda r: r["sqnr_db"])
        out[name] = dict(median_db=_median([r["sqnr_db"] for r in got]), min_db=worst["sqnr_db"],
                         worst_layer=worst["layer"], layers=len(got),
                         skipped=sum(1 for r in rows if r["variant"] == name and "skipped" in r),
                         bytes=sum(r["bytes"] for r in got))
    return out


def kind_table(rows, names):
    """{kind: {variant: median SQNR over the studied blocks}}."""
    out = {}
    for r in rows:
        if "sqnr_db" in r:
            out.setdefault(r["kind"], {}).setdefault(r["variant"], []).append(r["sqnr_db"])
    return {k: {v: _median(xs) for v, xs in d.items()} for k, d in out.items()}


def rank_gains(rows, key, rank_schemes, ranks):
    """[{scheme, rank, median_gain_db, min_gain_db, extra_bytes, extra_fraction}]: per unit (layer
    or shape, named by `key`) the SQNR gain of rank r over rank 0 of the same scheme, and the
    bytes the factors add."""
    by = {(r[key], r["variant"]): r for r in rows if "sqnr_db" in r}
    out = []
    for s in rank_schemes:
        for rank in ranks:
            name = with_rank(s, rank)
            gains, extra, base_bytes = [], 0, 0
            for (unit, v), r in by.items():
                if v != name or (unit, s) not in by:
                    continue
                b = by[(unit, s)]
                gains.append(r["sqnr_db"] - b["sqnr_db"])
                extra += r["bytes"] - b["bytes"]
                base_bytes += b["bytes"]
            if gains:
                out.append(dict(scheme=s, rank=rank, units=len(gains), median_gain_db=_median(gains),
                                min_gain_db=min(gains), max_gain_db=max(gains), extra_bytes=extra,
                                extra_fraction=extra / base_bytes if base_bytes else None))
    return out


def e2e_gains(rows, rank_schemes, ranks):
    by = {r["variant"]: r for r in rows if "sqnr_db" in r}
    out = []
    for s in rank_schemes:
        for rank in ranks:
            name = with_rank(s, rank)
            if name in by and s in by:
                out.append(dict(scheme=s, rank=rank, sqnr_db=by[name]["sqnr_db"],
                                gain_db=by[name]["sqnr_db"] - by[s]["sqnr_db"], extra_bytes=by[name]["bytes"] - by[s]["bytes"],
                                extra_fraction=(by[name]["bytes"] - by[s]["bytes"]) / by[s]["bytes"]))
    return out


# ---------------------------------------------------------------- report


def _f(x, spec=".2f"):
    return "-" if x is None else format(x, spec)


def markdown(result):
    a, lines = result["args"], []
    lines.append(f"# 4-bit quality study: {a['model']}{' (' + ' '.join(a['override']) + ')' if a['override'] else ''}, "
                 f"{result['info']['device_name']}")
    lines.append("")
    lines.append(f"Random weights (init std {a['init_std']}, seed {a['seed']}), bfloat16 master weights, one step at "
                 f"{a['width']}x{a['height']} ({result['info']['image_tokens']} image + {a['text_tokens']} text tokens). "
                 "SQNR in dB against float32 of the same weights (per layer: float64 of the float32 layer on "
                 f"{a['rows']} captured token rows). Studied blocks: {a['layer_blocks']}. Bytes as stored (codes, scales, "
                 "low-rank factors, biases, unquantized layers); 1 GB = 1e9 bytes.")
    if "end_to_end" in result:
        lines += ["", "## End to end (transformer output)", "", "| variant | SQNR dB | stored GB | layers quantized |",
                  "|---|---|---|---|"]
        for r in result["end_to_end"]:
            if "sqnr_db" in r:
                lines.append(f"| {r['variant']} | {r['sqnr_db']:.2f} | {r['bytes'] / 1e9:.3f} | {r['layers_quantized']} |")
            else:
                lines.append(f"| {r['variant']} | skipped: {r['skipped']} | - | - |")
    if "layer_summary" in result:
        lines += ["", "## Per layer (each layer quantized alone)", "",
                  "| variant | median SQNR dB | lowest SQNR dB | lowest at | layers | skipped |", "|---|---|---|---|---|---|"]
        for name, s in result["layer_summary"].items():
            lines.append(f"| {name} | {_f(s.get('median_db'))} | {_f(s.get('min_db'))} | {s.get('worst_layer', '-')} | "
                         f"{s['layers']} | {s['skipped']} |")
        kinds = result["layer_kinds"]
        names = list(result["layer_summary"])
        lines += ["", "Median SQNR (dB) per layer kind over the studied blocks:", "",
                  "| layer | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
        for kind, d in kinds.items():
            lines.append(f"| {kind} | " + " | ".join(_f(d.get(n), ".1f") for n in names) + " |")
    sections = (("rank_layers", "Low-rank correction, per layer (random weights)", "layers"),
                ("rank_synthetic", "Low-rank correction, synthetic structured weights (low rank + outlier channels)",
                 "shapes"))
    for key, title, units in sections:
        if result.get(key):
            lines += ["", f"## {title}", "", f"| scheme | rank | {units} | median gain dB | lowest gain dB | highest gain dB "
                      "| extra bytes | extra % |", "|---|---|---|---|---|---|---|---|"]
            for g in result[key]:
                lines.append(f"| {g['scheme']} | {g['rank']} | {g['units']} | {_f(g['median_gain_db'])} | "
                             f"{_f(g['min_gain_db'])} | {_f(g['max_gain_db'])} | {g['extra_bytes']:,} | "
                             f"{_f(100 * g['extra_fraction'] if g['extra_fraction'] is not None else None, '.1f')} |")
    if result.get("rank_e2e"):
        lines += ["", "## Low-rank correction, end to end (random weights)", "",
                  "| scheme | rank | SQNR dB | gain dB | extra GB | extra % |", "|---|---|---|---|---|---|"]
        for g in result["rank_e2e"]:
            lines.append(f"| {g['scheme']} | {g['rank']} | {g['sqnr_db']:.2f} | {g['gain_db']:+.2f} | "
                         f"{g['extra_bytes'] / 1e9:.3f} | {100 * g['extra_fraction']:.1f} |")
    if result.get("synthetic"):
        names = list(dict.fromkeys(r["variant"] for r in result["synthetic"]))
        lines += ["", "## Synthetic structured layers: SQNR dB", "",
                  f"Weights: a rank-{STRUCT_RANK} component (singular values decaying x{STRUCT_DECAY} per rank) holding "
                  f"{STRUCT_SHARE:.0%} of the energy plus Gaussian noise, {W_OUTLIER_FRACTION:.0%} of the input channels "
                  f"scaled x{W_OUTLIER_SCALE:g}; activations N(0, 1) with another {X_OUTLIER_FRACTION:.0%} of the channels "
                  f"scaled x{X_OUTLIER_SCALE:g}; {result['synthetic'][0]['rows']} rows.", "",
                  "| K -> N | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
        shapes = list(dict.fromkeys((r["K"], r["N"]) for r in result["synthetic"]))
        by = {(r["K"], r["N"], r["variant"]): r for r in result["synthetic"]}
        for k, n in shapes:
            lines.append(f"| {k} -> {n} | " + " | ".join(_f(by.get((k, n, v), {}).get("sqnr_db"), ".1f") for v in names)
                         + " |")
    lines.append("")
    return "\n".join(lines)


# ---------------------------------------------------------------- main


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="See the module docstring for what each part measures.")
    p.add_argument("--model", default="flux-dev", help="entry of python/cquant/data/model_configs.json (default: %(default)s)")
    p.add_argument("--blocks", default=None, metavar="D,S", help="keep D double and S single blocks (default: all)")
    p.add_argument("--override", nargs="*", default=[], metavar="KEY=JSON", help="change config entries")
    p.add_argument("--schemes", default=",".join(SCHEMES), help="comma-separated variants (default: %(default)s)")
    p.add_argument("--rank-schemes", default=",".join(RANK_SCHEMES),
                   help="variants whose low-rank correction is studied per rank (default: %(default)s)")
    p.add_argument("--ranks", default=",".join(map(str, RANKS)), help="ranks (default: %(default)s)")
    p.add_argument("--parts", default="layers,e2e,synthetic",
                   help="comma-separated parts to run: layers, e2e, synthetic (default: %(default)s)")
    p.add_argument("--layer-blocks", default="first,middle,last",
                   help="blocks of each stack whose layers are studied one by one: 'all' or indices / first / "
                        "middle / last (default: %(default)s)")
    p.add_argument("--rows", type=int, default=512, help="token rows of each layer's input kept (default: %(default)s)")
    p.add_argument("--synthetic-rows", type=int, default=SYNTHETIC_ROWS)
    p.add_argument("--height", type=int, default=1024)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--text-tokens", type=int, default=512)
    p.add_argument("--device", default="cuda")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--init-std", type=float, default=0.02, help="std of the random Linear weights")
    p.add_argument("--out", default=None, help="write the JSON here and the markdown report beside it (.md)")
    p.add_argument("--quick", action="store_true",
                   help="a tiny Flux config on the CPU (1 + 1 blocks, width 128, 64x64 image, 8 text tokens), "
                        "tiny synthetic shapes: checks the plumbing in a few minutes")
    args = p.parse_args(argv)
    if args.quick:
        args.override = [*QUICK_OVERRIDES, *args.override]
        args.height = args.width = 64
        args.text_tokens, args.rows, args.synthetic_rows = 8, 64, 64
        args.device = "cpu" if args.device == "cuda" else args.device
        args.layer_blocks = "all"
    if args.blocks:
        try:
            d, s = (int(x) for x in args.blocks.split(","))
        except ValueError:
            p.error(f"--blocks {args.blocks!r}: expected D,S (two integers)")
        args.override = [*args.override, f"num_layers={d}", f"num_single_layers={s}"]
    try:
        args.parts = comma_list(args.parts, "--parts", "part", "comma-separated parts of layers, e2e, synthetic")
        if args.layer_blocks != "all":
            args.layer_blocks = comma_list(args.layer_blocks, "--layer-blocks", "block",
                                           "'all' or comma-separated indices / first / middle / last")
        args.schemes = comma_list(args.schemes, "--schemes", "variant", "comma-separated variants")
        args.rank_schemes = comma_list(args.rank_schemes, "--rank-schemes", "variant", "comma-separated variants")
        ranks = comma_list(args.ranks, "--ranks", "rank", "comma-separated whole numbers")
    except ValueError as e:
        p.error(str(e))
    for part in args.parts:
        if part not in ("layers", "e2e", "synthetic"):
            p.error(f"--parts: unknown part {part!r}; expected layers, e2e, synthetic")
    for item in args.layer_blocks if args.layer_blocks != "all" else ():
        if item not in ("first", "middle", "last") and not item.isdigit():
            p.error(f"--layer-blocks: {item!r} is not a block index or first / middle / last")
    try:
        args.ranks = sorted({int(r) for r in ranks} | {0})
        for name in args.schemes + args.rank_schemes:
            if parse(name).rank:
                raise ValueError(f"{name}: give ranks with --ranks, not in the scheme name")
        for name in variant_names(args.schemes, args.rank_schemes, args.ranks):
            variant_config(name)
    except ValueError as e:
        p.error(str(e))
    if args.height % 16 or args.width % 16:
        p.error("--height and --width must be multiples of 16")
    return args


def main(argv=None):
    args = parse_args(argv)
    warnings.simplefilter("ignore")
    import diffusers

    import cquant

    diffusers.utils.logging.set_verbosity_error()
    device = torch.device(args.device)
    if device.type == "cuda" and not cquant._C.built_with_cuda():
        raise SystemExit("cquant was built without CUDA; rebuild with nvcc on PATH (or --quick / --device cpu)")
    torch.backends.cuda.matmul.allow_tf32 = False  # the reference is true float32
    torch.backends.cudnn.allow_tf32 = False
    names = variant_names(args.schemes, args.rank_schemes, args.ranks)
    t_start = time.perf_counter()

    def log(msg):
        print(f"[{time.perf_counter() - t_start:6.0f} s] {msg}", flush=True)

    config = load_config(args.model, args.override)
    master = build_master(config, args.seed, args.init_std, device)
    n_params = sum(p.numel() for p in master.parameters())
    tokens = (args.height // 16) * (args.width // 16)
    log(f"{args.model}: {n_params / 1e9:.3f} B parameters, {len(master.transformer_blocks)} + "
        f"{len(master.single_transformer_blocks)} blocks; variants: {', '.join(names)}")
    info = dict(model=args.model, config=config, parameters=n_params, image_tokens=tokens, torch=torch.__version__,
                cquant=cquant.__version__, diffusers=diffusers.__version__, torch_device=str(device),
                device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else
                (platform.processor() or platform.machine() or "cpu"))
    result = dict(info=info, args=vars(args), variants=names)

    # 1. the float32 reference: its output, and the inputs of the studied layers
    layers = studied_layers(master, args.layer_blocks) if "layers" in args.parts else {}
    if "layers" in args.parts or "e2e" in args.parts:
        ref_model = materialize(master, device, torch.float32)
        ref_inputs = make_inputs(config, args.height, args.width, args.text_tokens, device, torch.float32,
                                 args.seed + 1)
        ref_out, xs = capture_inputs(ref_model, layers, ref_inputs, args.rows)
        del ref_model, ref_inputs
        free(device)
        log(f"float32 reference done (output rms {float(ref_out.pow(2).mean().sqrt()):.3g}); {len(layers)} layers studied")

    # 2. each studied layer quantized alone
    if "layers" in args.parts:
        rows = per_layer(master, layers, xs, names, device, log)
        del xs
        result.update(per_layer=rows, layer_summary=layer_summary(rows, names), layer_kinds=kind_table(rows, names),
                      rank_layers=rank_gains(rows, "layer", args.rank_schemes, args.ranks))

    # 3. synthetic structured layers (the per-rank study where low rank has something to find)
    if "synthetic" in args.parts:
        shapes = QUICK_SYNTHETIC_SHAPES if args.quick else SYNTHETIC_SHAPES
        rows = synthetic(shapes, names, args.synthetic_rows, device, log)
        for r in rows:
            r["shape"] = f"{r['K']}x{r['N']}"
        result.update(synthetic=rows, rank_synthetic=rank_gains(rows, "shape", args.rank_schemes, args.ranks))

    # 4. the whole transformer quantized
    if "e2e" in args.parts:
        inputs = make_inputs(config, args.height, args.width, args.text_tokens, device, torch.bfloat16, args.seed + 1)
        rows = end_to_end(master, names, inputs, ref_out, device, log)
        result.update(end_to_end=rows, rank_e2e=e2e_gains(rows, args.rank_schemes, args.ranks))

    result["seconds"] = round(time.perf_counter() - t_start, 1)
    report = markdown(result)
    print()
    print(report)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1, default=str)
        md = os.path.splitext(args.out)[0] + ".md"
        with open(md, "w") as f:
            f.write(report)
        print(f"wrote {args.out} and {md}")
    return result


if __name__ == "__main__":
    main()
    sys.exit(0)
