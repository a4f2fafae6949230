"""cquant's quantizer for transformers' PreTrainedModel.from_pretrained / save_pretrained.

Text encoders of diffusion pipelines (T5, CLIP, Qwen2.5-VL, ...) quantize the same way as the
denoiser. Quantizing a float checkpoint: transformers hands each planned layer's float weight
to CQuantQuantize.convert on its device; it swaps the layer for a QuantizedLinear and returns
the codes and scales that transformers then sets. Loading a quantized checkpoint: the listed
layers become meta skeletons first, and transformers loads their codes and fp32 scales without
casting (the skeleton's dtypes say they are not float weights). Before that, config.json's layer
list, the files' own cquant metadata (every shard's) and the stored tensors' dtypes and shapes
are checked against each other (cquant.checkpoint): transformers itself would fill a missing
weight_scale with uninitialised memory and cast float weights into int8 codes.
"""

from __future__ import annotations

import torch
from transformers.quantizers.base import HfQuantizer

from .. import checkpoint
from ..quantize import dequantize_, finish_, quantized_layers, swap_in
from . import common

try:
    from transformers.core_model_loading import ConversionOps
except ImportError:  # older transformers: on-the-fly quantization goes through quantize_ after loading
    ConversionOps = object

__all__ = ["CQuantHfQuantizer", "CQuantQuantize"]


class CQuantQuantize(ConversionOps):
    """transformers conversion op: float weight of one planned layer -> its codes and scales (and
    low-rank factors)."""

    def __init__(self, hf_quantizer):
        self.hf_quantizer = hf_quantizer

    def convert(self, input_dict, source_patterns=None, target_patterns=None, full_layer_name=None, model=None,
                **kwargs):
        (value,) = input_dict.values()
        value = value[0] if isinstance(value, list) else value
        fqn = full_layer_name.rpartition(".")[0]
        new = swap_in(model, {fqn: self.hf_quantizer._layers[fqn]}, weights={fqn: value})[fqn]
        return {f"{fqn}.{name}": getattr(new, name) for name in new.expected_shapes()}


class CQuantHfQuantizer(common.ModelBound, HfQuantizer):
    """transformers quantizer for CQuantConfig (quant_method "cquant")."""

    requires_calibration = False

    def __init__(self, quantization_config, **kwargs):
        super().__init__(common.own_config(quantization_config), **kwargs)
        self._layers = {}
        self._report = {}
        self._source = "checkpoint"

    def validate_environment(self, *args, **kwargs):
        common.reject_disk_offload(kwargs.get("device_map"))

    def preprocess_model(self, model, dtype=None, **kwargs):
        self._dtype = dtype
        return super().preprocess_model(model, dtype=dtype, **kwargs)

    def _process_model_before_weight_loading(self, model, checkpoint_files=None, **kwargs):
        cfg = self.quantization_config
        self.bind(model)
        files = common.safetensors_files(checkpoint_files)
        self._source = common.describe_files(files, self._source)
        keep_fp32 = list(getattr(model, "_keep_in_fp32_modules", None) or []) + list(
            getattr(model, "_keep_in_fp32_modules_strict", None) or [])
        stored = common.read_checkpoint(files, self.pre_quantized, self._source)
        if self.pre_quantized:
            self._layers = common.stored_layers(cfg)
            swap_in(model, self._layers, dtype=getattr(self, "_dtype", None), empty=True)
            finish_(model, sync=False)
            common.check_checkpoint(stored, self._layers, model)
        else:
            p = common.plan_for_loading(model, cfg, keep_fp32)
            self._layers, self._report = p.layers, p.report
        return model

    def param_needs_quantization(self, model, param_name, **kwargs):
        if self.pre_quantized:
            return False
        fqn, _, name = param_name.rpartition(".")
        return name == "weight" and fqn in self._layers

    def get_quantize_ops(self):
        if ConversionOps is object:
            raise RuntimeError("this transformers version has no conversion ops; quantize after loading with "
                               "cquant.quantize_(model, config)")
        return CQuantQuantize(self)

    def _process_model_after_weight_loading(self, model, **kwargs):
        cfg = self.quantization_config
        if self.pre_quantized:
            checkpoint.check_loaded(model, self._layers, self._source)
        else:
            checkpoint.check_all_quantized(model, self._layers, self._source)
            finish_(model, report=self._report, sync=False)
        cfg.set_layers(quantized_layers(model))
        model.config.quantization_config = cfg
        return model

    def get_state_dict_and_metadata(self, model):
        self.quantization_config.set_layers(quantized_layers(model))
        model.config.quantization_config = self.quantization_config
        return None, checkpoint.metadata(model)

    def is_serializable(self):
        model = self.bound_model
        if model is not None:  # config.json is written before the weights: list the current layers
            self.quantization_config.set_layers(quantized_layers(model))
            if not getattr(model, "_hf_peft_config_loaded", False):  # with it, transformers saves the adapter alone
                checkpoint.refuse_adapter_layers(model, f"cannot save {type(model).__name__}")
        return True

    @property
    def is_trainable(self):
        return True

    @property
    def is_compileable(self):
        return True

    def _dequantize(self, model, dtype=None):
        return dequantize_(model, dtype, sync=False)
