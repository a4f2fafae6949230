"""cquant.quantize_: swap a model's linear layers for QuantizedLinear, in place, as torchao does.

    cquant.quantize_(pipe.transformer, "fp8dqrow")
    cquant.quantize_(model, cquant.FqnToConfig({"re:.*attn.*": "fp8dqrow", "_default": "int8wo"}))
    cquant.quantize_(model_on_cpu, "int8wo", device="cuda")   # layer by layer onto the GPU

Every decision is recorded on the model (see cquant.summary): layers a scheme cannot take (too
small, misaligned, non-float) stay as they are and are reported with a warning; layers the
caller excluded (filter_fn, a None entry in a mapping, the model's _keep_in_fp32_modules) are
listed in the summary.
"""

from __future__ import annotations

import warnings
from collections import defaultdict

import torch

from .configs import FqnToConfig, as_config
from .nn import COMPUTE_DTYPES, QuantizedLinear

__all__ = ["quantize_", "dequantize_", "SkippedLayersWarning", "REPORT_ATTR", "PROGRESS_MIN_LAYERS"]

# Attribute of the root module where quantize_ records its per-layer decisions.
REPORT_ATTR = "_cquant_report"
# Below this many layers, no progress bar.
PROGRESS_MIN_LAYERS = 64


class SkippedLayersWarning(UserWarning):
    """Some linear layers were left unquantized because their scheme cannot take them."""


def _keep_in_fp32(model):
    names = []
    for attr in ("_keep_in_fp32_modules", "_keep_in_fp32_modules_strict"):
        v = getattr(model, attr, None)
        if v:
            names.extend([v] if isinstance(v, str) else list(v))
    return names


def _device_refusal(scheme, mod, device):
    """What libcquant says about running this layer's shapes on a CUDA device, or None."""
    if device is None or device.type != "cuda":
        return None
    from . import _C

    if not _C.built_with_cuda():
        return "this cquant build has no CUDA kernels (built CPU-only)"
    try:
        cc = _C.cuda_compute_capability(device.index or 0)
        _C.linear_workspace_size(*scheme.c_args(), mod.in_features, 1, mod.out_features, True)
    except (NotImplementedError, ValueError, RuntimeError) as e:
        return f"the CUDA kernels refuse it: {e}"
    need = scheme.min_compute_capability()
    if cc < need:
        return f"its CUDA kernels need compute capability {need // 10}.{need % 10}+; device {device} is {cc // 10}.{cc % 10}"
    return None


def _plan(model, config, filter_fn, device, *, exclude=None, allow_meta=False):
    """[(fqn, module, scheme)] to quantize and {fqn: (kind, reason)} for the rest.

    exclude(fqn) -> bool removes more layers (an HF config's modules_to_not_convert); allow_meta
    plans on a model whose weights are not loaded yet (from_pretrained)."""
    from .fusion import unfused_parts

    keep_fp32 = _keep_in_fp32(model) if filter_fn is None else []
    # the unfused q / k / v of fused attention become views of the fused layer instead
    views = unfused_parts(model)
    plan, report = [], {}
    seen = set()
    for fqn, mod in model.named_modules():
        if not isinstance(mod, torch.nn.Linear) or id(mod) in seen:
            continue
        seen.add(id(mod))
        if isinstance(mod, QuantizedLinear):
            continue
        if fqn in views:
            continue
        if filter_fn is not None and not filter_fn(mod, fqn):
            report[fqn] = ("excluded", "excluded by filter_fn")
            continue
        if exclude is not None and exclude(fqn):
            report[fqn] = ("excluded", "listed in modules_to_not_convert")
            continue
        if any(k in fqn.split(".") for k in keep_fp32):
            report[fqn] = ("excluded", "listed in the model's _keep_in_fp32_modules")
            continue
        if isinstance(config, FqnToConfig):
            cfg, key = config.config_for(fqn)
            if cfg is None:
                report[fqn] = ("excluded", f"mapped to None by {key!r}" if key else "no entry in the FqnToConfig "
                               "and no '_default'")
                continue
        else:
            cfg = config
        scheme = cfg.scheme()
        w = mod.weight
        if w is None or not isinstance(w, torch.Tensor):
            reason = "has no weight tensor"
        elif w.dtype not in COMPUTE_DTYPES:
            reason = f"weight dtype {w.dtype}: cquant quantizes float32, float16 and bfloat16 layers"
        elif type(w) not in (torch.Tensor, torch.nn.Parameter):
            reason = f"weight is a {type(w).__name__} (already quantized or wrapped by another library)"
        elif w.device.type == "meta" and not allow_meta:
            reason = "weight is on the meta device (not loaded)"
        else:
            reason = scheme.refusal(mod.in_features, mod.out_features) or _device_refusal(
                scheme, mod, device if device is not None else w.device)
        if reason:
            report[fqn] = ("skipped", f"{scheme.name}: {reason}")
            continue
        plan.append((fqn, mod, scheme))
    return plan, report


def _progress(total, desc, enabled):
    if enabled is False or (enabled is None and total < PROGRESS_MIN_LAYERS):
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, unit="layer")


def _replace_modules(model, replaced):
    """Point every parent at the replacement of each replaced child (shared modules included)."""
    for parent in model.modules():
        for name, child in list(parent._modules.items()):
            if child is not None and id(child) in replaced:
                parent._modules[name] = replaced[id(child)]


def _warn_skipped(report, n_linear):
    skipped = {fqn: r for fqn, (kind, r) in report.items() if kind == "skipped"}
    if not skipped:
        return
    by_reason = defaultdict(list)
    for fqn, reason in skipped.items():
        by_reason[reason].append(fqn)
    lines = []
    for reason, fqns in by_reason.items():
        shown = ", ".join(fqns[:3]) + (f", ... ({len(fqns) - 3} more)" if len(fqns) > 3 else "")
        lines.append(f"  {len(fqns)} x {reason}: {shown}")
    warnings.warn(f"cquant.quantize_: {len(skipped)} of {n_linear} linear layers were left unquantized:\n"
                  + "\n".join(lines) + "\ncquant.summary(model) lists every layer.", SkippedLayersWarning, stacklevel=3)


def quantize_(model, config, filter_fn=None, *, device=None, progress=None, fuse_activations=True):
    """Quantize the linear layers of `model` in place.

    Args:
        model: a torch.nn.Module (a diffusers / transformers model, or any module).
        config: a config (Int8WeightOnlyConfig(), Float8DynamicActivationFloat8WeightConfig(PerRow()),
            ...), a scheme name ("int8wo", "int8dq", "fp8dqrow", "float8dq_e4m3_tensor", "fp8wo",
            "fp6_e3m2", ...), an FqnToConfig, or a dict {fqn or "re:regex" or "_default": config or None}.
        filter_fn: filter_fn(module, fqn) -> bool picks among the torch.nn.Linear layers (default:
            all of them, except those the model lists in _keep_in_fp32_modules).
        device: where to put the quantized model ("cuda", ...). Layers move one at a time: each
            float weight is copied to the device, quantized there and dropped, so the device's
            peak memory stays near the quantized model plus one float layer. The other
            parameters and buffers follow at the end. None: quantize where each layer lives.
        progress: show a tqdm bar (None: only for models with many layers).
        fuse_activations: fuse each tanh GELU that follows a quantized layer into the layer's
            kernel (see cquant.fuse_activations_); False keeps the GELU modules as they are.

    Returns the model. Layers a scheme cannot take are left unquantized, with a
    SkippedLayersWarning; cquant.summary(model) lists every layer and why.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if filter_fn is not None and not callable(filter_fn):
        raise TypeError(f"filter_fn must be callable as filter_fn(module, fqn), got {type(filter_fn).__name__}")
    config = as_config(config)
    device = torch.device(device) if device is not None else None
    if device is not None and device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())

    plan, report = _plan(model, config, filter_fn, device)
    parents = defaultdict(list)  # id(child) -> [(parent, name)], shared modules included
    for parent in model.modules():
        for name, child in parent._modules.items():
            if child is not None:
                parents[id(child)].append((parent, name))
    bar = _progress(len(plan), f"cquant {getattr(config, 'name', 'mapping')}", progress)
    try:
        for fqn, mod, scheme in plan:
            new = QuantizedLinear.from_float(mod, scheme, device=device)
            # swap now, so this layer's float weight is freed before the next one is copied
            for parent, name in parents[id(mod)]:
                parent._modules[name] = new
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    from .fusion import install_fusion, slice_unfused

    slice_unfused(model)
    install_fusion(model)
    if fuse_activations:
        from .activation_fusion import fuse_activations_

        fuse_activations_(model)
    if device is not None:
        model.to(device)
    record = dict(getattr(model, REPORT_ATTR, None) or {})
    for fqn, _, _ in plan:
        record.pop(fqn, None)
    record.update(report)
    model.__dict__[REPORT_ATTR] = record
    n_linear = sum(1 for m in model.modules() if isinstance(m, torch.nn.Linear))
    _warn_skipped(report, n_linear)
    from .integrations import attach_quantization_config

    attach_quantization_config(model, config)
    return model


def dequantize_modules(model, dtype=None):
    """Replace every QuantizedLinear of `model` by a torch.nn.Linear with the dequantized weight."""
    from .activation_fusion import unfuse_activations_

    unfuse_activations_(model)  # a float layer does not apply the GELU: its module runs again
    replaced = {}
    for mod in model.modules():
        if isinstance(mod, QuantizedLinear) and id(mod) not in replaced:
            replaced[id(mod)] = mod.to_float(dtype)
    _replace_modules(model, replaced)
    for mod in model.modules():
        if "fuse_projections" in mod.__dict__:  # cquant's fusion, no longer needed
            del mod.__dict__["fuse_projections"]
    model.__dict__.pop(REPORT_ATTR, None)
    return model


def dequantize_(model, dtype=None):
    """Replace every QuantizedLinear of `model` by a torch.nn.Linear with the dequantized weight, in place."""
    dequantize_modules(model, dtype)
    from .integrations import detach_quantization_config

    detach_quantization_config(model)
    return model

