"""Fused attention of cquant: full precision (bf16/fp16) or 8-bit (int8 QK^T, u8 x int8 PV).

``attention(q, k, v)`` takes arrays in diffusers' layout, q [B, Sq, H, D] and k, v
[B, Skv, H, D], and returns out [B, Sq, H, D] in q's dtype (and, with ``return_lse=True``,
the natural-log log-sum-exp [B, H, Sq] in float32). The math of both modes is written in
csrc/include/cquant.h. On the CPU it runs the C reference; on CUDA the kernels.

With torch installed the op is also ``torch.ops.cquant.attention`` (a torch.library custom
op with a fake implementation), so ``torch.compile(fullgraph=True)`` traces it as one node
and CUDA graphs capture it: its workspace is allocated with torch on the current stream.
"""

import math
import operator

from . import ops
from ._arrays import dtype_name, empty, framework_of

MODES = {"bf16": ops.ATTENTION_FULL, "fp16": ops.ATTENTION_FULL, "full": ops.ATTENTION_FULL,
         "int8": ops.ATTENTION_INT8}


def mode_id(mode):
    """libcquant's attention mode (ops.ATTENTION_FULL or ops.ATTENTION_INT8) of a mode name."""
    if isinstance(mode, str) and mode.lower() in MODES:
        return MODES[mode.lower()]
    raise ValueError(f"mode must be 'bf16' (full precision in the inputs' dtype; 'fp16'/'full' are the same) or 'int8', got {mode!r}")


def _check_shapes(q, k, v):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if len(ops._shape(t, name)) != 4:  # TypeError naming a non-array
            raise ValueError(f"{name} has shape {tuple(t.shape)}; expected 4 dims [batch, seq, heads, head_dim]")
    return tuple(int(s) for s in q.shape), int(k.shape[1])


def _scale_of(scale, head_dim):
    if scale is None:
        if head_dim < 1:  # libcquant names the shape; 1 / sqrt(0) would raise first
            return 1.0
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, (str, bytes)) or not hasattr(scale, "__float__"):
        raise TypeError(f"scale must be a real number (or None: 1 / sqrt(head_dim)), got {type(scale).__name__}")
    scale = float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale = {scale}; expected a finite softmax scale")
    return scale


BLOCK_MAX = 2**31 - 1  # cq_attention_params holds the block sizes as int32


def _block(value, name):
    if value is None:
        return 0
    try:
        block = None if isinstance(value, bool) else operator.index(value)  # Python or NumPy ints
    except TypeError:
        block = None
    if block is None or not 1 <= block <= BLOCK_MAX:
        raise ValueError(f"{name} must be a positive int of at most {BLOCK_MAX}, got {value!r}")
    return block


def workspace_size(mode, batch, heads, seq_q, seq_kv, head_dim, *, cuda, q_block=None, k_block=None):
    """Bytes of workspace the op needs (0 for full precision and on the CPU)."""
    return ops.attention_workspace_size(mode_id(mode), batch, heads, seq_q, seq_kv, head_dim, cuda=cuda,
                                        q_block=_block(q_block, "q_block"), k_block=_block(k_block, "k_block"))


def attention(q, k, v, *, scale=None, mode="bf16", return_lse=False, out=None, q_block=None, k_block=None):
    """Softmax attention without mask, in diffusers' [batch, seq, heads, head_dim] layout.

    q: [B, Sq, H, D]; k, v: [B, Skv, H, D], one dtype (bfloat16 or float16 on CUDA; float32
    as well on the CPU). scale defaults to 1/sqrt(D). mode "bf16" computes in the inputs'
    precision with fp32 accumulation; "int8" quantizes Q and K to int8 per block (K smoothed by
    its per-channel mean), P to u8 codes at each k_block tile's max and V to int8 per channel
    (CUDA: sm_89 or newer, k_block 128); heads whose logit-error estimate passes the mode's
    bound (ops.attention_int8_logit_error) are computed in full precision instead.
    q_block/k_block set the 8-bit block sizes (default 32 query rows, 128 keys).

    Returns out [B, Sq, H, D] in q's dtype, or (out, lse) with lse float32 [B, H, Sq] when
    return_lse. out= takes a preallocated output.
    """
    m = mode_id(mode)
    (b, sq, h, d), skv = _check_shapes(q, k, v)
    s = _scale_of(scale, d)
    qb, kb = _block(q_block, "q_block"), _block(k_block, "k_block")
    if framework_of(q) == "torch" and out is None:
        o, lse = register_torch_op()(q, k, v, s, m, bool(return_lse), qb, kb)
        return (o, lse) if return_lse else o
    o = out if out is not None else empty(q, (b, sq, h, d), dtype_name(q))
    lse = empty(q, (b, h, sq), "float32") if return_lse else None
    if b == 0 or sq == 0 or skv == 0:  # no work for the kernels: out 0 and lse -inf, as the torch op gives
        ops.check_attention_shapes(q, k, v, o)
        ops.check_attention_call(q, k, v, s, m, qb, kb)
        o[...] = 0
        if lse is not None:
            lse[...] = float("-inf")
    else:
        ops.attention_into(q, k, v, o, lse, s, m, qb, kb)
    return (o, lse) if return_lse else o


def register_torch_op():
    """torch.ops.cquant.attention (registered with cquant's other torch ops on first use)."""
    import torch

    from . import torch_ops  # noqa: F401  (registers the op)

    return torch.ops.cquant.attention
