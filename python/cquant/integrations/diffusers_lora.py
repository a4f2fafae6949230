"""pipe.load_lora_weights on a Flux transformer whose q / k / v cquant fused.

diffusers fuses float projections by copying their weights into to_qkv and keeps to_q / to_k /
to_v: a LoRA loaded later goes into those, which the fused forward never calls (it is unused
until unfuse_qkv_projections). cquant keeps them as views of the fused layer's rows
(QuantizedLinearSlice), which state_dict leaves out since the fused layer holds their data.
transformer.load_lora_adapter loads into the views as into float layers, but FluxLoraLoaderMixin
first passes the LoRA through _maybe_expand_lora_state_dict(transformer, lora_state_dict), which
looks up each targeted layer's weight in transformer.state_dict() (to zero-pad a LoRA narrower
than its layer, for Flux Control) and raised KeyError: '...attn.to_k.weight'.

cquant wraps that one method: the entries of LoRA modules whose layer is such a view are set
aside while diffusers' method handles the others, padded the way it pads (a lora_A narrower than
the layer gets zero columns; a wider one is refused, naming the fusion), and put back in their
places. A diffusers version without the method is left alone.
"""

from __future__ import annotations

import functools

import torch

from ..fusion import base_layer
from ..nn import QuantizedLinearSlice

__all__ = ["install"]


def _views(transformer, names, prefix):
    """{LoRA module name: the view it targets} among `names` (with `prefix`)."""
    out = {}
    for name in names:
        if not name.startswith(prefix):
            continue
        try:
            mod = transformer.get_submodule(name[len(prefix):])
        except AttributeError:
            continue  # diffusers logs and ignores modules the model does not have
        layer = base_layer(mod)
        if isinstance(layer, QuantizedLinearSlice):
            out[name] = layer
    return out


def _pad(name, lora_a, view):
    """lora_A [r, K'] for a view with K = view.in_features: zero-padded if K' < K, as diffusers pads a layer."""
    k = view.in_features
    if lora_a.shape[1] == k:
        return lora_a
    if lora_a.shape[1] > k:
        raise NotImplementedError(f"LoRA {name}.lora_A.weight has {lora_a.shape[1]} input features, but {name} has "
                                  f"{k}: it is a view of the rows of a QKV-fused layer (fuse_qkv_projections / "
                                  "quantize_pipeline(fuse_qkv=True)), which cannot be widened")
    padded = torch.zeros(lora_a.shape[0], k, device=view.weight.device, dtype=lora_a.dtype)
    padded[:, :lora_a.shape[1]].copy_(lora_a)
    return padded


def _wrap(original):
    @functools.wraps(original)
    def _maybe_expand_lora_state_dict(cls, transformer, lora_state_dict):
        prefix = f"{cls.transformer_name}."
        names = {k[:-len(".lora_A.weight")] for k in lora_state_dict if k.endswith(".lora_A.weight")}
        views = _views(transformer, names, prefix)
        if not views:
            return original(cls, transformer, lora_state_dict)
        order = list(lora_state_dict)
        held = {k: lora_state_dict.pop(k) for k in order if k.split(".lora_", 1)[0] in views}
        for name, view in views.items():
            key = f"{name}.lora_A.weight"
            held[key] = _pad(name, held[key], view)
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
    """Wrap diffusers.loaders.lora_pipeline.FluxLoraLoaderMixin._maybe_expand_lora_state_dict (idempotent)."""
    mixin = getattr(lora_pipeline, "FluxLoraLoaderMixin", None)
    method = getattr(mixin, "__dict__", {}).get("_maybe_expand_lora_state_dict")
    if not isinstance(method, classmethod) or getattr(method.__func__, "_cquant", False):
        return
    mixin._maybe_expand_lora_state_dict = _wrap(method.__func__)
