"""The fused DiT block ops on Flux-dev's shapes against the unfused torch math, eager and compiled.

For each op, interleaved on one GPU (benchmarks/_timing.py), inputs rotating over sets larger
than the L2:

  norm_modulate   LayerNorm (no affine, eps 1e-6) + x * (1 + scale) + shift of x [B, S, 3072]
                  torch eager / torch.compile of the same function / cquant writing bf16 /
                  cquant writing fp8 e4m3 codes + per-row scales, against torch.compile of
                  LayerNorm + modulation followed by cquant's own activation quantization
                  (what the fused op replaces in a quantized block)
  qk_norm_rope    diffusers' RMSNorm of q and k (per head, weight) + apply_rotary_emb (Flux's
                  interleaved pairs, fp32 math) of a fused QKV output [B, S, 3 * 24 * 128] into
                  [B, S, 24, 128] tensors, v copied (the attention's contiguous input)
  linear_gated    residual + gate * layer(x) of an fp8dqrow layer 3072 -> 3072: cquant's
                  layer then torch.addcmul (the best unfused form) against cq_linear_gated

"GB/s" counts the bytes the op must move at least (inputs read once, outputs written once);
"x base" is the median over repeats of the baseline's time over the candidate's (the baseline:
the first candidate of each table), with its range. max err: largest |candidate - eager torch|
over the output, in the output's dtype (codes: dequantized).

    python benchmarks/bench_fused_ops.py --out fused_ops.json      # ~60 s on an H200 (3 compiles)
    python benchmarks/bench_fused_ops.py --quick
    pytest benchmarks/test_bench_fused_ops.py --benchmark-only   # pytest-benchmark's tables, seconds per call
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import NamedTuple

import torch
import torch.nn.functional as F

import cquant
from cquant import _C, torch_ops
from cquant.demo import comma_list
from cquant.schemes import scheme

from _timing import describe, describe_line, fmt_speedup, interleaved, require_cuda, rotating, sets_for_l2, text_table

EPS = 1e-6
HEADS, HEAD_DIM, HIDDEN = 24, 128, 3072
# each op's candidates, its baseline first (benchmarks/test_bench_fused_ops.py parametrizes over them)
CANDIDATES = {"norm_modulate": ("torch.compile", "torch eager", "cquant bf16", "compile + quantize fp8", "cquant fp8 codes"),
              "qk_norm_rope": ("torch.compile", "torch eager", "cquant"),
              "linear_gated": ("linear + addcmul", "cquant linear_gated")}


class Case(NamedTuple):
    """One op's set-up: {name: no-argument call}, the bytes a call moves at least, the max errors."""

    title: str
    candidates: dict
    nbytes: int
    errors: dict


def _gbs(nbytes, ms):
    return nbytes / ms / 1e6


def _table(title, timings, nbytes, errors):
    rows = [("candidate", "ms", "ms range", "GB/s", "x base", "max err")]
    for name, t in timings.items():
        d = t.as_dict()
        rows.append((name, f"{d['ms'] * 1e3:.1f} us", f"{d['ms_min'] * 1e3:.1f}-{d['ms_max'] * 1e3:.1f}",
                     f"{_gbs(nbytes, d['ms']):.0f}", fmt_speedup(d), errors.get(name, "-")))
    print(f"\n{title}")
    print(text_table(rows))
    return {name: dict(t.as_dict(), gbs=_gbs(nbytes, t.median), max_err=errors.get(name)) for name, t in timings.items()}


def _err(a, b):
    return f"{float((a.float() - b.float()).abs().max()):.3g}"


def norm_modulate_case(batch, seq):
    dt = torch.bfloat16

    def make():
        emb = torch.randn(batch, 6 * HIDDEN, device="cuda", dtype=dt)
        return dict(x=torch.randn(batch, seq, HIDDEN, device="cuda", dtype=dt) * 3 + 1,
                    shift=emb[:, :HIDDEN], scale=emb[:, HIDDEN:2 * HIDDEN])

    def torch_math(x, scale, shift):
        return F.layer_norm(x, (HIDDEN,), eps=EPS) * (1 + scale[:, None]) + shift[:, None]

    compiled = torch.compile(torch_math)
    fp8 = _C.FORMAT_FP8_E4M3
    sets = [make() for _ in range(sets_for_l2(batch * seq * HIDDEN * 2))]

    def cq(s, fmt=_C.FORMAT_NONE):
        return torch_ops.norm_modulate_impl(s["x"], s["scale"], s["shift"], _C.NORM_LAYER, EPS, fmt)

    def compiled_then_quantize(s):
        return torch_ops.quantize_impl(compiled(s["x"], s["scale"], s["shift"]), fp8, _C.GRANULARITY_ROW)

    cands = {"torch.compile": rotating(lambda s: compiled(s["x"], s["scale"], s["shift"]), sets),
             "torch eager": rotating(lambda s: torch_math(s["x"], s["scale"], s["shift"]), sets),
             "cquant bf16": rotating(cq, sets),
             "compile + quantize fp8": rotating(compiled_then_quantize, sets),
             "cquant fp8 codes": rotating(lambda s: cq(s, fp8), sets)}
    s = sets[0]
    ref = torch_math(s["x"], s["scale"], s["shift"])
    q, sc = cq(s, fp8)
    deq = torch_ops.dequantize(q.view(-1, HIDDEN), sc, fp8, _C.GRANULARITY_ROW, HIDDEN, torch.float32)
    errors = {"cquant bf16": _err(cq(s)[0], ref), "cquant fp8 codes": _err(deq.view_as(ref), ref),
              "torch.compile": _err(compiled(s["x"], s["scale"], s["shift"]), ref)}
    n = batch * seq * HIDDEN
    return Case(f"norm_modulate, x [{batch}, {seq}, {HIDDEN}] bf16 (GB/s: bf16 in, bf16 out)", cands, 4 * n, errors)


def qk_norm_rope_case(batch, seq):
    from diffusers.models.embeddings import apply_rotary_emb

    dt = torch.bfloat16
    inner = HEADS * HEAD_DIM
    wq = torch.rand(HEAD_DIM, device="cuda", dtype=dt) + 0.5
    wk = torch.rand(HEAD_DIM, device="cuda", dtype=dt) + 0.5
    ang = torch.rand(seq, HEAD_DIM // 2, device="cuda") * 6.28
    cos_half, sin_half = ang.cos().contiguous(), ang.sin().contiguous()
    rot = (cos_half.repeat_interleave(2, dim=1), sin_half.repeat_interleave(2, dim=1))  # diffusers' Flux layout

    def rms(x, w):
        v = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(v + EPS)).to(dt) * w

    def torch_math(qkv):
        q, k, v = qkv.view(batch, seq, 3, HEADS, HEAD_DIM).unbind(2)
        q = apply_rotary_emb(rms(q, wq), rot, sequence_dim=1)
        k = apply_rotary_emb(rms(k, wk), rot, sequence_dim=1)
        return q, k, v.contiguous()

    compiled = torch.compile(torch_math)
    sets = [torch.randn(batch, seq, 3 * inner, device="cuda", dtype=dt) for _ in range(sets_for_l2(batch * seq * 3 * inner * 2))]
    outs = [torch.empty(batch, seq, HEADS, HEAD_DIM, device="cuda", dtype=dt) for _ in range(3)]

    def cq(qkv):
        q, k, v = qkv.view(batch, seq, 3, HEADS, HEAD_DIM).unbind(2)
        torch_ops.qk_norm_rope_impl(q, k, v, wq, wk, cos_half, sin_half, *outs, True, EPS, 0)
        return outs

    cands = {"torch.compile": rotating(compiled, sets), "torch eager": rotating(torch_math, sets),
             "cquant": rotating(cq, sets)}
    ref = torch_math(sets[0])
    got = cq(sets[0])
    errors = {"cquant": _err(torch.stack(got), torch.stack(ref)),
              "torch.compile": _err(torch.stack(compiled(sets[0])), torch.stack(ref))}
    n = batch * seq * 3 * inner
    return Case(f"qk_norm_rope, qkv [{batch}, {seq}, {3 * inner}] bf16 -> q, k, v [{batch}, {seq}, {HEADS}, {HEAD_DIM}]",
                cands, 4 * n, errors)


def linear_gated_case(batch, seq):
    dt = torch.bfloat16
    lin = torch.nn.Linear(HIDDEN, HIDDEN, device="cuda", dtype=dt)
    layer = cquant.nn.QuantizedLinear.from_float(lin, scheme("fp8dqrow"))
    wf, wg, af, ag = layer._c_args
    w, ws, b = layer.weight.data, layer.weight_scale, layer.bias
    sets = [dict(x=torch.randn(batch, seq, HIDDEN, device="cuda", dtype=dt),
                 r=torch.randn(batch, seq, HIDDEN, device="cuda", dtype=dt),
                 g=torch.randn(batch, 6 * HIDDEN, device="cuda", dtype=dt)[:, 2 * HIDDEN:3 * HIDDEN])
            for _ in range(sets_for_l2(batch * seq * HIDDEN * 6))]

    def unfused(s):
        y = torch_ops.linear_impl(s["x"], w, ws, b, wf, wg, af, ag, HIDDEN)
        return torch.addcmul(s["r"], s["g"][:, None], y)

    def fused(s):
        return torch_ops.linear_gated_impl(s["x"], w, ws, b, s["g"], s["r"], wf, wg, af, ag, HIDDEN)

    cands = {"linear + addcmul": rotating(unfused, sets), "cquant linear_gated": rotating(fused, sets)}
    errors = {"cquant linear_gated": _err(fused(sets[0]), unfused(sets[0]))}
    n = batch * seq * HIDDEN
    return Case(f"linear_gated, fp8dqrow {HIDDEN} -> {HIDDEN}, x [{batch}, {seq}, {HIDDEN}] bf16 (GB/s: x, residual "
                "in, y out)", cands, 6 * n, errors)


CASES = dict(norm_modulate=norm_modulate_case, qk_norm_rope=qk_norm_rope_case, linear_gated=linear_gated_case)


def build(op, batch, seq):
    """The Case of op (a key of CASES) at x [batch, seq, HIDDEN]."""
    case = CASES[op](batch, seq)
    if tuple(case.candidates) != CANDIDATES[op]:
        raise AssertionError(f"{op}: candidates {tuple(case.candidates)} differ from CANDIDATES {CANDIDATES[op]}")
    return case


def bench(op, batch, seq, args):
    case = build(op, batch, seq)
    t = interleaved(case.candidates, repeats=args.repeats, iters=args.iters, baseline=CANDIDATES[op][0])
    return _table(case.title, t, case.nbytes, case.errors)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=4608, help="tokens (default: Flux-dev at 1024x1024)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--ops", default=",".join(CASES))
    p.add_argument("--out", default=None)
    p.add_argument("--quick", action="store_true", help="2 repeats of 5 calls")
    args = p.parse_args(argv)
    try:
        ops = comma_list(args.ops, "--ops", "op", f"comma-separated ops of {', '.join(CASES)}")
    except ValueError as e:
        p.error(str(e))
    for name in ops:
        if name not in CASES:
            p.error(f"--ops: unknown op {name!r}; expected {', '.join(CASES)}")
    if args.quick:
        args.repeats, args.iters = 2, 5
    require_cuda("bench_fused_ops")
    info = describe()
    print(describe_line(info))
    results = {}
    for name in ops:
        results[name] = bench(name, args.batch, args.seq, args)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(dict(info=info, batch=args.batch, seq=args.seq, results=results), f, indent=2)
    return results


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
