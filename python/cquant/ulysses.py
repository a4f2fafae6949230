"""Ulysses attention for cquant's backends: fewer copies than diffusers' template, and the
exchange through symmetric memory where the GPUs can map each other's memory (CQUANT_ULYSSES,
CQUANT_ULYSSES_TRANSPORT, below).

Under diffusers' Ulysses context parallelism (ContextParallelConfig(ulysses_degree=N), ring
degree 1) each rank holds S / N tokens of all H heads, and attention needs all S tokens of
H / N heads: q, k and v go through one all-to-all each, the output through one more. diffusers'
template makes each tensor contiguous before and after its exchange and waits for each exchange
before the next. cquant's kernels read q, k and v with any strides, so what a rank receives,
[N, S / N, B, heads, D] (source rank, its tokens), is read in place as [B, S, heads, D] (the
source ranks' token blocks are consecutive). Two transports carry it:

- p2p (peer_memory: torch's symmetric memory, GPUs of one host over NVLink or PCIe peer access):
  the copy engines (ops.copy_rows, no SMs taken) push the heads a peer runs straight into the
  peer's workspace, the attention reads them there, each rank pushes the peers' tokens of its
  output into their workspaces, and one copy kernel moves what arrived into the result; a
  barrier a head group and one for the outputs, no NCCL. Under a CUDA graph, where the call
  gives each group enough work (_p2p_groups), the heads run in three groups: the later groups'
  inputs and the earlier groups' outputs travel beside an attention; inside a graph the copies
  within one GPU run as a copy kernel. On two H200s a graphed Flux-dev step takes 56.2-57.1 ms at
  1024x1024 (61.4 ms with NCCL; 1.58-1.59x of one GPU) and 280.7-284.5 ms at 2048x2048 (309.4 ms
  with NCCL; 1.90-1.91x), an eager 1024 step 116-158 ms against the template's 173 ms
  (benchmarks/results/context_parallel_h200x2.md).
- nccl: all-to-alls (torch's functional collectives), the rank's H / N heads in
  CQUANT_ULYSSES_CHUNKS groups (2 by default, 1 where H / N does not split evenly): every input
  exchange is issued first, so that each group's attention runs while the next group's inputs
  and the last group's output travel. At batch 1 the output already is the send buffer of its
  exchange. It also carries the calls that ask for the log-sum-exp.

A fused block's work that does not need the attention (Flux's single-stream MLP GEMM) runs
while either transport moves q, k and v (beside_exchange): the copy engines and NCCL's kernels
leave the GEMM nearly every SM.

CQUANT_ULYSSES_WIRE=int8 (ulysses_wire) sends q, k, v and the output of eager calls through the
NCCL all-to-alls as int8 codes with a scale a (token, head) row, about half the bytes, where the
8-bit attention's accuracy bound holds for the call (else it crosses in full precision); for
links slower than the GPUs' memory. Captured calls, and those asking for the lse, keep their
full-precision exchange.

The math is the one-process call's (each rank runs whole sequences of its heads, every head on
its own), so outputs are those of diffusers' template to the bit (the 8-bit wire aside); but
for the 8-bit CUDA kernel in several head groups, which splits the keys of its last wave's query
blocks by the call's heads (cquant.h): those rows' folds run in another order, an output ulp
apart at most (plus the folds' fp32 round-off where an output nearly cancels).

CQUANT_ULYSSES selects the exchange: "auto" (unset: cquant's where its transport is p2p, and with
NCCL only where a CUDA graph is captured (or warmed up for a capture), whose replay costs the host
nothing: an eager step is host-bound, and NCCL's head groups add host work; diffusers' template
elsewhere; eager NCCL calls too under CQUANT_ULYSSES_WIRE=int8), "cquant" (always) or
"diffusers" (never). CQUANT_ULYSSES_TRANSPORT (peer_memory.transport) picks the transport:
"auto" (p2p where the group's GPUs can map each other's memory, else NCCL), "p2p" or "nccl".
Calls it does not take (ring attention, ulysses_anything, heads not divisible by N, inputs that
require grad) run diffusers' template either way.
"""

import contextlib
import os
import threading

from . import peer_memory, ulysses_wire

SETTING = "CQUANT_ULYSSES"
CHOICES = ("auto", "cquant", "diffusers")
CHUNKS_SETTING = "CQUANT_ULYSSES_CHUNKS"
DEFAULT_CHUNKS = 2
# Head groups of the p2p exchange where CQUANT_ULYSSES_CHUNKS is unset: under a CUDA graph three,
# the first and the last as small as keeps P2P_EDGE_ROWS_PER_SM query rows (times heads) for every
# SM (the first group's inputs and the last group's output travel beside no attention), the middle
# one the rest; eagerly one group (an eager step is host-bound, and each group adds host work).
P2P_EDGE_ROWS_PER_SM = 256


def setting():
    """CQUANT_ULYSSES, read at each call (so it can change between calls)."""
    value = os.environ.get(SETTING, "auto").strip().lower() or "auto"
    if value not in CHOICES:
        raise ValueError(f"{SETTING}={os.environ[SETTING]!r}; expected one of {', '.join(CHOICES)}")
    return value


def _graphed(torch):
    """Whether this call is captured into a CUDA graph, or is the eager warm-up of a capture."""
    from . import cuda_graph

    return torch.cuda.is_current_stream_capturing() or cuda_graph.warming_up()


def selected(torch):
    """Whether CQUANT_ULYSSES may give this call to cquant's exchange (under "auto", attention() may
    still hand it back, where only NCCL could carry it eagerly)."""
    value = setting()
    if value == "auto":
        return torch.cuda.is_available() and (peer_memory.transport() != "nccl" or _graphed(torch)
                                              or ulysses_wire.setting() == "int8")
    return value == "cquant"


def chunks(default=DEFAULT_CHUNKS):
    """Head groups a rank's attention runs in (CQUANT_ULYSSES_CHUNKS; unset: `default`)."""
    value = os.environ.get(CHUNKS_SETTING, "").strip()
    if not value:
        return default
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{CHUNKS_SETTING}={os.environ[CHUNKS_SETTING]!r}; expected a whole number >= 1")
    return int(value)


def group_of(torch, parallel_config, query, key):
    """(process group, N) where this exchange takes the call, else None."""
    cp = getattr(parallel_config, "context_parallel_config", None)
    if cp is None or (cp.ring_degree or 1) != 1 or getattr(cp, "ulysses_anything", False):
        return None
    degree, mesh = cp.ulysses_degree or 1, getattr(cp, "_ulysses_mesh", None)
    if degree < 2 or mesh is None or query.shape[2] % degree or key.shape[2] != query.shape[2]:
        return None
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key)):
        return None  # diffusers' template raises the backends' inference-only error
    return mesh.get_group(), degree


def _wait(funcol, t):
    return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t


_beside = threading.local()  # .work: what the next exchange runs while its inputs travel


@contextlib.contextmanager
def beside_exchange(work):
    """Within: cquant's next Ulysses exchange calls work() (on the current stream) once its inputs
    are on their way, so that work independent of the attention (a fused block's MLP GEMM) runs
    while they cross; where no exchange of cquant's takes it (no context parallelism, diffusers'
    template, ring attention), work() runs on leaving, after the attention. Either way once."""
    if work is None:
        yield
        return
    run_beside()  # work an earlier block left behind (none is expected) is owed first
    _beside.work = work
    try:
        yield
    except BaseException:
        _beside.work = None  # the block fails: its work is not wanted
        raise
    run_beside()


def run_beside():
    """The work beside_exchange left for this exchange, if any (then none is left)."""
    work, _beside.work = getattr(_beside, "work", None), None
    if work is not None:
        work()


def attention(shard, query, key, value, scale, return_lse, group, degree):
    """Ulysses attention of [B, S / N, H, D] query, key, value shards (the model's layout) through
    shard(q, k, v, scale, return_lse) on [B, S, heads, D]: out [B, S / N, H, D] and, with
    return_lse, lse [B, S / N, H] (the backends' layout). None where CQUANT_ULYSSES=auto hands an
    eager call that only NCCL could carry back to diffusers' template."""
    import torch

    eager = not (query.is_cuda and _graphed(torch))
    if ulysses_wire.setting() == "int8" and eager and ulysses_wire.takes(query, key, value, return_lse):
        out = ulysses_wire.attention(shard, query, key, value, scale, group, degree, chunks(), run_beside)
        if out is not None:
            return out  # else the bound failed: the exchange below, in full precision
    if not return_lse and value.shape == key.shape and key.shape[0] == query.shape[0] \
            and key.shape[3] == query.shape[3] and key.dtype == query.dtype == value.dtype:
        layout = _p2p_layout(query, key, degree)
        ws = peer_memory.workspace(torch, group, query.device, layout[-1])
        if ws is not None:
            return _p2p_attention(shard, query, key, value, scale, degree, ws, layout,
                                  _p2p_groups(torch, query, degree))
    if setting() == "auto" and eager:
        return None
    return _nccl_attention(shard, query, key, value, scale, return_lse, group, degree)


def _p2p_groups(torch, query, degree):
    """Heads of each group the p2p exchange runs this call's H / N heads in: CQUANT_ULYSSES_CHUNKS
    equal groups (one where they do not divide the heads), else the default above."""
    b, s, h, _ = query.shape
    hl = h // degree
    if os.environ.get(CHUNKS_SETTING, "").strip():
        n = chunks()
        return (hl // n,) * n if hl % n == 0 else (hl,)
    if not _graphed(torch):
        return (hl,)
    rows = P2P_EDGE_ROWS_PER_SM * torch.cuda.get_device_properties(query.device).multi_processor_count
    edge = next((e for e in range(1, hl // 3 + 1) if b * degree * s * e >= rows), None)
    return (hl,) if edge is None else (edge, hl - 2 * edge, edge)


def _p2p_layout(query, key, degree):
    """Byte offsets of the workspace's regions: what q, k and v each rank receives,
    [N, seq, B, H / N, D] (source rank, its tokens; in head groups a slot a group, [N, seq, B,
    heads of the group, D]), and the output the peers send, [B, S / N, N, H / N, D] (this rank's
    tokens, every rank's heads: the result's layout); the last entry is the size."""
    b, s, h, d = query.shape
    size = query.element_size()
    recv_q = degree * s * b * (h // degree) * d * size
    recv_kv = degree * key.shape[1] * b * (h // degree) * d * size
    offsets = [0]
    for n in (recv_q, recv_kv, recv_kv, recv_q):
        offsets.append(offsets[-1] + peer_memory.aligned(n))
    return tuple(offsets)


_copy_streams = {}  # device index -> (link, local): the streams of the p2p exchange's copy-engine copies


def _copy_streams_of(torch, device):
    if device.index not in _copy_streams:
        _copy_streams[device.index] = (torch.cuda.Stream(device), torch.cuda.Stream(device))
    return _copy_streams[device.index]


def _rows(x):
    """[B, seq, heads, D] as [B, seq, heads D] rows for copy_rows: a view where heads and D are one
    run (every tensor the exchange writes), else a contiguous copy (an input laid out otherwise)."""
    return x.flatten(2)


def _copy_words(torch, dst, src):
    """dst.copy_(src) by a copy kernel moving 16-byte words where the rows allow it: on the exposed
    path a kernel copies within one GPU about twice as fast as the copy engines."""
    try:
        dst, src = dst.view(torch.complex128), src.view(torch.complex128)  # a plain 16-byte move, no arithmetic
    except RuntimeError:  # rows not a whole number of aligned 16-byte words
        pass
    dst.copy_(src)


def _local_copies_by_kernel(torch):
    """Whether the exchange's copies within one GPU run as a copy kernel (_copy_words): inside a CUDA
    graph (or its warm-up), where the driver runs a 2D memcpy within one GPU as a kernel of its own,
    slower than torch's copy of 16-byte words; eagerly the copy engines take them, no SMs."""
    return _graphed(torch)


def _p2p_attention(shard, query, key, value, scale, degree, ws, layout, groups=None):
    """The exchange through symmetric memory, moved by the copy engines (ops.copy_rows), which take
    no SMs: each rank pushes the heads a peer runs straight into that peer's workspace (a link
    stream; its own heads into its own workspace on a local stream, by a copy kernel inside a
    CUDA graph: _local_copies_by_kernel), a barrier, the attention on the received tokens in
    place, each peer's tokens of the output pushed into that peer's workspace where they belong
    in the result (its own tokens straight into the result, as its own heads), a barrier, and a
    copy kernel a peer moves what it sent into the result.

    In head groups (`groups`: the heads of each, in order; _p2p_groups) the input regions hold a
    slot a group; the copy streams move the inputs of every group in order and each group's
    output once its attention is done, so that groups 1.. travel in and groups ..n - 2 travel out
    while an attention runs. Barrier channels: inputs c, outputs n (n groups).

    Why one workspace is enough: the copy streams start call i + 1 after everything the current
    stream issued before, the output barrier of call i included, which every peer reaches only
    after its attentions of call i have read their inputs; and a rank pushes outputs of call
    i + 1 after the first input barrier of call i + 1, which every peer reaches after copying what
    it received in call i out."""
    import contextlib

    import torch

    from . import ops

    b, s, h, d = query.shape
    skv, hl, me = key.shape[1], h // degree, ws.rank
    groups = tuple(groups or (hl,))
    n, first = len(groups), [sum(groups[:c]) for c in range(len(groups))]  # group c: heads first[c] ..
    main = link = local = None
    if query.device.type == "cuda":
        main = torch.cuda.current_stream(query.device)
        link, local = _copy_streams_of(torch, query.device)
        link.wait_stream(main)
        local.wait_stream(main)

    by_kernel = main is not None and _local_copies_by_kernel(torch)

    def local_copy(src, dst):
        if by_kernel:
            _copy_words(torch, dst, src)
        else:
            ops.copy_rows(_rows(src), _rows(dst))

    def on(stream):
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    def event(stream):
        return stream.record_event() if stream is not None else None

    inputs = ((query, s, layout[0]), (key, skv, layout[1]), (value, skv, layout[2]))

    def slot(p, c, x, seq, offset):  # rank p's input slot c: [N, seq, B, heads of group c, D]
        at = offset + degree * seq * b * first[c] * d * x.element_size()
        return ws.view(p, at, (degree, seq, b, groups[c], d), x.dtype)

    def push(c, p):  # group c of rank p's heads into its input slot c, as [seq, B, heads, D] from this rank
        for x, seq, offset in inputs:
            lo = p * hl + first[c]
            src, dst = x[:, :, lo:lo + groups[c]], slot(p, c, x, seq, offset)[me].transpose(0, 1)
            if p == me:
                local_copy(src, dst)
            else:
                ops.copy_rows(_rows(src), _rows(dst))

    def received(c):  # [N, seq, B, heads, D] (source rank, its tokens) read in place as [B, N seq, heads, D]
        return [slot(me, c, x, seq, offset).permute(2, 0, 1, 3, 4).flatten(1, 2) for x, seq, offset in inputs]

    peers = [p for p in range(degree) if p != me]
    sent, kept = [], []
    for c in range(n):
        with on(link):
            for p in peers:
                push(c, p)
            sent.append(event(link))
        with on(local):
            push(c, me)
            kept.append(event(local))
    run_beside()  # beside the copy engines' pushes
    whole = query.new_empty(b, s, degree, hl, d)
    result = (b, s, degree, hl, d)  # this rank's tokens of the output, as the peers push their heads of them
    read_by_copies = []  # outputs the copy streams read: alive until the current stream waits for them
    for c in range(n):
        for e in (sent[c], kept[c]):
            if e is not None:
                main.wait_event(e)
        ws.barrier(c)
        out = shard(*received(c), scale, False)  # [B, N s, heads, D]
        read_by_copies.append(out)
        heads = slice(first[c], first[c] + groups[c])
        for stream in (local, link):
            if stream is not None:
                stream.wait_stream(main)
        with on(local):
            local_copy(out[:, me * s:(me + 1) * s], whole[:, :, me, heads])
        with on(link):
            for p in peers:
                dst = ws.view(p, layout[3], result, out.dtype)[:, :, me, heads]
                ops.copy_rows(_rows(out[:, p * s:(p + 1) * s]), _rows(dst))
    for stream in (link, local):
        if stream is not None:
            main.wait_stream(stream)
    del read_by_copies
    ws.barrier(n)
    mine = ws.view(me, layout[3], result, query.dtype)
    for p in peers:
        _copy_words(torch, whole[:, :, p], mine[:, :, p])
    return whole.view(b, s, h, d)


def _nccl_attention(shard, query, key, value, scale, return_lse, group, degree):
    """The exchange through NCCL all-to-alls, the heads in CQUANT_ULYSSES_CHUNKS groups."""
    import torch.distributed._functional_collectives as funcol

    b, s, h, d = query.shape
    skv, hl = key.shape[1], h // degree
    n = chunks()
    n = n if hl % n == 0 else 1
    hc = hl // n

    def send(x, seq, c):  # [N, seq, B, hc, D]: block r is group c of head group r, this rank's tokens
        buf = x.reshape(b, seq, degree, hl, d)[:, :, :, c * hc:(c + 1) * hc].permute(2, 1, 0, 3, 4).contiguous()
        return funcol.all_to_all_single(buf.flatten(), None, None, group)

    def received(t, seq):  # [N, seq, B, hc, D] (source rank, its tokens) as [B, N seq, hc, D]
        return _wait(funcol, t).view(degree, seq, b, hc, d).permute(2, 0, 1, 3, 4).flatten(1, 2)

    def send_back(x, tail):  # [B, N s, hc, *tail] -> rank r gets its tokens: [N, B, s, hc, *tail]
        buf = x.reshape(b, degree, s, hc, *tail).transpose(0, 1).contiguous()  # no copy at batch 1
        return funcol.all_to_all_single(buf.flatten(), None, None, group)

    def place(pending, whole, tail):  # from rank r: group c of head group r, this rank's tokens
        for c, t in enumerate(pending):
            part = _wait(funcol, t).view(degree, b, s, hc, *tail)
            whole[:, :, :, c * hc:(c + 1) * hc] = part.permute(1, 2, 0, 3, *range(4, 4 + len(tail)))
        return whole.view(b, s, h, *tail)

    inputs = [(send(query, s, c), send(key, skv, c), send(value, skv, c)) for c in range(n)]
    run_beside()  # beside the all-to-alls
    outs, lses = [], []
    for q, k, v in inputs:
        result = shard(received(q, s), received(k, skv), received(v, skv), scale, return_lse)
        out, lse = result if return_lse else (result, None)
        outs.append(send_back(out, (d,)))
        if return_lse:
            lses.append(send_back(lse.contiguous(), ()))
    out = place(outs, query.new_empty(b, s, degree, hl, d), (d,))
    if not return_lse:
        return out
    return out, place(lses, query.new_empty(b, s, degree, hl, dtype=lses[0].dtype), ())
