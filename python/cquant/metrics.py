"""Accuracy measures shared by the demo, the benchmarks and the tests."""

import math

import numpy as np

__all__ = ["sqnr_db", "psnr_db", "ssim"]


def _is_torch(a):
    return type(a).__module__.startswith("torch") and hasattr(a, "detach")


def _check_real(name, arg, a):
    """a (a NumPy array or torch tensor) if it holds real numbers; TypeError naming the argument
    for complex values, objects and strings (NumPy would drop the imaginary part or give NaN)."""
    if _is_torch(a):
        bad = a.is_complex()
    else:
        bad = np.issubdtype(a.dtype, np.complexfloating) or not (np.issubdtype(a.dtype, np.number)
                                                                  or a.dtype == np.bool_)
    if bad:
        raise TypeError(f"{name}: {arg} has dtype {a.dtype}; expected real numbers")
    return a


def _as_array(name, arg, a):
    """a as a NumPy array or torch tensor (tensors stay on their device)."""
    if a is None:
        raise TypeError(f"{name}: {arg} is None; expected a NumPy array or torch tensor")
    return _check_real(name, arg, a.detach() if _is_torch(a) else np.asarray(a))


def _float64_pair(name, ref, x):
    """ref and x as float64 NumPy arrays of one shape (torch tensors from any device)."""
    def as_array(arg, a):
        a = _as_array(name, arg, a)
        if _is_torch(a):
            import torch

            return a.to("cpu", torch.float64).numpy()
        return a.astype(np.float64)

    r, d = as_array("ref", ref), as_array("x", x)
    if r.shape != d.shape:
        raise ValueError(f"{name}: ref has shape {r.shape} and x {d.shape}; expected the same")
    if r.size == 0:
        raise ValueError(f"{name}: ref and x are empty")
    return r, d


def _check_range(name, data_range):
    if isinstance(data_range, bool) or not hasattr(data_range, "__float__"):
        raise ValueError(f"{name}: data_range must be a positive finite number, got {data_range!r}")
    value = float(data_range)  # NumPy and 0-d torch scalars too
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name}: data_range must be a positive finite number, got {data_range!r}")
    return value


def _norms(r, d, lib):
    """(|r|, |r - d|) over all elements, with r and d scaled by their largest magnitude first, so
    neither the squares nor r - d overflow or underflow; NaN when either holds a NaN or an inf."""
    m = max(float(lib.max(lib.abs(r))), float(lib.max(lib.abs(d))))
    if not math.isfinite(m):
        return math.nan, math.nan
    if m == 0:
        return 0.0, 0.0
    r, d = r / m, d / m
    return m * float(lib.sqrt(lib.sum(r * r))), m * float(lib.sqrt(lib.sum((r - d) ** 2)))


def sqnr_db(ref, x):
    """Signal-to-quantization-noise ratio of x against ref, in dB:
    20 log10(|ref| / |ref - x|), both norms over all elements, computed in float64.

    ref comes first: the noise is measured against ref's energy, so swapping the arguments
    changes the result. ref and x are NumPy arrays or torch tensors of real numbers (any dtype,
    any device; a torch x meets ref on ref's device) of the same, nonempty shape.

    Returns +inf when x equals ref exactly, -inf when ref is all zeros and x is not, and NaN
    (never an exception or a warning) when either holds a NaN or an infinity.
    """
    if _is_torch(ref) or _is_torch(x):
        import torch

        r = torch.as_tensor(_as_array("sqnr_db", "ref", ref)).to(torch.float64)
        d = torch.as_tensor(_as_array("sqnr_db", "x", x)).to(r.device, torch.float64)
        if r.shape != d.shape:
            raise ValueError(f"sqnr_db: ref has shape {tuple(r.shape)} and x {tuple(d.shape)}; expected the same")
        if r.numel() == 0:
            raise ValueError("sqnr_db: ref and x are empty")
        lib = torch
    else:
        r, d = _float64_pair("sqnr_db", ref, x)
        lib = np
    with np.errstate(invalid="ignore", over="ignore"):
        signal, noise = _norms(r, d, lib)
    if not (math.isfinite(signal) and math.isfinite(noise)):
        return math.nan
    if noise == 0:
        return math.inf
    if signal == 0:
        return -math.inf
    return 20.0 * math.log10(signal / noise)


def psnr_db(ref, x, data_range=1.0):
    """Peak signal-to-noise ratio of x against ref, in dB: 10 log10(data_range^2 / MSE), the mean
    over all elements, in float64. Images in [0, 1] take data_range=1 (255 for 8-bit values).

    ref and x are NumPy arrays or torch tensors of the same shape. Returns +inf when x equals
    ref, NaN (never an exception) when either holds a NaN or an infinity."""
    data_range = _check_range("psnr_db", data_range)
    r, d = _float64_pair("psnr_db", ref, x)
    with np.errstate(invalid="ignore", over="ignore"):
        mse = float(np.mean((r - d) ** 2))
    if not math.isfinite(mse):
        return math.nan
    if mse == 0:
        return math.inf
    return 10.0 * math.log10(data_range * data_range / mse)


SSIM_WINDOW = 11
SSIM_SIGMA = 1.5
SSIM_K1, SSIM_K2 = 0.01, 0.03


def _gaussian_window():
    t = np.arange(SSIM_WINDOW, dtype=np.float64) - (SSIM_WINDOW - 1) / 2
    g = np.exp(-(t * t) / (2 * SSIM_SIGMA * SSIM_SIGMA))
    return g / g.sum()


def _filter_valid(a, g):
    """a [N, H, W] filtered by the separable window g x g over the last two axes, 'valid' region."""
    k = len(g)
    h, w = a.shape[-2] - k + 1, a.shape[-1] - k + 1
    rows = sum(g[i] * a[:, i:i + h, :] for i in range(k))
    return sum(g[i] * rows[:, :, i:i + w] for i in range(k))


def ssim(ref, x, data_range=1.0):
    """Structural similarity of x against ref (Wang et al. 2004): an 11x11 gaussian window of
    sigma 1.5 over the valid region, K1 = 0.01, K2 = 0.03, in float64; the mean SSIM over
    positions, channels and images.

    Images are [H, W], [C, H, W], [B, C, H, W] or video [B, C, F, H, W] (the frames are folded
    into the batch), NumPy arrays or torch tensors of the same shape, at least 11 x 11. Returns
    1.0 when x equals ref, NaN when either holds a NaN or an infinity."""
    data_range = _check_range("ssim", data_range)
    r, d = _float64_pair("ssim", ref, x)
    if not 2 <= r.ndim <= 5:
        raise ValueError(f"ssim: ref has shape {r.shape}; expected [H, W], [C, H, W], [B, C, H, W] or [B, C, F, H, W]")
    if r.ndim == 5:  # [B, C, F, H, W] -> frames beside the channels: each (image, channel) on its own
        r, d = r.transpose(0, 2, 1, 3, 4), d.transpose(0, 2, 1, 3, 4)
    if r.shape[-2] < SSIM_WINDOW or r.shape[-1] < SSIM_WINDOW:
        raise ValueError(f"ssim: images of {r.shape[-2]}x{r.shape[-1]} pixels are smaller than the "
                         f"{SSIM_WINDOW}x{SSIM_WINDOW} window; expected at least {SSIM_WINDOW}x{SSIM_WINDOW}")
    if not (np.isfinite(r).all() and np.isfinite(d).all()):
        return math.nan
    r = r.reshape(-1, *r.shape[-2:])
    d = d.reshape(-1, *d.shape[-2:])
    g = _gaussian_window()
    c1, c2 = (SSIM_K1 * data_range) ** 2, (SSIM_K2 * data_range) ** 2
    mu_r, mu_d = _filter_valid(r, g), _filter_valid(d, g)
    var_r = _filter_valid(r * r, g) - mu_r * mu_r
    var_d = _filter_valid(d * d, g) - mu_d * mu_d
    cov = _filter_valid(r * d, g) - mu_r * mu_d
    num = (2 * mu_r * mu_d + c1) * (2 * cov + c2)
    den = (mu_r * mu_r + mu_d * mu_d + c1) * (var_r + var_d + c2)
    return float(np.mean(num / den))
