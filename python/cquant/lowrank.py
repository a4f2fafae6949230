"""Low-rank correction of a quantized weight's rounding error (in the spirit of SVDQuant).

At quantize time the error E = W - W' of the stored weight (W' dequantized, float32) is
approximated by its top-r singular components, E ~ L_up @ L_down with L_up [N, r] and
L_down [r, K], kept in the layer's compute dtype. The layer then computes

    y = quantized_linear(x) + (x @ L_down^T) @ L_up^T

with two small torch matmuls on the same stream (the correction is added before a fused
activation, so layers holding one run their GELU after it). Where the weight has a few large
directions (outliers, low-rank structure) that a 4-bit grid rounds badly, r = 16..64 recovers
much of the loss for (N + K) * r extra values per layer. Rank 0 (the default) adds nothing.

    up, down = lowrank.factors(w, w_dequantized, rank, dtype)
    y = lowrank.apply(x, y, up, down)
"""

from __future__ import annotations

# torch is imported where it is used: cquant.configs validates ranks (check_rank) without it.

__all__ = ["factors", "apply", "weight", "check_rank", "MAX_RANK", "MAX_FUSED_RANK", "EXACT_SVD_MAX_DIM"]

# Ranks above this cost more than they recover at 4 bits: the correction's matmuls would no
# longer be small beside the layer's (SVDQuant uses 16..32).
MAX_RANK = 256
# QKV fusion joins up to three layers into one whose correction stacks theirs, so its rank is the
# sum of theirs: a scheme (and a checkpoint's layer) may carry up to this; configs stay at MAX_RANK.
MAX_FUSED_RANK = 3 * MAX_RANK
# Below this min(N, K), a full SVD of E is cheap enough; above it, a seeded randomized range
# finder (a few power iterations) gives the top-r components at a fraction of the cost.
EXACT_SVD_MAX_DIM = 1024
_OVERSAMPLE = 16
_POWER_ITERS = 4
_SEED = 0x5EED  # the range finder's sketch: same weight, same factors


def check_rank(rank, name="lowrank_rank", limit=MAX_RANK):
    """rank as an int in [0, limit]; TypeError / ValueError naming `name` otherwise."""
    if not isinstance(rank, int) or isinstance(rank, bool):
        raise TypeError(f"{name} must be an int (0: no low-rank correction), got {type(rank).__name__}")
    if not 0 <= rank <= limit:
        fused = f" (a fused q / k / v layer, the sum of its parts': to {limit})" if limit > MAX_RANK else ""
        raise ValueError(f"{name} = {rank}; expected 0 (off) to {MAX_RANK}{fused}")
    return rank


def _top_components(e, rank):
    """(U [N, r], S [r], Vh [r, K]) of the rank-r truncated SVD of e (float32)."""
    import torch

    n, k = e.shape
    if min(n, k) <= EXACT_SVD_MAX_DIM or rank + _OVERSAMPLE >= min(n, k):
        u, s, vh = torch.linalg.svd(e, full_matrices=False)
        return u[:, :rank], s[:rank], vh[:rank]
    # Halko, Martinsson & Tropp, "Finding structure with randomness" (2011), algorithm 4.4:
    # subspace iteration with re-orthonormalisation after every product
    g = torch.Generator(device="cpu").manual_seed(_SEED)
    sketch = torch.randn(k, rank + _OVERSAMPLE, generator=g, dtype=torch.float32).to(e.device)
    q = torch.linalg.qr(e @ sketch).Q
    for _ in range(_POWER_ITERS):
        q = torch.linalg.qr(e.T @ q).Q
        q = torch.linalg.qr(e @ q).Q
    u_small, s, vh = torch.linalg.svd(q.T @ e, full_matrices=False)
    return (q @ u_small)[:, :rank], s[:rank], vh[:rank]


def factors(w, w_dequantized, rank, dtype):
    """(L_up [N, r], L_down [r, K]) in `dtype` with L_up @ L_down the best rank-r approximation
    of w - w_dequantized (both [N, K], computed in float32 on w's device). The singular values
    are split evenly (sqrt into each factor), so neither factor's range strains bf16 / fp16.
    A weight whose error is not finite (NaN or inf weights) raises ValueError."""
    import torch

    rank = check_rank(rank, "rank", MAX_FUSED_RANK)  # a fused q / k / v layer requantized (a LoRA merge)
    n, k = w.shape
    if rank > min(n, k):
        raise ValueError(f"lowrank rank {rank} exceeds min(out_features, in_features) = {min(n, k)}")
    with torch.no_grad():
        return _factors(w, w_dequantized, rank, dtype)


def _factors(w, w_dequantized, rank, dtype):
    import torch

    e = w.detach().to(torch.float32) - w_dequantized.detach().to(device=w.device, dtype=torch.float32)
    if not torch.isfinite(e).all():
        raise ValueError("the weight's quantization error is not finite (NaN or inf weights); no low-rank correction "
                         "can be computed")
    u, s, vh = _top_components(e, rank)
    root = s.sqrt()
    return (u * root).to(dtype).contiguous(), (root[:, None] * vh).to(dtype).contiguous()


def apply(x, y, up, down):
    """y + (x @ down^T) @ up^T: x [..., K], y [..., N] (x's dtype), up [N, r], down [r, K]."""
    import torch.nn.functional as F

    if up.dtype != x.dtype:
        up, down = up.to(x.dtype), down.to(x.dtype)
    return y + F.linear(F.linear(x, down), up)


def weight(up, down, dtype=None):
    """The correction as a dense [N, K] weight in dtype (default float32), for dequantize,
    merges and the float fallback."""
    import torch

    return (up.to(torch.float32) @ down.to(torch.float32)).to(dtype or torch.float32)
