"""Test tolerances, named once: SQNR in dB for quantization, relative L2 error against a
float64 reference for GEMMs."""

# Quantized linear layer on CUDA vs float64 of the same quantized math (decoded codes, fp32
# scales): what remains is fp32 accumulation order, the final rounding to y's dtype (about
# 2^-9 relative for bf16, 2^-11 for fp16, spread over the outputs), and for weight-only
# schemes with M > 16 the rounding of the dequantized weight to x's dtype before the GEMM.
LINEAR_CUDA_REL_L2 = {
    "bfloat16": 8e-3,
    "float16": 2e-3,
    "float32": 1e-5,
}

# Floor for schemes with fp8 activations: fp8 tensor cores accumulate with a reduced-precision
# adder (cuBLASLt promotes to fp32 every few K blocks; the mma.sync fallback does not).
LINEAR_CUDA_FP8_REL_L2 = 5e-3
