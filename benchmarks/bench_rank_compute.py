"""What one rank of an N-GPU Ulysses step computes, timed on one GPU: the floor that the exchange
adds to, for world sizes no machine at hand has.

Under diffusers' Ulysses context parallelism on N ranks (bench_context_parallel.py) each rank runs
every GEMM, norm and RoPE of the model on S / N tokens, and the attention on all S tokens of
H / N heads. This script runs exactly that work on one GPU: the model (Flux by default) takes
the inputs of one rank (--width / N image columns, --text-tokens / N text tokens), and cquant's
attention backend, given a call's [B, S / N, H, D] query, key and value, runs cquant's kernel on
random [B, S, H / N, D] tensors instead (made once a shape) and hands its output back as
[B, S / N, H, D] (the same element count): the timing holds, the step's output means nothing. What it leaves out is the exchange itself (copies, barriers, NCCL) and
the split of the heads in groups (ulysses._p2p_groups), so

    one GPU ms / rank ms      the most an N-GPU step can gain over one GPU with these kernels
    rank ms - one GPU ms / N  what running 1 / N of the work costs beyond 1 / N of the time (GEMMs
                              over fewer rows, attention over fewer heads, per-call latencies)

Every --world is timed interleaved with the whole step on the same GPU (benchmarks/_timing.py:
--repeats repeats of --iters steps, the median of the per-repeat medians, the ratio per repeat),
followed by the split of one step's kernels (GEMM / attention / other).

    python benchmarks/bench_rank_compute.py --worlds 2,4 --variant fp8dqrow@cquant+graph
    python benchmarks/bench_rank_compute.py --worlds 2,4 --height 2048 --width 2048
    python benchmarks/bench_rank_compute.py --device cpu --override num_layers=1 num_single_layers=1 \\
        --height 64 --width 64 --text-tokens 8 --repeats 1 --iters 1 --warmup 0    # a smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_flux_step as fs  # noqa: E402
from _timing import describe, interleaved, time_calls, wall_time_calls  # noqa: E402
from cquant.bench import models  # noqa: E402
from cquant.demo import text_table  # noqa: E402


class RankAttention:
    """cquant's attention op with the Ulysses shapes of one rank of `world` (1: the op itself)."""

    def __init__(self, op):
        self.op, self.world, self._inputs = op, 1, {}
        self.shapes = set()  # (world, the query shape the kernel ran on)

    def __call__(self, query, key, value, *args):
        n = self.world
        if n == 1:
            self.shapes.add((1, tuple(query.shape)))
            return self.op(query, key, value, *args)
        b, s, h, d = query.shape
        if h % n:
            raise ValueError(f"--world {n} does not divide the model's {h} heads")
        # random q, k, v the size a rank attends over, made once a shape (CUDA graphs read them)
        key_ = (n, tuple(query.shape), tuple(key.shape), query.dtype, query.device)
        if key_ not in self._inputs:
            g = torch.Generator(device=query.device).manual_seed(len(self._inputs))
            self._inputs[key_] = [torch.randn(b, t * n, h // n, d, generator=g, dtype=query.dtype, device=query.device)
                                  for t in (s, key.shape[1], key.shape[1])]
        self.shapes.add((n, tuple(self._inputs[key_][0].shape)))
        out, lse = self.op(*self._inputs[key_], *args)
        return out.view(b, s, h, d), lse


@contextlib.contextmanager
def rank_attention(attention_backend):
    """Within: cquant's attention backends rebuilt around a RankAttention (yielded); on leaving the
    process has its own backends back."""
    dispatch = attention_backend._dispatch_module()
    registry, names = dispatch._AttentionBackendRegistry, dispatch.AttentionBackendName
    rank_op = RankAttention(attention_backend.register_torch_op())
    native = registry._backends[names.NATIVE]
    templated = attention_backend._templated_context_parallel(dispatch)
    members = [names(value) for value in attention_backend.BACKENDS]
    saved = {m: registry._backends[m] for m in members}
    original = attention_backend.register_torch_op
    attention_backend.register_torch_op = lambda: rank_op
    try:
        for member, (_, mode) in zip(members, attention_backend.BACKENDS.values()):
            registry._backends[member] = attention_backend._make_backend(mode, native, templated)
    finally:
        attention_backend.register_torch_op = original
    try:
        yield rank_op
    finally:
        registry._backends.update(saved)


def rank_inputs(model, args, device, world):
    """One rank's share of the step's inputs: width / world image columns, text_tokens / world."""
    return models.make_inputs(args.model, model, batch=args.batch, dtype=torch.bfloat16, device=device,
                              seed=args.seed + 1, height=args.height, width=args.width // world,
                              text_tokens=args.text_tokens // world)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="flux-dev")
    p.add_argument("--override", nargs="*", default=[], metavar="KEY=JSON")
    p.add_argument("--variant", default="fp8dqrow@cquant+graph",
                   help="bench_flux_step's NAME@ATTENTION[+optimize|+graph]; the attention must be cquant's")
    p.add_argument("--worlds", default="2,4", help="comma-separated rank counts to emulate")
    p.add_argument("--height", type=int, default=1024)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--text-tokens", type=int, default=512)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--init-std", type=float, default=models.INIT_STD)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--device", default="cuda")
    p.add_argument("--no-profile", action="store_true", help="skip the kernel split")
    p.add_argument("--out", help="write the rows as JSON here")
    args = p.parse_args(argv)
    args.v = fs.parse_variant(args.variant)
    if args.v["attention"] not in ("cquant", "cquant_int8"):
        p.error("--variant: the emulation runs cquant's attention (NAME@cquant or NAME@cquant_int8)")
    try:
        args.worlds = [int(w) for w in args.worlds.split(",")]
    except ValueError:
        p.error(f"--worlds {args.worlds!r}: expected comma-separated whole numbers")
    if args.height % 16:
        p.error("--height must be a multiple of 16")
    for w in args.worlds:
        if w < 2 or args.width % (16 * w) or args.text_tokens % w:
            p.error(f"--worlds: {w} must be >= 2 and divide --width / 16 ({args.width // 16}) and --text-tokens "
                    f"({args.text_tokens})")
    try:
        args.config = models.load_config(args.model, args.override)
    except ValueError as e:
        p.error(f"--model / --override: {e}")
    return args


def main(argv=None):
    args = parse_args(argv)
    warnings.simplefilter("ignore")
    import cquant
    import diffusers

    from cquant import attention_backend

    diffusers.utils.logging.set_verbosity_error()
    device = torch.device(args.device)
    cquant.register_attention_backends()
    with rank_attention(attention_backend) as rank_op:
        info = models.model_info(args.model)
        master = models.build_master(args.config, args.seed, args.init_std, device, cls=info["class"])
        model = fs.build_variant(master, args.v, device, {}, 0)
        del master
        inputs = {1: rank_inputs(model, args, device, 1)}
        inputs.update({w: rank_inputs(model, args, device, w) for w in args.worlds})

        def step_of(w):
            def run():
                rank_op.world = w  # read while a graph is captured, not at its replays
                return fs.step(model, inputs[w])
            return run

        timer = time_calls if device.type == "cuda" else wall_time_calls
        result = interleaved({w: step_of(w) for w in inputs}, repeats=args.repeats, warmup=args.warmup,
                             iters=args.iters, baseline=1, timer=timer)
        rows = []
        for w, t in result.items():
            row = dict(world=w, ms=t.median, ms_spread=t.spread, one_gpu_over_rank=t.speedup,
                       one_gpu_over_rank_spread=t.speedup_spread)
            if device.type == "cuda" and not args.no_profile:
                rank_op.world = w
                row["split_ms"], row["top_kernels"] = fs.kernel_split(model, inputs[w])
            rows.append(row)
    one = rows[0]["ms"]
    table = [["world", "rank ms (spread)", "one GPU / rank", "beyond 1/N ms", "GEMM / attention / other ms"]]
    for r in rows:
        split = r.get("split_ms")
        table.append([str(r["world"]), f"{r['ms']:.1f} ({r['ms_spread'][0]:.1f}-{r['ms_spread'][1]:.1f})",
                      f"{r['one_gpu_over_rank']:.2f}x ({r['one_gpu_over_rank_spread'][0]:.2f}-"
                      f"{r['one_gpu_over_rank_spread'][1]:.2f})", f"{r['ms'] - one / r['world']:.1f}",
                      " / ".join(f"{split[k]:.1f}" for k in ("gemm", "attention", "other")) if split else "-"])
    print(f"{args.model} {args.height}x{args.width}, {args.text_tokens} text tokens, batch {args.batch}, "
          f"{args.variant}: one rank of a Ulysses step on one GPU")
    print(text_table(table))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(args={k: v for k, v in vars(args).items() if k not in ("config", "v")},
                           machine=describe() if device.type == "cuda" else None, rows=rows), f, indent=1)
    return rows, rank_op


if __name__ == "__main__":
    main()
