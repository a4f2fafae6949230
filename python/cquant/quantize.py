"""cquant.quantize_: swap a model's linear layers for QuantizedLinear, in place, as torchao does.

    cquant.quantize_(pipe.transformer, "fp8dqrow")
    cquant.quantize_(model, cquant.FqnToConfig({"re:.*attn.*": "fp8dqrow", "_default": "int8wo"}))
    cquant.quantize_(model_on_cpu, "int8wo", device="cuda")   # layer by layer onto the GPU

This module is the one owner of the three steps every way of getting a quantized model takes
(quantize_, load_quantized, and the diffusers and transformers quantizers, which call these and
nothing else):

    plan(model, config, ...)     which linear layers get which scheme, and why the others do not
    swap_in(model, layers, ...)  replace those layers by QuantizedLinear (quantized from their
                                 float weight, or empty skeletons for stored tensors to load into)
    finish_(model, ...)          fusions (QKV views, GELU into the layer before it), the per-layer
                                 report, and the hooks other packages registered (the diffusers and
                                 transformers integration keeps the model's quantization_config)

Every decision is recorded on the model (see cquant.summary): layers a scheme cannot take (too
small, misaligned, non-float) stay as they are and are reported with a warning; layers the
caller excluded (filter_fn, a None entry in a mapping, the model's _keep_in_fp32_modules) are
listed in the summary.
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from . import module_hooks, ops
from .activation_fusion import fuse_activations_, unfuse_activations_
from .attention_backend import reroute, routed_layers
from .configs import FqnToConfig, as_config
from .fusion import check_fusable, install_fusion, refuse_hooked_parts, slice_unfused, unfused_parts
from .nn import COMPUTE_DTYPES, QuantizedLinear, QuantizedLinearSlice, finish_layers

__all__ = ["quantize_", "dequantize_", "quantize_pipeline", "fuse_qkv_", "plan", "swap_in", "finish_", "Plan",
           "SkippedLayersWarning", "UnmatchedKeysWarning", "REPORT_ATTR", "PROGRESS_MIN_LAYERS", "add_sync_hook", "quantized_layers"]

# Attribute of the root module where quantize_ records its per-layer decisions.
REPORT_ATTR = "_cquant_report"
# Below this many layers, no progress bar.
PROGRESS_MIN_LAYERS = 64


class SkippedLayersWarning(UserWarning):
    """Some linear layers were left unquantized because their scheme cannot take them."""


class UnmatchedKeysWarning(UserWarning):
    """Keys of a per-module mapping (FqnToConfig) name no linear layer of the model."""


# Called as hook(model, config) whenever the set of quantized layers of a model changed
# (finish_, dequantize_, fuse_qkv_); config is the config that quantized it, or None.
_SYNC_HOOKS = []


def add_sync_hook(hook):
    """Run hook(model, config) after every change of a model's quantized layers (idempotent)."""
    if hook not in _SYNC_HOOKS:
        _SYNC_HOOKS.append(hook)


def _sync(model, config):
    for hook in _SYNC_HOOKS:
        hook(model, config)


# ---------------------------------------------------------------- plan


@dataclass
class Plan:
    """What quantizing a model will do: `layers` {fqn: Scheme} to quantize, in module order, and
    `report` {fqn: (kind, reason)} of the linear layers left as they are ("skipped" when a scheme
    refused them, "excluded" when the caller did)."""

    layers: dict = field(default_factory=dict)
    report: dict = field(default_factory=dict)


def _keep_in_fp32(model):
    names = []
    for attr in ("_keep_in_fp32_modules", "_keep_in_fp32_modules_strict"):
        v = getattr(model, attr, None)
        if v:
            names.extend([v] if isinstance(v, str) else list(v))
    return names


def _device_refusal(scheme, mod, device):
    """What libcquant says about running this layer on a CUDA device, or None."""
    if device is None or device.type != "cuda":
        return None
    if not ops.built_with_cuda():
        return "this cquant build has no CUDA kernels (built CPU-only)"
    try:
        cc = ops.cuda_compute_capability(device.index or 0)
        supported, why = ops.cuda_device_supported(device.index or 0)
        if not supported:
            return f"libcquant has no kernel image for {device} ({why})"
        ops.linear_workspace_size(scheme.c_args, mod.in_features, 1, mod.out_features, cuda=True)
    except (NotImplementedError, ValueError, RuntimeError) as e:
        return f"the CUDA kernels refuse it: {e}"
    need = scheme.min_compute_capability
    if cc < need:
        return (f"its CUDA kernels need compute capability {need // 10}.{need % 10}+; device {device} is "
                f"{cc // 10}.{cc % 10}")
    return None


def _module_refusal(mod):
    # torch.nn.MultiheadAttention hands out_proj.weight to F.multi_head_attention_forward itself,
    # never calling the layer (torchao's filter leaves this class out for the same reason)
    if isinstance(mod, torch.nn.modules.linear.NonDynamicallyQuantizableLinear):
        return "its parent (torch.nn.MultiheadAttention) reads its float weight directly instead of calling it"
    # a QuantizedLinear computes x W^T + b and nothing else: a subclass's own forward (reshaping its
    # input, adding an adapter) would be lost without a word
    if type(mod).forward is not torch.nn.Linear.forward and not isinstance(mod, QuantizedLinear):
        return f"{type(mod).__name__} has its own forward, which QuantizedLinear would replace"
    return module_hooks.move_refusal(mod, QuantizedLinear)


def _weight_refusal(w, allow_meta):
    if w is None or not isinstance(w, torch.Tensor):
        return "has no weight tensor"
    if w.dtype not in COMPUTE_DTYPES:
        return f"weight dtype {w.dtype}: cquant quantizes float32, float16 and bfloat16 layers"
    if type(w) not in (torch.Tensor, torch.nn.Parameter):
        return f"weight is a {type(w).__name__} (already quantized or wrapped by another library)"
    if w.device.type == "meta" and not allow_meta:
        return "weight is on the meta device (not loaded)"
    return None


def plan(model, config, filter_fn=None, *, device=None, exclude=None, allow_meta=False):
    """The Plan of quantizing `model` with `config` (see quantize_ for config and filter_fn).

    exclude(fqn) -> reason or None removes more layers (an HF config's modules_to_not_convert);
    allow_meta plans on a model whose weights are not loaded yet (from_pretrained); device is
    where the layers will run (None: where their weights are).

    Raises ValueError if a selected layer is already quantized with another scheme."""
    config = as_config(config)
    keep_fp32 = _keep_in_fp32(model) if filter_fn is None else []
    views = unfused_parts(model)  # the unfused q / k / v of fused attention become views instead
    result, conflicts, seen = Plan(), [], set()
    for fqn, mod in model.named_modules():
        if not isinstance(mod, torch.nn.Linear) or id(mod) in seen or fqn in views:
            continue
        seen.add(id(mod))
        if isinstance(mod, QuantizedLinearSlice):
            continue
        if filter_fn is not None and not filter_fn(mod, fqn):
            result.report[fqn] = ("excluded", "excluded by filter_fn")
            continue
        reason = exclude(fqn) if exclude is not None else None
        if reason:
            result.report[fqn] = ("excluded", reason)
            continue
        if any(k in fqn.split(".") for k in keep_fp32):
            result.report[fqn] = ("excluded", "listed in the model's _keep_in_fp32_modules")
            continue
        cfg, key = config.config_for(fqn) if isinstance(config, FqnToConfig) else (config, None)
        if cfg is None:
            result.report[fqn] = ("excluded", f"mapped to None by {key!r}" if key else
                                  "no entry in the FqnToConfig and no '_default'")
            continue
        scheme = cfg.scheme()
        if isinstance(mod, QuantizedLinear):
            if mod.scheme != scheme:
                conflicts.append(f"{fqn or '<model>'} ({mod.scheme.name}, asked {scheme.name})")
            continue
        reason = (_module_refusal(mod) or _weight_refusal(mod.weight, allow_meta)
                  or scheme.refusal(mod.in_features, mod.out_features)
                  or _device_refusal(scheme, mod, device if device is not None else mod.weight.device))
        if reason:
            result.report[fqn] = ("skipped", f"{scheme.name}: {reason}")
            continue
        result.layers[fqn] = scheme
    if isinstance(config, FqnToConfig):
        _warn_unmatched(config, model)
    if conflicts:
        shown = ", ".join(conflicts[:4]) + (f", ... ({len(conflicts) - 4} more)" if len(conflicts) > 4 else "")
        raise ValueError(f"{len(conflicts)} layers are already quantized with another scheme: {shown}. Quantizing "
                         "stored codes again would round the weights twice: quantize the float model, call "
                         "cquant.dequantize_(model) first, or leave these layers out with filter_fn")
    return result


def _warn_unmatched(config, model):
    """A mapping key that names no linear layer (a typo, a block instead of its layers) would
    otherwise leave the layers meant float without a word."""
    if all(v is None for v in config.fqn_to_config.values()):
        warnings.warn(f"cquant: the mapping quantizes no layer of {type(model).__name__}: it has "
                      f"{'no keys' if not config.fqn_to_config else 'only None values'}; give a key (or '_default') "
                      "a scheme", UnmatchedKeysWarning, stacklevel=3)
    used = {config.config_for(fqn)[1] for fqn, mod in model.named_modules() if isinstance(mod, torch.nn.Linear)}
    unmatched = [k for k in config.fqn_to_config if k != "_default" and k not in used]
    if unmatched:
        warnings.warn(f"cquant: {len(unmatched)} keys of the mapping match no linear layer of "
                      f"{type(model).__name__}: {', '.join(map(repr, unmatched[:6]))}; keys are full names of "
                      "torch.nn.Linear modules (model.named_modules()) or 're:' regexes matching whole names",
                      UnmatchedKeysWarning, stacklevel=3)


# ---------------------------------------------------------------- swap in


def _progress(total, desc, enabled):
    if enabled is False or (enabled is None and total < PROGRESS_MIN_LAYERS):
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, unit="layer")


def _parents(model):
    """{id(child): [(parent, name)]} of every submodule, shared modules included."""
    parents = defaultdict(list)
    for parent in model.modules():
        for name, child in parent._modules.items():
            if child is not None:
                parents[id(child)].append((parent, name))
    return parents


def _become(module, new):
    """Turn `module` itself into `new` (its class and state), keeping its hooks: the root of a
    model cannot be replaced in its parent, since it has none."""
    keep = {k: v for k, v in module.__dict__.items() if "hook" in k or k == "training"}
    module.__dict__.clear()
    module.__dict__.update(new.__dict__)
    module.__dict__.update(keep)
    module.__class__ = type(new)


def _replace(model, parents, old, new):
    """Put new in old's place, diffusers' hooks of old (enable_parallelism's split and gather) included."""
    hooks = module_hooks.detach(old)
    if old is model:
        _become(model, new)
        new = model
    else:
        for parent, name in parents[id(old)]:
            parent._modules[name] = new
    module_hooks.attach(new, hooks)


def _skeleton_dtype(mod, dtype):
    if not isinstance(dtype, torch.dtype):
        w = getattr(mod, "weight", None)
        dtype = w.dtype if isinstance(w, torch.Tensor) and w.dtype.is_floating_point else torch.bfloat16
    if dtype not in COMPUTE_DTYPES:
        # computing in another dtype than the one the model was asked in would pass unnoticed
        raise TypeError(f"cquant's quantized layers compute in torch.float32, torch.float16 or torch.bfloat16, not "
                        f"{dtype}: build or load the model in one of them")
    return dtype


def swap_in(model, layers, *, device=None, dtype=None, weights=None, empty=False, progress=None, desc="cquant"):
    """Replace the named torch.nn.Linear layers of `model` by QuantizedLinear, in place.

    layers: {fqn: Scheme} ("" names the model itself, which then becomes the QuantizedLinear).
    A layer whose float weight is loaded, or given in weights {fqn: tensor}, is quantized on
    `device` (default: where the weight is), one layer at a time, so at most one float layer
    is copied there at once; a layer whose weight is on the meta device becomes an empty
    skeleton with compute dtype `dtype` (default: the weight's) for stored tensors to be loaded
    into (empty=True: every layer does, whatever its weight). Layers already quantized with
    the same scheme are left as they are.
    Returns {fqn: QuantizedLinear}.
    """
    done, olds, first, alias = {}, {}, {}, {}
    for fqn, scheme in layers.items():  # every layer first: a refused one must not leave the others swapped
        old = model.get_submodule(fqn) if fqn else model
        if id(old) in first:  # one module under two names: swapped once
            alias[fqn] = first[id(old)]
            if layers[alias[fqn]] != scheme:
                raise ValueError(f"{fqn or '<model>'} is {alias[fqn] or '<model>'} under another name, which is asked "
                                 f"{layers[alias[fqn]].name}, not {scheme.name}")
            continue
        first[id(old)] = fqn
        if isinstance(old, QuantizedLinear):
            if old.scheme != scheme:
                raise ValueError(f"{fqn or '<model>'} is already quantized with {old.scheme.name}, not {scheme.name}")
            done[fqn] = old
            continue
        if not isinstance(old, torch.nn.Linear):
            raise ValueError(f"{fqn or '<model>'} is a {type(old).__name__}, not a torch.nn.Linear: it cannot "
                             f"hold {scheme.name} codes")
        refusal = _module_refusal(old)  # plan leaves these out; a checkpoint's list may still name one
        if refusal:
            raise ValueError(f"{fqn or '<model>'} cannot become a QuantizedLinear: {refusal}")
        olds[fqn] = old
    parents = _parents(model)
    bar = _progress(len(layers), desc, progress)
    try:
        for fqn, old in olds.items():
            scheme = layers[fqn]
            w = weights.get(fqn) if weights else None
            if w is None:
                w = old.weight
            if not empty and isinstance(w, torch.Tensor) and w.device.type != "meta":
                try:
                    new = QuantizedLinear.from_float(old, scheme, device=device, weight=w)
                except (TypeError, ValueError) as e:  # among hundreds of layers, say which one
                    raise type(e)(f"{fqn or '<model>'} ({scheme.name}): {e}") from e
            else:
                new = QuantizedLinear.skeleton(old, scheme, dtype=_skeleton_dtype(old, dtype))
            _replace(model, parents, old, new)  # now, so this layer's float weight is freed before the next
            done[fqn] = model if old is model else new
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
        module_hooks.invalidate_caches(model)
    return {fqn: done[alias.get(fqn, fqn)] for fqn in layers}


# ---------------------------------------------------------------- finish


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
    warnings.warn(f"cquant: {len(skipped)} of {n_linear} linear layers were left unquantized:\n"
                  + "\n".join(lines) + "\ncquant.summary(model) lists every layer.", SkippedLayersWarning, stacklevel=4)


def quantized_layers(model):
    """{fqn: scheme name} of the layers that store codes (views of fused layers excluded)."""
    return {fqn: mod.scheme.name for fqn, mod in model.named_modules()
            if isinstance(mod, QuantizedLinear) and not isinstance(mod, QuantizedLinearSlice)}


def finish_(model, config=None, report=None, *, fuse_activations=True, sync=True):
    """Complete a model after swap_in: unfused q / k / v of fused attention become views of the
    fused layer, attention modules learn to fuse quantized projections, each tanh GELU moves
    into the quantized layer before it (unless fuse_activations=False), `report` {fqn: (kind,
    reason)} is recorded for cquant.summary (with a warning for layers a scheme refused), and
    the sync hooks run (sync=False: the caller is a quantizer that keeps the model's config
    itself). Returns the model."""
    slice_unfused(model)
    install_fusion(model)
    if fuse_activations:
        fuse_activations_(model)
    finish_layers(model)  # layer names for error messages, scopes that share quantized activations
    if report is not None:
        record = dict(model.__dict__.get(REPORT_ATTR) or {})
        for fqn in quantized_layers(model):
            record.pop(fqn, None)
        record.update(report)
        model.__dict__[REPORT_ATTR] = record
        _warn_skipped(report, sum(1 for m in model.modules() if isinstance(m, torch.nn.Linear)))
    if sync:
        _sync(model, config)
    return model


# ---------------------------------------------------------------- the public workflow


def _device(device):
    device = torch.device(device) if device is not None else None
    if device is not None and device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def quantize_(model, config, filter_fn=None, *, device=None, progress=None, fuse_activations=True):
    """Quantize the linear layers of `model` in place.

    Args:
        model: a torch.nn.Module (a diffusers / transformers model, any module, or a single
            torch.nn.Linear, which then becomes a QuantizedLinear itself).
        config: a config (Int8WeightOnlyConfig(), Float8DynamicActivationFloat8WeightConfig(PerRow()),
            Int4WeightOnlyConfig(group_size=64), ...), a scheme name ("int8wo", "int8dq", "fp8dqrow",
            "float8dq_e4m3_tensor", "fp8wo", "fp6_e3m2", "int4wo", "int4dq_g64", "int8wo_r16", ...), an
            FqnToConfig, or a dict {fqn or "re:regex" or "_default": config or None}.
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
    SkippedLayersWarning; cquant.summary(model) lists every layer and why. Layers already
    quantized with the scheme asked for are left as they are; with another scheme, ValueError.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if filter_fn is not None and not callable(filter_fn):
        raise TypeError(f"filter_fn must be callable as filter_fn(module, fqn), got {type(filter_fn).__name__}")
    config = as_config(config)
    device = _device(device)
    p = plan(model, config, filter_fn, device=device)
    swap_in(model, p.layers, device=device, progress=progress, desc=f"cquant {getattr(config, 'name', 'mapping')}")
    if device is not None:
        model.to(device)
    return finish_(model, config, p.report, fuse_activations=fuse_activations)


def dequantize_(model, dtype=None, *, sync=True):
    """Replace every QuantizedLinear of `model` by a torch.nn.Linear with the dequantized weight,
    in place (a QuantizedLinear passed as the model becomes a torch.nn.Linear itself). dtype:
    of the float weights (default: each layer's compute dtype). sync=False leaves the model's
    quantization_config to the caller (the diffusers and transformers quantizers)."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if dtype is not None and dtype not in COMPUTE_DTYPES:  # before anything changes
        raise TypeError(f"dtype must be torch.float32, torch.float16 or torch.bfloat16, got {dtype}")
    for fqn, mod in model.named_modules():
        refusal = isinstance(mod, QuantizedLinear) and module_hooks.move_refusal(mod, torch.nn.Linear)
        if refusal:
            raise ValueError(f"{fqn or '<model>'} cannot become a torch.nn.Linear: {refusal}")
    unfuse_activations_(model)  # a float layer does not apply the GELU: its module runs again
    parents = _parents(model)
    replaced = {}
    for mod in list(model.modules()):
        if isinstance(mod, QuantizedLinear) and id(mod) not in replaced:
            replaced[id(mod)] = (mod, mod.to_float(dtype))
    for old, new in replaced.values():
        _replace(model, parents, old, new)
    module_hooks.invalidate_caches(model)
    for mod in model.modules():
        mod.__dict__.pop("fuse_projections", None)  # cquant's fusion, no longer needed
    model.__dict__.pop(REPORT_ATTR, None)
    if sync:
        _sync(model, None)
    return model


def fuse_qkv_(model):
    """Fuse the q / k / v projections of a diffusers model, quantized or not (model.fuse_qkv_projections()).
    Layers that ran cquant's attention (cquant.enable_attention) keep it: diffusers gives them its
    fused processors, which get cquant's counterparts. A PEFT adapter on q / k / v stays on its
    (unfused) projection, unused while fused, as with diffusers' fusion of float layers. Raises
    before fusing any module if one of them cannot be fused (see cquant.fusion), or if a q / k / v
    projection carries hooks (diffusers' or torch's), which the fused layer would bypass."""
    fuse = getattr(model, "fuse_qkv_projections", None)
    if not callable(fuse):
        raise TypeError(f"{type(model).__name__} has no fuse_qkv_projections(); cquant fuses diffusers attention")
    refuse_hooked_parts(model, "cquant.fuse_qkv_")
    routed = routed_layers(model)
    install_fusion(model)
    check_fusable(model)
    fuse()
    if routed:
        reroute(routed)
    _sync(model, None)
    return model


def quantize_pipeline(pipe, config, components=None, *, fuse_qkv=False, device=None, progress=None):
    """Quantize the components of a diffusers pipeline with one config, optionally fusing QKV.

    Args:
        pipe: a DiffusionPipeline (anything with a `components` dict works).
        config: as for cquant.quantize_ (a config, a scheme name, an FqnToConfig or a dict).
        components: names of the components to quantize (default: the denoiser, "transformer" or
            "unet"). Text encoders ("text_encoder", "text_encoder_2", ...) quantize the same way.
        fuse_qkv: fuse each attention's q / k / v projections after quantizing: the fused layer
            is built from the quantized codes, and the unfused layers become views of it, so no
            unfused weights stay alive.
        device, progress: as for cquant.quantize_ (device moves each component layer by layer).

    Returns the pipeline.
    """
    available = dict(getattr(pipe, "components", {}) or {})
    if components is None:
        components = [n for n in ("transformer", "unet") if isinstance(available.get(n), torch.nn.Module)][:1]
        if not components:
            raise ValueError("the pipeline has no 'transformer' or 'unet'; name the components to quantize")
    if isinstance(components, str):
        components = [components]
    for name in components:  # every name first: a bad one must not leave the others quantized
        comp = available.get(name)
        if comp is None:
            raise ValueError(f"pipeline has no component {name!r}; it has {sorted(available)}")
        if not isinstance(comp, torch.nn.Module):
            raise TypeError(f"component {name!r} is a {type(comp).__name__}, not a torch.nn.Module")
    if fuse_qkv:  # hooks that fusing would bypass: refused before any component is quantized
        for name in components:
            refuse_hooked_parts(available[name], f"cquant.quantize_pipeline(fuse_qkv=True) of {name!r}")
    for name in components:
        comp = available[name]
        quantize_(comp, config, device=device, progress=progress)
        if fuse_qkv:
            if callable(getattr(comp, "fuse_qkv_projections", None)):
                fuse_qkv_(comp)
            else:
                warnings.warn(f"component {name!r} ({type(comp).__name__}) cannot fuse QKV projections; left unfused",
                              stacklevel=2)
    return pipe
