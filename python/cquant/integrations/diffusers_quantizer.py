"""cquant's quantizer for diffusers' ModelMixin.from_pretrained / save_pretrained.

Quantizing a float checkpoint (quantization_config=CQuantConfig("fp8dqrow")): the layers to
quantize are planned on the empty (meta) model; as each layer's float weight is read from the
checkpoint, it is put on its device, quantized there and the layer swapped for a
QuantizedLinear, so at most one float layer exists at a time besides the unquantized modules.

Loading a quantized checkpoint (config.json carries the CQuantConfig with quantized_layers):
the listed layers become empty QuantizedLinear skeletons on the meta device before loading, and
their stored tensors (codes, fp32 scales) are installed directly; float weights of those layers
never exist. Before any tensor is read, config.json's layer list, the files' own cquant metadata
(every shard's) and the stored tensors' dtypes and shapes are checked against each other
(cquant.checkpoint).

The model's config records `_pre_quantization_dtype`: the dtype of the float layers cquant
quantized, which is the compute dtype of its quantized layers (the dtype= given to
from_pretrained, else torch's default dtype). model.dequantize() gives float layers of that
dtype back, and leaves a model that saves and loads as a float model.
"""

from __future__ import annotations

import torch
from diffusers.quantizers.base import DiffusersQuantizer

from .. import checkpoint
from ..nn import QuantizedLinear
from ..quantize import dequantize_, finish_, quantized_layers, swap_in
from . import common

__all__ = ["CQuantDiffusersQuantizer"]


# device_map strings diffusers resolves into a dict (validate_environment gets that dict)
_UNRESOLVED_DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")


def _param_device(param_name, device_map):
    if device_map is None or device_map in _UNRESOLVED_DEVICE_MAPS:  # not yet placed: diffusers moves it
        return "cpu"
    if isinstance(device_map, (str, int, torch.device)):
        return device_map
    name = param_name
    while name and name not in device_map:
        name = name.rpartition(".")[0]
    if name == "" and "" not in device_map:
        raise ValueError(f"{param_name} has no device in device_map")
    return device_map[name]


def _torch_device(d):
    if isinstance(d, int):
        return torch.device("cuda", d)
    return torch.device(d)


class CQuantDiffusersQuantizer(common.ModelBound, DiffusersQuantizer):
    """diffusers quantizer for CQuantConfig (quant_method "cquant")."""

    requires_calibration = False
    required_packages = None
    use_keep_in_fp32_modules = True

    def __init__(self, quantization_config, **kwargs):
        super().__init__(common.own_config(quantization_config), **kwargs)
        self._layers = {}  # fqn -> Scheme
        self._report = {}
        self._device_map = None
        self._torch_dtype = None
        self._stored = None  # the checkpoint's headers (cquant.checkpoint.StoredCheckpoint)
        self._source = "checkpoint"

    # ------------------------------------------------------------ before loading

    def validate_environment(self, *args, **kwargs):
        device_map = kwargs.get("device_map")
        common.reject_disk_offload(device_map)
        if isinstance(device_map, dict):  # diffusers calls again with "auto" / "balanced" resolved
            self._device_map = device_map

    def update_torch_dtype(self, torch_dtype):
        # diffusers records what this returns as the config's _pre_quantization_dtype: the dtype
        # the float layers load in (torch's default when none is given), which the quantized
        # layers compute in and dequantize() returns to
        self._torch_dtype = torch_dtype if torch_dtype is not None else torch.get_default_dtype()
        return self._torch_dtype

    def adjust_target_dtype(self, target_dtype):
        return torch.int8  # for device_map memory estimates: every scheme stores <= 1 byte per weight

    def maybe_update_loaded_keys(self, loaded_keys, checkpoint_files):
        files = common.safetensors_files(checkpoint_files)
        self._source = common.describe_files(files, self._source)
        self._stored = common.read_checkpoint(files, self.pre_quantized, self._source)
        return loaded_keys

    def _process_model_before_weight_loading(self, model, device_map=None, keep_in_fp32_modules=(), **kwargs):
        cfg = self.quantization_config
        self._device_map = device_map
        self.bind(model)
        self.modules_to_not_convert = list(cfg.modules_to_not_convert or []) + list(keep_in_fp32_modules or [])
        dtype = getattr(self, "_torch_dtype", None)
        if self.pre_quantized:
            self._layers = common.stored_layers(cfg)
            checkpoint.fuse_for_loading(model, self._layers)
            swap_in(model, self._layers, dtype=dtype, empty=True)
            finish_(model, sync=False)
            common.check_checkpoint(self._stored, self._layers, model)
        else:
            p = common.plan_for_loading(model, cfg, keep_in_fp32_modules)
            self._layers, self._report = p.layers, p.report
        model.config.quantization_config = cfg

    # ------------------------------------------------------------ while loading

    def maybe_update_state_dict(self, state_dict):
        """Pre-quantized: install the stored codes, scales (and low-rank factors) of quantized layers
        as they are (no dtype cast, which would turn fp32 scales into bfloat16)."""
        if not self.pre_quantized or not self._layers:
            return state_dict
        model = self.bound_model
        rest = {}
        for key, tensor in state_dict.items():
            fqn, _, name = key.rpartition(".")
            mod = model.get_submodule(fqn) if fqn in self._layers else None
            if mod is not None and name in mod.expected_shapes():
                device = _torch_device(_param_device(key, self._device_map))
                checkpoint.install_tensor(mod, name, tensor, device, fqn, self._source)
            else:
                rest[key] = tensor
        return rest

    def check_if_quantized_param(self, model, param_value, param_name, state_dict, **kwargs):
        if self.pre_quantized:
            return False
        fqn, _, name = param_name.rpartition(".")
        return name == "weight" and fqn in self._layers and not isinstance(model.get_submodule(fqn), QuantizedLinear)

    def create_quantized_param(self, model, param_value, param_name, target_device, state_dict, unexpected_keys,
                               **kwargs):
        """Quantize one float weight on its device and swap its layer for a QuantizedLinear."""
        fqn = param_name.rpartition(".")[0]
        swap_in(model, {fqn: self._layers[fqn]}, device=_torch_device(target_device), weights={fqn: param_value})

    def check_quantized_param_shape(self, param_name, current_param, loaded_param):
        return True

    # ------------------------------------------------------------ after loading

    def _process_model_after_weight_loading(self, model, **kwargs):
        cfg = self.quantization_config
        if self.pre_quantized:
            checkpoint.check_loaded(model, self._layers, self._source)
        else:
            checkpoint.check_all_quantized(model, self._layers, self._source)
            finish_(model, report=self._report, sync=False)
        cfg.set_layers(quantized_layers(model))
        model.register_to_config(quantization_config=cfg)
        return model

    # ------------------------------------------------------------ saving

    def _refresh(self):
        model = self.bound_model
        if model is not None:
            self.quantization_config.set_layers(quantized_layers(model))
            model.register_to_config(quantization_config=self.quantization_config)
        return model

    def get_state_dict_and_metadata(self, state_dict, safe_serialization=False):
        if not safe_serialization:
            # a pickle has no place for the files' cquant metadata, the only check of config.json's
            # scheme names against the codes (fp6_e3m2 and fp6_e2m3 codes look alike)
            raise ValueError("cquant saves quantized models as safetensors only: call save_pretrained with "
                             "safe_serialization=True (the default)")
        model = self._refresh()
        return state_dict, checkpoint.metadata(model)

    @property
    def is_serializable(self):
        # save_pretrained asks first, before it writes anything: config.json must list the current
        # layers, and adapter layers (which diffusers saves with the model) must be gone
        model = self._refresh()
        if model is not None:
            checkpoint.refuse_adapter_layers(model, f"cannot save {type(model).__name__}")
        return True

    @property
    def supports_safetensors_serialization(self):
        return True

    @property
    def is_trainable(self):
        return True  # adapters (LoRA) train on top; the quantized weights stay frozen

    @property
    def is_compileable(self):
        return True

    def _dequantize(self, model):
        """Float layers of the pre-quantization dtype; config.json loses its quantization_config
        (DiffusersQuantizer.dequantize then drops the quantizer)."""
        dtype = model.config.get("_pre_quantization_dtype") if hasattr(model, "config") else None
        dequantize_(model, dtype if isinstance(dtype, torch.dtype) else None, sync=False)
        common.remove_quantization_config(model)
        return model
