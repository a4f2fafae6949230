"""What the diffusers and transformers quantizers share: config handling and loading plans."""

from __future__ import annotations

import copy

from .. import checkpoint
from ..quantize import plan
from .hf_config import CQuantConfig

__all__ = ["own_config", "reject_disk_offload", "safetensors_files", "describe_files", "plan_for_loading",
           "stored_layers"]


def own_config(quantization_config):
    """The quantizer's own copy of its CQuantConfig (a dict is parsed). The same config object may
    serve several models (a PipelineQuantizationConfig), and loading writes quantized_layers."""
    if isinstance(quantization_config, dict):
        quantization_config = CQuantConfig.from_dict(quantization_config)
    if not isinstance(quantization_config, CQuantConfig):
        raise TypeError(f"expected a CQuantConfig, got {type(quantization_config).__name__}")
    return copy.deepcopy(quantization_config)


def reject_disk_offload(device_map):
    if isinstance(device_map, dict) and "disk" in device_map.values():
        raise ValueError("cquant does not support disk offload in device_map; use 'cpu' or a GPU")


def safetensors_files(checkpoint_files):
    return [f for f in (checkpoint_files or []) if isinstance(f, str) and f.endswith(".safetensors")]


def describe_files(files, default):
    """How error messages name the checkpoint: its file, or its first shard and the count."""
    if not files:
        return default
    return files[0] if len(files) == 1 else f"{files[0]} (+{len(files) - 1} shards)"


def stored_layers(qconfig):
    """{fqn: Scheme} a quantized checkpoint's config lists."""
    if qconfig.quantized_layers is None:
        raise ValueError("this checkpoint's quantization_config (cquant) has no quantized_layers; it was not "
                         "written by cquant's save_pretrained")
    return checkpoint.layers_from_names(qconfig.quantized_layers, "quantization_config.quantized_layers")


def plan_for_loading(model, qconfig, keep_in_fp32=()):
    """The Plan of quantizing a float checkpoint while it loads (the model is still on meta)."""
    skip = list(keep_in_fp32 or ())

    def exclude(fqn):
        if qconfig.excluded(fqn):
            return "listed in modules_to_not_convert"
        if any(k in fqn.split(".") for k in skip):
            return "listed in the model's _keep_in_fp32_modules"
        return None

    return plan(model, qconfig.quant_type, exclude=exclude, allow_meta=True)
