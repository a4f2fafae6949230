"""QKV fusion of quantized diffusers models, and cquant.quantize_pipeline.

diffusers fuses an attention module's q / k / v projections (and the added q / k / v of joint
attention) into one linear layer with `model.fuse_qkv_projections()`, by concatenating float
weights. cquant makes that work in both orders:

* fuse, then quantize_: quantize_ quantizes the fused layer and turns the unfused q / k / v
  (which the fused processor no longer calls) into QuantizedLinearSlice views of its rows, so
  they cost nothing.
* quantize_, then fuse: quantize_ gives every attention module whose projections it quantized a
  fuse_projections that concatenates the stored codes and scales (exact for per-row and per-group
  scales; a per-tensor layer is requantized from its dequantized weights with one common scale)
  and leaves views behind as above. Low-rank corrections fuse exactly too: the fused layer's
  down factor stacks the parts' ([sum r, K]) and its up factor is their block diagonal
  ([N, sum r]), so its rank is the sum of theirs (ranks may differ; a part without one adds none).

cquant.quantize_pipeline(pipe, config, components, fuse_qkv=True) does the second, layer by
layer, so no unfused float weights outlive the call.

A projection wrapped by a PEFT adapter layer (LoRA on to_q, ...) fuses its base layer, as
diffusers' fusion does (it reads to_q.weight, which PEFT forwards to the base layer): the fused
layer holds the base weights only, so the adapter is unused while fused, and the view becomes the
adapter layer's base layer, so unfusing runs the adapter again. A group cquant cannot fuse is
refused before anything changes, never left with fused_projections set and no fused layer. So are
projections that carry hooks (diffusers' or torch's, also on the base layer under an adapter), float
or quantized: the fused layer would run in their place and the hooks would not.
"""

from __future__ import annotations

import warnings
import weakref

import torch

from . import module_hooks
from .nn import QuantizedLinear, QuantizedLinearSlice

__all__ = ["base_layer", "check_fusable", "fusion_groups", "install_fusion", "slice_unfused", "unfused_parts", "hooked_parts",
           "FuseProjections"]


def _chain(mod):
    """(".base_layer" * depth, module) for a projection and each base layer under its PEFT adapter layers."""
    path = ""
    yield path, mod
    while callable(getattr(mod, "get_base_layer", None)) and hasattr(mod, "base_layer"):
        mod, path = mod.base_layer, path + ".base_layer"
        yield path, mod


def _base_path(mod):
    """(".base_layer" * depth, layer) of the layer a projection runs: under PEFT adapter layers
    (which keep it as base_layer, get_base_layer() walking down), their base layer."""
    return list(_chain(mod))[-1]


def base_layer(mod):
    """The layer a projection module runs: mod, or its base layer if mod is a PEFT adapter layer."""
    return _base_path(mod)[1]


def _part(attn, name):
    """The layer attn.<name> runs (its base layer under a PEFT adapter layer)."""
    return _base_path(getattr(attn, name))[1]


def _set_part(attn, name, layer):
    """Make `layer` what attn.<name> runs, keeping any PEFT adapter layer around it."""
    path, _ = _base_path(getattr(attn, name))
    if not path:
        setattr(attn, name, layer)
        return
    holder = attn.get_submodule(name + path[:-len(".base_layer")])
    holder.base_layer = layer


def _diffusers_groups(attn):
    """[(fused_name, (part names))] that diffusers' fuse_projections builds, whatever the parts are."""
    groups = []
    if all(getattr(attn, n, None) is not None for n in ("to_k", "to_v")):
        if getattr(attn, "is_cross_attention", False):
            groups.append(("to_kv", ("to_k", "to_v")))
        elif getattr(attn, "to_q", None) is not None:
            groups.append(("to_qkv", ("to_q", "to_k", "to_v")))
    if all(getattr(attn, n, None) is not None for n in ("add_q_proj", "add_k_proj", "add_v_proj")):
        groups.append(("to_added_qkv", ("add_q_proj", "add_k_proj", "add_v_proj")))
    return groups


def fusion_groups(attn):
    """[(fused_name, (part names))] of an attention module whose parts are (or wrap) linear layers,
    following diffusers' fuse_projections."""
    return [(f, p) for f, p in _diffusers_groups(attn) if all(isinstance(_part(attn, n), torch.nn.Linear) for n in p)]


def _is_attention(mod):
    return callable(getattr(type(mod), "fuse_projections", None)) and bool(fusion_groups(mod))


def _install_views(attn, fused_name, parts):
    fused = getattr(attn, fused_name)
    start = 0
    for name in parts:
        part = _part(attn, name)
        n = part.out_features
        view = QuantizedLinearSlice(fused, start, start + n)
        hooks = module_hooks.detach(part)  # they run again where the view is called (after unfuse_projections)
        _set_part(attn, name, view)
        module_hooks.attach(view, hooks)
        start += n
    if start != fused.out_features:
        raise ValueError(f"{fused_name} has {fused.out_features} outputs but {', '.join(parts)} add up to {start}")


def slice_unfused(model):
    """Where an attention module is fused and its fused layer quantized, make the unfused parts views of it.

    Returns the names of the parts replaced."""
    replaced = []
    for prefix, attn in model.named_modules():
        if not getattr(attn, "fused_projections", False):
            continue
        for fused_name, parts in fusion_groups(attn):
            fused = getattr(attn, fused_name, None)
            if not isinstance(fused, QuantizedLinear) or isinstance(fused, QuantizedLinearSlice):
                continue
            layers = [_part(attn, p) for p in parts]
            if all(isinstance(x, QuantizedLinearSlice) and x.source is fused for x in layers):
                continue
            if sum(x.out_features for x in layers) != fused.out_features:
                continue
            if any(module_hooks.move_refusal(x, QuantizedLinearSlice) for x in layers):
                continue  # they stay as they are, hooks included
            _install_views(attn, fused_name, parts)
            replaced += [f"{prefix}.{p}" if prefix else p for p in parts]
    return replaced


def unfused_parts(model):
    """{fqn of an unfused part: fqn of its fused layer} for every fused attention module (under a
    PEFT adapter layer, the fqn of its base layer)."""
    out = {}
    for prefix, attn in model.named_modules():
        if not getattr(attn, "fused_projections", False):
            continue
        for fused_name, parts in fusion_groups(attn):
            if getattr(attn, fused_name, None) is None:
                continue
            join = (lambda n: f"{prefix}.{n}") if prefix else (lambda n: n)
            for p in parts:
                out[join(p + _base_path(getattr(attn, p))[0])] = join(fused_name)
    return out


def _group_refusal(attn, parts):
    """(exception type, why) cquant cannot fuse `parts` of attn, or None; checked for every group
    before any is fused."""
    mods = [getattr(attn, p) for p in parts]
    layers = [_part(attn, p) for p in parts]
    for p, mod, layer in zip(parts, mods, layers):
        if not isinstance(layer, torch.nn.Linear):
            what = type(mod).__name__ + (f" around a {type(layer).__name__}" if layer is not mod else "")
            return TypeError, f"{p} is a {what}, not a linear layer (or a PEFT adapter layer around one)"
    views = [isinstance(x, QuantizedLinearSlice) for x in layers]
    if any(views):  # fused by cquant before: _fuse_group puts the shared fused layer back
        if not all(views):
            return TypeError, (f"{', '.join(p for p, v in zip(parts, views) if v)} are rows of a fused layer and "
                               f"{', '.join(p for p, v in zip(parts, views) if not v)} not")
        if len({id(x.source) for x in layers}) != 1:
            return TypeError, "they are rows of different fused layers"
        return None
    for p, mod, layer in zip(parts, mods, layers):
        merged = list(getattr(mod, "merged_adapters", None) or ())
        if merged and isinstance(layer, QuantizedLinear):
            # the fused layer would hold the merged codes, and unmerging could not reach it
            return ValueError, (f"LoRA adapter(s) {merged} are merged into {p} (fuse_lora / merge_adapter); unmerge "
                                "them first (unfuse_lora / unmerge_adapter), then fuse")
    in_features = {x.in_features for x in layers}
    if len(in_features) != 1:
        return ValueError, f"their in_features differ ({sorted(in_features)})"
    if len({x.bias is not None for x in layers}) != 1:
        return ValueError, "some have a bias and some do not"
    return None


def check_fusable(model):
    """Raise (before anything changes) if fuse_qkv_projections() would find an attention module of
    `model` that cquant fuses with a group it cannot fuse."""
    for prefix, attn in model.named_modules():
        if getattr(attn.__dict__.get("fuse_projections"), "func", None) is not _cquant_fuse_projections:
            continue
        _check_module(attn, prefix, "no module was fused")


def _check_module(attn, name, outcome):
    if getattr(attn, "fused_projections", False) or not getattr(attn, "_supports_qkv_fusion", True):
        return
    for fused_name, parts in _diffusers_groups(attn):
        refusal = _group_refusal(attn, parts)
        if refusal:
            error, why = refusal
            where = name or type(attn).__name__
            raise error(f"cannot fuse {where}: {', '.join(parts)} into {fused_name}: {why}; {outcome}")


@torch.no_grad()
def _fuse_group(attn, fused_name, parts):
    layers = [_part(attn, p) for p in parts]
    if any(isinstance(x, QuantizedLinearSlice) for x in layers):
        # fused by cquant before (all views of one layer, _group_refusal checked); diffusers'
        # unfuse_projections deleted the fused layer the views share
        if getattr(attn, fused_name, None) is None:
            setattr(attn, fused_name, layers[0].source)
        return
    quantized = [isinstance(x, QuantizedLinear) for x in layers]
    # the parts' schemes up to their low-rank ranks, which may differ (a per-layer mapping)
    schemes = {x.scheme.with_lowrank(0) for x in layers} if all(quantized) else set()
    if all(quantized) and len(schemes) == 1:
        scheme = schemes.pop()
        ranks = [x.scheme.lowrank_rank for x in layers]
        dtype = layers[0].compute_dtype
        k, n = layers[0].in_features, sum(x.out_features for x in layers)
        bias = torch.cat([x.bias.to(dtype) for x in layers]) if layers[0].bias is not None else None
        if scheme.weight_granularity != "tensor":
            codes = torch.cat([x.weight for x in layers])
            scale = torch.cat([x.weight_scale for x in layers])
            factors = None
            if sum(ranks):
                scheme = scheme.with_lowrank(sum(ranks))
                ups, downs = zip(*[(x.lowrank_up.to(dtype), x.lowrank_down.to(dtype)) if r else
                                   (codes.new_zeros(x.out_features, 0, dtype=dtype), codes.new_zeros(0, k, dtype=dtype))
                                   for x, r in zip(layers, ranks)])
                factors = (torch.block_diag(*ups), torch.cat(downs))
            fused = QuantizedLinear(k, n, scheme, bias=bias is not None, device="meta", dtype=dtype,
                                    orig_dtype=layers[0].orig_dtype)
            fused._set_tensors(codes, scale, bias, factors)
        else:
            # one scale for the fused tensor: requantize the dequantized weights
            lin = torch.nn.Linear(k, n, bias=False, device="meta", dtype=torch.float32)
            lin.weight = torch.nn.Parameter(torch.cat([x.dequantize(torch.float32) for x in layers]))
            fused = QuantizedLinear.from_float(lin, scheme.with_lowrank(max(ranks)))
            fused.compute_dtype = dtype
            fused.orig_dtype = layers[0].orig_dtype
            if bias is not None:
                fused.bias = torch.nn.Parameter(bias)
        setattr(attn, fused_name, fused)
        _install_views(attn, fused_name, parts)
        return
    # float (or mixed) projections: a float fused layer, as diffusers builds it
    if any(quantized):
        # quantized parts dequantized into a float layer: the memory grows, which must not pass unnoticed
        said = ", ".join(f"{p} {x.scheme.name if isinstance(x, QuantizedLinear) else 'float'}"
                         for p, x in zip(parts, layers))
        warnings.warn(f"cquant: fusing {said} into one float {fused_name}, since one quantized layer holds one "
                      "scheme; quantize these projections with one scheme (up to the low-rank rank) to fuse them "
                      "quantized", UserWarning, stacklevel=2)
    dtype = next((x.compute_dtype if isinstance(x, QuantizedLinear) else x.weight.dtype) for x in layers)
    w = torch.cat([x.dequantize(dtype) if isinstance(x, QuantizedLinear) else x.weight.detach().to(dtype)
                   for x in layers])
    fused = torch.nn.Linear(w.shape[1], w.shape[0], bias=layers[0].bias is not None, device="meta", dtype=dtype)
    fused.weight = torch.nn.Parameter(w)
    if layers[0].bias is not None:
        fused.bias = torch.nn.Parameter(torch.cat([x.bias.detach().to(dtype) for x in layers]))
    setattr(attn, fused_name, fused)


def hooked_parts(model):
    """{fqn: hook names} of the q / k / v projections (and the base layers under their PEFT
    adapter layers) whose hooks fusing the attention modules of model not fused yet would
    bypass: the fused layer computes them in their place, so their hooks (diffusers': a
    context-parallel plan's split or gather, ...; torch's forward and backward hooks) would no
    longer run."""
    found = {}
    for prefix, attn in model.named_modules():
        if getattr(attn, "fused_projections", False) or not _is_attention(attn) or \
                not getattr(attn, "_supports_qkv_fusion", True):
            continue
        for _, parts in fusion_groups(attn):
            for p in parts:
                for path, mod in _chain(getattr(attn, p)):
                    names = module_hooks.hook_names(mod) + module_hooks.torch_hook_kinds(mod)
                    if names:
                        found[f"{prefix}.{p}{path}" if prefix else p + path] = names
    return found


def _hooked_message(hooked):
    shown = ", ".join(f"{fqn} ({', '.join(names)})" for fqn, names in list(hooked.items())[:3])
    more = f", ... ({len(hooked)} in all)" if len(hooked) > 3 else ""
    return (f"q / k / v projections carry hooks: {shown}{more}. The fused layer would compute them in their place "
            "and the hooks would not run; remove the hooks or leave these projections unfused (a context-parallel "
            "plan that hooks them, for one, cannot run on fused projections)")


def refuse_hooked_parts(model, what):
    """Raise ValueError, before anything changes, where fusing would bypass hooks on q / k / v."""
    hooked = hooked_parts(model)
    if hooked:
        raise ValueError(f"{what}: {_hooked_message(hooked)}")


def _cquant_fuse_projections(self, fuse=True):
    """diffusers' fuse_projections for attention modules holding cquant layers."""
    if fuse and not getattr(self, "fused_projections", False) and getattr(self, "_supports_qkv_fusion", True):
        hooked = hooked_parts(self)
        if hooked:  # diffusers' fuse_qkv_projections has fused the modules before this one: this one stays unfused
            warnings.warn(f"cquant: {type(self).__name__} left unfused: {_hooked_message(hooked)}", UserWarning,
                          stacklevel=2)
            return
        _check_module(self, None, "this module is left unfused")
        for fused_name, parts in fusion_groups(self):
            _fuse_group(self, fused_name, parts)
    self.fused_projections = fuse


class FuseProjections:
    """The fuse_projections install_fusion gives an attention module: _cquant_fuse_projections on
    that module, held by weak reference.

    It sits in the module's own __dict__, so a bound method or functools.partial (which hold the
    module) would make a reference cycle: after `del model` the attention modules and their
    quantized projections (2.5 GB of GPU memory on Flux-dev) would stay allocated until the
    garbage collector next ran. Pickling and deepcopy store the module itself, which their memo
    turns into the copy, so a copied module's fuse_projections fuses the copy."""

    __slots__ = ("_module_ref",)

    def __init__(self, module):
        self._module_ref = weakref.ref(module)

    @property
    def module(self):
        """The attention module, or None once it is freed."""
        return self._module_ref()

    def __call__(self, fuse=True):
        module = self.module
        if module is None:
            raise ReferenceError("fuse_projections was called after its attention module was freed")
        return _cquant_fuse_projections(module, fuse)

    def __reduce__(self):
        return FuseProjections, (self.module,)

    def __repr__(self):
        module = self.module
        return f"FuseProjections({type(module).__name__ if module is not None else 'freed module'})"


def install_fusion(model):
    """Give attention modules with quantized projections a fuse_projections that handles them."""
    for mod in model.modules():
        if not _is_attention(mod) or isinstance(mod.__dict__.get("fuse_projections"), FuseProjections):
            continue
        if any(isinstance(_part(mod, p), QuantizedLinear) for _, parts in fusion_groups(mod) for p in parts):
            mod.fuse_projections = FuseProjections(mod)
