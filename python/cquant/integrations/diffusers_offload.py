"""diffusers' sequential CPU offload of a pipeline that holds cquant's quantized layers: refused.

pipe.enable_sequential_cpu_offload() gives every submodule accelerate's hooks, which keep its
tensors on the CPU and the meta device and bring them to the GPU around each of its calls. That
has not been shown to work for cquant's layers (their codes, scales and the fused layers their
views read), and a failure would come from deep inside accelerate at the first call, long after
the pipeline was changed. So the call is refused first, before diffusers removes hooks or moves
anything, naming the way that works: enable_model_cpu_offload(), which moves each whole model to
the device around its call (a quantized model needs a fraction of the memory there).
"""

from __future__ import annotations

import functools

import torch

from ..nn import QuantizedLinear

__all__ = ["install", "refuse_quantized_components"]


def _first_quantized(module):
    return next((fqn for fqn, m in module.named_modules() if isinstance(m, QuantizedLinear)), None)


def refuse_quantized_components(pipe):
    """NotImplementedError if a component that sequential offload would offload holds quantized layers."""
    excluded = set(getattr(pipe, "_exclude_from_cpu_offload", ()) or ())
    for name, comp in (getattr(pipe, "components", None) or {}).items():
        if name in excluded or not isinstance(comp, torch.nn.Module):
            continue
        layer = _first_quantized(comp)
        if layer is not None:
            raise NotImplementedError(
                f"cquant: enable_sequential_cpu_offload() cannot offload {name!r}: it holds cquant quantized layers "
                f"({name}.{layer}, ...), which accelerate's per-layer offloading is not supported for. Use "
                "pipe.enable_model_cpu_offload() instead: it moves each whole model to the device around its call, "
                "and a quantized model needs a fraction of the memory there. The pipeline is unchanged")


def install(pipeline_utils):
    """Wrap DiffusionPipeline.enable_sequential_cpu_offload in diffusers.pipelines.pipeline_utils (idempotent)."""
    cls = pipeline_utils.DiffusionPipeline
    original = cls.__dict__["enable_sequential_cpu_offload"]
    if getattr(original, "_cquant", False):
        return

    @functools.wraps(original)
    def enable_sequential_cpu_offload(self, *args, **kwargs):
        refuse_quantized_components(self)
        return original(self, *args, **kwargs)

    enable_sequential_cpu_offload._cquant = True
    cls.enable_sequential_cpu_offload = enable_sequential_cpu_offload
