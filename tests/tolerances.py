"""Every tolerance of the test suite, named, with where its number comes from.

SQNR(ref, x) = 20 log10(|ref| / |ref - x|) in dB with ref in float64 (DESIGN.md, section 4).
Floors marked "measured" are the minimum over many seeds of the exact configuration the test
draws (N(0, 1) data, the shapes named in the test), rounded down with the stated margin. They
catch gross errors (a wrong scale, a lost mantissa bit, truncation instead of rounding: each
several dB); the exact comparisons against tests/reference.py catch the rest.
"""

import math

import numpy as np

# ---------------------------------------------------------------- bit-exact ops
# quantize / dequantize / pack / unpack / format tables are compared EXACTLY (codes, scale bits,
# output bits) against tests/reference.py: no tolerance. NaN payloads are not part of the
# contract (cquant.h says "scale = NaN"), so NaNs compare by position only.

# ---------------------------------------------------------------- quantize -> dequantize SQNR
# Dequantized float32 vs the float64 input, N(0, 1) data, shapes (7, 1025), (3, 97), (33, 97),
# row and tensor granularity. Measured: minimum over 200 seeds of tests/reference.py (which the
# library matches bit for bit), minus at least 1 dB, rounded down to 0.5 dB. They follow
# 6.02 dB per mantissa bit (about 6.02 * M + 13 dB for formats whose exponent range covers the
# data, int8 about 39 dB with amax at ~3.3 sigma).
QUANT_SQNR_FLOOR_DB = {
    "int8": 37.5,  # min 38.88
    "fp8_e4m3": 29.5,  # min 30.57
    "fp8_e5m2": 23.5,  # min 24.79
    "fp3_e1m1": 5.0,  # min 6.28
    "fp4_e1m2": 12.5,  # min 13.69
    "fp5_e1m3": 19.5,  # min 20.71
    "fp6_e1m4": 25.0,  # min 26.42
    "fp7_e1m5": 31.5,  # min 32.97
    "fp3_e2m0": 7.5,  # min 8.57
    "fp4_e2m1": 16.0,  # min 17.29
    "fp5_e2m2": 22.5,  # min 23.97
    "fp6_e2m3": 29.0,  # min 30.09
    "fp7_e2m4": 35.0,  # min 36.28
    "fp4_e3m0": 12.0,  # min 13.18
    "fp5_e3m1": 17.5,  # min 18.55
    "fp6_e3m2": 23.5,  # min 24.67
    "fp7_e3m3": 29.0,  # min 30.46
    "fp5_e4m0": 12.0,  # min 13.24
    "fp6_e4m1": 17.5,  # min 18.55
    "fp7_e4m2": 23.0,  # min 24.37
    "fp6_e5m0": 12.0,  # min 13.39
    "fp7_e5m1": 17.5,  # min 18.76
    "fp7_e6m0": 12.0,  # min 13.20
}

# ---------------------------------------------------------------- quantized linear vs float64
# Against the float64 evaluation of the SAME quantized math (tests/reference.py decoding the
# codes cquant produced), the only differences are fp32 roundings. For a dot product of K
# terms in fp32, in any summation order, |error| <= gamma(K) * sum_k |a_k w_k| with
# gamma(n) = n u / (1 - n u) and u the fp32 unit roundoff (Higham, "Accuracy and Stability of
# Numerical Algorithms", 2nd ed., eq. 3.5). The products add one rounding, the epilogue
# acc * sx * sw + b three more (cquant.h: fp32, left to right), then y is rounded once to its
# dtype (half an ulp, or half the subnormal step near zero).
FP32_UNIT_ROUNDOFF = 2.0**-24
LINEAR_EXTRA_ROUNDINGS = 4  # 1 for the products, 3 for the epilogue
OUTPUT_UNIT_ROUNDOFF = {"float32": 2.0**-24, "float16": 2.0**-11, "bfloat16": 2.0**-8}
OUTPUT_HALF_SUBNORMAL_STEP = {"float32": 2.0**-150, "float16": 2.0**-25, "bfloat16": 2.0**-134}

# The bound above is for the worst case; the norm-wise relative error |y - y64| / |y64| of a
# correct implementation is far smaller: fp32 round-off gives ~1e-7 at K = 1025, and the
# output rounding an rms relative error of u_out / sqrt(3) (2.8e-4 for float16, 2.3e-3 for
# bfloat16). Bounds: about 4x to 20x those.
LINEAR_REL_L2 = {"float32": 2e-6, "float16": 1e-3, "bfloat16": 8e-3}


def gamma(n, u=FP32_UNIT_ROUNDOFF):
    """Higham's gamma_n = n u / (1 - n u)."""
    return n * u / (1.0 - n * u)


# Higham's model assumes no underflow. Weight-only layers multiply x itself, so subnormal
# activations (fp32, or fp16 widened) make subnormal products and sums, each rounded to fp32's
# subnormal step: an absolute error of up to half of it (2^-150) per rounding, scaled by the
# weight scale |sw| in the epilogue, whose own roundings may underflow too. (Dynamic schemes
# multiply codes, whose products are at least 2^-18: no underflow.)
FP32_HALF_SUBNORMAL_STEP = 2.0**-150


def linear_abs_bound(k, terms, y_ref, out_dtype, weight_scale=0.0):
    """Elementwise bound on |y - y_ref| for K = k (see above); terms = sum of |addends|;
    weight_scale: the largest |sw| of a weight-only layer (its underflow term), 0 otherwise."""
    g = gamma(k + LINEAR_EXTRA_ROUNDINGS)
    u_out = OUTPUT_UNIT_ROUNDOFF[out_dtype]
    underflow = FP32_HALF_SUBNORMAL_STEP * (2 * k * weight_scale + LINEAR_EXTRA_ROUNDINGS) if weight_scale else 0.0
    return (g * terms + underflow + u_out * (abs(y_ref) + g * terms + underflow)
            + OUTPUT_HALF_SUBNORMAL_STEP[out_dtype])


# A linear layer with activation="gelu_tanh" against gelu of its float64 reference: an error e
# of the pre-activation v moves gelu(v) by at most e * max |gelu'| over [v - e, v + e], which is
# at most |gelu'(v)| + e * max |gelu''| (|gelu''| <= sqrt(2 / pi) = 0.798, at 0) and never more
# than max |gelu'| = 1.129. GELU's fp32 evaluation adds a few ulp of |v| (more for large |v|,
# where the cubic term dominates the tanh argument), then y is rounded once to its dtype.
# The local slope matters: in the negative tail (v near -2.7, slope -0.025) the bound is far
# below the 4.7e-4 by which erf GELU differs from the tanh form, so the tests tell them apart.
GELU_MAX_SLOPE = 1.13
GELU_MAX_CURVATURE = 0.8
GELU_EVAL_ULPS = 16
_SQRT_2_OVER_PI = 0.7978845608028654


def gelu_tanh(v):
    """torch's gelu(approximate="tanh") in float64."""
    return 0.5 * v * (1.0 + np.tanh(_SQRT_2_OVER_PI * (v + 0.044715 * v**3)))


def gelu_erf(v):
    """The exact GELU, v * Phi(v), in float64 (what the tanh form approximates)."""
    return 0.5 * v * (1.0 + np.vectorize(math.erf, otypes=[np.float64])(np.asarray(v, np.float64) / math.sqrt(2.0)))


def gelu_tanh_slope(v):
    t = np.tanh(_SQRT_2_OVER_PI * (v + 0.044715 * v**3))
    return 0.5 * (1.0 + t) + 0.5 * v * (1.0 - t * t) * _SQRT_2_OVER_PI * (1.0 + 3 * 0.044715 * v**2)


def gelu_of_error_bound(pre_error, pre_ref, act_ref, out_dtype):
    """Bound on |gelu_tanh(y) - gelu_tanh(y_ref)| given |y - y_ref| <= pre_error (see above)."""
    slope = np.minimum(GELU_MAX_SLOPE, np.abs(gelu_tanh_slope(pre_ref)) + GELU_MAX_CURVATURE * pre_error)
    v = np.abs(pre_ref)
    evaluation = GELU_EVAL_ULPS * FP32_UNIT_ROUNDOFF * v * (1.0 + 0.134 * v * v)
    u_out = OUTPUT_UNIT_ROUNDOFF[out_dtype]
    return slope * pre_error + evaluation + u_out * np.abs(act_ref) + OUTPUT_HALF_SUBNORMAL_STEP[out_dtype]


def gelu_abs_bound(k, terms, pre_ref, act_ref, out_dtype):
    """Elementwise bound on |gelu(y) - gelu(y_ref)| of the C reference (fp32 pre-activation)."""
    return gelu_of_error_bound(linear_abs_bound(k, terms, pre_ref, "float32"), pre_ref, act_ref, out_dtype)


# A gated linear layer (cq_linear_gated) y = residual + gate * v, v the layer's fp32 value before
# its rounding: an error e of v becomes |gate| e; the fp32 product gate * v and the sum with the
# residual add one rounding each, u (|gate| (|v| + e)) and u (|residual| + |gate| (|v| + e)) (1 + u);
# then y is rounded once to its dtype (rounded_bound, below).
def gated_value_error(v_error, v_ref, gate, residual):
    """Bound on |fl(residual + fl(gate v)) - (residual + gate v_ref)| given |v - v_ref| <= v_error."""
    g = np.abs(gate)
    gv = g * (np.abs(v_ref) + v_error)
    return g * v_error + FP32_UNIT_ROUNDOFF * gv + FP32_UNIT_ROUNDOFF * (np.abs(residual) + gv) * (1 + FP32_UNIT_ROUNDOFF)


def gated_abs_bound(v_error, v_ref, gate, residual, y_ref, out_dtype):
    """Elementwise bound on |y - y_ref| of the gated layer, y_ref = residual + gate v_ref in float64."""
    return rounded_bound(gated_value_error(v_error, v_ref, gate, residual), y_ref, out_dtype)


# SQNR of the quantized linear layer against the unquantized float64 product x W^T, per
# scheme. Measured: N(0, 1) activations, N(0, 1/K) weights, (M, K, N) = (16, 1025, 97) and
# (7, 97, 33), activations float32 / float16 / bfloat16, no bias; minimum over 260 seeds
# (in parentheses) minus at least 1.5 dB, rounded down to 0.5 dB. Weight-only schemes sit
# near the weight format's SQNR above, dynamic ones about 3 dB lower (two quantized operands
# of about equal noise).
LINEAR_SQNR_FLOOR_DB = {
    "int8wo": 39.5,  # (41.1)
    "int8wo_tensor": 36.0,  # (37.7)
    "int8dq": 36.5,  # (38.3)
    "int8dq_tensor": 33.5,  # (35.4)
    "fp8dqrow": 25.5,  # (27.1)
    "fp8dq_tensor": 25.0,  # (26.6)
    "fp8wo_e4m3": 28.5,  # (30.1)
    "fp8wo_e5m2": 22.0,  # (23.8)
    "fp6_e3m2": 22.0,  # (23.8)
    "fp6_e2m3": 28.0,  # (29.9)
    "fp5_e2m2": 22.0,  # (23.6)
    "fp4_e2m1": 15.0,  # (16.6)
    "fp3_e1m1": 7.0,  # (8.6)
    "fp3_e2m0": 9.0,  # (10.7)
    "fp5_e3m1": 16.0,  # (17.5)
    "fp7_e3m3": 28.5,  # (30.2)
}


# ---------------------------------------------------------------- 4-bit weights per group
# quantize -> dequantize SQNR of int4 / uint4 with groups of 64: N(0, 9) data (8, 512)
# (test_int4's round trip). Measured: minimum over 120 seeds minus at least 1 dB, rounded down
# to 0.5 dB. About 6 dB below int8's 8-bit grid per bit lost less the gain of small groups;
# uint4's zero point spends its 16 codes on the group's range alone.
GROUP_QUANT_SQNR_FLOOR_DB = {
    "int4": 17.5,  # min 18.89
    "uint4": 19.0,  # min 20.43 (20.40 with scales rounded to 8 significant bits; int4 unchanged)
}

# SQNR of the 4-bit linear schemes against the unquantized float64 x W^T: N(0, 1) activations,
# N(0, 1/K) weights, (M, K, N) in test_int4.LINEAR_SHAPES, groups of 32 / 64 / 128, x float32 /
# float16 / bfloat16. Measured: minimum over 120 seeds of all 27 configurations minus at least
# 1.3 dB, rounded down to 0.5 dB (M = 1 with N = 33 gives the widest spread: few outputs).
# Rounding the 4-bit scales to 8 significant bits moved the minima by under 0.3 dB (the same 120
# seeds measured with both scales).
GROUP_LINEAR_SQNR_FLOOR_DB = {
    "int4wo": 13.0,  # (14.36)
    "int4wo_sym": 11.5,  # (12.94)
    "int4dq": 12.0,  # (13.39)
    "fp8da_int4w": 12.5,  # (13.83)
    # measured separately (same rule): 11.21 over 120 seeds, where int4dq's minimum was 11.75
    "int4dq_2l": 9.5,
}


def linear_group_abs_bound(k, groups, terms, y_ref, out_dtype, tensor_cores=False, fp8_mma=False):
    """Elementwise bound on |y - y_ref| of a layer with 4-bit weights per group against
    reference.linear_group (float64 of the same codes; terms = sum of |addends| there).

    Weight-only: the model rounds w' to x's dtype too, so only the fp32 dot of K products and the
    bias differ. Dynamic: each group's dot is exact (int8 codes: int32) or a sum of exact products
    (fp8: group_size - 1 roundings), each times its scale (G roundings), the G - 1 sums, then * sx
    and + b: every path within gamma(K + G + 4) * terms (linear_abs_bound with k + groups terms).
    tensor_cores: the fp32 accumulator truncates (2^-23 a step, see above), fp8_mma adds the
    narrow fp8 adder of each k-step of 32 and each group's partial sum, and a bias may be rounded
    to a 16-bit y's dtype in a GEMM's epilogue (u_y |b| <= u_y terms)."""
    if not tensor_cores:
        return linear_abs_bound(k + groups, terms, y_ref, out_dtype)
    err = gamma(k + groups + LINEAR_EXTRA_ROUNDINGS, TENSOR_CORE_ACC_UNIT_ROUNDOFF) * terms
    if fp8_mma:
        err = err + FP8_MMA_ACC_UNIT_ROUNDOFF * (math.ceil(k / FP8_MMA_K_STEP) + groups + 1) * terms
    if out_dtype != "float32":
        err = err + OUTPUT_UNIT_ROUNDOFF[out_dtype] * terms
    return rounded_bound(err, y_ref, out_dtype)


# Two-level int4 x int8 (int4dq_2l) against float64 of the same codes (reference.linear_two_level):
# acc = a . q8 is an exact int32, so only its conversion to fp32, the products with sx and s1 and
# the bias sum round (LINEAR_EXTRA_ROUNDINGS, no dot roundings), then y's dtype once.
def two_level_linear_abs_bound(terms, y_ref, out_dtype):
    return linear_abs_bound(0, terms, y_ref, out_dtype)


# ---------------------------------------------------------------- leaks
# 100k calls of cheap ops (a fifth of them failing), measured after a warm-up; one leaked
# object or buffer per call would be 100k blocks / >= 3 MB, orders of magnitude above these.
LEAK_CALLS = 100_000
# Python objects in use (sys.getallocatedblocks): caches and free lists move by a few hundred.
LEAK_PYTHON_BLOCKS = 2_000
# Bytes malloc has handed out (glibc mallinfo2), C-side temporaries included: one leaked
# chunk per call would be >= 3.2 MB.
LEAK_HEAP_BYTES = 1024 * 1024
# RSS is noisier (arenas, page granularity) but a leaked DLPack tensor per call (struct and
# shape arrays, ~150 B) would still be >= 15 MB.
LEAK_RSS_BYTES = 8 * 1024 * 1024
# tracemalloc slows calls ~5x, so it watches fewer of them: 20k calls, where one leaked
# object of >= 32 B per call would be >= 640 KB.
LEAK_TRACEMALLOC_CALLS = 20_000
LEAK_TRACEMALLOC_BYTES = 128 * 1024
# GPU memory still allocated after `del model` (gc off) minus before the model was built, after a
# first build-run-delete round made what torch and cquant create once per process. cquant keeps
# no GPU memory between calls (README "Memory after a model is freed"), so it should be 0; the
# margin is for allocator bookkeeping only. The model of test_model_free_cuda.py is sized so the
# attention layers the former fuse_projections cycle held (about 5.5 MB) are well above it.
MODEL_FREE_CUDA_LEFTOVER_BYTES = 1024 * 1024


# ---------------------------------------------------------------- quantized linear on CUDA
# The CUDA layer against float64 of the same quantized math (decoded weight codes, fp32 scales,
# the activation codes of the C reference, which the CUDA quantizer matches bit for bit), per
# element, like the CPU bound above (linear_abs_bound) plus what each kernel path adds:
#   * tensor cores add into their fp32 accumulator truncating rather than rounding to nearest
#     (Fasi, Higham, Mikaitis, Pranesh, "Numerical behavior of NVIDIA tensor cores", PeerJ
#     Computer Science 7:e330, 2021): each addition errs by up to 2^-23, not 2^-24;
#   * weight-only GEMMs through cuBLASLt (M > 16, "wo_gemm") are held to one rounding of each
#     weight to x's dtype, u_x * terms (an older path rounded decode(q) * s; the codes now go in
#     exact); the sm_90a mixed-input GEMM ("wo_mixed") multiplies the exact codes and adds the
#     scale and any bias in fp32, so it has only the tensor cores' accumulation;
#   * fp8 tensor cores sum each k-step of 32 products with the accumulator in a narrower adder,
#     aligned to the largest addend and truncated to about 14 bits (DeepSeek-V3 Technical
#     Report, 2024, section 3.3.2): each k-step errs by at most 2^-13 times the magnitudes it
#     adds, so a dot product of K terms by at most 2^-13 (ceil(K / 32) + 1) terms. cuBLASLt's
#     promotion into fp32 registers every few k-steps only lowers it; the mma.sync kernel has
#     the same k-step;
#   * a float32 bias with a 16-bit y is rounded to y's dtype for cuBLASLt's epilogue: u_y |b|;
#   * the GEMV applies the activation as a pass over y, after y was rounded to its dtype: u_y |v|
#     more on the pre-activation v.
TENSOR_CORE_ACC_UNIT_ROUNDOFF = 2.0**-23
FP8_MMA_ACC_UNIT_ROUNDOFF = 2.0**-13
FP8_MMA_K_STEP = 32
CUDA_LINEAR_PATHS = ("gemv", "wo_gemm", "wo_mixed", "int8", "fp8")


def cuda_linear_path(act_format, m, gemv_max_m=16):
    """Which CUDA path ops.linear takes (kernels/linear.cu): the weight-only GEMV for M <= 16,
    the dequantize + cuBLASLt GEMM above, the int8 GEMM, or an fp8 GEMM (cuBLASLt or mma.sync)."""
    if act_format is None:
        return "gemv" if m <= gemv_max_m else "wo_gemm"
    return "int8" if act_format == "int8" else "fp8"


def cuda_pre_activation_error(path, k, terms, bias_abs, x_dtype, y_dtype):
    """Bound on |v - y64| of the fp32 result v before its rounding to y's dtype (see above)."""
    if path == "fp8":
        err = FP8_MMA_ACC_UNIT_ROUNDOFF * (math.ceil(k / FP8_MMA_K_STEP) + 1) * terms
        err = err + gamma(LINEAR_EXTRA_ROUNDINGS) * terms
    elif path == "int8":  # int32 sums are exact: the C reference's fp32 bound is generous
        err = gamma(k + LINEAR_EXTRA_ROUNDINGS) * terms
    else:
        err = gamma(k + LINEAR_EXTRA_ROUNDINGS, TENSOR_CORE_ACC_UNIT_ROUNDOFF) * terms
    if path == "wo_gemm":
        err = err + OUTPUT_UNIT_ROUNDOFF[x_dtype] * terms
    if path in ("wo_gemm", "fp8") and y_dtype != "float32":
        err = err + OUTPUT_UNIT_ROUNDOFF[y_dtype] * bias_abs
    return err


def rounded_bound(pre_error, y_ref, y_dtype):
    """Bound on |round(v) - y_ref| given |v - y_ref| <= pre_error."""
    u = OUTPUT_UNIT_ROUNDOFF[y_dtype]
    return pre_error + u * (np.abs(y_ref) + pre_error) + OUTPUT_HALF_SUBNORMAL_STEP[y_dtype]


def cuda_linear_abs_bound(path, k, terms, bias_abs, y_ref, x_dtype, y_dtype):
    """Elementwise bound on |y - y64| of the CUDA layer without activation."""
    return rounded_bound(cuda_pre_activation_error(path, k, terms, bias_abs, x_dtype, y_dtype), y_ref, y_dtype)


def cuda_gelu_abs_bound(path, k, terms, bias_abs, pre_ref, act_ref, x_dtype, y_dtype):
    """Elementwise bound on |y - gelu_tanh(y64)| of the CUDA layer with activation="gelu_tanh"."""
    pre = cuda_pre_activation_error(path, k, terms, bias_abs, x_dtype, y_dtype)
    if path == "gemv":
        pre = rounded_bound(pre, pre_ref, y_dtype)
    return gelu_of_error_bound(pre, pre_ref, act_ref, y_dtype)


# A gated layer on CUDA: v's error is the path's (above), carried through gated_value_error. The
# fp8 path through cuBLASLt folds the gate into the per-row weight scales (sw * gate, one more fp32
# rounding of each product) and into the bias (b * gate rounded to y's dtype: u_y |gate b|, already
# in the path's bias term times |gate|), and adds the residual as its C matrix in its own order: a
# few more fp32 roundings of |residual| + |gate v|. cquant.h allows such paths one rounding of y's
# dtype on the gated term (u_y |gate v|).
GATED_FOLD_EXTRA_ROUNDINGS = 4


def cuda_gated_abs_bound(path, k, terms, bias_abs, pre_ref, v_ref, gate, residual, y_ref, x_dtype, y_dtype,
                         gelu=False):
    """Elementwise bound on |y - y_ref| of a CUDA gated layer: y_ref = residual + gate v_ref in
    float64, v_ref the pre-activation pre_ref or gelu_tanh of it."""
    v_err = cuda_pre_activation_error(path, k, terms, bias_abs, x_dtype, y_dtype)
    if gelu:
        if path == "gemv":
            v_err = rounded_bound(v_err, pre_ref, y_dtype)
        v_err = gelu_of_error_bound(v_err, pre_ref, v_ref, "float32")
    err = gated_value_error(v_err, v_ref, gate, residual)
    if path == "fp8":
        gv = np.abs(gate) * (np.abs(v_ref) + v_err)
        err = err + GATED_FOLD_EXTRA_ROUNDINGS * FP32_UNIT_ROUNDOFF * (np.abs(residual) + gv)
        err = err + OUTPUT_UNIT_ROUNDOFF[y_dtype] * gv
    return rounded_bound(err, y_ref, y_dtype)


# ---------------------------------------------------------------- weight-only GEMV (CUDA)
# cquant's CUDA GEMV (M <= 16) against float64 and against the C reference run on CPU copies of
# the same tensors, per element, terms = sum_k |x[m,k]| |decode(q[n,k])| |sw[n]| + |b[n]|.
# Decoding and products are exact on both sides; only the fp32 summation order differs
# (tensor-core k-tiles and split-K warps vs 8-way partial sums), which on N(0, 1) data moves
# results by ~u sqrt(K) rms. Measured: the C reference itself is within 6.5e-8 * terms of
# float64 at K <= 3072; 2^-16 is ~200x that and still 20x below the error of one wrong code at
# K = 4097. Then each side rounds its fp32 sum to y's dtype once: half an ulp (u |y|) against
# float64, and both roundings against each other (so results a few fp32 ulps apart may land
# one output ulp apart).
GEMV_WO_ACC_REL = 2.0**-16


def gemv_wo_abs_bound(terms, y_ref, out_dtype, against="float64"):
    """Elementwise bound on |y - y_ref| of the CUDA GEMV: against the float64 value, or against
    the C reference ("reference", itself rounded to out_dtype)."""
    acc = GEMV_WO_ACC_REL * terms
    u, sub = OUTPUT_UNIT_ROUNDOFF[out_dtype], OUTPUT_HALF_SUBNORMAL_STEP[out_dtype]
    if against == "float64":
        return acc + u * (np.abs(y_ref) + acc) + sub
    return 2 * acc + 2 * u * (np.abs(y_ref) + 2 * acc) * (1 + u) + 2 * sub

# ---------------------------------------------------------------- 4-bit weights per group (CUDA)
# The CUDA kernels of int4 / uint4 layers (gemv_group4.cu for M <= 16, the mixed-input GEMMs
# above) against the C reference run on CPU copies of the same tensors, and against float64 of
# the same quantized math.
#
# Weight-only (int4wo): both sides compute w' = x' of the format rounded to x's dtype bit for
# bit, so the only difference is the order of the fp32 sum of the K products. For bf16 / f16 x
# the products x w' are exact in fp32 (8 + 8 or 11 + 11 significant bits), so, as for the
# weight-only GEMV (GEMV_WO_ACC_REL): fp32 summation in any order errs by ~u sqrt(K) of terms
# = sum_k |x w'| + |b| (the tensor cores' truncating adds, once per k-tile of 16, stay below
# that); INT4_WO_ACC_REL = 2^-16 is over 10x the tensor-core worst case at K = 15360 and still
# below the change one wrong code makes at the shapes tested. f32 x: the reference rounds each
# product, the f32 GEMV fuses it into its sum: one more u per term.
INT4_WO_ACC_REL = 2.0**-16


def int4_wo_pre_error(terms, x_dtype):
    """Bound on |v - v_ref| of the fp32 pre-rounding values of a weight-only 4-bit layer (either
    side against float64 of the same w')."""
    err = INT4_WO_ACC_REL * terms
    if x_dtype == "float32":
        err = err + FP32_UNIT_ROUNDOFF * terms
    return err


def int4_wo_abs_bound(terms, y_ref, x_dtype, against="float64"):
    """Elementwise bound on |y - y_ref| of a CUDA 4-bit weight-only layer (y in x's dtype): against
    float64, or against the C reference ("reference": both sides' errors and roundings)."""
    pre = int4_wo_pre_error(terms, x_dtype)
    if against == "float64":
        return rounded_bound(pre, y_ref, x_dtype)
    u, sub = OUTPUT_UNIT_ROUNDOFF[x_dtype], OUTPUT_HALF_SUBNORMAL_STEP[x_dtype]
    return 2 * pre + 2 * u * (np.abs(y_ref) + 2 * pre) * (1 + u) + 2 * sub


# Dynamic (int4dq, fp8da_int4w): y = act((sum_g acc_g sw[n, g]) sx + b), terms = sum_k |a code|
# sw sx + |b| (a the activation codes' values). int8 activations: acc_g is an exact int32 sum
# (|acc_g| <= 1024 * 127 * 8 < 2^24: exact in fp32 too) on every path, so paths differ only in the
# order of the G-term fp32 sum over groups: gamma(G) of sum_g |acc_g sw| <= terms / sx each, and
# the epilogue's two roundings (the mma.sync kernel adds in group order with the reference's
# roundings, bit-identical to it, except where it splits K into ranges summed apart). fp8 activations: products are exact, but the fp8 tensor cores'
# k-steps of 32 add with ~14-bit truncation (FP8_MMA_ACC_UNIT_ROUNDOFF above): 2^-13 (gs / 32 + 1)
# of each group's terms, while the reference's fp32 group dot errs by gamma(gs).
INT4_DYNAMIC_EXTRA_ROUNDINGS = 3  # the product acc_g * sw, * sx, + b


def int4_dynamic_pre_error(terms, k, group_size, act_format, path="cuda"):
    """Bound on |v - v64| of a dynamic 4-bit layer's fp32 value before its rounding (path "cuda":
    the GPU kernels, "reference": the C reference)."""
    groups = k // group_size
    err = gamma(groups + INT4_DYNAMIC_EXTRA_ROUNDINGS) * terms
    if act_format != "int8":
        if path == "cuda":
            err = err + FP8_MMA_ACC_UNIT_ROUNDOFF * (group_size / FP8_MMA_K_STEP + 1) * terms
        else:
            err = err + gamma(group_size) * terms
    return err


def int4_dynamic_abs_bound(terms, y_ref, k, group_size, act_format, y_dtype, against="float64"):
    """Elementwise bound on |y - y_ref| of a CUDA dynamic 4-bit layer: against float64, or against
    the C reference ("reference": both sides' errors and roundings)."""
    pre = int4_dynamic_pre_error(terms, k, group_size, act_format)
    if against == "float64":
        return rounded_bound(pre, y_ref, y_dtype)
    pre = pre + int4_dynamic_pre_error(terms, k, group_size, act_format, path="reference")
    u, sub = OUTPUT_UNIT_ROUNDOFF[y_dtype], OUTPUT_HALF_SUBNORMAL_STEP[y_dtype]
    return pre + 2 * u * (np.abs(y_ref) + pre) * (1 + u) + 2 * sub


# ---------------------------------------------------------------- attention
# Relative L2 error |out - ref| / |ref| against float64 attention on the same (already rounded)
# inputs. The full-precision reference computes in fp64 and rounds once to the output dtype: an
# rms relative error of about u / sqrt(3) (u = 2^-24 fp32, 2^-11 fp16, 2^-8 bf16); bounds ~4x.
ATTN_REF_REL_L2 = {"float32": 1e-6, "float16": 1e-3, "bfloat16": 8e-3}
# Its log-sum-exp is rounded once from fp64 to fp32: absolute error ~|lse| * 2^-24.
ATTN_REF_LSE_ABS = 1e-5
# 8-bit mode (int8 Q/K per block with K smoothed, u8 P at each tile's max, int8 V per channel)
# against float64 attention, with and without large per-channel key offsets: the accuracy the
# mode promises.
ATTN_INT8_MIN_COSINE = 0.999
# Values with per-channel means (as activations of diffusion transformers have): outputs are
# coherent averages and the rounding of P and V averages out (measured 0.05-0.33%).
ATTN_INT8_REL_L2 = 0.03
# i.i.d. N(0, 1) values are the worst case: each output is an incoherent average, so the
# roundings of its terms survive. int8 V per channel rounds by at most amax / 254, amax ~3.2-4.2
# (the largest |N(0, 1)| of 333-4097 keys): rms amax / (127 sqrt(12)) = 0.7-1.0% of a value;
# u8 P rounds each weight by at most 1/510 of its tile's largest (0.7% of the output); int8 Q/K
# add 1.1% (each rounding alone, measured). Independent, they give ~1.6%: measured 1.3-1.8%
# (D = 8-256, 77-16384 keys), where e4m3 P and V (3 mantissa bits) measured 3.7-4.1%. The bound
# is the mode's target. It holds for the randn q, k of the tests (E ~0.45 of the threshold); heads
# near the threshold measured up to 3.2% (cquant.h, scripts/attention_int8_bound_study.py).
ATTN_INT8_REL_L2_IID = 0.03
# ... measured over hundreds of outputs; over n outputs the estimate itself spreads by about
# 1/sqrt(n) relative (a single query with head dim 8 gives 16), so the bound grows by
# ATTN_INT8_IID_SPREAD / sqrt(n). The cosine bar (>= 0.999) applies to the realistic case above.
ATTN_INT8_IID_SPREAD = 2.0
# Below this many outputs the i.i.d. estimate is too noisy to bound (16 outputs: up to 3.6% in
# 300 draws, 2.4x their mean; 8.9% once with e4m3 P and V): those shapes keep the cosine check
# on realistic values and the C-reference checks.
ATTN_INT8_IID_MIN_OUTPUTS = 64
# lse of the 8-bit mode: int8 scores carry ~1% relative error on |scale q.k| ~ O(1..10).
ATTN_INT8_LSE_ABS = 0.05
# The C reference of the 8-bit mode against an independent NumPy evaluation of the same
# quantized math (cquant.h): the integer sums are exact in both, only exp2 ulps (and NumPy's
# fmaf, rounded twice) differ, which moves a rare u8 code of P by one step. One such step moves
# its row by about |v_j - out_i| / l_i (l counting codes): measured up to 1.3e-4 of the whole
# output (1000 calls with the data of test_int8_reference_is_the_documented_math; 2.5-4.5% of
# them flip a code). 5e-4 leaves room for a few flips in one call; P quantized at the running
# max instead of the tile's max differs by 2-6e-3.
ATTN_INT8_VS_NUMPY_REL_L2 = 5e-4
# The 8-bit mode with every key's value equal (per channel): every value code is +-127 and l sums
# the same P codes that weight them (cquant.h), so A = 127 ls exactly and out = acc / l * sv gives
# the value back up to fp32 rounding: acc and l each take two roundings a tile (the rescale and
# the fmaf), then a division, sv and its product, each 2^-24 relative: (4 t + 3) 2^-24 over t
# tiles, 15 at the Skv <= 333 (t <= 3) of the test (measured at most 4.4); 32 of them. (Normalised
# by the unrounded p instead, the output moves with the P rounding, by far more.)
ATTN_INT8_CONSTANT_VALUES_REL = 32 * 2.0**-24
# The 8-bit mode's logit-error estimate E (cquant.h) in fp32 against the same formula in float64
# on the same codes: about ten fp32 roundings of 2^-24 relative each, so ~1e-6; 10x margin.
ATTN_INT8_BOUND_REL = 1e-5
# E of typical inputs (randn q, k with any common key offset; RMSNorm / LayerNorm q, k with
# weights near 1) as a fraction of the threshold: a head's is 0.4-0.5, the worst of the ~100
# heads of test_typical_inputs_stay_in_8_bits measured 0.52 (median) to 0.68 (max) over 400 seeds.
ATTN_INT8_TYPICAL_BOUND_FRACTION = 0.8
# Whole tiny diffusers transformers through the cquant backend vs the default (SDPA) backend.
ATTN_MODEL_FULL_REL_L2 = {"float32": 1e-5, "bfloat16": 2e-2}
# ... and through the 8-bit backend (measured 1.5-2.3e-4 in float32 on the CPU, 4-6e-4 with e4m3 P
# and V: the tiny Flux, also as a CFG batch, the tiny PixArt, and the tiny CogVideoX, also
# 1.5-style with its rotary embedding on a CFG batch).
ATTN_MODEL_INT8_REL_L2 = 0.05
# Ring attention (diffusers' context-parallel template) against float64 attention: each shard's
# (out, lse) comes from the kernels, out rounded to its dtype, then the shards merge in fp32:
# out = prev - sigmoid(lse - prev_lse) (prev - out), lse = prev_lse - logsigmoid(prev_lse - lse).
# fp32: a merge adds about four roundings of |out| (sigmoid, product, two differences), rms
# ~4 * 2^-24 / sqrt(3) = 1.4e-7 (measured, 2 shards, 60 seeds: at most 1.3e-7; one process 3.6e-8).
# bf16: out is rounded twice (the shard's, then the merged result), rms ~sqrt(2) * 2^-8 / sqrt(3) =
# 3.2e-3 (measured at most 2.4e-3; one process 1.7e-3). Bounds ~3x to 8x; the merged lse stays
# within ATTN_REF_LSE_ABS (measured 9e-8 relative).
ATTN_RING_REL_L2 = {"float32": 1e-6, "bfloat16": 8e-3}
# Ulysses attention with q, k, v and the output crossing in 8 bits (cquant.ulysses_wire: int8 a
# (token, head) row, keys smoothed by the sender's means) against float64 attention, for calls the
# wire takes: its q and k roundings meet the 8-bit attention's logit-error bound (E <= 0.06), and
# its v and output roundings, amax / 254 of a row at most (rms amax / 440, 0.6-0.8% of an element
# of a randn row of 32-128), average over the keys (v) or land once on each output element (out).
# The 8-bit attention's target holds them (measured 0.7% with values with channel means).
ULYSSES_WIRE_REL_L2 = ATTN_INT8_REL_L2

# CUDA kernels. Full precision: error vs float64 at most this factor times the error of torch
# SDPA (flash/cuDNN/efficient, whichever torch picks) in the same dtype on the same inputs,
# plus a tiny absolute floor for outputs where both are exact to within rounding.
ATTN_CUDA_VS_SDPA_FACTOR = 2.0
ATTN_CUDA_REL_L2_FLOOR = 1e-4
# lse of the CUDA full-precision kernel: exact products of the (already rounded) inputs, fp32
# sums and ex2.approx (2 ulp): ~1e-6 relative on |lse| ~ 10.
ATTN_CUDA_LSE_ABS = 1e-3
# The 8-bit CUDA kernel against the C reference of the same quantized math: the u8 x s8 sums are
# exact in both, the fp32 steps (fmaf folds) the same; ex2.approx and the conversions may flip a
# rare u8 code of P by one step (each ~1e-4 of the output, ATTN_INT8_VS_NUMPY_REL_L2). The bound
# stays loose; e4m3 P and V differ from this math by 3-4% on i.i.d. values.
ATTN_CUDA_INT8_VS_REF_REL_L2 = 1e-2
# The 8-bit kernel runs the keys of a last wave's query blocks in two halves and merges them
# (cquant.h); a call over another set of heads (cquant's Ulysses exchange in head groups) splits
# other blocks, so some rows' fp32 folds run in another order: results a few fp32 ulps apart,
# which land at most one ulp of the output dtype apart (2 u |x|, u its unit roundoff), plus,
# where the output nearly cancels, the fold's fp32 round-off itself: the folded partial outputs
# are convex combinations of value rows, so a few fp32 units of the largest |v| (seen: 7e-10 at
# |out| 3.5e-8, where this allows about 1e-6).
ATTN_INT8_MERGE_ORDER_ULPS = 1
ATTN_INT8_MERGE_ORDER_VALUE_UNITS = 4 * 2.0**-24
# The full-precision CUDA kernels against the C reference in the same 16-bit dtype: each rounds P
# (kernel) or the products (reference) and the output to bf16, about 2.3e-3 rms against float64
# each (measured, the ATTN_CUDA_VS_SDPA_FACTOR tests); their difference stays below twice that.
ATTN_CUDA_FULL_VS_REF_REL_L2 = 1e-2
# Per-head decisions of the 8-bit mode's accuracy bound: the GPU's estimate differs from the C
# reference's by fp32 rounding of kmean (another summation order) moving rare int8 codes by one,
# ~1e-4 relative; tests keep every head's estimate 5% away from the threshold (their inputs
# measure >= 40% away).
ATTN_CUDA_INT8_BOUND_MARGIN = 0.05


# ---------------------------------------------------------------- quantized models (workflow)
# Output of a tiny random-weight diffusion transformer (tests/tiny_models.py: Flux, SD3,
# PixArt-Sigma, CogVideoX, Qwen-Image, 2 blocks, width 64, float32 compute) with every linear
# layer quantized by cquant.quantize_, against the same model unquantized. Measured: minimum
# over 12 seeds x 5 families (in parentheses) minus about 2 dB, rounded down to 0.5 dB. Error
# grows through the blocks, so these sit a few dB under the single-layer floors.
MODEL_SQNR_FLOOR_DB = {
    "int8wo": 42.5,  # (44.7)
    "int8dq": 37.5,  # (39.8)
    "fp8dqrow": 23.5,  # (25.6)
    "fp8dq": 23.0,  # (24.9)
    "fp8wo": 26.0,  # (28.2)
    "fp8wo_e5m2": 20.0,  # (22.1)
    "fp6_e3m2": 20.0,  # (22.1)
    "fp6_e2m3": 26.0,  # (28.0)
    "fp5_e2m2": 20.0,  # (22.0)
    "fp4_e2m1": 13.5,  # (15.5)
}

# The same tiny Flux with a LoRA adapter (rank 4, alpha / r = 32, random A and B) on to_q / to_k /
# to_v / add_k_proj, quantized base layers against float ones (tests/test_fusion_lora.py): the
# adapter's float branch changes the attention inputs, so the error grows a little more, and its
# lower tail is long (1% quantile 36.1 and 22.5 dB, minimum 34.2 and 19.4). Measured: minimum over
# 1000 seeds of both tests' layouts (in parentheses) minus about 1.7 dB, rounded down to 0.5 dB. An
# adapter that did not run leaves at most 12 dB between the float outputs, far under these floors.
MODEL_WITH_ADAPTER_SQNR_FLOOR_DB = {
    "int8dq": 32.5,  # (34.2)
    "fp8dqrow": 17.5,  # (19.4)
}

# A quantized model in bfloat16 against the float32 unquantized one: bfloat16's own rounding
# through the blocks (about 33 dB for the tiny Qwen-Image, more for the others) caps what any
# scheme can reach, so 8-bit schemes share one floor there.
MODEL_SQNR_FLOOR_BF16_DB = {name: min(v, 30.0) for name, v in MODEL_SQNR_FLOOR_DB.items()}

# One QuantizedLinear against float64 x @ dequantize(W)^T + b (the same quantized weight): only
# fp32 accumulation and the output rounding differ; norm-wise relative error bounds per output
# dtype (u / sqrt(3) rms for the output rounding, times about 10).
QLINEAR_REL_L2 = {"float32": 1e-5, "float16": 5e-3, "bfloat16": 3e-2}

# Dynamic schemes also quantize the activations: against float64 x @ dequantize(W)^T + b the
# error is the activation format's. Measured: N(0, 1) x, N(0, 1/K) W, N(0, 1) b, (M, K, N) =
# (1, 1025, 97), (7, 97, 33), (16, 64, 1) (the last has only 16 outputs, hence the spread),
# float32 / float16 / bfloat16; minimum over 300 seeds (in parentheses) minus about 1.5 dB.
QLINEAR_DYNAMIC_SQNR_FLOOR_DB = {"int8dq": 36.0, "fp8dqrow": 24.0, "fp8dq": 23.5}  # (37.6, 25.6, 25.0)

# The activation codes of a dynamic layer (cquant.h, cq_quantize) with the scale s = amax / qmax of
# their row (or of the tensor): int8 codes are within s / 2 of x, fp8 e4m3 ones within half a step
# of their 3-bit mantissa (2^-4 |x|) or of the subnormals (2^-10 s), each beside the fp32 roundings
# of x / s and code * s (2 u |x| more).
ACT_QMAX = {"int8": 127.0, "fp8_e4m3": 448.0}


def dynamic_linear_abs_bound(x, w, b, act_format, granularity, y_ref, out_dtype):
    """Elementwise bound on |y - y_ref| of a dynamic layer, y_ref = x @ w.T + b in float64 with w
    its dequantized weight (x [M, K], w [N, K], b [N], float64 arrays): the activations' quantization
    error through |w|, then the fp32 sums and the output rounding. Unlike an SQNR floor it holds for
    every draw, also of layers with a handful of outputs."""
    ax = np.abs(x)
    amax = ax.max(axis=1, keepdims=True) if granularity == "row" else np.full((x.shape[0], 1), ax.max())
    s = amax / ACT_QMAX[act_format]
    ex = np.broadcast_to(s / 2, ax.shape) if act_format == "int8" else 2.0**-4 * ax + 2.0**-10 * s
    ex = ex * (1 + 4 * FP32_UNIT_ROUNDOFF) + 2 * FP32_UNIT_ROUNDOFF * ax
    aw = np.abs(w)
    terms = (ax + ex) @ aw.T + np.abs(b).reshape(1, -1)
    pre = ex @ aw.T + gamma(x.shape[1] + LINEAR_EXTRA_ROUNDINGS) * terms
    return rounded_bound(pre, y_ref, out_dtype)

# quantize-then-fuse of a per-tensor scheme requantizes the q / k / v codes onto the fused
# scale (a second rounding): the fused model stays this close to the unfused quantized one.
FUSED_REQUANT_SQNR_FLOOR_DB = 30.0

# torch.compile (inductor) of a quantized model against eager: the quantized linear op is the
# same opaque call, only the float ops around it may be fused and reordered.
COMPILE_REL_L2 = 1e-4

# Tiny text encoders (tests/tiny_models.py: T5 with d_model 64, CLIP with hidden 32, 2 layers,
# float32), every layer a scheme takes quantized (T5 keeps its _keep_in_fp32_modules), output
# hidden states against the unquantized encoder. Measured: minimum over 12 seeds of both encoders
# (CLIP is the lower, in parentheses; its final layer norm of a 32-wide state magnifies the
# error) minus about 2 dB.
TEXT_ENCODER_SQNR_FLOOR_DB = {
    "int8wo": 35.0,  # (37.0)
    "int8dq": 31.5,  # (33.7)
    "fp8dqrow": 19.0,  # (21.1)
    "fp8wo": 22.0,  # (23.9)
    "fp6_e3m2": 15.0,  # (17.3)
}

# CUDA: the same quantized model run again (a CUDA graph replay, another stream) launches the
# same kernels; results are equal unless a GEMM reduces split-K partial sums in a varying order,
# which moves bfloat16 outputs by about one ulp at most (2^-8 relative, far less norm-wise).
REPLAY_REL_L2 = 1e-3
# torch.compile on CUDA fuses the bfloat16 elementwise ops around the quantized layers and may
# keep intermediates in fp32 where eager rounds to bfloat16: differences of a few bfloat16 ulps,
# which flip fp8 activation codes (3 mantissa bits) and grow through two blocks. Measured on an
# H100 for fp8dqrow: 3.9e-2 between compiled and eager; both are equally close to float32.
COMPILE_CUDA_REL_L2 = 8e-2
COMPILE_CUDA_SQNR_LOSS_DB = 1.0


# ---------------------------------------------------------------- fused DiT block ops
# norm_modulate and qk_norm_rope against the float64 evaluation of cquant.h's formulas on the same
# (already rounded) inputs. Every path computes in fp32 and rounds once to the output dtype; the
# sums may run in any order, so the bounds are Higham's order-free gamma(n) (see above).
#
# norm_modulate, per row of D elements, u the fp32 unit roundoff:
#   mean (LayerNorm): D - 1 additions and a division: |mu32 - mu| <= gamma(D) * mean|x| = delta
#   rstd: the subtraction x - mu32 and the square (3u relative on each square), D - 1 additions,
#     the division by D, + eps, sqrtf (halves what came before, adds u), 1 / (u): relative
#     gamma(D + NORM_EXTRA_ROUNDINGS); the offset delta of mu32 adds (delta * rstd)^2 / 2 more
#     (the centred sum of squares grows by D delta^2)
#   n = (x - mu32) * rstd: |n32 - n| <= delta * rstd + (rel(rstd) + 2u) |n|
#   v = n * (1 + s) + sh: three roundings (1 + s, the product, the sum): gamma(3) of the terms
# then the output rounds once (rounded_bound). The same bound holds for the CUDA kernels, which sum in
# another order and may contract products into fused multiply-adds (fewer roundings, not more).
NORM_EXTRA_ROUNDINGS = 8
MODULATE_ROUNDINGS = 3


def norm_modulate_pre_error(d, mean_abs_x, rstd, n, one_plus_scale, shift, layer):
    """Bound on |v32 - v64| before the rounding to the output dtype (see above); arrays broadcast
    per row (mean_abs_x, rstd) and per element (n, one_plus_scale, shift)."""
    g = gamma(d + NORM_EXTRA_ROUNDINGS)
    delta_r = g * mean_abs_x * rstd if layer else 0.0
    err_n = delta_r + (g + 0.5 * delta_r**2 + 2 * FP32_UNIT_ROUNDOFF) * np.abs(n)
    terms = np.abs(n) * np.abs(one_plus_scale) + np.abs(shift)
    return err_n * np.abs(one_plus_scale) + gamma(MODULATE_ROUNDINGS) * (terms + err_n * np.abs(one_plus_scale))


# Against diffusers' unfused modulation (LayerNorm / RMSNorm, then x * (1 + scale) + shift in the
# model's dtype, as AdaLayerNormZero does): diffusers rounds n, 1 + scale and the product to the
# 16-bit dtype before adding shift and rounding again, where cquant rounds once. The product then
# differs by at most ((1 + u)^3 - 1) |n| |1 + s| (grown by one more rounding, (1 + u)), each side
# rounds the sum (u |v| each), and each side's fp32 error (above) adds once.
UNFUSED_MODULATE_ROUNDINGS = 3


def unfused_modulate_abs_bound(pre_error, n, one_plus_scale, v, out_dtype):
    """Bound on |cquant - diffusers| of norm + modulation in a 16-bit dtype (see above)."""
    u = OUTPUT_UNIT_ROUNDOFF[out_dtype]
    product = ((1 + u) ** UNFUSED_MODULATE_ROUNDINGS - 1) * (1 + u) * np.abs(n) * np.abs(one_plus_scale)
    return (2 * pre_error + product + 2 * u * (np.abs(v) + pre_error)) * (1 + u) + 2 * OUTPUT_HALF_SUBNORMAL_STEP[
        out_dtype]


# qk_norm_rope, per head of D elements: the RMSNorm's r has a relative error of gamma(D + 4) (the
# squares, D - 1 additions, / D, + eps, sqrtf, 1 /); a = x * r * w two more roundings; the rotation
# a0 c - a1 z a product each and the difference: gamma(D + QK_EXTRA_ROUNDINGS) times the terms
# |a0 c| + |a1 z| (|a| without rotation), then the output rounds once.
QK_EXTRA_ROUNDINGS = 8


def qk_norm_rope_pre_error(d, terms):
    return gamma(d + QK_EXTRA_ROUNDINGS) * terms


# Against diffusers' unfused RMSNorm (weight in the 16-bit dtype: the normalized value is rounded to it,
# then the product with the weight is rounded again) and apply_rotary_emb (fp32 from the rounded
# values, rounded once): the inputs of the rotation differ by ((1 + u)^2 - 1) |a|, each side rounds
# its output once, and each side's fp32 error adds once.
UNFUSED_QK_ROUNDINGS = 2


def unfused_qk_abs_bound(pre_error, terms, out_ref, out_dtype):
    u = OUTPUT_UNIT_ROUNDOFF[out_dtype]
    inputs = ((1 + u) ** UNFUSED_QK_ROUNDINGS - 1) * terms
    return (2 * pre_error + inputs + 2 * u * (np.abs(out_ref) + pre_error + inputs)) * (1 + u) + \
        2 * OUTPUT_HALF_SUBNORMAL_STEP[out_dtype]


# ---------------------------------------------------------------- fused block forwards (cquant.optimize)
# A block, or a whole tiny model (tests/tiny_models.py: Flux, SD3, SD3.5-style with Q/K RMSNorm and
# dual attention, Qwen-Image), with cquant's fused forward against the same one running diffusers'
# forward: same weights, same inputs. The fused ops keep each element-wise step (norm, modulation,
# Q/K norm, rotation, gated residual) in fp32 and round once where diffusers rounds after every
# step, so float32 models agree to fp32 round-off and 16-bit ones to a few roundings per block;
# with a dynamic scheme an activation code can flip where the two differ by a rounding (one step
# of the format on that element: int8 and fp8 codes of float32 models too). Measured: minimum
# over 6 seeds of the four models (in parentheses), minus about 4 dB. Keys: (dtype, scheme kind)
# with kind "float" (unquantized or weight-only) or "dynamic".
OPTIMIZE_BLOCK_SQNR_FLOOR_DB = {
    ("float32", "float"): 140.0,  # (148.9)
    ("float32", "dynamic"): 84.0,  # (89.8)
    ("bfloat16", "float"): 53.0,  # (57.5)
    ("bfloat16", "dynamic"): 47.0,  # (51.3)
    ("float16", "float"): 70.0,  # (74.8)
}
# The final AdaLayerNormContinuous (norm_out) alone: its output is the modulated norm itself, not a
# residual plus small gated terms, so the roundings diffusers makes (norm, 1 + scale, product, sum)
# show in full. Measured as above (with every scheme).
OPTIMIZE_NORM_OUT_SQNR_FLOOR_DB = {"float32": 133.0, "bfloat16": 44.0, "float16": 62.0}  # (137.6, 47.7, 66.0)
# Whole models: errors grow through the blocks and the final layers. Keys: (dtype, scheme or None).
OPTIMIZE_MODEL_SQNR_FLOOR_DB = {
    ("float32", None): 125.0,  # (133.6)
    ("float32", "int8wo"): 125.0,  # (135.0)
    ("float32", "int8dq"): 55.0,  # (60.5)
    ("float32", "fp8dqrow"): 72.0,  # (78.2)
    ("bfloat16", None): 41.5,  # (45.2)
    ("bfloat16", "int8wo"): 41.5,  # (45.4)
    ("bfloat16", "int8dq"): 36.5,  # (40.3)
    ("bfloat16", "fp8dqrow"): 28.0,  # (31.8)
    ("float16", None): 59.5,  # (63.5)
}
# ... and both against the float32 unquantized model: the fused forward is as accurate as
# diffusers' (measured: at most 0.57 dB less, often more).
OPTIMIZE_SQNR_LOSS_DB = 1.5

# ---------------------------------------------------------------- low-rank correction
# cquant.lowrank.factors of an error of exact rank r (N(0, 1) factors): the exact SVD recovers
# it to fp32 round-off (~1e-6); the randomized range finder (min dim > 1024) with 16 extra
# columns and 4 power iterations to ~1e-5 as well. The bound catches a wrong split or sign.
LOWRANK_FACTOR_REL_L2 = 1e-4
# Output SQNR gained by rank 8 over rank 0 on tests/test_lowrank.py's structured weight (noise,
# a rank-4 part and 6 outliers) per scheme. Measured: minimum over 200 seeds minus about 1 dB.
LOWRANK_SQNR_GAIN_DB = {"fp4_e2m1": 1.0, "int8wo": 2.5, "int8dq": 0.8}  # (2.09, 3.49, 1.86)
# int4wo (group 128) at rank 16 on tests/test_int4_workflow.py's structured Linear(256, 96): its
# rounding error is mostly white, so the gain is small but steady (min 2.07 dB over 100 seeds).
LOWRANK_SQNR_GAIN_DB["int4wo"] = 1.5

# ---------------------------------------------------------------- 4-bit layers and models
# One Linear(1024, 256) with N(0, 1) weights, group 128, x N(0, 1): the output SQNR is the
# weight's. Derived: symmetric int4 has step a / 7 (rounded to 8 significant bits, which moves it
# by under 2^-8) with a ~ 2.9 sigma the amax of 128 Gaussians,
# so noise step^2 / 12 ~ 0.014 sigma^2, 18.4 dB; uint4 has 15 steps over max - min ~ 5.2 sigma,
# 19.9 dB (measured min over 30 seeds: 19.8 int4wo, 18.2-18.4 the others). 15 dB leaves room for
# the activation rounding of the dynamic schemes and catches any lost bit (6 dB each).
INT4_GAUSSIAN_LAYER_SQNR_FLOOR_DB = {"int4wo": 15.0, "int4wo_sym": 15.0, "int4dq": 15.0, "fp8da_int4w": 15.0}
# Two-level int4: the step of a group is s1 s2 = (a / 112) ceil(ag / (7 s1)), at most one s1 above
# ag / 7, which costs ~0.4 dB against int4's (scripts/w4a8_two_level_study.py: 18.2 dB for
# Gaussian weights); the same 15 dB floor.
INT4_GAUSSIAN_LAYER_SQNR_FLOOR_DB["int4dq_2l"] = 15.0
# The tiny Flux at head dim 64 (tests/test_int4_workflow.py), float32, every layer the group size
# takes quantized, group sizes 32 / 64 / 128, against the float model. Measured: minimum over 6
# seeds and the three group sizes (in parentheses) minus about 2 dB.
INT4_MODEL_SQNR_FLOOR_DB = {"int4wo": 20.0, "int4wo_sym": 19.5, "int4dq": 19.5, "fp8da_int4w": 19.0}  # (22.2, 21.7, 21.7, 21.3)
INT4_MODEL_SQNR_FLOOR_DB["int4dq_2l"] = 19.5  # (21.67; int4dq 21.86 in the same run)
# The tiny CLIP text encoder (hidden 32, MLP 64) as int4dq with group 32 against float: 4 bits
# in every layer of a model this narrow lose more (11.9 to 15.3 dB over 5 seeds, 14.5 for the
# seed the test uses).
INT4_TEXT_ENCODER_SQNR_FLOOR_DB = 11.0
# Batch parallelism in float32 (test_batch_parallel.py): a rank computes the same math on the same
# weights as the one-process model, on fewer rows; only the summation order inside the GEMMs
# changes with the row count (CPU BLAS blocks M), so outputs differ by a few unit roundoffs
# (2^-24): measured rel. L2 1.3e-7 to 1.8e-7 on its five tiny models. 32 unit roundoffs (1.9e-6)
# leave a 10x margin, while a sample of the wrong branch or a lost row is off by order 1
# (test_the_samples_differ checks that the data shows it).
BATCH_PARALLEL_REL_L2 = 2.0 ** -19
