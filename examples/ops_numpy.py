"""Quantize a random weight in every scheme and run the quantized linear layer on NumPy arrays."""

import numpy as np

from cquant import ops
from cquant.metrics import sqnr_db

SCHEMES = [
    ("int8wo", "int8", None),
    ("int8dq", "int8", "int8"),
    ("fp8dqrow", "fp8_e4m3", "fp8_e4m3"),
    ("fp8wo", "fp8_e4m3", None),
    ("fp6_e3m2", "fp6_e3m2", None),
    ("fp5_e2m2", "fp5_e2m2", None),
    ("fp4_e2m1", "fp4_e2m1", None),
]


def main():
    rng = np.random.default_rng(0)
    k, n, m = 1024, 512, 64
    w = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)
    x = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    ref = x.astype(np.float64) @ w.astype(np.float64).T + b
    print(f"{'scheme':<10} {'weight bytes':>12} {'SQNR vs float64 (dB)':>22}")
    for name, wfmt, afmt in SCHEMES:
        qw, sw = ops.quantize(w, wfmt)
        y = ops.linear(x, qw, sw, weight_format=wfmt, act_format=afmt, bias=b, in_features=k)
        print(f"{name:<10} {qw.nbytes + sw.nbytes:>12} {sqnr_db(ref, y):>22.1f}")
    print(f"{'float32':<10} {w.nbytes:>12}")


if __name__ == "__main__":
    main()
