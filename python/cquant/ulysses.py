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
  each rank's copy kernels write the heads a peer runs straight into the peer's workspace, the
  attention reads them there, and each rank copies its tokens of the output out of the peers'
  workspaces; two barriers a call, no NCCL. On two H200s a Flux-dev step (1024x1024, CUDA
  graphs) takes 57.6 ms against 61.4 ms with NCCL, and an eager step 109 ms against the
  template's 173 ms (benchmarks/results/context_parallel_h200x2.md). CQUANT_ULYSSES_CHUNKS=G > 1
  runs the rank's heads in G groups, the next groups' inputs and each group's output copies on a
  side stream beside the attention (not yet measured on GPUs; unset, one group).
- nccl: all-to-alls (torch's functional collectives), the rank's H / N heads in
  CQUANT_ULYSSES_CHUNKS groups (2 by default, 1 where H / N does not split evenly): every input
  exchange is issued first, so that each group's attention runs while the next group's inputs
  and the last group's output travel. At batch 1 the output already is the send buffer of its
  exchange. It also carries the calls that ask for the log-sum-exp.

The math is the one-process call's (each rank runs whole sequences of its heads, every head on
its own), so outputs are those of diffusers' template to the bit; but for the 8-bit CUDA kernel in
several head groups, which splits the keys of its last wave's query blocks by the call's
heads (cquant.h): those rows' folds run in another order, at most an output ulp apart.

CQUANT_ULYSSES selects the exchange: "auto" (unset: cquant's where its transport is p2p, and with
NCCL only where a CUDA graph is captured (or warmed up for a capture), whose replay costs the host
nothing: an eager step is host-bound, and the head groups add host work; diffusers' template
elsewhere), "cquant" (always) or "diffusers" (never). CQUANT_ULYSSES_TRANSPORT
(peer_memory.transport) picks the transport: "auto" (p2p where the group's GPUs can map each
other's memory, else NCCL), "p2p" or "nccl". Calls it does not take (ring attention,
ulysses_anything, heads not divisible by N, inputs that require grad) run diffusers' template
either way.
"""

import os

from . import peer_memory

SETTING = "CQUANT_ULYSSES"
CHOICES = ("auto", "cquant", "diffusers")
CHUNKS_SETTING = "CQUANT_ULYSSES_CHUNKS"
DEFAULT_CHUNKS = 2
P2P_DEFAULT_CHUNKS = 1  # head groups of the p2p exchange where CQUANT_ULYSSES_CHUNKS is unset: measured one


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
        return torch.cuda.is_available() and (peer_memory.transport() != "nccl" or _graphed(torch))
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


def attention(shard, query, key, value, scale, return_lse, group, degree):
    """Ulysses attention of [B, S / N, H, D] query, key, value shards (the model's layout) through
    shard(q, k, v, scale, return_lse) on [B, S, heads, D]: out [B, S / N, H, D] and, with
    return_lse, lse [B, S / N, H] (the backends' layout). None where CQUANT_ULYSSES=auto hands an
    eager call that only NCCL could carry back to diffusers' template."""
    import torch

    h = query.shape[2]
    if not return_lse and value.shape == key.shape and key.shape[0] == query.shape[0] \
            and key.shape[3] == query.shape[3] and key.dtype == query.dtype == value.dtype:
        layout = _p2p_layout(query, key, degree)
        ws = peer_memory.workspace(torch, group, query.device, layout[-1])
        if ws is not None:
            n = chunks(P2P_DEFAULT_CHUNKS)
            n = n if (h // degree) % n == 0 else 1
            return _p2p_attention(shard, query, key, value, scale, degree, ws, layout, n)
    if setting() == "auto" and not _graphed(torch):
        return None
    return _nccl_attention(shard, query, key, value, scale, return_lse, group, degree)


def _p2p_layout(query, key, degree):
    """Byte offsets of the workspace's regions: what q, k and v each rank receives,
    [N, seq, B, H / N, D] (source rank, its tokens; in head groups, [G, N, seq, B, H / N / G, D]),
    and the attention output [B, S, H / N, D] the peers read their tokens from (in groups
    [G, B, S, H / N / G, D]); the last entry is the size."""
    b, s, h, d = query.shape
    size = query.element_size()
    recv_q = degree * s * b * (h // degree) * d * size
    recv_kv = degree * key.shape[1] * b * (h // degree) * d * size
    offsets = [0]
    for n in (recv_q, recv_kv, recv_kv, recv_q):
        offsets.append(offsets[-1] + peer_memory.aligned(n))
    return tuple(offsets)


_side_streams = {}  # device index -> the stream the p2p exchange's head groups overlap on


def _side_stream(torch, device):
    if device.index not in _side_streams:
        _side_streams[device.index] = torch.cuda.Stream(device)
    return _side_streams[device.index]


def _p2p_attention(shard, query, key, value, scale, degree, ws, layout, n=1):
    """The exchange through symmetric memory: each rank writes the heads a peer runs straight into
    that peer's workspace (one copy kernel a peer and tensor, no send buffer), a barrier, the
    attention on the received tokens in place, the output into this rank's workspace, a barrier,
    and each rank copies its tokens out of every peer's.

    In n head groups (CQUANT_ULYSSES_CHUNKS) every region holds n group slots, each group has its
    own barrier channels (inputs c, outputs n + c), and on a GPU a side stream carries the
    inputs of groups 1.. and the copies out of the peers, so that they run beside the attention
    of the group before.

    Why one workspace is enough: a rank overwrites a peer's received q, k, v (call i + 1) only after
    the last output barrier of call i, which the peer reaches after its attention of call i has
    read them; and it overwrites its own output region after the first input barrier of call
    i + 1, which every peer reaches after copying its tokens of call i out (each call ends with
    the current stream waiting for the side stream, and the side stream starts each call after
    everything the current stream issued before it)."""
    import contextlib

    import torch

    b, s, h, d = query.shape
    skv, hl, me = key.shape[1], h // degree, ws.rank
    hc = hl // n
    main = side = None
    if n > 1 and query.device.type == "cuda":
        main, side = torch.cuda.current_stream(query.device), _side_stream(torch, query.device)
        side.wait_stream(main)

    def push(c):  # group c of each rank's heads, into that rank's slot c as [seq, B, hc, D] from this rank
        received = []
        for x, seq, offset in ((query, s, layout[0]), (key, skv, layout[1]), (value, skv, layout[2])):
            shape = (n, degree, seq, b, hc, d)
            for p in range(degree):
                lo = p * hl + c * hc
                ws.view(p, offset, shape, x.dtype)[c, me].copy_(x[:, :, lo:lo + hc].transpose(0, 1))
            # [N, seq, B, hc, D] read in place as [B, N seq, hc, D]: the source ranks' tokens in order
            received.append(ws.view(me, offset, shape, x.dtype)[c].permute(2, 0, 1, 3, 4).flatten(1, 2))
        ws.barrier(c)
        return received

    inputs, ready = [push(0)], [None]
    with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
        for c in range(1, n):
            inputs.append(push(c))
            ready.append(side.record_event() if side is not None else None)
    shape = (n, b, degree * s, hc, d)
    mine = ws.view(me, layout[3], shape, query.dtype)
    whole = query.new_empty(b, s, degree, hl, d)
    for c in range(n):
        if ready[c] is not None:
            main.wait_event(ready[c])
        out = shard(*inputs[c], scale, False)  # [B, N s, hc, D]
        heads = slice(c * hc, (c + 1) * hc)
        for p in range(degree):  # what the peers read; this rank's own tokens go straight to the result
            dst = whole[:, :, me, heads] if p == me else mine[c, :, p * s:(p + 1) * s]
            dst.copy_(out[:, p * s:(p + 1) * s])
        ws.barrier(n + c)
        if side is not None:
            side.wait_stream(main)
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            for p in range(degree):
                if p != me:
                    whole[:, :, p, heads].copy_(ws.view(p, layout[3], shape, query.dtype)[c, :, me * s:(me + 1) * s])
    if side is not None:
        main.wait_stream(side)
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
