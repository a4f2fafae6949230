"""Array-level ops of cquant: quantize, dequantize, quantized linear, fpX pack/unpack.

Every op takes any array with ``__dlpack__`` (NumPy, torch CPU/CUDA, CuPy), returns results
in the input's framework and on its device, and accepts ``out=`` buffers. The math of each op
is defined in csrc/include/cquant.h; on the CPU it runs the C reference, on CUDA the kernels.

Formats are named as in the format table ("int8", "fp8_e4m3", "fp8_e5m2", "int4", "uint4",
"fp6_e3m2", "fp6_e2m3", "fp5_e2m2", "fp4_e2m1", any "fpB_eEmM") or given by their numeric id.
The 4-bit integer formats int4 and uint4 take one scale (uint4: scale and zero point) per group
of group_size columns ("group" granularity); int4 also takes "two_level" scales: a row scale s1
and an integer multiplier s2 per group, [rows, 1 + G] (see cquant.h).
"""

import math
import operator
from dataclasses import dataclass

import numpy as np

from . import _C
from ._arrays import any_bit_from, check_writable, dtype_name, empty, is_cuda, readable, refuse_broadcast, stream_of

CudaError = _C.CudaError
VERSION = _C.VERSION
FORMAT_VERSION = _C.FORMAT_VERSION  # of every stored layout; saved checkpoints record it
GRANULARITIES = {"row": _C.GRANULARITY_ROW, "tensor": _C.GRANULARITY_TENSOR, "group": _C.GRANULARITY_GROUP,
                 "two_level": _C.GRANULARITY_TWO_LEVEL}
_GROUPED = (_C.GRANULARITY_GROUP, _C.GRANULARITY_TWO_LEVEL)  # granularities with a group size
# Group sizes of the 4-bit formats: powers of two in [GROUP_SIZE_MIN, GROUP_SIZE_MAX]
GROUP_SIZE_MIN, GROUP_SIZE_MAX, GROUP_SIZE_DEFAULT = _C.GROUP_SIZE_MIN, _C.GROUP_SIZE_MAX, _C.GROUP_SIZE_DEFAULT
ATTENTION_FULL, ATTENTION_INT8 = 0, 1  # cq_attention_mode
FORMAT_NONE = _C.FORMAT_NONE  # the act_format of weight-only schemes
NORM_LAYER, NORM_RMS = _C.NORM_LAYER, _C.NORM_RMS  # cq_norm_kind (norm_modulate)
# compute capability (x 10) the CUDA attention kernels of each mode need
MIN_CC_ATTENTION, MIN_CC_ATTENTION_INT8 = _C.MIN_CC_ATTENTION, _C.MIN_CC_ATTENTION_INT8
ATTENTION_MAX_HEAD_DIM = _C.ATTENTION_MAX_HEAD_DIM  # largest head dim of the CUDA attention / qk_norm_rope
# The 8-bit attention computes heads whose logit-error estimate (attention_int8_logit_error) exceeds this in
# full precision (cquant.h)
ATTENTION_INT8_MAX_LOGIT_ERROR = _C.ATTENTION_INT8_MAX_LOGIT_ERROR


@dataclass(frozen=True)
class FormatInfo:
    """One entry of libcquant's format table."""

    id: int
    name: str
    kind: str  # "int", "uint" (codes with a zero point per group) or "float"
    bits: int
    ebits: int
    mbits: int
    bias: int
    max_value: float
    max_code: int
    packed: bool
    code_dtype: str  # dtype of unpacked codes ("int8", "float8_e4m3fn", "uint8", ...)

    @property
    def grouped(self):
        """True for the 4-bit formats (int4, uint4): one scale per group of columns."""
        return self.name in ("int4", "uint4")

    @property
    def scales_per_group(self):
        """fp32 values stored per group: 2 for uint4 (scale, zero point), else 1."""
        return 2 if self.name == "uint4" else 1


FORMATS = {f["name"]: FormatInfo(**f) for f in _C.formats()}
_BY_ID = {f.id: f for f in FORMATS.values()}


def format_info(fmt, name="format"):
    """FormatInfo of a format name ("fp6_e3m2"), id, or FormatInfo; `name` is the argument's
    name in error messages."""
    if isinstance(fmt, FormatInfo):
        return fmt
    if isinstance(fmt, bool):
        raise TypeError(f"{name} must be a format name or id, got {fmt!r}")
    if isinstance(fmt, int):
        if fmt in _BY_ID:
            return _BY_ID[fmt]
        raise ValueError(f"{name} id {fmt} is not in cquant's format table")
    if isinstance(fmt, str):
        key = fmt.lower().replace("float8_e4m3fn", "fp8_e4m3").replace("float8_e5m2", "fp8_e5m2")
        if key in FORMATS:
            return FORMATS[key]
        raise ValueError(f"{name} {fmt!r} is unknown; expected one of {', '.join(FORMATS)}")
    raise TypeError(f"{name} must be a format name or id, got {type(fmt).__name__}")


def fpx_format(ebits, mbits):
    """FormatInfo of the fpX format with 1 sign, `ebits` exponent and `mbits` mantissa bits."""
    for name, value in (("ebits", ebits), ("mbits", mbits)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if ebits < 1 or mbits < 0 or not 3 <= 1 + ebits + mbits <= 7:
        raise ValueError(f"fpX needs ebits >= 1, mbits >= 0 and 3 <= 1 + ebits + mbits <= 7; got e{ebits}m{mbits}")
    return _BY_ID[0x100 + 0x10 * ebits + mbits]


def granularity_id(granularity, name="granularity"):
    if isinstance(granularity, str) and granularity in GRANULARITIES:
        return GRANULARITIES[granularity]
    raise ValueError(f"{name} must be 'row', 'tensor', 'group' or 'two_level', got {granularity!r}")


def check_group_size(group_size, name="group_size"):
    """group_size as an int: a power of two in [GROUP_SIZE_MIN, GROUP_SIZE_MAX]; TypeError /
    ValueError naming the argument otherwise."""
    g = _positive_int(group_size, name)
    if not GROUP_SIZE_MIN <= g <= GROUP_SIZE_MAX or g & (g - 1):
        raise ValueError(f"{name} = {g}; expected a power of two from {GROUP_SIZE_MIN} to {GROUP_SIZE_MAX}")
    return g


def _group_size_of(f, granularity, group_size, name):
    """The group size libcquant takes: group_size (GROUP_SIZE_DEFAULT when None) for "group" and
    "two_level", 0 otherwise (a group size given with another granularity is refused by libcquant)."""
    if granularity not in _GROUPED:
        if group_size is None or isinstance(group_size, bool):
            return 0 if group_size is None else int(group_size)
        try:
            return operator.index(group_size)
        except TypeError:
            raise TypeError(f"{name} must be an int, got {type(group_size).__name__}") from None
    return GROUP_SIZE_DEFAULT if group_size is None else check_group_size(group_size, name)


_settings = None


def settings():
    """libcquant's run-time switches as a dict: every CQUANT_* environment variable, read once
    (see the README's table). reload_settings() reads the environment again."""
    global _settings
    if _settings is None:
        _settings = _C.settings()
    return _settings


def reload_settings():
    """Read the CQUANT_* environment variables again (for programs that change them while running)."""
    global _settings
    _C.reload_settings()
    _settings = None


def built_with_cuda():
    """Whether libcquant was compiled with its CUDA kernels."""
    return bool(_C.built_with_cuda())


def build_info():
    """What libcquant was built with: version, cuda (bool), archs (';'-separated arches of the
    machine code, e.g. "80;89;90a"), ptx (the arch of the embedded PTX, "" for none), cuda_version
    (1000 * major + 10 * minor of the CUDA the kernels were compiled with; 0 CPU-only)."""
    return _C.build_info()


def cuda_runtime_info():
    """What the CUDA installation gives this process: runtime_version, driver_version (0: no
    driver), device_count, cublaslt_version (0: none could be opened), cublaslt_path,
    cublaslt_error. NotImplementedError in a CPU-only build."""
    return _C.cuda_runtime_info()


def cuda_device(device_index):
    """One CUDA device as cquant sees it: name, cc, sms, total_memory, kernels (whether cquant's
    kernels run on it), sm90a (whether this build's sm_90a kernels do), why_not."""
    return _C.cuda_device(int(device_index))


def cuda_compute_capability(device_index):
    """Compute capability (e.g. 90) of a CUDA device; CudaError if CUDA or the device is unavailable."""
    return _C.cuda_compute_capability(int(device_index))


def cuda_device_supported(device_index):
    """(True, "") if libcquant holds kernels it can run on this CUDA device, else (False, why):
    a build whose kernel images are all for other GPU generations. A libcquant without that
    query answers (True, ""), leaving the compute-capability check alone to decide."""
    query = getattr(_C, "cuda_device_supported", None)
    if query is None:
        return True, ""
    ok, reason = query(int(device_index))
    return bool(ok), str(reason or "")


def linear_workspace_size(c_args, in_features, m, n, *, cuda):
    """Bytes of workspace linear needs for m rows and n outputs of a scheme (c_args: libcquant's
    (weight_format, weight_granularity, act_format, act_granularity, weight_group_size); the group
    size may be left out for schemes without groups)."""
    group_size = c_args[4] if len(c_args) > 4 else 0
    return _C.linear_workspace_size(*c_args[:4], int(in_features), int(m), int(n), bool(cuda),
                                    weight_group_size=int(group_size))


def linear_min_compute_capability(weight_format, weight_granularity, act_format, act_granularity,
                                  weight_group_size=0):
    """Oldest CUDA compute capability (e.g. 89) whose kernels run a linear scheme (libcquant's ints)."""
    return _C.linear_min_compute_capability(weight_format, weight_granularity, act_format, act_granularity,
                                            weight_group_size=int(weight_group_size))


def packed_row_bytes(fmt, cols):
    """Bytes of one stored row of `cols` codes (packed and padded for fpX formats)."""
    return _C.packed_row_bytes(format_info(fmt).id, int(cols))


def format_values(fmt):
    """float32 NumPy array: the value of every code of a format, indexed by code."""
    return np.frombuffer(_C.format_values(format_info(fmt).id), dtype=np.float32).copy()


def _shape(a, name):
    """Shape of an array argument; TypeError naming it for anything else."""
    if not hasattr(a, "__dlpack__") or not hasattr(a, "shape"):
        raise TypeError(f"{name}: expected an array supporting DLPack (a NumPy array, torch tensor, CuPy "
                        f"array, ...), got {type(a).__name__}")
    return tuple(int(s) for s in a.shape)


def _rows(x, name="x"):
    shape = _shape(x, name)
    if not shape:
        raise ValueError(f"{name} is a scalar; expected at least 1 dimension")
    if 0 in shape:
        raise ValueError(f"{name} has a zero-size dimension (shape {shape}); expected every dimension >= 1")
    rows = 1
    for s in shape[:-1]:
        rows *= int(s)
    return rows, int(shape[-1])


def quantize(x, format="int8", granularity=None, *, scale=None, out=None, scale_out=None, group_size=None):
    """Quantize x [..., cols] (float32/float16/bfloat16) to codes and fp32 scales.

    Returns ``(q, scale)``: q is [rows, cols] codes (int8 for int8, float8 for fp8 in torch,
    uint8 for fp8 in NumPy) or, for packed formats (fpX, int4, uint4), uint8 [rows,
    packed_row_bytes(cols)]; scale is float32 [rows] ("row"), [1] ("tensor"), [rows, G]
    ("group", int4), [rows, G, 2] ("group", uint4: scale and zero point of each group) or
    [rows, 1 + G] ("two_level", int4: s1, then each group's s2), with G = cols / group_size. granularity defaults to "group" for int4 / uint4 and "row" otherwise;
    group_size (columns per group, a power of two from 32 to 1024 dividing cols) to
    GROUP_SIZE_DEFAULT. With ``scale=`` given, that static scale is used instead of one computed
    from the data (and returned as is; not for groups).
    """
    f = format_info(format)
    g = granularity_id(granularity if granularity is not None else ("group" if f.grouped else "row"))
    gs = _group_size_of(f, g, group_size, "group_size")
    rows, cols = _rows(refuse_broadcast(x, "x"))
    x, scale = readable(x), readable(scale) if scale is not None else None
    for name, buf in (("out", out), ("scale_out", scale_out)):
        if buf is not None:
            check_writable(buf, name)
    q = out if out is not None else empty(x, (rows, _C.packed_row_bytes(f.id, cols)), f.code_dtype)
    static = scale is not None
    if static:
        s = scale
    elif scale_out is not None:
        s = scale_out
    elif g in _GROUPED:
        if cols % gs:
            raise ValueError(f"group_size = {gs} does not divide x's {cols} columns; expected whole groups (group "
                             "tails are not supported)")
        if g == _C.GRANULARITY_TWO_LEVEL:
            s = empty(x, (rows, 1 + cols // gs), "float32")
        else:
            s = empty(x, (rows, cols // gs) + ((2,) if f.scales_per_group == 2 else ()), "float32")
    else:
        s = empty(x, (rows if g == _C.GRANULARITY_ROW else 1,), "float32")
    _C.quantize(x, q, s, f.id, g, static_scale=static, stream=stream_of(x), group_size=gs)
    return q, s


def dequantize(q, scale, format, *, cols=None, dtype="float32", granularity=None, out=None, group_size=None):
    """y [rows, cols] = decode(q) * scale, in `dtype` (or out's); (code - zp) * scale for uint4.
    dtype: "float32", "float16" or "bfloat16", by name or as a torch / NumPy dtype.

    `cols` is required for packed formats (their rows are padded, so several column counts
    share one row size) and defaults to out's or q's row length for the others; it must match q's
    stored rows and out's shape. Packed rows with bits set past code `cols` are refused: quantize
    leaves the padding zero, so they hold more columns than cols (on CUDA the row tails are read
    and waited for, except while a CUDA graph is being captured). granularity defaults to "group"
    for int4 / uint4, else to "tensor" when scale has one element and q more than one row, else
    "row". group_size defaults to cols / G, G the groups a row of scale holds ([rows, G],
    [rows, G, 2] or, "two_level", [rows, 1 + G]).
    """
    f = format_info(format)
    q_shape = _shape(q, "q")
    refuse_broadcast(q, "q")
    rows = q_shape[0] if q_shape else 1
    if cols is None:
        if f.packed:
            raise ValueError(f"cols is required to dequantize packed {f.name} rows: they are padded, so the "
                             "number of columns cannot be read from q")
        cols = int(out.shape[-1]) if out is not None else (q_shape[-1] if q_shape else 1)
        if cols < 1:
            raise ValueError(f"{'out' if out is not None else 'q'} has no columns; expected rows of at least one code")
    cols = _positive_int(cols, "cols")
    row = q_shape[-1] if len(q_shape) == 2 else None
    if row is not None and row != _C.packed_row_bytes(f.id, cols):
        raise ValueError(f"q has {row} {'bytes' if f.packed else 'codes'} per row, but cols = {cols} {f.name} codes "
                         f"take {_C.packed_row_bytes(f.id, cols)}")
    if out is not None:
        check_writable(out, "out")
        out_shape = _shape(out, "out")
        if out_shape != (rows, cols):
            raise ValueError(f"out has shape {out_shape}; expected (rows, cols) = ({rows}, {cols})")
    if granularity is None:
        granularity = "group" if f.grouped else "tensor" if _numel(scale, "scale") == 1 and rows != 1 else "row"
    g = granularity_id(granularity)
    if g in _GROUPED and group_size is None:
        group_size = _group_size_from_scale(scale, "scale", rows, cols, f, g)
    gs = _group_size_of(f, g, group_size, "group_size")
    q = readable(q)
    if f.packed and q_shape and q_shape[-1] == _C.packed_row_bytes(f.id, cols):
        _refuse_codes_past(q, "q", f.bits, cols, "quantize")
    y = out if out is not None else empty(q, (rows, cols), _float_dtype(dtype))
    _C.dequantize(q, readable(scale), y, f.id, g, stream=stream_of(q), group_size=gs)
    return y


FLOAT_DTYPES = ("float32", "float16", "bfloat16")  # of the values dequantize writes


def _float_dtype(dtype, name="dtype"):
    """libcquant's name of a result dtype given as a name ("bfloat16") or a torch / NumPy dtype;
    TypeError naming the argument for anything else (an unknown name was an AttributeError of torch)."""
    if isinstance(dtype, str):
        key = dtype
    elif type(dtype).__module__ == "torch":
        key = str(dtype).split(".")[-1]  # torch.bfloat16 -> "bfloat16"
    else:
        try:
            key = np.dtype(dtype).name if dtype is not None else None
        except TypeError:
            key = None
    if key not in FLOAT_DTYPES:
        raise TypeError(f"{name} = {dtype!r}; expected one of {', '.join(FLOAT_DTYPES)}")
    return key


def _group_size_from_scale(scale, name, rows, cols, f, granularity=_C.GRANULARITY_GROUP):
    """cols / G for group scales [rows, G] (uint4: [rows, G, 2], a scale and a zero point a group;
    two-level: [rows, 1 + G], s1 then each group's s2)."""
    shape = _shape(scale, name)
    two_level = granularity == _C.GRANULARITY_TWO_LEVEL
    width = f.scales_per_group
    lead = shape[:-1] if width == 1 else shape[:-2]
    groups = shape[-width] if len(shape) >= width and (width == 1 or shape[-1] == 2) else 0
    groups -= two_level  # column 0 holds s1
    if groups < 1 or math.prod(lead) != rows or cols % groups:
        want = f"[{rows}, 1 + G]" if two_level else f"[{rows}, G{', 2' if width == 2 else ''}]"
        raise ValueError(f"{name} has shape {shape}; expected fp32 {want} group scales of {f.name} with G "
                         f"dividing {cols} columns (or pass the group size)")
    return cols // groups


def _positive_int(value, name):
    """value as an int >= 1 (Python or NumPy integers); TypeError / ValueError naming it otherwise."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be a positive int, got {value!r}")
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be a positive int, got {type(value).__name__}") from None
    if value < 1:
        raise ValueError(f"{name} = {value}; expected a positive int")
    return value


def _numel(t, name):
    n = 1
    for s in _shape(t, name):
        n *= int(s)
    return n


def pack(codes, bits, *, out=None):
    """Bit-pack uint8 codes [rows, cols] (low `bits` bits each) into [rows, padded bytes]."""
    rows, cols = _rows(refuse_broadcast(codes, "codes"), "codes")
    if out is not None:
        check_writable(out, "out")
    packed = out if out is not None else empty(codes, (rows, _pack_bytes(bits, cols)), "uint8")
    _C.pack(readable(codes), packed, int(bits), stream=stream_of(codes))
    return packed


def copy_rows(src, dst):
    """dst = src, byte for byte (cq_copy_rows): views of one shape and dtype, 1 to 4 dims, the last
    contiguous. On CUDA the copy engines carry it, beside kernels; either view may be a peer GPU's
    memory mapped into this process (torch's symmetric memory). Returns dst."""
    check_writable(dst, "dst")
    _C.copy_rows(readable(src), dst, stream=stream_of(src))
    return dst


def wire_encode(x, codes, scales, *, mean=None, norms=None):
    """Rows of x [R0, .., cols] (2 to 5 dims; f32/f16/bf16), less mean (f32, same shape; strides 0
    broadcast it) where given, as int8 codes (same shape) and fp32 scales [R0, ..] with
    cq_quantize's int8 row math; norms [R0, ..] (optional) gets each decoded row's norm,
    scale * sqrt(sum code^2). Every argument may be a strided view whose last dim (of x, mean,
    codes) is contiguous, so rows go straight into a send buffer's layout (cq_wire_encode). A row
    holding NaN or Inf gets scale NaN and codes 0. Returns (codes, scales)."""
    for t, name in ((codes, "codes"), (scales, "scales"), (norms, "norms")):
        if t is not None:
            check_writable(t, name)
    _C.wire_encode(readable(x), codes, scales, mean=None if mean is None else readable(mean), norms=norms,
                   stream=stream_of(x))
    return codes, scales


def wire_decode(codes, scales, y, *, mean=None):
    """y = codes * scales, plus mean where given, in fp32 with each operation rounded, then to y's
    dtype: the inverse of wire_encode, into a strided view (cq_wire_decode). Returns y."""
    check_writable(y, "y")
    _C.wire_decode(readable(codes), readable(scales), y, mean=None if mean is None else readable(mean),
                   stream=stream_of(codes))
    return y


def unpack(packed, bits, cols, *, out=None):
    """Inverse of pack: uint8 codes [rows, cols]. Rows with non-zero bits past code `cols` (padding
    that pack leaves zero) are refused, as by dequantize."""
    rows, row = _rows(refuse_broadcast(packed, "packed"), "packed")
    cols = _positive_int(cols, "cols")
    if row != _pack_bytes(bits, cols):  # before the codes are allocated: cols may be huge
        raise ValueError(f"packed has {row} bytes per row, but cols = {cols} codes of {bits} bits take "
                         f"{_pack_bytes(bits, cols)}")
    if out is not None:
        check_writable(out, "out")
    packed = readable(packed)
    _refuse_codes_past(packed, "packed", bits, cols, "pack")
    codes = out if out is not None else empty(packed, (rows, cols), "uint8")
    _C.unpack(packed, codes, int(bits), stream=stream_of(packed))
    return codes


def _refuse_codes_past(packed, name, bits, cols, packer):
    """Refuse packed uint8 rows (of cols codes' row size) with a bit set past code `cols`: `packer`
    leaves the padding zero, so such rows hold more columns than cols says (several column counts
    share one padded row size)."""
    row_bytes, used = int(packed.shape[-1]), cols * bits
    if used == 8 * row_bytes or not any_bit_from(packed, used):
        return
    most = 8 * row_bytes // bits
    more = f"{cols + 1}" if cols + 1 == most else f"{cols + 1} to {most}"
    want = (f"the number of columns {name} was made with ({more} for rows of {row_bytes} bytes)"
            if cols < most else f"rows as {packer} writes them, with zero padding")
    raise ValueError(f"cols = {cols}, but {name}'s rows hold codes past column {cols} (non-zero bits in the padding, "
                     f"which {packer} leaves zero); expected {want}")


def _pack_bytes(bits, cols):
    if not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ValueError(f"bits = {bits!r}; expected an int in 1..8")
    raw = (int(cols) * bits + 7) // 8
    align = _C.PACK_ROW_ALIGN
    return (raw + align - 1) // align * align


def _linear_setup(x, w, w_scale, weight_format, act_format, act_granularity, weight_granularity, in_features,
                  buffers, weight_group_size=None):
    """(format ids and K as libcquant's linear takes them, rows of x, N, weight group size) of
    ops.linear's arguments; buffers: (name, array or None) of the outputs, checked writable."""
    wf = format_info(weight_format, "weight_format")
    af = format_info(act_format, "act_format") if act_format is not None else None
    rows, k_x = _rows(refuse_broadcast(x, "x"))
    if dict(buffers).get("out") is None and dtype_name(x) not in FLOAT_DTYPES:  # before y is made in x's dtype
        raise TypeError(f"x has dtype {dtype_name(x)}; expected float32, float16 or bfloat16")
    n = _rows(refuse_broadcast(w, "w"), "w")[0]
    if in_features is None:
        if wf.packed:
            raise ValueError(f"in_features is required with packed {wf.name} weights: their rows are padded, so "
                             "K cannot be read from w (x's last dim is checked against it)")
        k = k_x
    else:
        k = _positive_int(in_features, "in_features")
    if weight_granularity is None:
        weight_granularity = ("group" if wf.grouped else
                              "tensor" if _numel(w_scale, "w_scale") == 1 and n != 1 else "row")
    wg = granularity_id(weight_granularity, "weight_granularity")
    ag = granularity_id(act_granularity, "act_granularity")
    if wg in _GROUPED and weight_group_size is None:
        weight_group_size = _group_size_from_scale(w_scale, "w_scale", n, k, wf, wg)
    gs = _group_size_of(wf, wg, weight_group_size, "weight_group_size")
    for name, buf in buffers:
        if buf is not None:
            check_writable(buf, name)
    return (wf.id, wg, af.id if af else 0, ag, k), rows, n, gs


def _linear_workspace(x, c_args, rows, n, workspace, group_size):
    if workspace is not None:
        return workspace
    nbytes = _C.linear_workspace_size(*c_args, max(rows, 1), n, is_cuda(x), weight_group_size=group_size)
    return empty(x, (nbytes,), "uint8") if nbytes else None


def linear(x, w, w_scale, *, weight_format, bias=None, act_format=None, act_granularity="row",
           weight_granularity=None, in_features=None, out=None, workspace=None, activation=None,
           weight_group_size=None):
    """y [..., N] = act(x [..., K] W^T + bias) with a quantized weight (see cquant.h for the math).

    w is [N, K] codes or packed uint8 [N, packed_row_bytes(K)] (then in_features = K is
    required: padded rows do not tell K, and linear does not read w's padding to check it, which
    would wait on the device every call; dequantize(w, ..., cols=K) checks it once); w_scale
    float32 [N] (per output channel) or [1] (per tensor; the default when it has one element and
    N > 1); for
    int4 / uint4 weights [N, G] / [N, G, 2] per group of weight_group_size columns (default
    K / G; granularity "group"). act_format None keeps activations as they are (weight-only); "int8" or "fp8_e4m3"
    quantizes them per token ("row") or per tensor on the fly. activation None or
    "gelu_tanh" (torch's gelu(approximate="tanh"), applied in fp32 inside the op). y has x's
    dtype. out may be a column slice of a wider array (its rows one stride apart, the last dim
    contiguous): the columns outside it are not touched.
    """
    c_args, rows, n, gs = _linear_setup(x, w, w_scale, weight_format, act_format, act_granularity,
                                        weight_granularity, in_features, (("out", out), ("workspace", workspace)),
                                        weight_group_size)
    x, w, w_scale = readable(x), readable(w), readable(w_scale)
    bias = readable(bias) if bias is not None else None
    y = out if out is not None else empty(x, tuple(x.shape[:-1]) + (n,), dtype_name(x))
    workspace = _linear_workspace(x, c_args, rows, n, workspace, gs)
    _C.linear(x, w, w_scale, bias, y, *c_args, workspace=workspace, stream=stream_of(x),
              activation=activation_id(activation), weight_group_size=gs)
    return y


def linear_gated(x, w, w_scale, gate, residual, *, weight_format, bias=None, act_format=None, act_granularity="row",
                 weight_granularity=None, in_features=None, out=None, workspace=None, activation=None,
                 weight_group_size=None):
    """y [..., N] = residual + gate[sample] * act(x [..., K] W^T + bias): linear (same arguments)
    with adaLN-Zero's gated residual in its epilogue, one rounding (cq_linear_gated in cquant.h).

    gate [G, N] (float32/float16/bfloat16, last dim contiguous): x's M rows hold G samples of
    M / G rows each, sample g takes gate[g]. residual: y's shape and dtype. out may be residual
    itself (the residual updated in place), a column slice of a wider array, or None (a new array).
    """
    c_args, rows, n, gs = _linear_setup(x, w, w_scale, weight_format, act_format, act_granularity,
                                        weight_granularity, in_features, (("out", out), ("workspace", workspace)),
                                        weight_group_size)
    x, w, w_scale, gate = readable(x), readable(w), readable(w_scale), readable(gate)
    bias = readable(bias) if bias is not None else None
    y = out if out is not None else empty(x, tuple(x.shape[:-1]) + (n,), dtype_name(x))  # residual: checked to match
    workspace = _linear_workspace(x, c_args, rows, n, workspace, gs)
    _C.linear_gated(x, w, w_scale, bias, gate, residual if residual is y else readable(residual), y, *c_args,
                    workspace=workspace, stream=stream_of(x), activation=activation_id(activation),
                    weight_group_size=gs)
    return y


ACTIVATIONS = {None: _C.ACTIVATION_NONE, "none": _C.ACTIVATION_NONE, "gelu_tanh": _C.ACTIVATION_GELU_TANH}


def activation_id(activation, name="activation"):
    """cq_activation of None, "none" or "gelu_tanh"."""
    try:
        return ACTIVATIONS[activation]
    except (KeyError, TypeError):
        raise ValueError(f"{name} = {activation!r}; expected None, 'none' or 'gelu_tanh'") from None



def attention_workspace_size(mode, batch, heads, seq_q, seq_kv, head_dim, *, cuda, q_block=0, k_block=0):
    """Bytes of workspace attention needs (0 for full precision and on the CPU); blocks 0: defaults."""
    return _C.attention_workspace_size(int(mode), int(batch), int(heads), int(seq_q), int(seq_kv), int(head_dim),
                                       bool(cuda), int(q_block), int(k_block))


def attention_into(q, k, v, out, lse, scale, mode, q_block=0, k_block=0):
    """libcquant's attention into caller-given out (and lse, or None); allocates only the workspace.

    q [B, Sq, H, D], k and v [B, Skv, H, D]; see cq_attention in cquant.h."""
    check_writable(out, "out")
    if lse is not None:
        check_writable(lse, "lse")
    q, k, v = readable(q), readable(k), readable(v)
    b, sq, h, d = (int(s) for s in q.shape)
    nbytes = attention_workspace_size(mode, b, h, sq, int(k.shape[1]), d, cuda=is_cuda(q), q_block=q_block,
                                      k_block=k_block)
    workspace = empty(q, (nbytes,), "uint8") if nbytes else None
    _C.attention(q, k, v, out, scale, mode, lse=lse, workspace=workspace, q_block=q_block, k_block=k_block,
                 stream=stream_of(q))


def attention_int8_logit_error(q, k, scale, q_block=0, k_block=0):
    """The 8-bit attention's logit-error estimate E of every head, float32 [B, H] (CPU arrays;
    cq_attention_int8_logit_error_ref in cquant.h): the 8-bit mode computes the heads with
    E > ATTENTION_INT8_MAX_LOGIT_ERROR in full precision. Blocks 0: the defaults."""
    shape = _shape(q, "q")
    _shape(k, "k")
    q, k = readable(q), readable(k)
    if len(shape) != 4:
        raise ValueError(f"q has shape {shape}; expected 4 dims [batch, seq, heads, head_dim]")
    bound = empty(q, (int(q.shape[0]), int(q.shape[2])), "float32")
    _C.attention_int8_logit_error(q, k, bound, float(scale), int(q_block), int(k_block))
    return bound


def check_attention_call(q, k, v, scale, mode, q_block=0, k_block=0):
    """What libcquant checks of attention's mode, scale, blocks and dtypes, for the calls it never
    sees (no batch, queries or keys), so that they refuse what a call with work refuses."""
    b, sq, h, d = (int(n) for n in q.shape)
    attention_workspace_size(mode, b, h, sq, int(k.shape[1]), d, cuda=False)  # mode and sizes
    if not math.isfinite(float(scale)):
        raise ValueError(f"scale = {scale}; expected a finite softmax scale")
    if q_block < 0 or k_block < 0:
        raise ValueError(f"q_block = {q_block}, k_block = {k_block}; expected block sizes >= 1 (or 0 for the defaults)")
    dtypes = [dtype_name(t) for t in (q, k, v)]
    if dtypes[0] not in FLOAT_DTYPES or len(set(dtypes)) != 1:
        raise TypeError(f"q, k, v have dtypes {', '.join(dtypes)}; expected one of {', '.join(FLOAT_DTYPES)} for all")


def check_attention_shapes(q, k, v, out=None):
    """What libcquant checks of attention's shapes, for calls it never sees (no batch, queries or
    keys: the result is known without it). out may be None."""
    b, sq, h, d = (int(n) for n in q.shape)
    if tuple(k.shape) != tuple(v.shape) or (int(k.shape[0]), int(k.shape[2]), int(k.shape[3])) != (b, h, d):
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must be [batch, seq_kv, heads, head_dim] with q's "
                         f"batch, heads and head_dim (q: {tuple(q.shape)})")
    if out is not None:
        if tuple(out.shape) != (b, sq, h, d):
            raise ValueError(f"out has shape {tuple(out.shape)}; expected q's {tuple(q.shape)}")
        if dtype_name(out) != dtype_name(q):
            raise TypeError(f"out has dtype {dtype_name(out)}; expected q's dtype {dtype_name(q)}")
        if not getattr(getattr(out, "flags", None), "writeable", True):  # a read-only NumPy array
            raise ValueError("out is read-only; expected a writable output tensor")
        check_writable(out, "out")
