"""One Ulysses exchange of Flux-dev on two GPUs, by the parts each transport spends it on: NCCL's
all-to-all against symmetric memory (torch.distributed._symmetric_memory: a local pack, a barrier
kernel, a copy-engine pull from the peer, copy kernels that write into or read from the peer's
memory, the copy engines pushing a strided head slice into it: cquant.ops.copy_rows), eagerly and
replayed from a CUDA graph of 40 calls; and whether the pushes can run beside cquant's attention.

    torchrun --nproc-per-node 2 benchmarks/bench_ulysses_exchange.py [--tokens 8448] [--out FILE.json]
    NCCL_PROTO=Simple torchrun --nproc-per-node 2 benchmarks/bench_ulysses_exchange.py   # NCCL settings

Sizes: a rank's 2304 tokens (1024x1024; --tokens 8448: 2048x2048) of 24 heads of 128 (bfloat16),
the heads going to the peer in one group (12 heads; at 2304 tokens 13.5 MB of all-to-all input,
half of it leaving the rank) or two (6 heads). Beside the attention: cquant.attention over both
ranks' tokens of the group's heads on the current stream, the push of q, k, v and the output
(four pushes) on a side stream, by copy kernels or by the copy engines.
Each row: us per call, the median of 5 repeats, the slowest rank. The copies are checked bit
for bit against an all_gather of the same data.
"""

import argparse
import json
import os
import statistics
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import graphed, time_calls  # noqa: E402

H, D = 24, 128
ITERS, REPEATS = 40, 5


def timed(fn, graph):
    """us per call of fn: ITERS calls (one CUDA graph of them with graph) between CUDA events, each
    repeat after a barrier of the ranks, the median of REPEATS."""
    run, calls = graphed([fn] * ITERS) if graph else (lambda: [fn() for _ in range(ITERS)], ITERS)
    runs = []
    for _ in range(REPEATS):
        torch.cuda.synchronize()
        dist.barrier()
        runs += time_calls(run, iters=1, calls_per_run=calls)
    return statistics.median(runs) * 1e3


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=2304, help="a rank's tokens (8448: Flux-dev at 2048x2048)")
    p.add_argument("--out", default=None, help="rank 0 writes the rows here (JSON)")
    args = p.parse_args()
    if "RANK" not in os.environ:
        raise SystemExit("run it through torchrun: torchrun --nproc-per-node 2 benchmarks/bench_ulysses_exchange.py")
    import torch.distributed._symmetric_memory as symm_mem

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != 2:
        raise SystemExit("two ranks: the pulls and pushes below pair each rank with the other")
    dev = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", device_id=dev)
    group = dist.group.WORLD
    if hasattr(symm_mem, "enable_symm_mem_for_group"):
        symm_mem.enable_symm_mem_for_group(group.group_name)
    import cquant
    from cquant import ops

    S = args.tokens
    rows, peer = {}, 1 - rank

    def add(name, us):
        t = torch.tensor([us], device=dev, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        rows[name] = round(float(t), 2)

    x = torch.randn(1, S, H, D, device=dev, dtype=torch.bfloat16)
    for heads in (H // 2, H // 4):
        mb = f"{S * heads * D * 2 * world / 2**20:.1f} MB"
        inp = torch.empty(world, S, heads, D, device=dev, dtype=torch.bfloat16)
        out = torch.empty_like(inp)
        w = symm_mem.empty(world * S * heads * D, dtype=torch.bfloat16, device=dev)
        hdl = symm_mem.rendezvous(w, group.group_name)
        mine = hdl.get_buffer(rank, (world, S, heads, D), torch.bfloat16, 0)
        theirs = hdl.get_buffer(peer, (world, S, heads, D), torch.bfloat16, 0)
        src = x[0, :, :heads]  # strided, as a head slice of q is
        dst_strided = torch.empty(S, H, D, device=dev, dtype=torch.bfloat16)[:, :heads]

        def exchange():
            mine[peer].copy_(src)
            hdl.barrier(channel=0)
            out[peer].copy_(theirs[rank])
            hdl.barrier(channel=1)

        def push():
            theirs[rank].copy_(src)
            hdl.barrier(channel=0)

        def engine_push():  # [tokens, heads D] rows: one 2D copy on the copy engines
            ops.copy_rows(src.flatten(1), theirs[rank].flatten(1))

        def push_engines():
            engine_push()
            hdl.barrier(channel=0)

        cases = {
            "nccl all_to_all_single": lambda: dist.all_to_all_single(out, inp),
            "pack (local strided copy)": lambda: mine[peer].copy_(src),
            "barrier": lambda: hdl.barrier(channel=0),
            "copy-engine pull (contiguous)": lambda: out[peer].copy_(theirs[rank]),
            "pack + barrier + pull + barrier": exchange,
            "copy kernel pulling into a strided view": lambda: dst_strided.copy_(theirs[rank]),
            "copy kernel pushing a strided slice + barrier": push,
            "copy engines pushing a strided slice + barrier": push_engines,
        }
        for name, fn in cases.items():
            for graph in (False, True):
                add(f"{name}, {mb}{', graph' if graph else ''}", timed(fn, graph))
        data = torch.randn(world, S, heads, D, device=dev, dtype=torch.bfloat16)
        mine.copy_(data)
        hdl.barrier(channel=0)
        got = theirs.clone()
        every = [torch.empty_like(data) for _ in range(world)]
        dist.all_gather(every, data)
        torch.cuda.synchronize()
        if not torch.equal(got, every[peer]):
            raise AssertionError(f"the pull of {heads} heads is not the peer's data")
        hdl.barrier(channel=1)  # the peer has read this rank's buffer before the next size reuses nothing
        engine_push()
        hdl.barrier(channel=0)
        got = mine[peer].clone()
        every = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(every, x)
        if not torch.equal(got, every[peer][0, :, :heads]):
            raise AssertionError(f"the copy engines' push of {heads} heads is not the peer's data")
        hdl.barrier(channel=1)
        q = torch.randn(1, world * S, heads, D, device=dev, dtype=torch.bfloat16)
        attn_out, side = torch.empty_like(q), torch.cuda.Stream(dev)

        def attention():
            cquant.attention(q, q, q, out=attn_out)

        def beside(copy):
            def fn():
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(4):  # q, k, v and the output
                        copy()
                attention()
                torch.cuda.current_stream().wait_stream(side)
            return fn

        for name, fn in (("attention", attention),
                         ("attention + 4 copy-kernel pushes on a side stream", beside(lambda: theirs[rank].copy_(src))),
                         ("attention + 4 copy-engine pushes on a side stream", beside(engine_push))):
            add(f"{name}, {heads} heads, graph", timed(fn, True))
        hdl.barrier(channel=0)
    if rank == 0:
        env = {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}
        info = dict(torch=torch.__version__, nccl=".".join(map(str, torch.cuda.nccl.version())),
                    device=torch.cuda.get_device_name(dev), env=env)
        width = max(map(len, rows))
        for name, us in rows.items():
            print(f"  {name:<{width}}  {us:8.2f} us")
        if args.out:
            with open(args.out, "w") as f:
                json.dump(dict(info=info, us=rows), f, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
