"""What the diffusers and transformers quantizers share: config handling, loading plans, the
model they keep in step, and reading and checking the checkpoint they load."""

from __future__ import annotations

import copy
import sys
import warnings
import weakref

from .. import checkpoint
from ..quantize import UnmatchedKeysWarning, plan
from .hf_config import CQuantConfig

__all__ = ["own_config", "reject_disk_offload", "safetensors_files", "describe_files", "plan_for_loading",
           "stored_layers", "ModelBound", "read_checkpoint", "check_checkpoint", "CONFIG_LIST", "model_kind",
           "remove_quantization_config"]

# How errors name the layer list a quantized checkpoint's config.json carries.
CONFIG_LIST = "config.json's quantization_config.quantized_layers"


class ModelBound:
    """The model a quantizer keeps the quantization_config of (save_pretrained asks the quantizer,
    which lists the model's current quantized layers).

    The reference is weak, since the model owns its quantizer. A copy of the model gets a
    quantizer bound to the copy: copy.deepcopy rebinds through the deepcopy memo (a quantizer
    copied on its own stays bound to the original model), and pickling (torch.save) stores the
    model itself, which pickle's memo turns into the unpickled model."""

    _model_ref = None

    def bind(self, model):
        self._model_ref = weakref.ref(model)

    @property
    def bound_model(self):
        """The model, or None (never bound, or no longer alive)."""
        return self._model_ref() if self._model_ref is not None else None

    def __deepcopy__(self, memo):
        new = object.__new__(type(self))
        memo[id(self)] = new
        for k, v in self.__dict__.items():
            if k != "_model_ref":
                new.__dict__[k] = copy.deepcopy(v, memo)
        model = self.bound_model
        copied = memo.get(id(model)) if model is not None else None
        if copied is not None:
            new.bind(copied)
        elif self._model_ref is not None:
            new._model_ref = self._model_ref
        return new

    def __getstate__(self):
        state = {k: v for k, v in self.__dict__.items() if k != "_model_ref"}
        state["_model_ref"] = self.bound_model  # the model itself: a weakref cannot be pickled
        return state

    def __setstate__(self, state):
        model = state.pop("_model_ref", None)
        self.__dict__.update(state)
        if model is not None:
            self.bind(model)


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
    tied = getattr(model, "all_tied_weights_keys", None) or {}  # transformers: {target: source} it ties

    def exclude(fqn):
        if qconfig.excluded(fqn):
            return "listed in modules_to_not_convert"
        if any(k in fqn.split(".") for k in skip):
            return "listed in the model's _keep_in_fp32_modules"
        if f"{fqn}.weight" in tied:  # the checkpoint holds no weight of its own for it
            return f"its weight is tied to {tied[f'{fqn}.weight']}"
        return None

    _warn_unmatched_exclusions(model, qconfig)
    return plan(model, qconfig.quant_type, exclude=exclude, allow_meta=True)


def _warn_unmatched_exclusions(model, qconfig):
    """An entry of modules_to_not_convert that names no module (a typo) would leave the layers meant
    float quantized without a word."""
    names = [fqn for fqn, _ in model.named_modules() if fqn]
    unmatched = [m for m in qconfig.modules_to_not_convert or ()
                 if not any(f == m or f.startswith(m + ".") or m in f.split(".") for f in names)]
    if unmatched:
        warnings.warn(f"cquant: {len(unmatched)} entries of modules_to_not_convert name no module of "
                      f"{type(model).__name__}: {', '.join(map(repr, unmatched[:6]))}; entries are module names, "
                      "name prefixes or path components (model.named_modules())", UnmatchedKeysWarning, stacklevel=2)


def read_checkpoint(checkpoint_files, pre_quantized, source):
    """The headers of a checkpoint's safetensors files (None when it has none to read).

    A checkpoint whose files hold cquant codes but whose config.json has no cquant
    quantization_config (so this quantizer was asked to quantize it from a CQuantConfig) is
    refused: its codes would be quantized again as if they were float weights. So is one whose
    config.json says quantized but whose files carry no cquant metadata (cquant has written it
    into every file it saved): config.json's scheme names could not be checked against them."""
    files = safetensors_files(checkpoint_files)
    if not files:
        return None
    stored = checkpoint.read_checkpoint(files, source)
    if pre_quantized and stored.layers is None:
        raise ValueError(f"{source} has no cquant metadata ({checkpoint.META_LAYERS}), but its config.json says it "
                         "holds cquant-quantized layers: the files were not written by cquant's save_pretrained, or "
                         "their metadata was stripped, and their codes cannot be checked against the schemes "
                         "config.json names. Save the quantized model again.")
    if not pre_quantized and stored.layers:
        raise ValueError(f"{source} holds cquant-quantized layers ({len(stored.layers)}, e.g. "
                         f"{next(iter(stored.layers))}), but its config.json has no cquant quantization_config, so "
                         "they would be quantized again as if they were float weights. Restore the quantization_config "
                         "that save_pretrained wrote into config.json and load without quantization_config=.")
    return stored


def check_checkpoint(stored, layers, model):
    """Check the files against config.json's layer list and the model's skeletons (see cquant.checkpoint)."""
    if stored is not None:
        checkpoint.check_checkpoint(stored, layers, model, CONFIG_LIST)


def model_kind(model):
    """"diffusers", "transformers" or None: which library's model this is."""
    dm = sys.modules.get("diffusers.models.modeling_utils")
    if dm is not None and isinstance(model, dm.ModelMixin):
        return "diffusers"
    tm = sys.modules.get("transformers.modeling_utils")
    if tm is not None and isinstance(model, tm.PreTrainedModel):
        return "transformers"
    return None


def remove_quantization_config(model):
    """Make a model whose layers are all float again save as a float model: its config loses
    quantization_config (and diffusers' _pre_quantization_dtype), the model its quantized flags.
    The quantizer itself stays (the libraries' dequantize() removes it)."""
    if model_kind(model) == "diffusers":
        from diffusers.configuration_utils import FrozenDict

        drop = ("quantization_config", "_pre_quantization_dtype")
        model._internal_dict = FrozenDict({k: v for k, v in model._internal_dict.items() if k not in drop})
    elif hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.is_quantized = False
    model.__dict__.pop("quantization_method", None)
