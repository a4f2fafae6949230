"""Which modules cquant.verify hooks, under which names, and what each is measured against.

A model is one component named ""; a pipeline's torch.nn.Module components keep their names
("transformer", "text_encoder", ...), and layer names are "component.layer". A module compiled
with torch.compile stands for the module it wraps (the names are the model's). The full-precision
weight of a layer: a float layer's own; a quantized layer's from `reference` (a model, a pipeline
or a state_dict, by name; a fused projection from its unfused parts), else its dequantized codes.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..fusion import unfused_parts
from ..nn import QuantizedLinear

__all__ = ["components_of", "compiled", "linear_layers", "reference_weights", "fused_parts",
           "reference_for"]


def uncompiled(module):
    """The module torch.compile(module) wraps (its layers' names are the model's), else module."""
    return getattr(module, "_orig_mod", module) if type(module).__name__ == "OptimizedModule" else module


def compiled(obj):
    """Whether `obj` (a model or pipeline) holds a module compiled with torch.compile (wrapped, or
    compiled in place by .compile())."""
    return any(type(m).__name__ == "OptimizedModule" or getattr(m, "_compiled_call_impl", None) is not None
               for top in _modules(obj).values() for m in top.modules())


def _modules(obj):
    """{prefix: module} of a model or a pipeline, as they are held (empty if obj holds none)."""
    if isinstance(obj, torch.nn.Module):
        return {"": obj}
    comps = getattr(obj, "components", None)
    if isinstance(comps, Mapping):
        return {k: v for k, v in comps.items() if isinstance(v, torch.nn.Module)}
    found = {}  # cquant.bench's BenchPipeline: transformer, text_encoders {name: module}, vae
    if isinstance(getattr(obj, "transformer", None), torch.nn.Module):
        found["transformer"] = obj.transformer
    found.update({k: v for k, v in (getattr(obj, "text_encoders", None) or {}).items()
                  if isinstance(v, torch.nn.Module)})
    if isinstance(getattr(obj, "vae", None), torch.nn.Module):
        found["vae"] = obj.vae
    return found


def components_of(obj, what):
    """{prefix: module} of a model ("" -> the model) or a pipeline ("transformer" -> ...); a module
    compiled by torch.compile stands for the module it wraps. TypeError naming `what` if none."""
    found = {k: uncompiled(v) for k, v in _modules(obj).items()}
    if not found:
        raise TypeError(f"{what} must be a torch.nn.Module or a pipeline holding modules (a diffusers pipeline's "
                        f"components), got {type(obj).__name__}")
    return found


def linear_layers(components):
    """{name: module} of every linear layer, each module once, in module order."""
    out, seen = {}, set()
    for prefix, comp in components.items():
        for name, mod in comp.named_modules():
            if isinstance(mod, torch.nn.Linear) and id(mod) not in seen:
                seen.add(id(mod))
                out[f"{prefix}.{name}" if prefix and name else prefix or name] = mod
    return out


def reference_weights(reference, model_components):
    """{layer name: (weight, bias)} of the reference (a model, a pipeline or a state_dict)."""
    if isinstance(reference, Mapping) and not hasattr(reference, "components"):
        bad = [k for k, v in reference.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
        if bad:
            raise TypeError(f"reference: a state_dict maps names to tensors; {bad[0]!r} is not")
        names = {k[:-len(".weight")] for k in reference if k.endswith(".weight")}
        return {n: (reference[n + ".weight"], reference.get(n + ".bias")) for n in names}
    comps = components_of(reference, "reference")
    if not set(model_components) <= set(comps):
        raise ValueError(f"reference: its components {sorted(comps)} do not match the model's "
                         f"{sorted(model_components)}")
    out = {}
    for name, mod in linear_layers({k: comps[k] for k in model_components}).items():
        if isinstance(mod, QuantizedLinear):
            raise ValueError(f"reference: layer {name!r} is quantized ({mod.scheme.name}); pass the unquantized "
                             "model (or its state_dict)")
        out[name] = (mod.weight, mod.bias)
    return out


def fused_parts(components):
    """{row name of a fused projection (attn.to_qkv, ...): [row names of its parts, in order]}."""
    out = {}
    for prefix, comp in components.items():
        for part, fused in unfused_parts(comp).items():
            join = (lambda n: f"{prefix}.{n}") if prefix else (lambda n: n)
            out.setdefault(join(fused), []).append(join(part))
    return out


def _fused_reference(weights, parts, mod, name):
    """Function returning (weight, bias) of a fused projection from its parts in the reference
    (concatenated at each call, so no second copy of the weights stays alive), or None."""
    if not parts or not all(p in weights for p in parts):
        return None
    pw = [weights[p] for p in parts]
    shapes = [tuple(p[0].shape) for p in pw]
    if {s[1] for s in shapes} != {mod.in_features} or sum(s[0] for s in shapes) != mod.out_features:
        raise ValueError(f"reference: the parts {parts} of the fused {name!r} hold weights of shapes {shapes}, which "
                         f"do not stack to Linear({mod.in_features}, {mod.out_features})")

    def fused():
        w = torch.cat([p[0] for p in pw])
        b = None if any(p[1] is None for p in pw) else torch.cat([p[1] for p in pw])
        return w, b

    return fused


def reference_for(name, mod, weights, fused_parts):
    """(function returning (weight, bias), kind) of the layer's full-precision weight."""
    if not isinstance(mod, QuantizedLinear):
        return (lambda: (mod.weight, mod.bias)), "float"
    if weights is not None:
        if name in weights:
            w, b = weights[name]
            if tuple(w.shape) != (mod.out_features, mod.in_features) or not w.is_floating_point():
                raise ValueError(f"reference: {name!r} holds a {w.dtype} weight of shape {tuple(w.shape)}; the layer "
                                 f"is Linear({mod.in_features}, {mod.out_features}) and needs a float weight")
            b = b if b is not None else mod.bias
            return (lambda: (w, b)), "reference"
        fused = _fused_reference(weights, fused_parts.get(name), mod, name)
        if fused is not None:
            return fused, "reference"
    return (lambda: (mod.dequantize(torch.float32), mod.bias)), "dequantized"
