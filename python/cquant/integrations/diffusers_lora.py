"""pipe.load_lora_weights on a Flux transformer whose linear layers cquant quantized (and maybe fused).

FluxLoraLoaderMixin reshapes a LoRA before loading it, from the layers' stored weights:
- _maybe_expand_transformer_param_shape_or_error_ compares each LoRA with its layer's weight.shape
  and, where the LoRA is wider (Flux Control: x_embedder's input features 64 -> 128), rebuilds the
  layer as a wider float nn.Linear from its weight. A packed scheme stores [out_features, packed
  bytes] (fp6_e3m2: 3/4 of in_features), so every LoRA looked wider than its layer, and the
  rebuild from the uint8 codes raised "Only Tensors of floating point and complex dtype can
  require gradients".
- _maybe_expand_lora_state_dict zero-pads a lora_A narrower than transformer.state_dict()'s weight,
  to that weight's width: the packed width again, and a KeyError for the views cquant's QKV fusion
  leaves as to_q / to_k / to_v (QuantizedLinearSlice), which state_dict leaves out since the fused
  layer holds their data.

cquant wraps both methods. The entries of LoRA modules whose layer is a cquant layer are set aside
while diffusers' methods handle the others, measured against the layer's in_features and
out_features (a lora_A narrower than the layer gets zero columns, as diffusers pads), and put back
in their places. A LoRA wider than its quantized layer first turns that layer into its float
version in place (dequantized, with a LoraWideningWarning), which diffusers then widens as it
widens bnb and GGUF layers; a view of a fused layer cannot be widened and is refused before
anything changes. A diffusers version without the methods is left alone.
"""

from __future__ import annotations

import functools
import warnings

import torch

from ..fusion import base_layer
from ..nn import QuantizedLinear, QuantizedLinearSlice
from ..quantize import dequantize_
from .model_config import sync_quantization_config

__all__ = ["install", "LoraWideningWarning"]

_A, _B = ".lora_A.weight", ".lora_B.weight"


class LoraWideningWarning(UserWarning):
    """A quantized layer became float so that diffusers could widen it for a LoRA (Flux Control)."""


def _quantized_targets(transformer, state_dict, prefix, prefixed_only):
    """{LoRA module name in state_dict: (module path, the module, the cquant layer it runs)}; names
    without `prefix` count unless prefixed_only (as each of diffusers' two methods reads them)."""
    out = {}
    for key in state_dict:
        if not key.endswith(_A) or (prefixed_only and not key.startswith(prefix)):
            continue
        name = key[:-len(_A)]
        path = name[len(prefix):] if name.startswith(prefix) else name
        try:
            mod = transformer.get_submodule(path)
        except AttributeError:
            continue  # diffusers logs and ignores modules the model does not have
        layer = base_layer(mod)
        if isinstance(layer, QuantizedLinear):
            out[name] = (path, mod, layer)
    return out


def _wider(name, state_dict, layer):
    """How the LoRA of module `name` is wider than its layer ("input features 64 -> 128"), or None."""
    lora_a, lora_b = state_dict[name + _A], state_dict.get(name + _B)
    if lora_a.shape[1] > layer.in_features:
        return f"input features {layer.in_features} -> {lora_a.shape[1]}"
    if lora_b is not None and lora_b.shape[0] > layer.out_features:
        return f"output features {layer.out_features} -> {lora_b.shape[0]}"
    return None


def _widening_refusal(module, layer):
    """Why a quantized layer cannot become float for diffusers to widen it, or None."""
    if isinstance(layer, QuantizedLinearSlice):
        return ("it is a view of the rows of a QKV-fused layer (fuse_qkv_projections / "
                "quantize_pipeline(fuse_qkv=True)), which cannot be widened")
    if module is not layer:
        return "it carries a PEFT adapter already: load the wider LoRA first"
    if layer.activation is not None:
        return f"cquant fused its {layer.activation} into it (cquant.unfuse_activations_ undoes that)"
    return None


def _widen_quantized(transformer, state_dict, targets):
    """Turn the quantized layers that LoRAs in state_dict are wider than into float layers in place
    (cquant.dequantize_ of each), which diffusers then replaces by wider ones as it does for bnb and
    GGUF layers. Every such layer is checked before any changes; returns their LoRA modules' names."""
    wide = {}
    for name, (path, mod, layer) in targets.items():
        how = _wider(name, state_dict, layer)
        if how:
            refusal = _widening_refusal(mod, layer)
            if refusal:
                raise NotImplementedError(f"LoRA {name} is wider than its quantized layer ({how}), and {refusal}")
            wide[name] = how
    for name, how in wide.items():
        path, _, layer = targets[name]
        scheme, dtype = layer.scheme.name, str(layer.compute_dtype).replace("torch.", "")
        dequantize_(layer)
        warnings.warn(f"cquant: {path} ({scheme}) became a {dtype} layer with its dequantized weight: the LoRA "
                      f"widens it ({how}), which diffusers does on float weights", LoraWideningWarning, stacklevel=5)
    if wide:
        sync_quantization_config(transformer)
    return list(wide)


def _pad(lora_a, layer):
    """lora_A [r, K'] for a layer of K = in_features: zero-padded if K' < K, as diffusers pads a layer."""
    k = layer.in_features
    if lora_a.shape[1] == k:
        return lora_a
    padded = torch.zeros(lora_a.shape[0], k, device=lora_a.device, dtype=lora_a.dtype)
    padded[:, :lora_a.shape[1]].copy_(lora_a)
    return padded


def _set_aside(state_dict, targets):
    """The entries of state_dict that belong to the LoRA modules in targets, removed from it."""
    return {k: state_dict.pop(k) for k in list(state_dict) if k.split(".lora_", 1)[0] in targets}


def _wrap_param_shapes(original):
    @functools.wraps(original)
    def _maybe_expand_transformer_param_shape_or_error_(cls, transformer, lora_state_dict=None, norm_state_dict=None,
                                                         prefix=None):
        if lora_state_dict:
            targets = _quantized_targets(transformer, lora_state_dict, f"{prefix or cls.transformer_name}.", False)
            for name in _widen_quantized(transformer, lora_state_dict, targets):
                del targets[name]  # float now: diffusers widens it
            if targets:  # diffusers' method only reads the dict; it gets the entries of the other layers
                lora_state_dict = dict(lora_state_dict)
                _set_aside(lora_state_dict, targets)
        return original(cls, transformer, lora_state_dict, norm_state_dict, prefix)

    _maybe_expand_transformer_param_shape_or_error_._cquant = True
    return classmethod(_maybe_expand_transformer_param_shape_or_error_)


def _wrap_lora_padding(original):
    @functools.wraps(original)
    def _maybe_expand_lora_state_dict(cls, transformer, lora_state_dict):
        targets = _quantized_targets(transformer, lora_state_dict, f"{cls.transformer_name}.", True)
        if not targets:
            return original(cls, transformer, lora_state_dict)
        for name, (path, mod, layer) in targets.items():
            how = _wider(name, lora_state_dict, layer)
            if how:  # the shapes method widens these first; a caller that skipped it gets this
                raise NotImplementedError(f"LoRA {name} is wider than its quantized layer ({how}); "
                                          "pipe.load_lora_weights widens such layers")
        order = list(lora_state_dict)
        held = _set_aside(lora_state_dict, targets)
        for name, (_, _, layer) in targets.items():
            held[name + _A] = _pad(held[name + _A], layer)
        out = original(cls, transformer, lora_state_dict)
        rest = {k: v for k, v in out.items() if k not in held}
        merged = {k: held[k] if k in held else rest.pop(k) for k in order if k in held or k in rest}
        merged.update(rest)  # anything diffusers' method added
        out.clear()
        out.update(merged)
        return out

    _maybe_expand_lora_state_dict._cquant = True
    return classmethod(_maybe_expand_lora_state_dict)


def install(lora_pipeline):
    """Wrap FluxLoraLoaderMixin's two LoRA-reshaping methods in diffusers.loaders.lora_pipeline (idempotent)."""
    mixin = getattr(lora_pipeline, "FluxLoraLoaderMixin", None)
    for attr, wrap in (("_maybe_expand_transformer_param_shape_or_error_", _wrap_param_shapes),
                       ("_maybe_expand_lora_state_dict", _wrap_lora_padding)):
        method = getattr(mixin, "__dict__", {}).get(attr)
        if isinstance(method, classmethod) and not getattr(method.__func__, "_cquant", False):
            setattr(mixin, attr, wrap(method.__func__))
