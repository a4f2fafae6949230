"""libcquant's ops as torch custom ops: torch.ops.cquant.linear / quantize / dequantize /
norm_modulate / qk_norm_rope / attention.

Registered with torch.library (custom_op + register_fake), so torch.compile(fullgraph=True) sees
each as one opaque node with known output shapes, and CUDA-graph capture works: outputs and the
workspace come from torch.empty on the input's device (the caching allocator, or the graph's
pool while capturing) and the work is enqueued on torch's current stream. Nothing here
synchronizes.

Format and granularity arguments are libcquant's integers (cquant.schemes.Scheme.c_args); the
weight group size of the 4-bit schemes (granularity "group" or "two_level") is the last argument of every
linear op (weight_group_size, 0 for the other schemes), and group_size that of quantize and
dequantize. Stored codes are int8 for the int8 format and uint8 bytes for every other format
(fp8 codes as raw bytes, fpX and 4-bit bit-packed rows); 4-bit scales are [rows, G] (int4),
[rows, G, 2] (uint4: scale and zero point) or [rows, 1 + G] (two-level int4: s1, then each
group's s2) with G = cols / group_size.
"""

from typing import Optional

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from . import _C, ops

__all__ = ["linear", "linear_quantized", "linear_gated", "linear_out", "linear_quantized_out", "quantize", "dequantize", "attention",
           "norm_modulate", "qk_norm_rope"]


# With DLPack's C exchange table, cquant._C asks torch for its current stream itself (None).
_TORCH_REPORTS_STREAM = hasattr(torch.Tensor, "__dlpack_c_exchange_api__")


def _stream(t):
    if not t.is_cuda:
        return 0
    return None if _TORCH_REPORTS_STREAM else torch.cuda.current_stream(t.device).cuda_stream


def direct_call_ok(*tensors):
    """Whether the cquant ops may skip torch's dispatcher (the *_impl functions) for these inputs.

    torch.ops.cquant.* costs microseconds of dispatch per call, a few ms over a transformer step.
    Plain eager inference does not need it: no tracing (torch.compile), no dispatch mode (fake
    tensors, FlopCounter), no tensor subclass and no gradient to record.
    """
    if torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None:
        return False
    grad = torch.is_grad_enabled()
    for t in tensors:
        if t is not None and (type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter
                              or grad and t.requires_grad):
            return False
    return True


def ops_for(*tensors):
    """The linear-layer ops to call on these inputs: DIRECT (the bodies, no dispatcher) where
    direct_call_ok allows it, else DISPATCHED (torch.ops.cquant.*). The one place that chooses."""
    return DIRECT if direct_call_ok(*tensors) else DISPATCHED


def _dims(t, name, least, what):
    """t, refused with a ValueError naming it when it has fewer than `least` dims (`what` says
    which): read before libcquant's own checks, a shape index of a scalar would be an IndexError."""
    if t.dim() < least:
        raise ValueError(f"{name} has {t.dim()} dims (shape {tuple(t.shape)}); expected at least {least} ({what})")
    return t


def _plain(t):
    """A tensor libcquant can import: no autograd history, no lazy negation, contiguous.

    DLPack carries no negative bit, so a view that has one (torch._neg_view, .conj().imag)
    would be read without it: it is resolved into memory first. (The conjugate bit only exists
    on complex tensors, which libcquant refuses anyway.) Each step costs nothing when not
    needed: this runs for every tensor of every call."""
    return None if t is None else _detached(t).contiguous()


def _detached(t):
    """t without autograd history or a lazy negative bit (DLPack carries neither)."""
    if t.requires_grad:
        t = t.detach()
    if t.is_neg():
        t = t.resolve_neg()
    return t


def _row_strided(t):
    """t as libcquant reads an operand whose rows may lie apart (a column slice, a chunk of a wider
    tensor): no autograd history, no lazy negation, and its strides kept where the last dim is
    contiguous and the flattened rows one stride (>= the row length) apart, else a contiguous copy."""
    t = _detached(t)
    if t.dim() >= 1 and (t.shape[-1] == 1 or t.stride(-1) == 1):
        try:
            rows = t.view(-1, t.shape[-1])  # a view exists exactly when the rows are one stride apart
        except RuntimeError:
            rows = None
        if rows is not None and (rows.shape[0] <= 1 or rows.stride(0) >= t.shape[-1]):
            return t
    return t.contiguous()


def _gate_rows(gate):
    """gate [G, N] with its last dim contiguous; any row stride (a chunk of the modulation vector)."""
    gate = _detached(gate)
    if gate.dim() == 2 and (gate.shape[-1] > 1 and gate.stride(-1) != 1 or gate.stride(0) < 0):
        gate = gate.contiguous()
    return gate


def _check_empty_linear(x, w, w_scale, bias, y_dtype, weight_format, weight_granularity, act_format, act_granularity,
                        in_features, activation, weight_group_size, x_scale=None):
    """What libcquant checks of a linear op's arguments, for the empty calls it never sees (no rows
    or no outputs): arguments it refuses are refused whatever the batch. x is the activations or,
    for linear_quantized (x_scale given), their codes."""
    k = int(x.shape[-1])
    _C.linear_min_compute_capability(weight_format, weight_granularity, act_format, act_granularity,
                                     weight_group_size=weight_group_size)
    if activation not in (_C.ACTIVATION_NONE, _C.ACTIVATION_GELU_TANH):
        raise ValueError(f"activation = {activation}; expected ACTIVATION_NONE ({_C.ACTIVATION_NONE}) or "
                         f"ACTIVATION_GELU_TANH ({_C.ACTIVATION_GELU_TANH})")
    if k < 1:  # else y's rows, which nothing would write, came back uninitialised
        raise ValueError("x has no features (a last dim of 0); expected in_features >= 1")
    if in_features > 0 and k != in_features:
        raise ValueError(f"x has {k} features in its last dim; expected in_features = {in_features}")
    n = int(w.shape[0])
    if n == 0:
        return
    # w, its scales and the bias go through libcquant's own checks, with one row of zeros for x
    x1 = x.new_zeros((1, k))
    y1 = torch.empty((1, n), dtype=y_dtype, device=x.device)
    workspace = _linear_workspace(x1, weight_format, weight_granularity, act_format, act_granularity, in_features, 1,
                                  n, weight_group_size)
    common = dict(workspace=workspace, stream=_stream(x), activation=activation, weight_group_size=weight_group_size)
    if x_scale is None:
        _C.linear(x1, _plain(w), _plain(w_scale), _plain(bias), y1, weight_format, weight_granularity, act_format,
                  act_granularity, in_features, **common)
    else:
        if x_scale.numel() > 1:
            raise ValueError(f"x_scale has {x_scale.numel()} elements; expected one per row of x_codes (none here) "
                             f"or one for the tensor")
        _C.linear_quantized(x1, torch.ones(1, device=x.device), _plain(w), _plain(w_scale), _plain(bias), y1,
                            weight_format, weight_granularity, act_format, act_granularity, in_features, **common)


def _linear_workspace(x, weight_format, weight_granularity, act_format, act_granularity, in_features, m, n,
                      weight_group_size=0):
    nbytes = _C.linear_workspace_size(weight_format, weight_granularity, act_format, act_granularity,
                                      in_features, m, n, x.is_cuda, weight_group_size=weight_group_size)
    return torch.empty(nbytes, dtype=torch.uint8, device=x.device) if nbytes else None


def linear_impl(x, w, w_scale, bias, weight_format, weight_granularity, act_format, act_granularity, in_features,
                activation=0, weight_group_size=0):
    """The body of cquant::linear, callable without torch's dispatcher (see direct_call_ok)."""
    x = _plain(_dims(x, "x", 1, "[..., in_features]"))
    y = torch.empty((*x.shape[:-1], int(_dims(w, "w", 1, "[out_features, stored row]").shape[0])), dtype=x.dtype,
                    device=x.device)
    linear_out_impl(x, w, w_scale, bias, y, weight_format, weight_granularity, act_format, act_granularity,
                    in_features, activation, weight_group_size)
    return y


@torch.library.custom_op("cquant::linear", mutates_args=())
def linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, bias: Optional[torch.Tensor],
           weight_format: int, weight_granularity: int, act_format: int, act_granularity: int,
           in_features: int, activation: int = 0, weight_group_size: int = 0) -> torch.Tensor:
    """y [..., N] (x's dtype) = act(x [..., K] W^T + bias); W stored as codes w [N, row bytes] and
    fp32 scales w_scale [N] or [1] (4-bit weights: [N, G] or [N, G, 2] per group of
    weight_group_size columns); activation a cq_activation; see cq_linear in cquant.h."""
    return linear_impl(x, w, w_scale, bias, weight_format, weight_granularity, act_format, act_granularity,
                       in_features, activation, weight_group_size)


@linear.register_fake
def _linear_fake(x, w, w_scale, bias, weight_format, weight_granularity, act_format, act_granularity, in_features,
                 activation=0, weight_group_size=0):
    return x.new_empty((*x.shape[:-1], w.shape[0]))


def linear_gated_impl(x, w, w_scale, bias, gate, residual, weight_format, weight_granularity, act_format,
                      act_granularity, in_features, activation=0, weight_group_size=0):
    """The body of cquant::linear_gated, callable without torch's dispatcher (see direct_call_ok)."""
    x = _plain(_dims(x, "x", 1, "[..., in_features]"))
    n = int(_dims(w, "w", 1, "[out_features, stored row]").shape[0])
    y = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    if x.numel() == 0 or n == 0:
        _check_empty_linear(x, w, w_scale, bias, y.dtype, weight_format, weight_granularity, act_format,
                            act_granularity, in_features, activation, weight_group_size)
        if tuple(residual.shape) != tuple(y.shape):
            raise ValueError(f"residual has shape {tuple(residual.shape)}; expected y's {tuple(y.shape)}")
        return y
    m = x.numel() // max(int(x.shape[-1]), 1)
    workspace = _linear_workspace(x, weight_format, weight_granularity, act_format, act_granularity, in_features, m, n,
                                  weight_group_size)
    _C.linear_gated(x, _plain(w), _plain(w_scale), _plain(bias), _gate_rows(gate), _row_strided(residual), y,
                    weight_format, weight_granularity, act_format, act_granularity, in_features, workspace=workspace,
                    stream=_stream(x), activation=activation, weight_group_size=weight_group_size)
    return y


@torch.library.custom_op("cquant::linear_gated", mutates_args=())
def linear_gated(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, bias: Optional[torch.Tensor],
                 gate: torch.Tensor, residual: torch.Tensor, weight_format: int, weight_granularity: int,
                 act_format: int, act_granularity: int, in_features: int, activation: int = 0,
                 weight_group_size: int = 0) -> torch.Tensor:
    """y [..., N] (x's dtype) = residual + gate[g] * act(x [..., K] W^T + bias), fp32, one rounding:
    adaLN-Zero's gated residual in the layer's epilogue. gate [G, N] (last dim contiguous, any row
    stride); x's M rows hold G samples of M / G rows each. residual [..., N] in x's dtype. See
    cq_linear_gated in cquant.h."""
    return linear_gated_impl(x, w, w_scale, bias, gate, residual, weight_format, weight_granularity, act_format,
                             act_granularity, in_features, activation, weight_group_size)


@linear_gated.register_fake
def _linear_gated_fake(x, w, w_scale, bias, gate, residual, weight_format, weight_granularity, act_format,
                       act_granularity, in_features, activation=0, weight_group_size=0):
    return x.new_empty((*x.shape[:-1], w.shape[0]))


def linear_out_impl(x, w, w_scale, bias, y, weight_format, weight_granularity, act_format, act_granularity,
                    in_features, activation=0, weight_group_size=0):
    """The body of cquant::linear_out, callable without torch's dispatcher: cquant::linear into y."""
    if y.is_neg():
        raise ValueError("y is a view with a lazy negative bit; expected a plain output tensor")
    x = _plain(_dims(x, "x", 1, "[..., in_features]"))
    n = int(_dims(w, "w", 1, "[out_features, stored row]").shape[0])
    if x.numel() == 0 or n == 0:
        _check_empty_linear(x, w, w_scale, bias, y.dtype, weight_format, weight_granularity, act_format,
                            act_granularity, in_features, activation, weight_group_size)
        if tuple(y.shape) != (*x.shape[:-1], n):
            raise ValueError(f"y has shape {tuple(y.shape)}; expected {(*x.shape[:-1], n)}")
        return
    m = x.numel() // max(int(x.shape[-1]), 1)
    workspace = _linear_workspace(x, weight_format, weight_granularity, act_format, act_granularity, in_features, m, n,
                                  weight_group_size)
    # y as it is (a column slice stays one): libcquant writes its rows where they lie
    _C.linear(x, _plain(w), _plain(w_scale), _plain(bias), y.detach(), weight_format, weight_granularity,
              act_format, act_granularity, in_features, workspace=workspace, stream=_stream(x), activation=activation,
              weight_group_size=weight_group_size)


@torch.library.custom_op("cquant::linear_out", mutates_args=("y",))
def linear_out(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, bias: Optional[torch.Tensor],
               y: torch.Tensor, weight_format: int, weight_granularity: int, act_format: int, act_granularity: int,
               in_features: int, activation: int = 0, weight_group_size: int = 0) -> None:
    """cquant::linear written into y [..., N] (x's dtype, last dim contiguous, rows one stride apart):
    y may be a column slice y_full[..., a:b] of a wider tensor, so layers write side by side into
    one buffer; the columns outside it are not touched."""
    linear_out_impl(x, w, w_scale, bias, y, weight_format, weight_granularity, act_format, act_granularity,
                    in_features, activation, weight_group_size)


@linear_out.register_fake
def _linear_out_fake(x, w, w_scale, bias, y, weight_format, weight_granularity, act_format, act_granularity,
                     in_features, activation=0, weight_group_size=0):
    return None


def linear_quantized_impl(x_codes, x_scale, w, w_scale, bias, weight_format, weight_granularity, act_format,
                          act_granularity, in_features, out_dtype, activation=0, weight_group_size=0):
    """The body of cquant::linear_quantized, callable without torch's dispatcher."""
    _dims(x_codes, "x_codes", 1, "[..., in_features]")
    y = torch.empty((*x_codes.shape[:-1], int(_dims(w, "w", 1, "[out_features, stored row]").shape[0])),
                    dtype=out_dtype, device=x_codes.device)
    linear_quantized_out_impl(x_codes, x_scale, w, w_scale, bias, y, weight_format, weight_granularity, act_format,
                              act_granularity, in_features, activation, weight_group_size)
    return y


@torch.library.custom_op("cquant::linear_quantized", mutates_args=())
def linear_quantized(x_codes: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                     bias: Optional[torch.Tensor], weight_format: int, weight_granularity: int, act_format: int,
                     act_granularity: int, in_features: int, out_dtype: torch.dtype,
                     activation: int = 0, weight_group_size: int = 0) -> torch.Tensor:
    """linear for activations already quantized by cquant::quantize (codes [..., K], scales
    [rows] or [1]): y [..., N] in out_dtype; see cq_linear_quantized in cquant.h."""
    return linear_quantized_impl(x_codes, x_scale, w, w_scale, bias, weight_format, weight_granularity, act_format,
                                 act_granularity, in_features, out_dtype, activation, weight_group_size)


@linear_quantized.register_fake
def _linear_quantized_fake(x_codes, x_scale, w, w_scale, bias, weight_format, weight_granularity, act_format,
                           act_granularity, in_features, out_dtype, activation=0, weight_group_size=0):
    return x_codes.new_empty((*x_codes.shape[:-1], w.shape[0]), dtype=out_dtype)


def linear_quantized_out_impl(x_codes, x_scale, w, w_scale, bias, y, weight_format, weight_granularity, act_format,
                              act_granularity, in_features, activation=0, weight_group_size=0):
    """The body of cquant::linear_quantized_out: cquant::linear_quantized into y (its dtype is the
    output type; a column slice stays one)."""
    if y.is_neg():
        raise ValueError("y is a view with a lazy negative bit; expected a plain output tensor")
    _dims(x_codes, "x_codes", 1, "[..., in_features]")
    n = int(_dims(w, "w", 1, "[out_features, stored row]").shape[0])
    if x_codes.numel() == 0 or n == 0:
        _check_empty_linear(x_codes, w, w_scale, bias, y.dtype, weight_format, weight_granularity, act_format,
                            act_granularity, in_features, activation, weight_group_size, x_scale=x_scale)
        if tuple(y.shape) != (*x_codes.shape[:-1], n):
            raise ValueError(f"y has shape {tuple(y.shape)}; expected {(*x_codes.shape[:-1], n)}")
        return
    m = x_codes.numel() // max(int(x_codes.shape[-1]), 1)
    workspace = _linear_workspace(x_codes, weight_format, weight_granularity, act_format, act_granularity,
                                  in_features, m, n, weight_group_size)
    _C.linear_quantized(_plain(x_codes), _plain(x_scale), _plain(w), _plain(w_scale), _plain(bias), y.detach(),
                        weight_format, weight_granularity, act_format, act_granularity, in_features,
                        workspace=workspace, stream=_stream(x_codes), activation=activation,
                        weight_group_size=weight_group_size)


@torch.library.custom_op("cquant::linear_quantized_out", mutates_args=("y",))
def linear_quantized_out(x_codes: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                         bias: Optional[torch.Tensor], y: torch.Tensor, weight_format: int, weight_granularity: int,
                         act_format: int, act_granularity: int, in_features: int, activation: int = 0,
                         weight_group_size: int = 0) -> None:
    """cquant::linear_quantized written into y [..., N] (last dim contiguous, rows one stride
    apart): a column slice of a wider tensor, as for cquant::linear_out."""
    linear_quantized_out_impl(x_codes, x_scale, w, w_scale, bias, y, weight_format, weight_granularity, act_format,
                              act_granularity, in_features, activation, weight_group_size)


@linear_quantized_out.register_fake
def _linear_quantized_out_fake(x_codes, x_scale, w, w_scale, bias, y, weight_format, weight_granularity, act_format,
                               act_granularity, in_features, activation=0, weight_group_size=0):
    return None


@torch.library.custom_op("cquant::dequantize", mutates_args=())
def dequantize(q: torch.Tensor, scale: torch.Tensor, format: int, granularity: int, cols: int,
               dtype: torch.dtype, group_size: int = 0) -> torch.Tensor:
    """y [rows, cols] in dtype = decode(q) * scale (q: codes [rows, row bytes]; 4-bit codes per
    group of group_size columns, uint4 as (code - zero point) * scale)."""
    if cols < 1:
        raise ValueError(f"cols = {cols}; expected a positive number of columns")
    row = _C.packed_row_bytes(format, cols)
    if int(_dims(q, "q", 1, "[rows, stored row]").shape[-1]) != row:  # before y is allocated: cols may be huge
        raise ValueError(f"q has {int(q.shape[-1])} codes or bytes per row, but cols = {cols} of format {format} take "
                         f"{row}")
    y = torch.empty((int(q.shape[0]), cols), dtype=dtype, device=q.device)
    if y.numel():
        _C.dequantize(_plain(q), _plain(scale), y, format, granularity, stream=_stream(q), group_size=group_size)
    return y


@dequantize.register_fake
def _dequantize_fake(q, scale, format, granularity, cols, dtype, group_size=0):
    return q.new_empty((q.shape[0], cols), dtype=dtype)


def _code_dtype(format):
    return torch.int8 if format == _C.FORMAT_INT8 else torch.uint8


def _scale_shape(format, granularity, group_size, rows, cols):
    """Shape of the fp32 scales quantize makes: [rows], [1], per group [rows, G] / [rows, G, 2], or
    two-level [rows, 1 + G]."""
    if granularity in (_C.GRANULARITY_GROUP, _C.GRANULARITY_TWO_LEVEL):
        if group_size < 1 or cols % group_size:
            raise ValueError(f"group_size = {group_size} does not divide x's {cols} columns; expected whole groups")
        if granularity == _C.GRANULARITY_TWO_LEVEL:
            return (rows, 1 + cols // group_size)
        per_group = ops.format_info(format).scales_per_group
        return (rows, cols // group_size) + ((per_group,) if per_group > 1 else ())
    return (rows if granularity == _C.GRANULARITY_ROW else 1,)


def quantize_impl(x, format, granularity, group_size=0):
    """The body of cquant::quantize, callable without torch's dispatcher."""
    x = _plain(_dims(x, "x", 1, "[..., cols]"))
    cols = int(x.shape[-1])
    rows = x.numel() // max(cols, 1)
    if cols < 1:
        raise ValueError("x has no columns (a last dim of 0); expected cols >= 1")
    q = torch.empty((rows, _C.packed_row_bytes(format, cols)), dtype=_code_dtype(format), device=x.device)
    s = torch.empty(_scale_shape(format, granularity, group_size, rows, cols), dtype=torch.float32, device=x.device)
    if rows:
        _C.quantize(x, q, s, format, granularity, static_scale=False, stream=_stream(x), group_size=group_size)
    else:  # libcquant checks the arguments on one row of zeros; a tensor scale is then the empty x's (amax 0)
        x1 = x.new_zeros((1, cols))
        q1 = torch.empty((1, q.shape[1]), dtype=q.dtype, device=x.device)
        s1 = torch.empty(_scale_shape(format, granularity, group_size, 1, cols), dtype=torch.float32, device=x.device)
        _C.quantize(x1, q1, s1, format, granularity, static_scale=False, stream=_stream(x), group_size=group_size)
        if s.numel():
            s.copy_(s1)
    return q, s


@torch.library.custom_op("cquant::quantize", mutates_args=())
def quantize(x: torch.Tensor, format: int, granularity: int, group_size: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes [rows, row bytes], fp32 scales [rows] or [1], or per group of group_size columns
    [rows, G] (int4) / [rows, G, 2] (uint4)) of x [..., cols]."""
    return quantize_impl(x, format, granularity, group_size)


@quantize.register_fake
def _quantize_fake(x, format, granularity, group_size=0):
    cols = x.shape[-1]
    rows = x.numel() // cols
    q = x.new_empty((rows, _C.packed_row_bytes(format, cols)), dtype=_code_dtype(format))
    s = x.new_empty(_scale_shape(format, granularity, group_size, rows, cols), dtype=torch.float32)
    return q, s



def _strided(t):
    """t as libcquant's strided readers take it (qk_norm_rope's q/k/v, norm_modulate's scale and
    shift): no autograd history, no lazy negation, last dim contiguous, every other stride kept,
    so a view of a fused QKV projection or a chunk of the modulation vector is read in place."""
    if t is None:
        return None
    t = _detached(t)
    if t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
        t = t.contiguous()
    return t


def _written(t):
    """An output written in place: never copied (the caller reads this very memory afterwards)."""
    return t.detach() if t is not None and t.requires_grad else t


def _norm_modulate_out_dtype(x, out_format):
    return x.dtype if out_format == _C.FORMAT_NONE else _code_dtype(out_format)


def norm_modulate_impl(x, scale, shift, norm, eps, out_format):
    """The body of cquant::norm_modulate, callable without torch's dispatcher."""
    x = _plain(x)
    out = torch.empty(x.shape, dtype=_norm_modulate_out_dtype(x, out_format), device=x.device)
    quantized = out_format != _C.FORMAT_NONE
    rows = x.numel() // max(int(x.shape[-1]), 1) if x.dim() else 1
    out_scale = torch.empty((rows if quantized else 0,), dtype=torch.float32, device=x.device)
    if x.numel():
        _C.norm_modulate(x, _strided(scale), _strided(shift), out, out_scale if quantized else None, norm, eps,
                         out_format, stream=_stream(x))
    elif x.dim() == 3:  # libcquant checks the arguments on a stand-in with every empty dim made 1
        _check_empty_norm_modulate(x, scale, shift, norm, eps, out_format)
    else:
        raise ValueError(f"x has {x.dim()} dims; expected 3 ([batch, seq, dim])")
    return out, out_scale


def _check_empty_norm_modulate(x, scale, shift, norm, eps, out_format):
    b, d = int(x.shape[0]), int(x.shape[2])

    def stand_in(m):  # a modulation of x's [batch, dim] gets the stand-in's; any other keeps its shape
        return m.new_zeros((max(b, 1), max(d, 1))) if m is not None and tuple(m.shape) == (b, d) else m

    x1 = x.new_zeros(tuple(max(int(n), 1) for n in x.shape))
    out1 = torch.empty(x1.shape, dtype=_norm_modulate_out_dtype(x, out_format), device=x.device)
    rows1 = x1.shape[0] * x1.shape[1]
    out_scale1 = torch.empty((rows1,), dtype=torch.float32, device=x.device) if out_format != _C.FORMAT_NONE else None
    _C.norm_modulate(x1, _strided(stand_in(scale)), _strided(stand_in(shift)), out1, out_scale1, norm, eps, out_format,
                     stream=_stream(x))


@torch.library.custom_op("cquant::norm_modulate", mutates_args=())
def norm_modulate(x: torch.Tensor, scale: Optional[torch.Tensor], shift: Optional[torch.Tensor], norm: int,
                  eps: float, out_format: int) -> tuple[torch.Tensor, torch.Tensor]:
    """LayerNorm (norm = _C.NORM_LAYER) or RMSNorm (_C.NORM_RMS), no affine parameters, of x
    [B, S, D] with adaLN modulation n * (1 + scale[b]) + shift[b] (scale, shift [B, D], last dim
    contiguous, e.g. chunks of the modulation vector; None: 0). Returns (out [B, S, D], out_scale):
    out_format FORMAT_NONE gives out in x's dtype and an empty fp32 out_scale [0]; FORMAT_INT8 /
    FORMAT_FP8_E4M3 give the codes (int8 / uint8 bytes) and fp32 per-row scales [B * S] that
    quantize would give for the modulated values. See cq_norm_modulate in cquant.h."""
    return norm_modulate_impl(x, scale, shift, norm, eps, out_format)


@norm_modulate.register_fake
def _norm_modulate_fake(x, scale, shift, norm, eps, out_format):
    quantized = out_format != _C.FORMAT_NONE
    rows = x.numel() // x.shape[-1] if x.dim() else 1
    out = x.new_empty(x.shape, dtype=_norm_modulate_out_dtype(x, out_format))
    return out, x.new_empty((rows if quantized else 0,), dtype=torch.float32)


def qk_norm_rope_impl(q_in, k_in, v_in, q_weight, k_weight, cos, sin, q_out, k_out, v_out, rms_norm, eps,
                      seq_offset):
    """The body of cquant::qk_norm_rope, callable without torch's dispatcher."""
    _C.qk_norm_rope(_strided(q_in), _strided(k_in), _strided(v_in), _plain(q_weight), _plain(k_weight), _plain(cos),
                    _plain(sin), _written(q_out), _written(k_out), _written(v_out), bool(rms_norm), float(eps),
                    int(seq_offset), stream=_stream(q_in))


@torch.library.custom_op("cquant::qk_norm_rope", mutates_args=("q_out", "k_out", "v_out"))
def qk_norm_rope(q_in: torch.Tensor, k_in: torch.Tensor, v_in: Optional[torch.Tensor],
                 q_weight: Optional[torch.Tensor], k_weight: Optional[torch.Tensor], cos: Optional[torch.Tensor],
                 sin: Optional[torch.Tensor], q_out: torch.Tensor, k_out: torch.Tensor, v_out: Optional[torch.Tensor],
                 rms_norm: bool, eps: float, seq_offset: int) -> None:
    """Per token and head of q_in, k_in [B, S, H, D] (any strides, last dim contiguous): RMSNorm
    over D (rms_norm; weights q_weight / k_weight [D] or None), then the rotary embedding of pairs
    (2i, 2i+1) by cos, sin fp32 [S_total, D / 2] (None: no rotation); v_in (or None) copied. All
    written into rows seq_offset .. seq_offset + S of q_out, k_out, v_out [B, S_total, H, D] (q_in's
    dtype, any strides, last dim contiguous); other rows are left alone. See cq_qk_norm_rope."""
    qk_norm_rope_impl(q_in, k_in, v_in, q_weight, k_weight, cos, sin, q_out, k_out, v_out, rms_norm, eps, seq_offset)


@qk_norm_rope.register_fake
def _qk_norm_rope_fake(q_in, k_in, v_in, q_weight, k_weight, cos, sin, q_out, k_out, v_out, rms_norm, eps,
                       seq_offset):
    return None


class _LinearOps:
    """The ops of a transformer block's layers (linear, linear_quantized, quantize, linear_gated,
    linear_out, linear_quantized_out, norm_modulate, qk_norm_rope), either the bodies or the
    dispatcher's ops."""

    __slots__ = ("linear", "linear_quantized", "quantize", "linear_gated", "linear_out", "linear_quantized_out",
                 "norm_modulate", "qk_norm_rope")

    def __init__(self, **ops):
        for name in self.__slots__:
            setattr(self, name, ops[name])


DIRECT = _LinearOps(linear=linear_impl, linear_quantized=linear_quantized_impl, quantize=quantize_impl,
                    linear_gated=linear_gated_impl, linear_out=linear_out_impl,
                    linear_quantized_out=linear_quantized_out_impl, norm_modulate=norm_modulate_impl,
                    qk_norm_rope=qk_norm_rope_impl)
DISPATCHED = _LinearOps(linear=torch.ops.cquant.linear, linear_quantized=torch.ops.cquant.linear_quantized,
                        quantize=torch.ops.cquant.quantize, linear_gated=torch.ops.cquant.linear_gated,
                        linear_out=torch.ops.cquant.linear_out,
                        linear_quantized_out=torch.ops.cquant.linear_quantized_out,
                        norm_modulate=torch.ops.cquant.norm_modulate,
                        qk_norm_rope=torch.ops.cquant.qk_norm_rope)

# Backward of the quantized linear layer for adapters trained on a frozen quantized base
# (LoRA): dL/dx = dL/dy W with W dequantized in the gradient's dtype; activation quantization
# of dynamic schemes passes gradients straight through. The weight gets no gradient. With a
# fused GELU the backward keeps x (as a float linear layer does) and recomputes the
# pre-activation from it with the dequantized weight, instead of storing the pre-activation.
def _linear_setup_context(ctx, inputs, output):
    x, w, w_scale, bias, weight_format, weight_granularity, _, _, in_features, *rest = inputs
    ctx.activation = rest[0] if rest else 0
    fused = ctx.activation != _C.ACTIVATION_NONE
    # The codes only when x takes a gradient or a GELU's must be recomputed (a bias alone needs
    # nothing). Tensors made under torch.inference_mode (quantize_ inside it) cannot be saved,
    # and a float layer made there still runs outside it: those needed are copied.
    ctx.x_grad = x.requires_grad
    keep = ctx.x_grad or fused
    saved = (w if keep else None, w_scale if keep else None, x if fused else None, bias if fused else None)
    ctx.save_for_backward(*(t.clone() if t is not None and t.is_inference() else t for t in saved))
    ctx.weight_args = (weight_format, weight_granularity, in_features, rest[1] if len(rest) > 1 else 0)
    ctx.bias_grad = bias is not None and bias.requires_grad


def _linear_backward(ctx, grad):
    w, w_scale, x, bias = ctx.saved_tensors
    weight_format, weight_granularity, in_features, group_size = ctx.weight_args
    wd = None if w is None else dequantize(w, w_scale, weight_format, weight_granularity, in_features, grad.dtype,
                                           group_size)
    if ctx.activation == _C.ACTIVATION_GELU_TANH:
        pre = torch.nn.functional.linear(x.detach().to(grad.dtype), wd,
                                         None if bias is None else bias.detach().to(grad.dtype))
        grad = torch.ops.aten.gelu_backward(grad, pre, approximate="tanh")
    grad_x = grad @ wd if ctx.x_grad else None
    grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.bias_grad else None
    return grad_x, None, None, grad_bias, None, None, None, None, None, None, None


torch.library.register_autograd("cquant::linear", _linear_backward, setup_context=_linear_setup_context)


def _kernel_layout(t):
    """t as the CUDA attention kernels read it: head dim contiguous, 16-byte aligned rows, no lazy
    negation (else a copy)."""
    if t.is_neg():
        t = t.resolve_neg()
    if t.stride(-1) != 1 or (t.is_cuda and (t.data_ptr() % 16 or any(s % 8 for s in t.stride()[:3]))):
        return t.contiguous()
    return t


def _empty_attention(q, return_lse):
    """Attention with no batch, no queries or no keys: out is 0 (a softmax-weighted sum over no
    keys, as torch's SDPA gives), lse is log(0) = -inf."""
    b, sq, h, d = q.shape
    out = torch.zeros((b, sq, h, d), dtype=q.dtype, device=q.device)
    lse = torch.full((b, h, sq) if return_lse else (0,), float("-inf"), dtype=torch.float32, device=q.device)
    return out, lse


@torch.library.custom_op("cquant::attention", mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mode: int, return_lse: bool,
              q_block: int, k_block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, Sq, H, D] in q's dtype, lse fp32 [B, H, Sq] or [0]) of cq_attention (see cquant.h)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} has shape {tuple(t.shape)}; expected 4 dims [batch, seq, heads, head_dim]")
    b, sq, h, d = q.shape
    if b == 0 or sq == 0 or k.shape[1] == 0:
        ops.check_attention_shapes(q, k, v)
        ops.check_attention_call(q, k, v, scale, mode, q_block, k_block)
        return _empty_attention(q, return_lse)
    q, k, v = (_kernel_layout(t) for t in (q, k, v))
    out = torch.empty((b, sq, h, d), dtype=q.dtype, device=q.device)
    lse = torch.empty((b, h, sq) if return_lse else (0,), dtype=torch.float32, device=q.device)
    ops.attention_into(q, k, v, out, lse if return_lse else None, scale, mode, q_block, k_block)
    return out, lse


@attention.register_fake
def _attention_fake(q, k, v, scale, mode, return_lse, q_block, k_block):
    b, sq, h, d = q.shape
    out = q.new_empty((b, sq, h, d))
    lse = q.new_empty((b, h, sq) if return_lse else (0,), dtype=torch.float32)
    return out, lse


def _attention_backward(ctx, grad_out, grad_lse):
    # said here, not by torch's "no autograd formula was registered", which reads as a bug to fix
    raise NotImplementedError("cquant attention has no backward pass: its kernels are inference-only; train "
                              "with another attention (model.set_attention_backend(\"native\"))")


torch.library.register_autograd("cquant::attention", _attention_backward)
