"""Keeping a diffusers or transformers model's quantization_config in step with its quantized layers.

cquant.quantize runs sync_quantization_config after quantize_, dequantize_ and fuse_qkv_ (the
integration registers it as a sync hook once diffusers or transformers is imported), so a
quantize_-d model saves with save_pretrained and loads back with from_pretrained. The quantizer
classes are imported only for the library the model belongs to: either may be missing.

A transformers model gets its own copy of its config before cquant writes quantization_config
into it (its modules read the copy too): models built from one config object share it, and a
float model sharing the config of a quantized one would save as quantized.
"""

from __future__ import annotations

import copy
import sys
import warnings

from ..quantize import quantized_layers
from . import common
from .hf_config import CQuantConfig

__all__ = ["sync_quantization_config"]


def sync_quantization_config(model, config=None):
    """cquant.quantize's sync hook: after quantize_ / dequantize_ / fuse_qkv_, give a diffusers or
    transformers model the quantizer and the CQuantConfig (listing its quantized layers) that
    save_pretrained / from_pretrained need, or take them away once no layer is quantized. Other
    modules are left alone."""
    kind = common.model_kind(model)
    if kind is None:
        return
    if quantized_layers(model):
        _attach(model, config, kind)
    else:
        _detach(model, kind)


def _attach(model, config, kind):
    existing = getattr(getattr(model, "hf_quantizer", None), "quantization_config", None)
    if isinstance(existing, CQuantConfig):
        qconfig = existing
    else:
        if getattr(model, "hf_quantizer", None) is not None:
            warnings.warn(f"{type(model).__name__} already has a {type(existing).__name__} quantizer; cquant replaces "
                          "it for save_pretrained", stacklevel=4)
        try:
            qconfig = CQuantConfig(config if config is not None else "int8wo")
        except TypeError:
            qconfig = CQuantConfig("int8wo")
    qconfig.set_layers(quantized_layers(model))
    if kind == "diffusers":
        from .diffusers_quantizer import CQuantDiffusersQuantizer

        quantizer = CQuantDiffusersQuantizer(qconfig, pre_quantized=True)
        quantizer.bind(model)
        model.hf_quantizer = quantizer
        model.is_quantized = True
        model.quantization_method = qconfig.quant_method
        extra = {}
        if model.config.get("_pre_quantization_dtype") is None:
            extra["_pre_quantization_dtype"] = _compute_dtype(model)
        model.register_to_config(quantization_config=quantizer.quantization_config, **extra)
    else:
        from .transformers_quantizer import CQuantHfQuantizer

        if not isinstance(existing, CQuantConfig):  # first time: the config may be shared with other models
            _own_config(model)
        quantizer = CQuantHfQuantizer(qconfig, pre_quantized=True)
        quantizer.bind(model)
        model.hf_quantizer = quantizer
        model.quantization_method = qconfig.quant_method
        model.config.quantization_config = quantizer.quantization_config


def _own_config(model):
    """Give a transformers model a copy of its config (and sub-configs), which all its modules that
    read the old one read instead: they stay shared within the model (set_attn_implementation
    reaches every attention module), no longer with other models."""
    memo = {}
    model.config = copy.deepcopy(model.config, memo)
    for mod in model.modules():
        c = mod.__dict__.get("config")
        if c is not None and id(c) in memo and mod is not model:
            mod.config = memo[id(c)]


def _compute_dtype(model):
    """The dtype the quantized layers compute in: that of the float layers they replaced."""
    from ..nn import QuantizedLinear

    return next(m.compute_dtype for m in model.modules() if isinstance(m, QuantizedLinear))


def _detach(model, kind):
    q = getattr(model, "hf_quantizer", None)
    if q is None or not isinstance(getattr(q, "quantization_config", None), CQuantConfig):
        return
    common.remove_quantization_config(model)
    if kind == "diffusers":
        del model.hf_quantizer
    else:
        model.hf_quantizer = None
