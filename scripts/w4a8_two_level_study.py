#!/usr/bin/env python3
"""What a two-level 4-bit weight format would cost in accuracy against int4dq's, on Flux's GEMM shapes.

int4dq (and fp8da_int4w) keep one fp32 scale per group of 128 weights of a row: y = sum_g sw[n, g] *
(sum over the group of x8 * c), which an 8-bit tensor-core mainloop can only apply by leaving the
fast path every group (a rescale of partial accumulators). A two-level format (QServe's progressive
quantization) keeps one fp32 scale per row, s1 = amax(row) / 112, and per group an integer
multiplier s2 in [1, 16] with codes c in [-7, 7]: w = s1 * s2 * c. s2 * c is an int8 (|s2 c| <= 112),
built in registers with integer operations, so one int32 accumulator runs over all of K and s1
enters the epilogue with the token scale. The price is resolution: a group whose largest weight is
far below its row's largest gets s2 = 1 and a step of s1 instead of amax(group) / 7.

This measures that price, as SQNR (dB) against float64, on the weights and on the layer's output
with int8 per-token activations (the activations are quantized the same way for both formats):

  int4 g128   cquant's int4 per-group format (ops.quantize, the codes int4dq stores)
  two-level   s1 = amax(row) / 112 per row, s2 = ceil(amax(group) / (7 s1)) per group, c = round(w / (s1 s2))

on two kinds of weights at each Flux shape (K, N from benchmarks/shapes.json, --rows of the N rows):
  gaussian    N(0, 1/K) weights, N(0, 1) activations (a randomly initialised Flux)
  outliers    the synthetic layers of scripts/int4_quality_study.py: a decaying rank-32 component
              holding 70% of the energy plus noise, 1% of the input channels x8 (trained weights'
              outlier channels), activations with another 1% of channels x10

    python scripts/w4a8_two_level_study.py --out benchmarks/results/w4a8_two_level_study.md
"""

from __future__ import annotations

import argparse
import json
import math
import os

import torch

from cquant import ops
from cquant.metrics import sqnr_db

HERE = os.path.dirname(os.path.abspath(__file__))

GROUP = 128
ROW_CODE_MAX = 112  # 7 x 16: |s2 c| stays an int8
S2_MAX = 16


def flux_shapes():
    """The distinct (K, N) of the Flux 1024x1024 GEMMs, in benchmarks/shapes.json's order."""
    with open(os.path.join(HERE, "..", "benchmarks", "shapes.json")) as f:
        rows = json.load(f)["gemm"]["flux_1024_tokenwise"]
    seen = []
    for r in rows:
        if (r["K"], r["N"]) not in seen and r["K"] % GROUP == 0:
            seen.append((r["K"], r["N"]))
    return seen


def layer(kind, k, n, m, gen):
    """(W [n, k], x [m, k]) in float64."""
    if kind == "gaussian":
        return torch.randn(n, k, generator=gen, dtype=torch.float64) / math.sqrt(k), \
            torch.randn(m, k, generator=gen, dtype=torch.float64)
    rank = 32
    spectrum = torch.exp(-torch.arange(rank, dtype=torch.float64) / 8.0)
    low = (torch.randn(n, rank, generator=gen, dtype=torch.float64) * spectrum) @ \
        torch.randn(rank, k, generator=gen, dtype=torch.float64)
    noise = torch.randn(n, k, generator=gen, dtype=torch.float64)
    w = low * math.sqrt(0.7 / low.pow(2).mean().item()) + noise * math.sqrt(0.3)
    w[:, torch.randperm(k, generator=gen)[:max(1, k // 100)]] *= 8.0
    x = torch.randn(m, k, generator=gen, dtype=torch.float64)
    x[:, torch.randperm(k, generator=gen)[:max(1, k // 100)]] *= 10.0
    return w / math.sqrt(k), x


def int4_g128(w):
    """cquant's int4 per-group codes and scales of w, dequantized (float64)."""
    q, s = ops.quantize(w.float(), "int4", "group", group_size=GROUP)
    return ops.dequantize(q, s, "int4", cols=w.shape[1], group_size=GROUP).double()


def two_level(w):
    """(w', s1 [n, 1], s2 [n, G, 1], c [n, G, GROUP]) with w' = s1 * s2 * c: s1 per row (fp32), s2 in
    [1, 16] per group (integer), c in [-7, 7]."""
    n, k = w.shape
    s1 = (w.abs().amax(dim=1, keepdim=True) / ROW_CODE_MAX).float().double()
    s1 = torch.where(s1 > 0, s1, torch.ones_like(s1))
    groups = w.view(n, k // GROUP, GROUP)
    s2 = torch.ceil(groups.abs().amax(dim=2, keepdim=True) / (7.0 * s1.unsqueeze(2))).clamp(1, S2_MAX)
    c = torch.round(groups / (s1.unsqueeze(2) * s2)).clamp(-7, 7)
    return (s1.unsqueeze(2) * s2 * c).view(n, k), s1, s2, c


def act_int8(x):
    """int8 per-token codes of x, dequantized: the activations of int4dq, the same for both formats."""
    s = (x.abs().amax(dim=1, keepdim=True) / 127.0).float().double()
    s = torch.where(s > 0, s, torch.ones_like(s))
    return torch.round(x / s).clamp(-127, 127) * s


def study(rows, tokens, seed):
    out = []
    for k, n_full in flux_shapes():
        n = min(rows, n_full)
        for kind in ("gaussian", "outliers"):
            gen = torch.Generator().manual_seed(seed + 31 * k + n_full + (kind == "outliers"))
            w, x = layer(kind, k, n, tokens, gen)
            y = x @ w.T
            xq = act_int8(x)
            wa = int4_g128(w)
            wb, _, s2, _ = two_level(w)
            out.append(dict(K=k, N=n_full, rows=n, kind=kind,
                            weight_int4_g128=sqnr_db(w, wa), weight_two_level=sqnr_db(w, wb),
                            layer_int4_g128=sqnr_db(y, xq @ wa.T), layer_two_level=sqnr_db(y, xq @ wb.T),
                            s2_is_1=float((s2 == 1).double().mean())))
    return out


def markdown(results, args):
    lines = ["# Two-level 4-bit weights (per-row fp32 x per-group integer 1..16) against int4 g128",
             "",
             f"`python scripts/w4a8_two_level_study.py --rows {args.rows} --tokens {args.tokens} --seed {args.seed}` "
             f"(CPU, float64 math; torch {torch.__version__}). SQNR in dB against float64; \"layer\" with int8 "
             "per-token activations for both formats. \"s2 = 1\": share of groups at the smallest multiplier.",
             "",
             "| K | N | weights | weight int4 g128 | weight two-level | layer int4 g128 | layer two-level | "
             "layer change | s2 = 1 |",
             "|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        lines.append(f"| {r['K']} | {r['N']} | {r['kind']} | {r['weight_int4_g128']:.2f} | {r['weight_two_level']:.2f} | "
                     f"{r['layer_int4_g128']:.2f} | {r['layer_two_level']:.2f} | "
                     f"{r['layer_two_level'] - r['layer_int4_g128']:+.2f} | {r['s2_is_1']:.1%} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=512, help="weight rows of each layer (a sample of N)")
    p.add_argument("--tokens", type=int, default=256, help="activation rows")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="markdown report (a .json beside it holds the numbers)")
    args = p.parse_args(argv)
    if args.rows < 1 or args.tokens < 1:
        p.error("--rows and --tokens must be >= 1")
    results = study(args.rows, args.tokens, args.seed)
    text = markdown(results, args)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
        with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
            json.dump(dict(args=vars(args), results=results), f, indent=1)
    return results


if __name__ == "__main__":
    main()
