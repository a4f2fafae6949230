"""Independent NumPy oracle of cquant's quantization math.

Written from the definitions in csrc/include/cquant.h, not from the C code, and never calling
cquant: every format's representable values are enumerated from (E, M, bias) or as int8, and a
value is encoded by searching that list for its nearest neighbour (ties to the even code), not by
bit manipulation. Where the header says fp32, the arithmetic here is np.float32 (IEEE, correctly
rounded); everything else is float64, where it is exact.

Arrays: x is float32 [rows, cols]; codes are uint32 [rows, cols] (sign bit at bit bits-1 for float
formats, two's complement byte for int8); scales are float32 [rows] (row) or [1] (tensor).
"""

from dataclasses import dataclass
from functools import cached_property

import numpy as np

AMAX_FLOOR = np.float32(2.0**-90)  # CQ_AMAX_FLOOR
PACK_ROW_ALIGN = 16  # CQ_PACK_ROW_ALIGN


@dataclass(frozen=True)
class Format:
    """A quantization format as cquant.h defines it."""

    name: str
    id: int
    kind: str  # "int" or "float"
    bits: int
    ebits: int
    mbits: int
    bias: int
    specials: str  # "none" (every code finite), "nan_only" (e4m3fn), "ieee" (e5m2)
    packed: bool

    @cached_property
    def values(self):
        """float64 [2**bits]: the value of every code (NaN / +-inf for special codes)."""
        codes = np.arange(1 << self.bits)
        if self.kind == "int":
            return np.where(codes >= 128, codes - 256, codes).astype(np.float64)
        emax, mmax = (1 << self.ebits) - 1, (1 << self.mbits) - 1
        out = np.empty(codes.size)
        for c in codes:
            sign = -1.0 if (c >> (self.bits - 1)) & 1 else 1.0
            exp, man = (c >> self.mbits) & emax, c & mmax
            if self.specials == "nan_only" and exp == emax and man == mmax:
                out[c] = np.nan
            elif self.specials == "ieee" and exp == emax:
                out[c] = sign * np.inf if man == 0 else np.nan
            elif exp == 0:  # subnormal: 0.man * 2^(1 - bias)
                out[c] = sign * (man / 2.0**self.mbits) * 2.0 ** (1 - self.bias)
            else:  # normal: 1.man * 2^(exp - bias)
                out[c] = sign * (1.0 + man / 2.0**self.mbits) * 2.0 ** (int(exp) - self.bias)
        return out

    @cached_property
    def positive(self):
        """(magnitudes, codes): the finite non-negative values, ascending, and their codes."""
        n = 1 << self.bits
        codes = np.arange(128) if self.kind == "int" else np.arange(n // 2)
        vals = self.values[codes]
        keep = np.isfinite(vals)
        codes, vals = codes[keep], vals[keep]
        assert np.all(np.diff(vals) > 0), f"{self.name}: codes do not order the values"
        return vals, codes

    @property
    def max_value(self):
        return float(self.positive[0][-1])

    @property
    def max_code(self):
        return int(self.positive[1][-1])

    @property
    def sign_bit(self):
        return 1 << (self.bits - 1)


def _fpx(e, m):
    return Format(f"fp{1 + e + m}_e{e}m{m}", 0x100 + 0x10 * e + m, "float", 1 + e + m, e, m,
                  (1 << (e - 1)) - 1, "none", True)


INT8 = Format("int8", 1, "int", 8, 0, 7, 0, "none", False)
FP8_E4M3 = Format("fp8_e4m3", 2, "float", 8, 4, 3, 7, "nan_only", False)
FP8_E5M2 = Format("fp8_e5m2", 3, "float", 8, 5, 2, 15, "ieee", False)
FPX = [_fpx(e, b - 1 - e) for b in range(3, 8) for e in range(1, b)]
FORMATS = {f.name: f for f in sorted([INT8, FP8_E4M3, FP8_E5M2, *FPX], key=lambda f: f.id)}


def fmt(name):
    return FORMATS[name]


def encode(f, v):
    """Codes (uint32) of float32 values v: nearest value, ties to the even code, saturating at
    +-max_value; the sign bit of v gives the sign of a float code (so -0.0 and tiny negatives
    give the negative zero code). NaN gives code 0 (reachable only with static scales)."""
    v = np.asarray(v, dtype=np.float32)
    a = np.abs(v.astype(np.float64))
    mags, mcodes = f.positive
    i = np.clip(np.searchsorted(mags, a, side="right") - 1, 0, mags.size - 1)
    j = np.minimum(i + 1, mags.size - 1)
    lo, hi = mags[i], mags[j]
    with np.errstate(invalid="ignore"):
        d_lo, d_hi = a - lo, hi - a  # exact in float64
        pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (mcodes[j] % 2 == 0) & (j != i))
    mag_code = np.where(pick_hi, mcodes[j], mcodes[i])
    mag_code = np.where(a >= f.max_value, f.max_code, mag_code)
    nan = np.isnan(v)
    if f.kind == "int":
        signed = np.where(np.signbit(v), -mag_code, mag_code)
        code = (signed & 0xFF).astype(np.uint32)
    else:
        code = (mag_code | np.where(np.signbit(v), f.sign_bit, 0)).astype(np.uint32)
    return np.where(nan, 0, code).astype(np.uint32)


def decode(f, codes):
    """float64 values of codes."""
    return f.values[np.asarray(codes, dtype=np.int64)]


def group_scales(x, f, granularity):
    """(scale, inv) float32 per group from amax, as cquant.h defines them (NaN, 0 for a group
    holding NaN or +-Inf)."""
    x = np.asarray(x, dtype=np.float32)
    amax = np.abs(x).max(axis=1) if granularity == "row" else np.abs(x).max(keepdims=True).reshape(1)
    amax = amax.astype(np.float32)  # NaN propagates through max
    finite = np.isfinite(amax)
    a = np.maximum(np.where(finite, amax, np.float32(1)), AMAX_FLOOR)
    maxv = np.float32(f.max_value)
    scale = np.where(finite, a / maxv, np.float32(np.nan)).astype(np.float32)
    inv = np.where(finite, maxv / a, np.float32(0)).astype(np.float32)
    return scale, inv


def static_inverse(scale):
    """inv = 1 / scale in fp32; 0 (the group stores zero codes) for a given scale that is not
    finite and > 0. A valid scale below 2^-128 has inv = +inf: its nonzero elements saturate,
    zeros (0 * inf = NaN) encode to 0."""
    s = np.asarray(scale, dtype=np.float32)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        inv = (np.float32(1) / s).astype(np.float32)
    ok = (s > 0) & np.isfinite(s)
    return np.where(ok, inv, np.float32(0)).astype(np.float32)


def quantize(x, f, granularity="row", static_scale=None):
    """(codes uint32 [rows, cols], scale float32) of x [rows, cols] (float32 values)."""
    x = np.asarray(x, dtype=np.float32)
    rows = x.shape[0]
    if static_scale is None:
        scale, inv = group_scales(x, f, granularity)
    else:
        scale = np.asarray(static_scale, dtype=np.float32).reshape(-1)
        inv = static_inverse(scale)
    inv_rows = inv if granularity == "row" else np.repeat(inv, rows)
    with np.errstate(invalid="ignore", over="ignore"):
        v = (x * inv_rows[:, None]).astype(np.float32)  # fp32 product
    codes = encode(f, v)
    codes[inv_rows == 0] = 0  # a bad group stores all-zero codes
    return codes, scale


def dequantize(codes, scale, f, granularity="row"):
    """float32 [rows, cols] = decode(code) * scale in fp32 (round to the output dtype after)."""
    vals = decode(f, codes).astype(np.float32)
    s = np.asarray(scale, dtype=np.float32).reshape(-1)
    s_rows = s if granularity == "row" else np.repeat(s, vals.shape[0])
    with np.errstate(invalid="ignore", over="ignore"):
        return (vals * s_rows[:, None]).astype(np.float32)


def packed_row_bytes(bits, cols):
    raw = -(-cols * bits // 8)
    return -(-raw // PACK_ROW_ALIGN) * PACK_ROW_ALIGN


def pack(codes, bits):
    """uint8 [rows, packed_row_bytes]: code j of a row in bits [j*bits, (j+1)*bits), LSB first,
    zero padding."""
    codes = np.asarray(codes, dtype=np.uint32)
    rows, cols = codes.shape
    stream = ((codes[:, :, None] >> np.arange(bits, dtype=np.uint32)) & 1).astype(np.uint8).reshape(rows, cols * bits)
    nbits = packed_row_bytes(bits, cols) * 8
    stream = np.concatenate([stream, np.zeros((rows, nbits - cols * bits), np.uint8)], axis=1)
    return np.packbits(stream, axis=1, bitorder="little")


def unpack(packed, bits, cols):
    """uint32 codes [rows, cols] of packed rows."""
    packed = np.asarray(packed, dtype=np.uint8)
    stream = np.unpackbits(packed, axis=1, bitorder="little")[:, : cols * bits].reshape(packed.shape[0], cols, bits)
    return (stream.astype(np.uint32) << np.arange(bits, dtype=np.uint32)).sum(axis=2).astype(np.uint32)


def stored(f, codes):
    """The bytes cquant stores for codes: packed rows for fpX, one byte per code otherwise."""
    return pack(codes, f.bits) if f.packed else np.asarray(codes).astype(np.uint8)


def codes_of_stored(f, q, cols):
    """uint32 codes from stored bytes (q as uint8 [rows, row bytes])."""
    q = np.asarray(q).view(np.uint8) if np.asarray(q).dtype != np.uint8 else np.asarray(q)
    return unpack(q, f.bits, cols) if f.packed else q.astype(np.uint32)


def round_to_bf16(v):
    """float32 values rounded to bfloat16 (nearest even), returned as float32."""
    u = np.asarray(v, dtype=np.float32).view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    out = (r & 0xFFFFFFFF).astype(np.uint32).view(np.float32)
    return np.where(np.isnan(v), np.float32(np.nan), out)


def round_to(v, dtype):
    """float32 values rounded to 'float32', 'float16' or 'bfloat16', returned as float64."""
    v = np.asarray(v, dtype=np.float32)
    if dtype == "float32":
        return v.astype(np.float64)
    if dtype == "float16":
        with np.errstate(over="ignore"):
            return v.astype(np.float16).astype(np.float64)
    if dtype == "bfloat16":
        return round_to_bf16(v).astype(np.float64)
    raise ValueError(dtype)


def linear(x, w_codes, w_scale, wf, weight_granularity="row", act_format=None, act_granularity="row", bias=None):
    """float64 evaluation of cquant's quantized linear layer (cquant.h) from the weight codes.

    x float32 [M, K]; w_codes uint32 [N, K]; w_scale float32 [N] or [1]. Activations are used as
    they are (act_format None) or quantized with quantize() and decoded. Returns (y, bound_terms):
    y float64 [M, N] = (a @ decode(w)^T) * sx * sw + b, and the same with every term made
    non-negative (|a| @ |decode(w)|^T * |sx| * |sw| + |b|), the size that rounding errors scale with.
    """
    x = np.asarray(x, dtype=np.float32)
    m = x.shape[0]
    if act_format is None:
        a, sx = x.astype(np.float64), np.ones(m)
    else:
        xc, s = quantize(x, act_format, act_granularity)
        a = decode(act_format, xc)
        sx = s.astype(np.float64) if act_granularity == "row" else np.repeat(s.astype(np.float64), m)
    wd = decode(wf, w_codes)
    sw = np.asarray(w_scale, dtype=np.float64).reshape(-1)
    if weight_granularity == "tensor":
        sw = np.repeat(sw, wd.shape[0])
    b = np.zeros(wd.shape[0]) if bias is None else np.asarray(bias, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        y = (a @ wd.T) * sx[:, None] * sw[None, :] + b
        terms = (np.abs(a) @ np.abs(wd).T) * np.abs(sx)[:, None] * np.abs(sw)[None, :] + np.abs(b)
    return y, terms


# ---------------------------------------------------------------- 4-bit formats per group
# int4 (symmetric, codes [-7, 7] stored as two's complement nibbles) and uint4 (codes [0, 15]
# with an integer zero point per group), one scale per group of group_size columns of a row
# (cquant.h, "4-bit integer formats"). Codes here are int64: signed values for int4, 0..15 for
# uint4; stored() of them is nibble-packed like fpX.

INT4_ID, UINT4_ID = 4, 5


def _groups(x, group_size):
    x = np.asarray(x, dtype=np.float32)
    rows, cols = x.shape
    assert cols % group_size == 0
    return x.reshape(rows, cols // group_size, group_size)


def round_to_8_significant_bits(v):
    """float32 values rounded to nearest-even to 8 significant bits (the nearest bfloat16 value
    for the normal, finite values the 4-bit scales are), returned as float32. Computed on the
    value, not its bit pattern: v = m * 2^e with m in [0.5, 1), m * 256 rounded to an integer
    (exact in float64, ties to even), scaled back; NaN / Inf pass through."""
    v = np.asarray(v, dtype=np.float32).astype(np.float64)
    finite = np.isfinite(v)
    m, e = np.frexp(np.where(finite, v, 1.0))
    r = np.ldexp(np.rint(m * 256.0), e - 8)
    return np.where(finite, r, v).astype(np.float32)


def quantize_int4(x, group_size):
    """(codes int64 [rows, cols] in [-7, 7], scale float32 [rows, G]): amax per group, a =
    max(amax, floor), scale = RN_bf16(a / 7) (a / 7 in fp32, then rounded to 8 significant bits),
    inv = 1 / scale (fp32), code = RNE(x * inv) saturated; a group holding NaN or +-Inf gets scale
    NaN and all-zero codes."""
    xg = _groups(x, group_size)
    amax = np.abs(xg).max(axis=2).astype(np.float32)  # NaN propagates through max
    ok = np.isfinite(amax)
    a = np.maximum(np.where(ok, amax, np.float32(1)), AMAX_FLOOR).astype(np.float32)
    s8 = round_to_8_significant_bits((a / np.float32(7)).astype(np.float32))
    scale = np.where(ok, s8, np.float32(np.nan)).astype(np.float32)
    inv = np.where(ok, np.float32(1) / s8, np.float32(0)).astype(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        v = (xg * inv[:, :, None]).astype(np.float32)
    codes = np.clip(np.rint(np.nan_to_num(v, nan=0.0, posinf=7.0, neginf=-7.0)), -7, 7).astype(np.int64)
    codes[~ok] = 0
    return codes.reshape(np.asarray(x).shape), scale


def quantize_uint4(x, group_size):
    """(codes int64 [rows, cols] in [0, 15], scale_zp float32 [rows, G, 2]): lo = min(0, min x),
    hi = max(0, max x), r = max(hi - lo, floor) in fp32, scale = RN_bf16(r / 15) (r / 15 in fp32,
    then rounded to 8 significant bits), inv = 1 / scale (fp32), zp = clamp(RNE(-lo * inv), 0,
    15), code = clamp(RNE(x * inv) + zp, 0, 15); NaN / +-Inf in a group or an fp32 overflow of
    hi - lo gives scale NaN, zp 0, all-zero codes."""
    xg = _groups(x, group_size)
    lo = np.minimum(np.float32(0), xg.min(axis=2)).astype(np.float32)  # NaN propagates
    hi = np.maximum(np.float32(0), xg.max(axis=2)).astype(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        r = (hi - lo).astype(np.float32)
    ok = np.isfinite(r)
    r = np.maximum(np.where(ok, r, np.float32(1)), AMAX_FLOOR).astype(np.float32)
    s8 = round_to_8_significant_bits((r / np.float32(15)).astype(np.float32))
    scale = np.where(ok, s8, np.float32(np.nan)).astype(np.float32)
    inv = np.where(ok, np.float32(1) / s8, np.float32(0)).astype(np.float32)
    lo0 = np.where(ok, lo, np.float32(0)).astype(np.float32)
    zp = np.clip(np.rint((-lo0 * inv).astype(np.float32)), 0, 15).astype(np.float32)
    zp = np.where(ok, zp, np.float32(0)) + np.float32(0)  # +0.0, never -0.0
    with np.errstate(invalid="ignore", over="ignore"):
        v = np.rint((xg * inv[:, :, None]).astype(np.float32)).astype(np.float64)
    codes = np.clip(np.nan_to_num(v + zp[:, :, None], nan=0.0), 0, 15).astype(np.int64)
    codes[~ok] = 0
    return codes.reshape(np.asarray(x).shape), np.stack([scale, zp.astype(np.float32)], axis=2)


def quantize_group(x, f_name, group_size):
    return quantize_int4(x, group_size) if f_name == "int4" else quantize_uint4(x, group_size)


def dequantize_group(codes, scale, f_name, group_size):
    """float32 [rows, cols] x' of 4-bit codes: code * scale (int4), (code - zp) * scale (uint4),
    in fp32."""
    codes = np.asarray(codes, dtype=np.int64)
    rows, cols = codes.shape
    cg = codes.reshape(rows, cols // group_size, group_size).astype(np.float32)
    s = np.asarray(scale, dtype=np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        if f_name == "int4":
            y = cg * s.reshape(rows, -1)[:, :, None]
        else:
            s = s.reshape(rows, -1, 2)
            y = (cg - s[:, :, 1:2]).astype(np.float32) * s[:, :, 0:1]
    return y.astype(np.float32).reshape(rows, cols)


def stored_group(codes):
    """The packed bytes cquant stores for 4-bit codes (int4: two's complement nibbles)."""
    return pack(np.asarray(codes, dtype=np.int64) & 0xF, 4)


def codes_of_stored_group(q, f_name, cols):
    """int64 codes of packed 4-bit rows (signed for int4)."""
    c = unpack(np.asarray(q, dtype=np.uint8), 4, cols).astype(np.int64)
    return np.where(c >= 8, c - 16, c) if f_name == "int4" else c


def linear_group(x, w_codes, w_scale, wf_name, group_size, x_dtype="float32", act_format=None, bias=None):
    """float64 evaluation of a linear layer with 4-bit weights per group (cquant.h, "4-bit
    weights per group"). Returns (y, terms) as linear() does.

    Weight-only (act_format None): w' = dequantize_group(...) rounded to x_dtype,
    y = x w'^T + b. Dynamic (int4 weights; act_format INT8 or FP8_E4M3 per row):
    y = (sum_g (a_g . code_g) sw[n, g]) * sx[m] + b with a, sx from quantize(x, act_format, "row").
    """
    x = np.asarray(x, dtype=np.float32)
    m, k = x.shape
    n = np.asarray(w_codes).shape[0]
    b = np.zeros(n) if bias is None else np.asarray(bias, dtype=np.float64)
    if act_format is None:
        wd = round_to(dequantize_group(w_codes, w_scale, wf_name, group_size), x_dtype)
        a = x.astype(np.float64)
        with np.errstate(invalid="ignore", over="ignore"):
            y = a @ wd.T + b
            terms = np.abs(a) @ np.abs(wd).T + np.abs(b)
        return y, terms
    assert wf_name == "int4"
    xc, sx = quantize(x, act_format, "row")
    a = decode(act_format, xc)
    g = k // group_size
    ag = a.reshape(m, g, group_size)
    wc = np.asarray(w_codes, dtype=np.float64).reshape(n, g, group_size)
    sw = np.asarray(w_scale, dtype=np.float64).reshape(n, g)
    acc = np.einsum("mgk,ngk->mng", ag, wc)  # exact for int8 codes; float64 sums otherwise
    acc_abs = np.einsum("mgk,ngk->mng", np.abs(ag), np.abs(wc))
    sx = sx.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        y = (acc * sw[None]).sum(axis=2) * sx[:, None] + b
        terms = (acc_abs * np.abs(sw)[None]).sum(axis=2) * np.abs(sx)[:, None] + np.abs(b)
    return y, terms


# ---------------------------------------------------------------- two-level int4
# int4 codes with a row scale s1 and an integer multiplier s2 per group (cquant.h, "Two-level
# int4"): scale [rows, 1 + G] holds s1, then s2 of each group.

S2_MAX = 16  # s2 * code stays an int8: 16 * -8 = -128, 16 * 7 = 112


def quantize_two_level(x, group_size):
    """(codes int64 [rows, cols] in [-7, 7], scale float32 [rows, 1 + G]): a = max(amax(row), floor),
    s1 = a / 112 (fp32); per group t = ag / (7 s1) (fp32: 7 s1 rounded, then the quotient),
    s2 = clamp(ceil(t), 1, 16), d = s1 s2 and inv = 1 / d (fp32 each), code = RNE(x inv) saturated
    at +-7. A row holding NaN or +-Inf gets s1 NaN, every s2 1 and all-zero codes."""
    xg = _groups(x, group_size)
    rows, groups, _ = xg.shape
    amax = np.abs(xg).max(axis=(1, 2)).astype(np.float32)  # NaN propagates
    ok = np.isfinite(amax)
    a = np.maximum(np.where(ok, amax, np.float32(1)), AMAX_FLOOR).astype(np.float32)
    s1 = (a / np.float32(112)).astype(np.float32)
    ag = np.abs(np.where(ok[:, None, None], xg, np.float32(0))).max(axis=2).astype(np.float32)
    t = (ag / (np.float32(7) * s1)[:, None]).astype(np.float32)
    s2 = np.clip(np.ceil(t), 1, S2_MAX).astype(np.float32)
    s2[~ok] = 1
    inv = (np.float32(1) / (s1[:, None] * s2).astype(np.float32)).astype(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        v = (xg * inv[:, :, None]).astype(np.float32)
    codes = np.clip(np.rint(np.nan_to_num(v, nan=0.0, posinf=7.0, neginf=-7.0)), -7, 7).astype(np.int64)
    codes[~ok] = 0
    scale = np.concatenate([np.where(ok, s1, np.float32(np.nan))[:, None], s2], axis=1).astype(np.float32)
    return codes.reshape(rows, -1), scale


def s2_valid(s2):
    """Whether stored multipliers are what the layout holds: integers in [0, 16]."""
    s2 = np.asarray(s2, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        return (s2 >= 0) & (s2 <= S2_MAX) & (np.floor(np.nan_to_num(s2, nan=0.5)) == s2)


def dequantize_two_level(codes, scale, group_size):
    """float32 [rows, cols] x' = (s2 * code) * s1 in fp32 (s2 * code exact); NaN in a group whose s2 is
    not an integer in [0, 16]."""
    codes = np.asarray(codes, dtype=np.int64)
    rows, cols = codes.shape
    s = np.asarray(scale, dtype=np.float32).reshape(rows, -1)
    s1, s2 = s[:, 0], s[:, 1:]
    ok = s2_valid(s2)
    q8 = codes.reshape(rows, -1, group_size) * np.where(ok, s2, 0).astype(np.int64)[:, :, None]
    with np.errstate(invalid="ignore", over="ignore"):
        y = (q8.astype(np.float32) * s1[:, None, None]).astype(np.float32)
    y[~np.broadcast_to(ok[:, :, None], y.shape)] = np.nan
    return y.reshape(rows, cols)


def two_level_q8(codes, scale, group_size):
    """(q8 int64 [N, K] = s2 * code, sw float32 [N]: s1, NaN for a row with an s2 that is not an
    integer in [0, 16]) -- the int8 weight rows and scales the layer's GEMM takes."""
    codes = np.asarray(codes, dtype=np.int64)
    n, k = codes.shape
    s = np.asarray(scale, dtype=np.float32).reshape(n, -1)
    ok = s2_valid(s[:, 1:])
    q8 = (codes.reshape(n, -1, group_size) * np.where(ok, s[:, 1:], 0).astype(np.int64)[:, :, None]).reshape(n, k)
    return q8, np.where(ok.all(axis=1), s[:, 0], np.float32(np.nan)).astype(np.float32)


def linear_two_level(x_codes, sx, w_codes, w_scale, group_size, bias=None):
    """A two-level int4 layer from int8 activation codes [M, K] and their scales sx [M]: (y64, terms,
    y32), y64 = acc sx s1 + b in float64 (acc = a . q8, exact), terms its sum of |addends|, y32 the
    same in fp32 as cquant.h orders it ((float(acc) * sx) * s1 + b, each step rounded)."""
    a = np.asarray(x_codes, dtype=np.int64)
    q8, sw = two_level_q8(w_codes, w_scale, group_size)
    acc = a @ q8.T  # exact
    acc_abs = np.abs(a) @ np.abs(q8).T
    n = q8.shape[0]
    b64 = np.zeros(n) if bias is None else np.asarray(bias, dtype=np.float64)
    sx64, sw64 = np.asarray(sx, dtype=np.float64), sw.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        y64 = acc * sx64[:, None] * sw64[None, :] + b64
        terms = acc_abs * np.abs(sx64)[:, None] * np.abs(sw64)[None, :] + np.abs(b64)
        b32 = np.zeros(n, np.float32) if bias is None else np.asarray(bias, dtype=np.float32)
        y32 = ((acc.astype(np.float32) * np.asarray(sx, np.float32)[:, None]).astype(np.float32)
               * sw[None, :]).astype(np.float32) + b32
    return y64, terms, y32.astype(np.float32)
