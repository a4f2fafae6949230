"""Fused attention of cquant: full precision (bf16/fp16) or 8-bit (int8 QK^T, fp8 PV).

``attention(q, k, v)`` takes arrays in diffusers' layout, q [B, Sq, H, D] and k, v
[B, Skv, H, D], and returns out [B, Sq, H, D] in q's dtype (and, with ``return_lse=True``,
the natural-log log-sum-exp [B, H, Sq] in float32). The math of both modes is written in
csrc/include/cquant.h. On the CPU it runs the C reference; on CUDA the kernels.

With torch installed the op is also ``torch.ops.cquant.attention`` (a torch.library custom
op with a fake implementation), so ``torch.compile(fullgraph=True)`` traces it as one node
and CUDA graphs capture it: its workspace is allocated with torch on the current stream.
"""

import math

from . import _C
from ._arrays import dtype_name, empty, framework_of, is_cuda, stream_of

MODES = {"bf16": 0, "fp16": 0, "full": 0, "int8": 1}


def mode_id(mode):
    """0 (full precision) or 1 (8-bit) for a mode name."""
    if isinstance(mode, str) and mode.lower() in MODES:
        return MODES[mode.lower()]
    raise ValueError(f"mode must be 'bf16' (full precision in the inputs' dtype; 'fp16'/'full' are the same) or 'int8', got {mode!r}")


def _check_shapes(q, k, v):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if len(t.shape) != 4:
            raise ValueError(f"{name} has shape {tuple(t.shape)}; expected 4 dims [batch, seq, heads, head_dim]")
    return tuple(int(s) for s in q.shape), int(k.shape[1])


def _scale_of(scale, head_dim):
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    scale = float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale = {scale}; expected a finite softmax scale")
    return scale


def _block(value, name):
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def workspace_size(mode, batch, heads, seq_q, seq_kv, head_dim, *, cuda, q_block=None, k_block=None):
    """Bytes of workspace the op needs (0 for full precision and on the CPU)."""
    return _C.attention_workspace_size(mode_id(mode), int(batch), int(heads), int(seq_q), int(seq_kv), int(head_dim),
                                       bool(cuda), _block(q_block, "q_block"), _block(k_block, "k_block"))


def _torch_kernel_layout(t):
    """t as the CUDA kernels read it: head dim contiguous, 16-byte aligned rows (else a copy)."""
    if t.stride(-1) != 1 or (t.is_cuda and (t.data_ptr() % 16 or any(s % 8 for s in t.stride()[:3]))):
        return t.contiguous()
    return t


def _run(q, k, v, out, lse, scale, mode, q_block, k_block):
    """Call libcquant with every buffer given; allocates only the workspace."""
    (b, sq, h, d), skv = _check_shapes(q, k, v)
    nbytes = _C.attention_workspace_size(mode, b, h, sq, skv, d, is_cuda(q), q_block, k_block)
    workspace = empty(q, (nbytes,), "uint8") if nbytes else None
    _C.attention(q, k, v, out, scale, mode, lse=lse, workspace=workspace, q_block=q_block, k_block=k_block,
                 stream=stream_of(q))


def attention(q, k, v, *, scale=None, mode="bf16", return_lse=False, out=None, q_block=None, k_block=None):
    """Softmax attention without mask, in diffusers' [batch, seq, heads, head_dim] layout.

    q: [B, Sq, H, D]; k, v: [B, Skv, H, D], one dtype (bfloat16 or float16 on CUDA; float32
    as well on the CPU). scale defaults to 1/sqrt(D). mode "bf16" computes in the inputs'
    precision with fp32 accumulation; "int8" quantizes Q and K to int8 per block (K smoothed by
    its per-channel mean) and P and V to fp8 e4m3 (CUDA: sm_89 or newer). q_block/k_block
    set the 8-bit block sizes (default 32 query rows, 64 keys).

    Returns out [B, Sq, H, D] in q's dtype, or (out, lse) with lse float32 [B, H, Sq] when
    return_lse. out= takes a preallocated output.
    """
    m = mode_id(mode)
    (b, sq, h, d), _ = _check_shapes(q, k, v)
    s = _scale_of(scale, d)
    qb, kb = _block(q_block, "q_block"), _block(k_block, "k_block")
    if framework_of(q) == "torch" and out is None:
        o, lse = _torch_op()(q, k, v, s, m, bool(return_lse), qb, kb)
        return (o, lse) if return_lse else o
    o = out if out is not None else empty(q, (b, sq, h, d), dtype_name(q))
    lse = empty(q, (b, h, sq), "float32") if return_lse else None
    _run(q, k, v, o, lse, s, m, qb, kb)
    return (o, lse) if return_lse else o


_OP = None


def _torch_op():
    """torch.ops.cquant.attention, registered on first use."""
    global _OP
    if _OP is None:
        _OP = _register_torch_op()
    return _OP


def _register_torch_op():
    import torch

    if hasattr(torch.ops, "cquant") and hasattr(torch.ops.cquant, "attention"):
        return torch.ops.cquant.attention

    @torch.library.custom_op("cquant::attention", mutates_args=())
    def attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mode: int, return_lse: bool,
                     q_block: int, k_block: int) -> tuple[torch.Tensor, torch.Tensor]:
        b, sq, h, d = q.shape
        q, k, v = (_torch_kernel_layout(t) for t in (q, k, v))
        out = torch.empty((b, sq, h, d), dtype=q.dtype, device=q.device)
        lse = torch.empty((b, h, sq) if return_lse else (0,), dtype=torch.float32, device=q.device)
        _run(q, k, v, out, lse if return_lse else None, scale, mode, q_block, k_block)
        return out, lse

    @attention_op.register_fake
    def _(q, k, v, scale, mode, return_lse, q_block, k_block):
        b, sq, h, d = q.shape
        out = q.new_empty((b, sq, h, d))
        lse = q.new_empty((b, h, sq) if return_lse else (0,), dtype=torch.float32)
        return out, lse

    return torch.ops.cquant.attention


def register_torch_op():
    """Register torch.ops.cquant.attention now (cquant does it on first use otherwise)."""
    return _torch_op()
