"""Accuracy measures shared by the demo, the benchmarks and the tests."""

import math

import numpy as np

__all__ = ["sqnr_db"]


def _is_torch(a):
    return type(a).__module__.startswith("torch") and hasattr(a, "detach")


def sqnr_db(ref, x):
    """Signal-to-quantization-noise ratio of x against ref, in dB:
    20 log10(|ref| / |ref - x|), both norms over all elements, computed in float64.

    ref comes first: the noise is measured against ref's energy, so swapping the arguments
    changes the result. ref and x are NumPy arrays or torch tensors (any dtype, any device;
    a torch x meets ref on ref's device) of the same shape.

    Returns +inf when x equals ref exactly, -inf when ref is all zeros and x is not, and NaN
    (never an exception or a warning) when either holds a NaN or an infinity.
    """
    if _is_torch(ref) or _is_torch(x):
        import torch

        r = torch.as_tensor(ref.detach() if _is_torch(ref) else np.asarray(ref)).to(torch.float64)
        d = torch.as_tensor(x.detach() if _is_torch(x) else np.asarray(x)).to(r.device, torch.float64)
        if r.shape != d.shape:
            raise ValueError(f"sqnr_db: ref has shape {tuple(r.shape)} and x {tuple(d.shape)}; expected the same")
        signal = float(torch.linalg.vector_norm(r))
        noise = float(torch.linalg.vector_norm(r - d))
    else:
        r, d = np.asarray(ref, dtype=np.float64), np.asarray(x, dtype=np.float64)
        if r.shape != d.shape:
            raise ValueError(f"sqnr_db: ref has shape {r.shape} and x {d.shape}; expected the same")
        with np.errstate(invalid="ignore", over="ignore"):
            signal = float(np.linalg.norm(r.ravel()))
            noise = float(np.linalg.norm((r - d).ravel()))
    if not (math.isfinite(signal) and math.isfinite(noise)):
        return math.nan
    if noise == 0:
        return math.inf
    if signal == 0:
        return -math.inf
    return 20.0 * math.log10(signal / noise)
