"""Ulysses attention for cquant's backends with fewer copies than diffusers' template, its exchanges
overlapped with the attention (CQUANT_ULYSSES, below).

Under diffusers' Ulysses context parallelism (ContextParallelConfig(ulysses_degree=N), ring
degree 1) each rank holds S / N tokens of all H heads, and attention needs all S tokens of
H / N heads: q, k and v go through one all-to-all each, the output through one more. diffusers'
template makes each tensor contiguous before and after its exchange and waits for each exchange
before the next. cquant's kernels read q, k and v with any strides, so:

- what a rank receives, [N, S / N, B, heads, D] (source rank, its tokens), is read in place as
  [B, S, heads, D] (the source ranks' token blocks are consecutive);
- at batch 1 the output [B, S, heads, D] already is the send buffer of its exchange (rank r gets
  tokens r S / N .. (r + 1) S / N);
- the rank's H / N heads run in CQUANT_ULYSSES_CHUNKS groups (2 by default, 1 where H / N does not
  split evenly): every input exchange is issued first, so that each group's attention runs while
  the next group's inputs and the last group's output travel.

At batch 1 that is 4 copies of an activation a call against the template's 5 (its copies after the
input exchanges are free there): on two H200s 0.7 ms of a 66 ms Flux-dev step; the overlap of the
head groups gives more (benchmarks/results/context_parallel_h200x2.md).

The math is the one-process call's (each rank runs whole sequences of its heads, every head on
its own), so outputs are those of diffusers' template to the bit; but for the 8-bit CUDA kernel in
several head groups, which splits the keys of its last wave's query blocks by the call's heads
(cquant.h): those rows' folds run in another order, at most an output ulp apart.

CQUANT_ULYSSES selects it: "auto" (unset: this exchange where a CUDA graph is being captured,
whose replay costs the host nothing, diffusers' template elsewhere: an eager parallel step is
host-bound, and the head groups add host work), "cquant" (always) or "diffusers" (never). Calls
it does not take (ring attention, ulysses_anything, heads not divisible by N, inputs that require
grad) run diffusers' template either way.
"""

import os

SETTING = "CQUANT_ULYSSES"
CHOICES = ("auto", "cquant", "diffusers")
CHUNKS_SETTING = "CQUANT_ULYSSES_CHUNKS"
DEFAULT_CHUNKS = 2


def selected(torch):
    """Whether CQUANT_ULYSSES asks for this exchange now (read at each call, so it can change between
    calls)."""
    value = os.environ.get(SETTING, "auto").strip().lower() or "auto"
    if value not in CHOICES:
        raise ValueError(f"{SETTING}={os.environ[SETTING]!r}; expected one of {', '.join(CHOICES)}")
    if value == "auto":
        return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
    return value == "cquant"


def chunks():
    """Head groups a rank's attention runs in (CQUANT_ULYSSES_CHUNKS, default 2)."""
    value = os.environ.get(CHUNKS_SETTING, "").strip()
    if not value:
        return DEFAULT_CHUNKS
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
    return_lse, lse [B, S / N, H] (the backends' layout)."""
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
