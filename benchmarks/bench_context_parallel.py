"""Context or batch parallelism of one denoising step (Flux by default, or another --model of
model_configs.json, CogVideoX's video step among them): the model on N GPUs through diffusers'
enable_parallelism (--parallel ulysses / ring) or cquant.enable_batch_parallel (--parallel batch),
against the same model on one GPU of the same machine, in the same run.

One process per GPU, through torchrun:

    torchrun --nproc-per-node 2 benchmarks/bench_context_parallel.py --variants bf16,fp8dqrow@cquant+optimize
    torchrun --nproc-per-node 4 benchmarks/bench_context_parallel.py --height 2048 --width 2048 --parallel ring
    torchrun --nproc-per-node 2 benchmarks/bench_context_parallel.py --parallel batch    # CFG parallel, batch 2
    torchrun --nproc-per-node 2 benchmarks/bench_context_parallel.py --variants fp8dqrow@cquant+graph \
        --ulysses diffusers,auto
    torchrun --nproc-per-node 2 benchmarks/bench_context_parallel.py --model cogvideox-5b --parallel batch

--height, --width, --text-tokens (and --frames for video) default to the model's usual step
(cquant.bench.models.DEFAULT_INPUTS: Flux 1024x1024 with 512 text tokens, CogVideoX 49 frames of
720x480 with 226). Ulysses and ring need diffusers' context-parallel plan of the model's class
(_cp_plan: Flux and Qwen-Image have one, CogVideoX, SD3 and PixArt not in diffusers 0.42.1); the
others run --parallel batch only.

--parallel batch times the step at batch 2 (default --batch there), as a pipeline with
classifier-free guidance runs it (the unconditional and conditional branches in one batch): each
rank runs its rows of the batch (one branch on 2 GPUs) and gathers the whole output. A batch that
does not split evenly over the ranks runs whole on each (no speed-up; the script says so).

A smoke run of the plumbing on the CPU (gloo; the script starts its --world processes itself):

    python benchmarks/bench_context_parallel.py --device cpu --world 2 --override num_layers=1 \\
        num_single_layers=1 --height 64 --width 64 --text-tokens 8 --repeats 1 --iters 1 --warmup 0
    python benchmarks/bench_context_parallel.py --device cpu --world 2 --model cogvideox-5b --parallel batch \\
        --override num_layers=1 num_attention_heads=2 attention_head_dim=32 text_embed_dim=64 \\
        time_embed_dim=32 --height 64 --width 64 --frames 9 --text-tokens 8 --repeats 1 --iters 1 --warmup 0

Random weights with the published architecture (python/cquant/data/model_configs.json), the same
on every rank. Variants are bench_flux_step's: NAME[@ATTENTION][+optimize|+graph] (bf16 for the
model left in bfloat16; +graph: cquant.optimize with CUDA graphs, on one device and under the
parallelism alike, whose graphs then hold the step's collectives; the row says how many graphs
each captured and any reason it ran eagerly). Under Ulysses, --ulysses times several exchanges of
cquant's attention backends on the same model (CQUANT_ULYSSES: auto, diffusers, cquant, cquant:G
in G head groups; /p2p or /nccl: the transport of cquant's exchange), a row each. For each variant:

  single ms     rank 0's step alone on its device while the other ranks wait (a second copy of the
                model, without the parallelism: rank 0 holds the model twice): the median over
                --repeats of the mean of --iters steps (wall time after a synchronize)
  parallel ms   the step after model.enable_parallelism(ContextParallelConfig(<--parallel>_degree=N))
                (--parallel batch: cquant.enable_batch_parallel(model)) on every rank, each repeat
                between barriers, the slowest rank's time; each repeat right after a repeat of the
                one-device step, so that both sides of a ratio see the machine alike
  speedup       the median over the repeats of single ms / parallel ms, with their range
  SQNR dB       of rank 0's parallel output (gathered on every rank) against its single-device output
  host ms       the time the host takes to issue one step (until the model returns, before the
                device finishes), alone and parallel: a step whose host ms reaches its step time
                is host-bound, and more GPUs do not make it faster
  split         CUDA only (--no-profile skips it): rank 0's GPU time in one parallel step by kernel,
                gemm / attention / communication (NCCL; its kernels also wait for the peers) /
                other, beside the step's wall time and the time some kernel ran (busy; wall - busy
                is the device idle, waiting on the host); --trace writes that step's profiler
                trace of every rank (chrome://tracing, Perfetto)
  census        on any device (--no-census skips it): rank 0's host-side ops (the profiler's leaf
                events) in one step alone and in one parallel step, and the parallel step's
                collectives (calls, and the MB of their inputs: for an all-to-all what the rank
                holds, of which (N - 1) / N leaves it); what the parallel step adds to the host's
                work stays whatever the GPU count, so a step it makes host-bound stops scaling
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
import traceback
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cquant.bench import models  # noqa: E402
from cquant.bench.models import enable_parallelism  # noqa: E402
from cquant.demo import comma_list  # noqa: E402
from cquant.metrics import sqnr_db  # noqa: E402

import bench_flux_step as fs  # noqa: E402
from _timing import describe, text_table  # noqa: E402

PARALLELISMS = ("ulysses", "ring", "batch")
DEFAULT_VARIANTS = ("bf16", "fp8dqrow@cquant+optimize")
# Kernel name -> bucket (first match wins): NCCL's kernels first, then bench_flux_step's buckets.
KERNEL_BUCKETS = (("communication", re.compile(r"nccl|all_?to_?all|all_?gather|reduce_?scatter|sendrecv", re.I)),
                  *fs.KERNEL_BUCKETS)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="flux-dev",
                   help=f"an entry of model_configs.json: {', '.join(models.MODEL_NAMES)} (default: %(default)s)")
    p.add_argument("--override", nargs="*", default=[], metavar="KEY=JSON", help="change config entries (smoke runs)")
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                   help="comma-separated NAME[@ATTENTION][+optimize|+graph] (bench_flux_step's syntax; default: "
                   "%(default)s)")
    p.add_argument("--parallel", default="ulysses", choices=PARALLELISMS,
                   help="ulysses / ring: diffusers' context parallelism; batch: cquant.enable_batch_parallel")
    p.add_argument("--height", type=int, default=None, help="pixels (default: the model's usual size)")
    p.add_argument("--width", type=int, default=None, help="pixels (default: the model's usual size)")
    p.add_argument("--frames", type=int, default=None, help="video models: frames (default: the model's usual count)")
    p.add_argument("--text-tokens", type=int, default=None, help="default: the model's usual count")
    p.add_argument("--batch", type=int, default=None, help="default: 2 with --parallel batch (a CFG batch), else 1")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--init-std", type=float, default=0.02)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cuda: one GPU per torchrun process; cpu: gloo processes this script starts (--world)")
    p.add_argument("--world", type=int, default=2, help="--device cpu: processes to start (default: %(default)s)")
    p.add_argument("--ulysses", default="auto",
                   help="--parallel ulysses: comma-separated exchanges of cquant's attention backends to time on the "
                        "same model (CQUANT_ULYSSES): 'auto' (cquant's under CUDA graphs, else diffusers' template), "
                        "'diffusers', 'cquant', 'cquant:G' (in G head groups, CQUANT_ULYSSES_CHUNKS=G); a suffix "
                        "/p2p or /nccl picks the transport of cquant's exchange (CQUANT_ULYSSES_TRANSPORT; default "
                        "auto), then +int8 its 8-bit wire (CQUANT_ULYSSES_WIRE=int8) (default: %(default)s)")
    p.add_argument("--no-profile", action="store_true", help="skip the parallel step's kernel split")
    p.add_argument("--no-census", action="store_true", help="skip the host-op and collective census")
    p.add_argument("--trace", default=None, metavar="DIR",
                   help="every rank writes its profiled parallel step of each variant here (chrome trace JSON)")
    p.add_argument("--out", default=None, help="rank 0 writes every number here (JSON)")
    args = p.parse_args(argv)
    _model_args(p, args)
    try:
        names = comma_list(args.variants, "--variants", "variant", "comma-separated NAME[@ATTENTION][+optimize|+graph]")
    except ValueError as e:
        p.error(str(e))
    args.variants = {v: fs.parse_variant(v) for v in names}
    for name, v in args.variants.items():
        if v["compile"]:
            p.error(f"--variants {name}: +compile is not measured here")
        if v["graph"] and args.device != "cuda":
            p.error(f"--variants {name}: +graph needs --device cuda")
    try:
        args.ulysses = comma_list(args.ulysses, "--ulysses", "exchange",
                                  "auto, diffusers, cquant, cquant:G[/p2p|/nccl][+int8]")
    except ValueError as e:
        p.error(str(e))
    if not all(re.fullmatch(r"diffusers|(auto|cquant(:[1-9]\d*)?)(/p2p|/nccl)?(\+int8)?", u) for u in args.ulysses):
        p.error(f"--ulysses {','.join(args.ulysses)}: expected auto, diffusers, cquant or cquant:G (G >= 1 head "
                "groups), the last three with an optional /p2p or /nccl, then an optional +int8")
    if args.ulysses != ["auto"] and args.parallel != "ulysses":
        p.error("--ulysses needs --parallel ulysses")
    if args.world < 2:
        p.error("--world must be at least 2")
    if args.batch is None:
        args.batch = 2 if args.parallel == "batch" else 1
    if args.batch < 1:
        p.error("--batch must be at least 1")
    return args


def _model_args(p, args):
    """Checks --model, --override and the parallelism against the model's class; fills args.config,
    args.model_class and the defaults of --height, --width, --frames and --text-tokens."""
    try:
        info = models.model_info(args.model)
        args.config = models.load_config(args.model, args.override)
    except ValueError as e:
        p.error(f"--model / --override: {e}")
    args.model_class = info["class"]
    defaults = info["inputs"]
    if args.frames is not None and "frames" not in defaults:
        p.error(f"--frames: {args.model} is an image model")
    for key in ("height", "width", "frames", "text_tokens"):
        if getattr(args, key) is None:
            setattr(args, key, defaults.get(key))
    if args.height % 16 or args.width % 16:
        p.error("--height and --width must be multiples of 16")
    if args.frames is not None and args.frames < 1:
        p.error("--frames must be at least 1")
    if args.parallel != "batch" and not _has_cp_plan(args.model_class):
        import diffusers

        p.error(f"--parallel {args.parallel}: diffusers {diffusers.__version__} has no context-parallel plan "
                f"(_cp_plan) for {args.model_class} ({args.model}); --parallel batch works for it")


def _has_cp_plan(cls):
    """Whether diffusers splits the sequence of `cls` under enable_parallelism (its _cp_plan); True
    without diffusers, which the run then asks for anyway."""
    try:
        import diffusers
    except ImportError:
        return True
    return getattr(getattr(diffusers, cls, None), "_cp_plan", None) is not None


def make_inputs(model, args, device):
    """The step's kwargs at --height / --width (/ --frames), --text-tokens and --batch."""
    return models.make_inputs(args.model, model, batch=args.batch, dtype=torch.bfloat16, device=device,
                              seed=args.seed + 1, height=args.height, width=args.width, frames=args.frames,
                              text_tokens=args.text_tokens)


def latent_tokens(config, inputs):
    """(tokens the transformer attends over besides the text, latent frames or None): a packed
    sequence ([B, seq, C]: Flux, Qwen-Image) as it is, a latent grid ([B, C, H, W], or video
    [B, F, C, H, W]) in patch_size (x patch_size_t) patches."""
    x = inputs["hidden_states"]
    if x.dim() == 3:
        return x.shape[1], None
    p = config["patch_size"]
    tokens = (x.shape[-2] // p) * (x.shape[-1] // p)
    if x.dim() == 4:
        return tokens, None
    p_t = config.get("patch_size_t") or 1  # CogVideoX 1.5 pads the frames to whole temporal patches
    return tokens * -(-x.shape[1] // p_t), x.shape[1]


# ---------------------------------------------------------------- processes


def _init(args, rank, world, init_file):
    """This rank's device, with its process group: NCCL on torchrun's GPU, or gloo on the CPU."""
    if args.device == "cpu":
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        return torch.device("cpu")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    return device


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _enable_parallelism(model, args, world):
    """--parallel batch: cquant.enable_batch_parallel over the world. Else model.enable_parallelism
    over every rank (cquant.bench.models.enable_parallelism: on a machine without an accelerator too)."""
    if args.parallel == "batch":
        import cquant

        cquant.enable_batch_parallel(model)
        return
    from diffusers import ContextParallelConfig

    enable_parallelism(model, ContextParallelConfig(**{f"{args.parallel}_degree": world}))


# ---------------------------------------------------------------- measurements


def _ms_per_step(model, inputs, iters, device):
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        fs.step(model, inputs)
    _sync(device)
    return (time.perf_counter() - t0) * 1e3 / iters


def _host_ms(model, inputs, device):
    """ms until one step returns on the host, the device idle at its start."""
    _sync(device)
    t0 = time.perf_counter()
    fs.step(model, inputs)
    ms = (time.perf_counter() - t0) * 1e3
    _sync(device)
    return ms


def _single(model, inputs, args, device, rank):
    """(host ms, output) of rank 0's step alone after its warm-up; None on the other ranks, which wait."""
    host = out = None
    if rank == 0:
        for _ in range(args.warmup):
            fs.step(model, inputs)
        host = _host_ms(model, inputs, device)
        out = fs.step(model, inputs).float().cpu()
    dist.barrier()
    return host, out


def _interleaved(single_model, model, inputs, args, device, rank):
    """(one-device ms, parallel ms, speedups): --repeats rounds of rank 0's steps alone on its device
    (the other ranks wait), then every rank's parallel steps between barriers (the slowest rank's
    time), each the mean of --iters steps; the speedup of each round, so that a drift of the machine
    reaches both sides of a ratio alike."""
    for _ in range(args.warmup):
        fs.step(model, inputs)
    singles, parallels = [], []
    for _ in range(args.repeats):
        if rank == 0:
            singles.append(_ms_per_step(single_model, inputs, args.iters, device))
        _sync(device)
        dist.barrier()
        t = torch.tensor([_ms_per_step(model, inputs, args.iters, device)], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        parallels.append(float(t))
    dist.barrier()
    return singles, parallels, [a / b for a, b in zip(singles, parallels)]


def _parallel_output(model, inputs, device):
    """(host ms, output) of the parallel step on this rank."""
    host = _host_ms(model, inputs, device)
    return host, fs.step(model, inputs).float().cpu()


def _busy_ms(intervals):
    """ms covered by the union of (start, end) intervals in microseconds (kernels of several streams
    overlap: their sum can pass the time the device was busy)."""
    busy, end = 0.0, None
    for a, b in sorted(intervals):
        if end is None or a > end:
            busy, end = busy + (b - a), b
        elif b > end:
            busy, end = busy + (b - end), b
    return busy / 1e3


def _kernel_split(model, inputs, device, trace=None):
    """{bucket: ms} of one parallel step's GPU kernels on this rank, with the step's wall ms and the
    ms some kernel ran (busy); with trace, that step's profiler trace is written there."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    _sync(device)
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        fs.step(model, inputs)
        _sync(device)
        wall = (time.perf_counter() - t0) * 1e3
    split = {b: 0.0 for b, _ in KERNEL_BUCKETS}
    split["other"] = 0.0
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", 0.0) if getattr(e, "device_type", None) == DeviceType.CUDA else 0.0
        if us:
            bucket = next((b for b, rx in KERNEL_BUCKETS if rx.search(e.key)), "other")
            split[bucket] += us / 1e3
    split = {k: round(v, 3) for k, v in split.items()}
    split["wall"] = round(wall, 3)
    spans = [(e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == DeviceType.CUDA]
    split["busy"] = round(_busy_ms(spans), 3)
    if trace:
        prof.export_chrome_trace(trace)
    return split


# A collective as the model calls it: diffusers' functional collectives, or torch.distributed's
# (their own inner c10d / backend events are not counted again).
COLLECTIVE = re.compile(r"^(_c10d_functional|c10d)::(?!wait)")
_DTYPE_BYTES = {"c10::BFloat16": 2, "c10::Half": 2, "float": 4, "double": 8, "c10::Float8_e4m3fn": 1,
                "signed char": 1, "unsigned char": 1, "int": 4, "long int": 8}


def _census(model, inputs, device):
    """(host ops, {collective: [calls, MB of inputs]}) of one step on this rank; MB is None where
    the profiler gives no dtype."""
    from torch.profiler import ProfilerActivity, profile

    _sync(device)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fs.step(model, inputs)
        _sync(device)
    events = prof.events()
    leaves = sum(1 for e in events if not e.cpu_children)
    colls = {}
    for e in events:
        if not COLLECTIVE.match(e.name):
            continue
        parent, nested = e.cpu_parent, False
        while parent is not None and not nested:
            nested, parent = bool(COLLECTIVE.match(parent.name)), parent.cpu_parent
        if nested:
            continue
        shapes, dtypes = e.input_shapes or [[]], getattr(e, "input_dtypes", None) or [None]
        size = _DTYPE_BYTES.get(dtypes[0]) if dtypes else None
        numel = 1
        for n in shapes[0] if shapes and shapes[0] else [0]:
            numel *= n
        entry = colls.setdefault(e.name.split("::", 1)[1], [0, 0.0])
        entry[0] += 1
        entry[1] = None if entry[1] is None or size is None else entry[1] + numel * size / 2**20
    return leaves, {k: [c, None if mb is None else round(mb, 3)] for k, (c, mb) in colls.items()}


def _graphs(model):
    """CUDA graphs the model's cquant.optimize(cuda_graph=True) forward holds (None without one)."""
    from cquant import cuda_graph

    f = cuda_graph.find(model)
    return None if f is None else f.num_graphs


def run_variant(name, v, master, args, device, rank, world):
    extra = dict(scheme=v["scheme"], attention=v["attention"], optimize=v["optimize"], quantize_peak_gb=None)
    model = fs.build_variant(master, v, device, extra, 0)  # nothing Flux-specific in it
    # rank 0's one-device model: a second copy, so that its steps interleave with the parallel ones
    single_model = fs.build_variant(master, v, device, dict(extra), 0) if rank == 0 else None
    inputs = make_inputs(model, args, device)
    with warnings.catch_warnings(record=True) as caught:  # why a graph ran eagerly, if it did
        warnings.simplefilter("always")
        rows = _measure_variant(name, v, single_model, model, inputs, args, device, rank, world)
    if v["graph"]:
        for row in rows:
            row["graph_warnings"] = sorted({str(w.message) for w in caught if "CUDA graphs" in str(w.message)})
    return rows


def _measure_variant(name, v, single_model, model, inputs, args, device, rank, world):
    """The rows of one variant: the parallel step with each --ulysses exchange, each interleaved with
    the one-device step."""
    from cquant import cuda_graph, peer_memory, ulysses, ulysses_wire

    single_host, single_out = _single(single_model, inputs, args, device, rank)
    single_ops = None
    if not args.no_census:
        if rank == 0:
            single_ops = _census(single_model, inputs, device)[0]
        dist.barrier()
    _enable_parallelism(model, args, world)
    single = dict(single_model=single_model, single_host_ms=single_host, single_out=single_out,
                  single_ops=single_ops)
    rows = []
    for exchange in args.ulysses:
        route, _, wire = exchange.partition("+")
        choice, _, transport = route.partition("/")
        kind, _, groups = choice.partition(":")
        os.environ[ulysses.SETTING] = kind
        if wire:
            os.environ[ulysses_wire.SETTING] = wire
        if groups:
            os.environ[ulysses.CHUNKS_SETTING] = groups
        if transport:
            os.environ[peer_memory.TRANSPORT_SETTING] = transport
        graphs = cuda_graph.find(model)
        if graphs is not None:  # a graph replays the exchange it captured
            graphs.reset()
        try:
            rows.append(_measure_parallel(name, v, model, inputs, args, device, rank, world, single, exchange))
        finally:
            del os.environ[ulysses.SETTING]
            os.environ.pop(ulysses.CHUNKS_SETTING, None)
            os.environ.pop(peer_memory.TRANSPORT_SETTING, None)
            os.environ.pop(ulysses_wire.SETTING, None)
    return rows


def _measure_parallel(name, v, model, inputs, args, device, rank, world, single, exchange):
    from cquant import ulysses_wire

    before = dict(ulysses_wire.calls)
    singles, parallels, speedups = _interleaved(single["single_model"], model, inputs, args, device, rank)
    parallel_host, parallel_out = _parallel_output(model, inputs, device)
    row = dict(variant=name, parallel=args.parallel, world=world, ulysses=exchange,
               parallel_ms=statistics.median(parallels), parallel_ms_repeats=parallels,
               single_host_ms=single["single_host_ms"], parallel_host_ms=parallel_host,
               wire_calls={w: n - before[w] for w, n in ulysses_wire.calls.items()})
    if v["graph"]:  # the parallel step's signature (its split inputs) is a capture of its own
        row["graphs"] = dict(single=_graphs(single["single_model"]) if rank == 0 else None, parallel=_graphs(model))
    if rank == 0:
        row.update(single_ms=statistics.median(singles), single_ms_repeats=singles,
                   speedup=statistics.median(speedups), speedup_range=[min(speedups), max(speedups)],
                   sqnr_db=sqnr_db(single["single_out"], parallel_out))
    if not args.no_census:
        ops, colls = _census(model, inputs, device)  # every rank: the collectives need them all
        row["census"] = dict(single_host_ops=single["single_ops"], parallel_host_ops=ops, collectives=colls)
    if device.type == "cuda" and not args.no_profile:
        trace = None
        if args.trace:
            os.makedirs(args.trace, exist_ok=True)
            trace = os.path.join(args.trace, re.sub(r"[^\w.-]+", "_", f"{name}_{args.parallel}{world}_{exchange}")
                                 + f"_rank{rank}.json")
        row["split_ms"] = _kernel_split(model, inputs, device, trace)
    return row


def worker(rank, world, args, init_file=None):
    warnings.simplefilter("ignore")
    import cquant
    import diffusers

    diffusers.utils.logging.set_verbosity_error()
    device = _init(args, rank, world, init_file)
    cquant.register_attention_backends()
    # the same seed: the same weights everywhere
    master = models.build_master(args.config, args.seed, args.init_std, device, cls=args.model_class)
    args.tokens, args.latent_frames = latent_tokens(args.config, make_inputs(master, args, "cpu"))
    rows = []
    if rank == 0 and args.parallel == "batch" and args.batch % world:
        print(f"  note: a batch of {args.batch} does not split over {world} ranks: each runs the whole batch "
              "(no speed-up)", flush=True)
    try:
        for name, v in args.variants.items():
            try:  # one variant failing must not lose the others' numbers
                new = run_variant(name, v, master, args, device, rank, world)
            except Exception as e:
                if rank == 0:
                    traceback.print_exc()
                new = [dict(variant=name, error=f"{type(e).__name__}: {e}")]
            rows += new
            for r in new:
                if rank == 0 and "error" not in r:
                    print(f"  {_label(r)}: one device {r['single_ms']:.1f} ms, {world} ({args.parallel}) "
                          f"{r['parallel_ms']:.1f} ms, {_speedup(r)}, SQNR {r['sqnr_db']:.1f} dB", flush=True)
            if rank == 0:
                write_json(rows, args, world)
            fs.free()
        if rank == 0:
            report(rows, args, world, device)
    finally:
        dist.destroy_process_group()
    return rows


def _label(row):
    """The variant, with the exchange of cquant's backends under Ulysses where it is not the default."""
    exchange = row.get("ulysses", "auto")
    return row["variant"] + ("" if exchange == "auto" else f" [{exchange} ulysses]")


def _speedup(row):
    lo, hi = row["speedup_range"]
    return f"{row['speedup']:.2f}x ({lo:.2f}-{hi:.2f})"


def report(rows, args, world, device):
    head = ("variant", "1 device ms", f"{world} x {args.parallel} ms", "speedup", "SQNR dB", "host ms 1 / N", "comm ms",
            "gemm ms", "attn ms", "other ms", "busy ms", "wall ms")
    lines = [head]
    for r in rows:
        if "error" in r:
            lines.append((_label(r), "FAILED: " + r["error"][:60], *[""] * (len(head) - 2)))
            continue
        s = r.get("split_ms", {})
        lines.append((_label(r), f"{r['single_ms']:.1f}", f"{r['parallel_ms']:.1f}", _speedup(r),
                      f"{r['sqnr_db']:.1f}", f"{r['single_host_ms']:.1f} / {r['parallel_host_ms']:.1f}",
                      *(f"{s[k]:.1f}" if k in s else "-" for k in
                        ("communication", "gemm", "attention", "other", "busy", "wall"))))
    size = f"{args.width}x{args.height}"
    if args.latent_frames is not None:
        size = f"{args.frames} frames of {size} ({args.latent_frames} latent)"
    print(f"\n{args.model}, one step at {size} ({args.tokens} + {args.text_tokens} tokens), batch "
          f"{args.batch}, {device.type}; SQNR of the parallel output against the one-device output")
    print(text_table(lines))
    for r in rows:
        c = r.get("census")
        if c:
            colls = ", ".join(f"{k} {n} x" + ("" if mb is None else f" ({mb:.1f} MB)") for k, (n, mb) in
                              sorted(c["collectives"].items()))
            print(f"  {_label(r)}: host ops a step {c['single_host_ops']} alone, {c['parallel_host_ops']} parallel; "
                  f"collectives: {colls or 'none'}")
        if "graphs" in r:
            print(f"  {_label(r)}: CUDA graphs after the one-device steps {r['graphs']['single']}, after the parallel "
                  f"ones {r['graphs']['parallel']}" + "".join(f"; {w}" for w in r["graph_warnings"]))
    write_json(rows, args, world)


def write_json(rows, args, world):
    """--out: the rows so far (written after each variant, so that a later one failing keeps them)."""
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        # image_tokens: the latent tokens, of all frames for video
        info = dict(describe(), model=args.model, model_class=args.model_class, override=args.override,
                    height=args.height, width=args.width, frames=args.frames, latent_frames=args.latent_frames,
                    image_tokens=args.tokens, text_tokens=args.text_tokens,
                    batch=args.batch, world=world, parallel=args.parallel, warmup=args.warmup, repeats=args.repeats,
                    iters=args.iters)
        with open(args.out, "w") as f:
            json.dump(dict(info=info, results=rows), f, indent=2)


def main(argv=None):
    args = parse_args(argv)
    if args.device == "cuda":
        if "RANK" not in os.environ:
            raise SystemExit("run it through torchrun, one process per GPU: torchrun --nproc-per-node 2 "
                             "benchmarks/bench_context_parallel.py ...")
        rows = worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)
    else:
        import torch.multiprocessing as mp

        with tempfile.TemporaryDirectory() as d:
            args.out = args.out or os.path.join(d, "results.json")  # rank 0's rows come back through it
            mp.spawn(worker, args=(args.world, args, os.path.join(d, "init")), nprocs=args.world, join=True)
            with open(args.out) as f:
                rows = json.load(f)["results"]
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
