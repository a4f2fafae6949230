"""Keeping a diffusers or transformers model's quantization_config in step with its quantized layers.

cquant.quantize runs sync_quantization_config after quantize_, dequantize_ and fuse_qkv_ (the
integration registers it as a sync hook once diffusers or transformers is imported), so a
quantize_-d model saves with save_pretrained and loads back with from_pretrained. The quantizer
classes are imported only for the library the model belongs to: either may be missing.
"""

from __future__ import annotations

import sys
import warnings

from ..quantize import quantized_layers
from .hf_config import CQuantConfig

__all__ = ["sync_quantization_config"]


def _kind(model):
    dm = sys.modules.get("diffusers.models.modeling_utils")
    if dm is not None and isinstance(model, dm.ModelMixin):
        return "diffusers"
    tm = sys.modules.get("transformers.modeling_utils")
    if tm is not None and isinstance(model, tm.PreTrainedModel):
        return "transformers"
    return None


def sync_quantization_config(model, config=None):
    """cquant.quantize's sync hook: after quantize_ / dequantize_ / fuse_qkv_, give a diffusers or
    transformers model the quantizer and the CQuantConfig (listing its quantized layers) that
    save_pretrained / from_pretrained need, or take them away once no layer is quantized. Other
    modules are left alone."""
    kind = _kind(model)
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
    qconfig.quantized_layers = quantized_layers(model)
    if kind == "diffusers":
        from .diffusers_quantizer import CQuantDiffusersQuantizer

        quantizer = CQuantDiffusersQuantizer(qconfig, pre_quantized=True)
        quantizer.bind(model)
        model.hf_quantizer = quantizer
        model.is_quantized = True
        model.quantization_method = qconfig.quant_method
        model.register_to_config(quantization_config=quantizer.quantization_config)
    else:
        from .transformers_quantizer import CQuantHfQuantizer

        quantizer = CQuantHfQuantizer(qconfig, pre_quantized=True)
        quantizer.bind(model)
        model.hf_quantizer = quantizer
        model.quantization_method = qconfig.quant_method
        model.config.quantization_config = quantizer.quantization_config


def _detach(model, kind):
    q = getattr(model, "hf_quantizer", None)
    if q is None or not isinstance(getattr(q, "quantization_config", None), CQuantConfig):
        return
    if kind == "diffusers":
        from diffusers.configuration_utils import FrozenDict

        del model.hf_quantizer
        model.is_quantized = False
        config = {k: v for k, v in model._internal_dict.items() if k != "quantization_config"}
        model._internal_dict = FrozenDict(config)
        model.__dict__.pop("quantization_method", None)
    else:
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.__dict__.pop("quantization_method", None)
