"""Ulysses attention for cquant's backends with half of diffusers' copies (CQUANT_ULYSSES=cquant).

Under diffusers' Ulysses context parallelism (ContextParallelConfig(ulysses_degree=N), ring
degree 1) each rank holds S / N tokens of all H heads, and attention needs all S tokens of
H / N heads: q, k and v go through one all-to-all each, the output through one more. diffusers'
template makes each tensor contiguous before and after its exchange, 8 copies of an activation a
call. cquant's kernels read q, k and v with any strides, so:

- what a rank receives, [N, S / N, B, H / N, D] (source rank, its tokens), is read in place as
  [B, S, H / N, D] (the source ranks' token blocks are consecutive);
- at batch 1 the output [B, S, H / N, D] already is the send buffer of its exchange (rank r gets
  tokens r S / N .. (r + 1) S / N);
- the three input exchanges are issued before the first is waited for, so that each overlaps the
  next one's copy.

That leaves the three send copies of q, k, v and the copy of the received output into
[B, S / N, H, D] (and the output's send copy at batch > 1). The math is the one-process call's
(each rank runs whole sequences of its heads), so outputs are those of diffusers' template to
the bit.

CQUANT_ULYSSES selects it: "diffusers" (unset: diffusers' template) or "cquant" (this). Calls
it does not take (ring attention, ulysses_anything, heads not divisible by N, inputs that require
grad) run diffusers' template either way.
"""

import os

SETTING = "CQUANT_ULYSSES"
CHOICES = ("diffusers", "cquant")


def selected():
    """Whether CQUANT_ULYSSES asks for this exchange (read at each call, so it can change between calls)."""
    value = os.environ.get(SETTING, "diffusers").strip().lower() or "diffusers"
    if value not in CHOICES:
        raise ValueError(f"{SETTING}={os.environ[SETTING]!r}; expected one of {', '.join(CHOICES)}")
    return value == "cquant"


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
    shard(q, k, v, scale, return_lse) on [B, S, H / N, D]: out [B, S / N, H, D] and, with
    return_lse, lse [B, S / N, H] (the backends' layout)."""
    import torch.distributed._functional_collectives as funcol

    b, s, h, d = query.shape
    skv, hl = key.shape[1], h // degree

    def send(x, seq):  # [N, seq, B, H / N, D]: block r is head group r of this rank's tokens
        buf = x.reshape(b, seq, degree, hl, d).permute(2, 1, 0, 3, 4).contiguous()
        return funcol.all_to_all_single(buf.flatten(), None, None, group)

    def received(t, seq):  # [N, seq, B, H / N, D] (source rank, its tokens) as [B, N seq, H / N, D]
        return _wait(funcol, t).view(degree, seq, b, hl, d).permute(2, 0, 1, 3, 4).flatten(1, 2)

    pending = (send(query, s), send(key, skv), send(value, skv))
    q, k, v = received(pending[0], s), received(pending[1], skv), received(pending[2], skv)
    result = shard(q, k, v, scale, return_lse)
    out, lse = result if return_lse else (result, None)

    def back(x, tail):  # [B, N s, H / N, *tail] -> rank r gets its tokens: [N, B, s, H / N, *tail]
        buf = x.reshape(b, degree, s, hl, *tail).transpose(0, 1).contiguous()  # no copy at batch 1
        t = _wait(funcol, funcol.all_to_all_single(buf.flatten(), None, None, group))
        # from rank r: head group r of this rank's tokens -> [B, s, H, *tail]
        return t.view(degree, b, s, hl, *tail).permute(1, 2, 0, 3, *range(4, 4 + len(tail))).reshape(b, s, h, *tail)

    out = back(out, (d,))
    return (out, back(lse.contiguous(), ())) if return_lse else out
