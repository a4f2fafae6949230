"""Quantized layers on a CUDA device that cannot run their scheme's kernels.

A model quantized on the CPU (or on a newer GPU) and moved to a GPU too old for its scheme
(compute capability below Scheme.min_compute_capability), or to one this build of libcquant has
no kernel image for, still runs: each such layer computes F.linear in its compute dtype with its
dequantized weight (decoded once on the CPU and kept on the device, as much memory as the float
layer), and applies its fused GELU after. One DeviceFallbackWarning per (device, scheme) names
both; the device is asked once, not per call.
"""

from __future__ import annotations

import warnings

from . import ops

__all__ = ["DeviceFallbackWarning", "kernel_refusal", "device_refusal"]


class DeviceFallbackWarning(UserWarning):
    """Quantized layers run a float fallback because their device cannot run the scheme's kernels."""


_device_refusals = {}  # device index -> why libcquant cannot run any kernel there, or None
_refusals = {}  # (device index, scheme c_args) -> why that scheme cannot run there, or None


def _device_refusal(index):
    if index not in _device_refusals:
        reason = None
        if not ops.built_with_cuda():
            reason = "this cquant build has no CUDA kernels (built CPU-only)"
        else:
            try:
                ok, why = ops.cuda_device_supported(index)
                if not ok:
                    reason = f"libcquant has no kernel image for this GPU ({why})"
            except (RuntimeError, ValueError) as e:
                reason = f"libcquant cannot query the device ({e})"
        _device_refusals[index] = reason
    return _device_refusals[index]


def device_refusal(device_index):
    """Why libcquant's kernels cannot run on CUDA device `device_index` at all, or None (cached)."""
    return _device_refusal(device_index)


def kernel_refusal(device_index, scheme):
    """Why scheme's kernels cannot run on CUDA device `device_index`, or None if they can (cached;
    the first refusal of each (device, scheme) warns)."""
    key = (device_index, scheme.c_args)
    if key in _refusals:
        return _refusals[key]
    reason = _device_refusal(device_index)
    if reason is None:
        try:
            cc = ops.cuda_compute_capability(device_index)
        except (RuntimeError, ValueError) as e:
            reason = f"libcquant cannot query the device ({e})"
        else:
            need = scheme.min_compute_capability
            if cc < need:
                reason = (f"its compute capability is {cc // 10}.{cc % 10}; the {scheme.name} kernels need "
                          f"{need // 10}.{need % 10} or newer")
    _refusals[key] = reason
    if reason is not None:
        warnings.warn(f"cquant: {scheme.name} layers on cuda:{device_index} cannot run cquant's kernels: {reason}. "
                      "They run a float fallback instead (F.linear with the dequantized weight in the compute "
                      "dtype, kept on the device: the memory of the unquantized layer, and no speed-up)",
                      DeviceFallbackWarning, stacklevel=4)
    return reason
