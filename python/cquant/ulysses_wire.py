"""The 8-bit wire of cquant's Ulysses exchange (CQUANT_ULYSSES_WIRE=int8): q, k, v and the
attention output cross the NCCL all-to-alls as int8 codes with one fp32 scale a (token, head) row,
D + 4 bytes where bf16 takes 2 D (0.52x at D = 128), and are decoded to the inputs' dtype on
arrival, so any attention backend reads them.

Each row is quantized with cq_quantize's int8 math (scale = amax / 127, round to nearest even:
every element within amax / 254 of its value). Keys are first smoothed by the sending rank's mean
of each head's channels over its tokens (their offsets, large in diffusion transformers, would
otherwise set the scales), and the mean, exact in fp32, is added back on arrival. One pass a
tensor and head group does all of it (ops.wire_encode: smoothing, codes, scales and the decoded
rows' norms, written straight into the send buffer), and one pass decodes (ops.wire_decode, into
the layout the attention reads).

The accuracy bound is the 8-bit attention's (cquant.h): E, the estimated standard deviation of
the error the q and k roundings put in a logit (log2 units), is at most
ATTENTION_INT8_MAX_LOGIT_ERROR for every head, with the scales and norms of every rank's rows; the
sending ranks' different key means add a term, as the rounding of q turns their differences into
shifts between the ranks' keys. The values and the output carry their own roundings (amax / 254
of a row at most, each), which do not grow with the logits. A call where E of some head exceeds the
bound (or is NaN: non-finite inputs) crosses in full precision instead: every rank computes E from
the same gathered statistics, so all take the same exchange. The codes leave before the check,
which reads one number on the host while they travel (a call that fails drops them): a
synchronisation a call, so the wire serves eager calls only; a captured CUDA graph cannot hold
it, and its calls keep the full-precision exchange.

Where it pays: links slower than a GPU's memory (PCIe without peer access, NICs between hosts),
where the exchange's bytes set its time: on two H200s with NCCL through host memory
(NCCL_P2P_DISABLE=1) an eager 2048x2048 Flux-dev step runs at 1.30-1.35x of one GPU against
1.02-1.05x in bf16. Its passes take about 15 ms of that step, and its synchronisation a call keeps
the host from running ahead: more than NVLink's p2p exchange, in CUDA graphs, leaves exposed
(benchmarks/results/context_parallel_h200x2.md).
"""

import math
import os

from . import ops

SETTING = "CQUANT_ULYSSES_WIRE"
CHOICES = ("bf16", "int8")
MAX_LOGIT_ERROR = ops.ATTENTION_INT8_MAX_LOGIT_ERROR
SCALE_BYTES = 4  # a row's fp32 scale

calls = {"int8": 0, "full": 0}  # calls that crossed in 8 bits / fell back to full precision (bound)


def setting():
    """CQUANT_ULYSSES_WIRE, read at each call: "bf16" (unset: the inputs' dtype) or "int8"."""
    value = os.environ.get(SETTING, "bf16").strip().lower() or "bf16"
    if value not in CHOICES:
        raise ValueError(f"{SETTING}={os.environ[SETTING]!r}; expected one of {', '.join(CHOICES)}")
    return value


def takes(query, key, value, return_lse):
    """Whether the wire can carry this call: no lse (it crosses in fp32 beside the output), q, k, v
    of one dtype, batch and head dim, and D % 4 == 0 (the scales after the codes stay 4-byte aligned)."""
    d = query.shape[3]
    return (not return_lse and value.shape == key.shape and key.shape[0] == query.shape[0]
            and key.shape[3] == d and d % SCALE_BYTES == 0 and query.dtype == key.dtype == value.dtype)


def _rows(x):
    """x with its last dim contiguous, as the wire's kernels read rows (a copy only where it is not)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def logit_error(torch, stats, scale):
    """E of every head (cquant.h's estimate of the 8-bit attention, here with a scale a row) from the
    gathered statistics [N, B, H, 4 + D] of the N ranks: each rank's largest q scale and norm of a
    decoded q row, the same of its smoothed keys, and its key mean. The means differ between
    ranks: the rounding of q (sq / 2 an element at most, variance sq^2 / 12) turns a key mean's
    distance M from the common one into a shift of that rank's logits, a term (A M)^2 / 12."""
    a, bq, c, bk = stats[..., :4].amax(0).unbind(-1)  # amax propagates NaN
    means = stats[..., 4:]
    m = torch.linalg.vector_norm(means - means.mean(0), dim=-1).amax(0)
    d = means.shape[-1]
    raw = ((c * bq) ** 2 + (a * bk) ** 2 + (a * m) ** 2) / 12 + d * (a * c) ** 2 / 144
    return torch.sqrt(raw) * (scale / math.log(2))  # q' = q * scale * log2(e): log2 units


def attention(shard, query, key, value, scale, group, degree, n, beside=lambda: None):
    """Ulysses attention of [B, S / N, H, D] shards through shard(q, k, v, scale, False) on
    [B, S, heads, D], the heads in n groups (one where n does not divide H / N), everything crossing
    in 8 bits: out [B, S / N, H, D], or None where the bound fails (the caller then runs the
    full-precision exchange). beside() runs once the inputs are sent."""
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    b, s, h, d = query.shape
    skv, hl, me = key.shape[1], h // degree, dist.get_rank(group)
    n = n if hl % n == 0 else 1
    hc = hl // n

    kmean = key.mean(dim=1, dtype=torch.float32)  # [B, H, D]: keys cross smoothed by it

    def encode(x, seq, mean=None, norms=None):  # each group's buffer: block r, [seq, B, hc] rows of head group r
        rows = _rows(x).unflatten(2, (degree, hl)).permute(2, 1, 0, 3, 4)  # [N, seq, B, hl, D]
        means = None if mean is None else mean.unflatten(1, (degree, hl)).transpose(0, 1)[:, None]
        bufs, scales = [], []
        for c in range(n):
            heads = slice(c * hc, (c + 1) * hc)
            buf = torch.empty(degree * seq * b * hc * (d + SCALE_BYTES), dtype=torch.uint8, device=x.device)
            to, scales_to = _regions(torch, buf, degree, (seq, b, hc), d)
            m = None if means is None else means[:, :, :, heads].expand(degree, seq, b, hc, d)
            ops.wire_encode(rows[:, :, :, heads], to, scales_to, mean=m,
                            norms=None if norms is None else norms[..., heads])
            bufs.append(buf)
            scales.append(scales_to)
        return bufs, scales

    def head_stats(scales, norms):  # [B, H, 2]: each head's largest scale and decoded-row norm
        by_rank = torch.stack((torch.cat([sc.amax(1) for sc in scales], -1), norms.amax(1)), -1)  # [N, B, hl, 2]
        return by_rank.transpose(0, 1).reshape(b, h, 2)

    qn, kn = (torch.empty(degree, seq, b, hl, device=query.device) for seq in (s, skv))
    (qbufs, qscales), (kbufs, kscales) = encode(query, s, norms=qn), encode(key, skv, kmean, kn)
    vbufs, _ = encode(value, skv)
    mine = torch.cat((head_stats(qscales, qn), head_stats(kscales, kn), kmean), -1)
    gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor  # the name of newer torch
    gathered = gather(mine, 0, group)

    def received(t, seq, mean=None):  # (source rank, its tokens) decoded, as [B, N seq, hc, D]
        codes, scales = _regions(torch, _wait(funcol, t), degree, (seq, b, hc), d)
        x = query.new_empty(b, degree, seq, hc, d)
        ops.wire_decode(codes, scales, x.permute(1, 2, 0, 3, 4), mean=mean)
        return x.view(b, degree * seq, hc, d)

    # The codes leave before the check, which waits for the statistics only (they cross first): the
    # host then reads one number while the codes travel, and a call whose bound fails drops them.
    inputs = [tuple(funcol.all_to_all_single(bufs[c], None, None, group) for bufs in (qbufs, kbufs, vbufs))
              for c in range(n)]
    beside()  # the caller's work that does not need the attention, while the codes travel
    every = _wait(funcol, gathered).view(degree, b, h, 4 + d)
    softmax_scale = scale if scale is not None else 1 / math.sqrt(d)  # None: the backends' default
    if not bool((logit_error(torch, every, softmax_scale) <= MAX_LOGIT_ERROR).all()):  # NaN fails too
        for sent in inputs:
            for t in sent:
                _wait(funcol, t)
        calls["full"] += 1
        return None
    calls["int8"] += 1
    outs = []
    for c, (q, k, v) in enumerate(inputs):
        lo = me * hl + c * hc
        mean = every[:, :, lo:lo + hc, 4:][:, None].expand(degree, skv, b, hc, d)  # each source rank's key means
        out = shard(received(q, s), received(k, skv, mean), received(v, skv), scale, False)  # [B, N s, hc, D]
        buf = torch.empty(degree * b * s * hc * (d + SCALE_BYTES), dtype=torch.uint8, device=out.device)
        to, scales_to = _regions(torch, buf, degree, (b, s, hc), d)  # block r: rank r's tokens
        ops.wire_encode(_rows(out).unflatten(1, (degree, s)).transpose(0, 1), to, scales_to)
        outs.append(funcol.all_to_all_single(buf, None, None, group))
    whole = query.new_empty(b, s, degree, hl, d)
    for c, t in enumerate(outs):  # from rank r: group c of head group r, this rank's tokens
        codes, scales = _regions(torch, _wait(funcol, t), degree, (b, s, hc), d)
        ops.wire_decode(codes, scales, whole[:, :, :, c * hc:(c + 1) * hc].permute(2, 0, 1, 3, 4))
    return whole.view(b, s, h, d)


def _regions(torch, buf, degree, rows, d):
    """A wire buffer, uint8 [N blocks]: each block holds the codes of its rows, int8 [*rows, D], then
    their scales, fp32 [*rows] (codes and scales each in one run, so packing and decoding read and
    write whole rows). Returns the views (codes [N, *rows, D], scales [N, *rows])."""
    n = math.prod(rows)
    blocks = buf.view(degree, n * (d + SCALE_BYTES))
    codes = blocks[:, :n * d].view(torch.int8).view(degree, *rows, d)
    scales = blocks[:, n * d:].view(torch.float32).view(degree, *rows)
    return codes, scales


def _wait(funcol, t):
    return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t
