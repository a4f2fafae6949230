"""What the diffusers and transformers quantizers share: planning, skeletons, checks, metadata."""

from __future__ import annotations

import copy
import json
import warnings

import torch

from .. import _C
from ..nn import COMPUTE_DTYPES, QuantizedLinear, QuantizedLinearSlice
from ..quantize import REPORT_ATTR, _plan, _warn_skipped

# Keys of the safetensors metadata cquant writes next to a quantized model's tensors.
META_FORMAT_VERSION = "cquant_format_version"
META_VERSION = "cquant_version"
META_LAYERS = "cquant_quantized_layers"


def quantized_layers(model):
    """{fqn: scheme name} of the layers that store codes (views of fused layers excluded)."""
    out = {}
    for fqn, mod in model.named_modules():
        if isinstance(mod, QuantizedLinear) and not isinstance(mod, QuantizedLinearSlice):
            out[fqn] = mod.scheme.name
    return out


def checkpoint_metadata(model=None):
    """String metadata for each safetensors file of a quantized model."""
    meta = {META_FORMAT_VERSION: str(_C.FORMAT_VERSION), META_VERSION: _C.VERSION}
    if model is not None:
        meta[META_LAYERS] = json.dumps(quantized_layers(model), sort_keys=True)
    return meta


def check_checkpoint_metadata(metadata, source):
    """Raise a ValueError naming `source` if its metadata says another cquant format version."""
    if not metadata or META_FORMAT_VERSION not in metadata:
        return
    found = metadata[META_FORMAT_VERSION]
    if found != str(_C.FORMAT_VERSION):
        raise ValueError(f"{source} was written with cquant format version {found}; this cquant ({_C.VERSION}) reads "
                         f"format version {_C.FORMAT_VERSION}. Install a matching cquant or quantize the float "
                         "checkpoint again.")


def read_safetensors_metadata(path):
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt") as f:
            return f.metadata() or {}
    except Exception as e:
        raise ValueError(f"{path} is not a readable safetensors file ({type(e).__name__}: {e})") from None


def own_config(quantization_config):
    """The quantizer's own copy of its CQuantConfig (a dict is parsed). The same config object may
    serve several models (a PipelineQuantizationConfig), and loading writes quantized_layers."""
    from .hf_config import CQuantConfig

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
    from ..configs import scheme_from_name

    if qconfig.quantized_layers is None:
        raise ValueError("this checkpoint's quantization_config (cquant) has no quantized_layers; it was not "
                         "written by cquant's save_pretrained")
    return {fqn: scheme_from_name(s) for fqn, s in qconfig.quantized_layers.items()}


def check_all_quantized(model, layers, source):
    """Raise a ValueError if a layer planned for quantization got no float weight while loading."""
    unquantized = [f for f in layers if not isinstance(model.get_submodule(f), QuantizedLinear)]
    if unquantized:
        raise ValueError(f"{source} has no weights for {len(unquantized)} layers cquant planned to quantize: "
                         f"{unquantized[:5]}")


def plan_for_loading(model, qconfig, keep_in_fp32=()):
    """{fqn: Scheme} to quantize while loading float weights, and the report of the other layers."""
    skip = list(keep_in_fp32 or ())

    def exclude(fqn):
        return qconfig.excluded(fqn) or any(k in fqn.split(".") for k in skip)

    plan, report = _plan(model, qconfig.quant_type, None, None, exclude=exclude, allow_meta=True)
    return {fqn: scheme for fqn, _, scheme in plan}, report


def _parent(model, fqn):
    if "." in fqn:
        parent_name, name = fqn.rsplit(".", 1)
        return model.get_submodule(parent_name), name
    return model, fqn


def compute_dtype_for(mod, dtype):
    if dtype in COMPUTE_DTYPES:
        return dtype
    w = getattr(mod, "weight", None)
    if isinstance(w, torch.Tensor) and w.dtype in COMPUTE_DTYPES:
        return w.dtype
    return torch.bfloat16


def fuse_for_loading(model, layers):
    """Before a fused quantized checkpoint loads: fuse the (meta) model as it was when saved."""
    missing = [fqn for fqn in layers if _get(model, fqn) is None]
    if not missing:
        return
    fuse = getattr(model, "fuse_qkv_projections", None)
    fused_names = ("to_qkv", "to_kv", "to_added_qkv")
    if not callable(fuse) or not all(fqn.rpartition(".")[2] in fused_names for fqn in missing):
        raise ValueError(f"the checkpoint stores layers this model does not have: {missing[:5]}; it belongs to "
                         "another model")
    fuse()
    still = [fqn for fqn in layers if _get(model, fqn) is None]
    if still:
        raise ValueError(f"the checkpoint stores layers this model does not have, even fused: {still[:5]}")


def _get(model, fqn):
    try:
        return model.get_submodule(fqn)
    except AttributeError:
        return None


def build_skeletons(model, layers, dtype):
    """Replace the named torch.nn.Linear layers by empty QuantizedLinear on the meta device."""
    from ..fusion import install_fusion, slice_unfused

    for fqn, scheme in layers.items():
        mod = _get(model, fqn)
        if not isinstance(mod, torch.nn.Linear):
            raise ValueError(f"the checkpoint quantized {fqn!r} with {scheme.name}, but in this model it is "
                             f"{type(mod).__name__ if mod is not None else 'missing'}, not a torch.nn.Linear")
        if isinstance(mod, QuantizedLinear):
            continue
        parent, name = _parent(model, fqn)
        setattr(parent, name, QuantizedLinear(mod.in_features, mod.out_features, scheme, bias=mod.bias is not None,
                                              device="meta", dtype=compute_dtype_for(mod, dtype)))
    slice_unfused(model)
    install_fusion(model)
    from ..activation_fusion import fuse_activations_

    fuse_activations_(model)


def check_loaded(model, layers, source):
    """Raise a ValueError if a quantized layer did not get its stored tensors from the checkpoint."""
    missing = []
    for fqn in layers:
        mod = _get(model, fqn)
        if not isinstance(mod, QuantizedLinear):
            missing.append(f"{fqn} (not quantized)")
            continue
        for name, (shape, dtype) in mod.expected_shapes().items():
            t = getattr(mod, name)
            if t.device.type == "meta":
                missing.append(f"{fqn}.{name}")
            elif tuple(t.shape) != shape or t.dtype != dtype:
                raise ValueError(f"{source}: {fqn}.{name} is {t.dtype} {tuple(t.shape)}, expected {dtype} {shape} for "
                                 f"{mod.scheme.name}")
        if mod.bias is not None and mod.bias.device.type == "meta":
            missing.append(f"{fqn}.bias")
    if missing:
        shown = ", ".join(missing[:6]) + (f", ... ({len(missing) - 6} more)" if len(missing) > 6 else "")
        raise ValueError(f"{source} does not hold the quantized tensors of {len(missing)} layer tensors: {shown}; the "
                         "file is incomplete or belongs to another model")


def install_tensor(module, name, tensor, device, fqn, source):
    """Put one stored tensor (weight codes or weight_scale) of a skeleton in place, checked."""
    shape, dtype = module.expected_shapes()[name]
    if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
        raise ValueError(f"{source}: {fqn}.{name} is {tensor.dtype} {tuple(tensor.shape)}, but a {module.scheme.name} "
                         f"layer of {module.in_features} -> {module.out_features} stores {dtype} {tuple(shape)}; the "
                         "file was written with another scheme, model or cquant format version")
    tensor = tensor.to(device) if device is not None else tensor
    if name == "weight":
        module.weight = torch.nn.Parameter(tensor, requires_grad=False)
    else:
        module.weight_scale = tensor


def record(model, report):
    """Store quantize_'s per-layer report on a model quantized while loading, and warn about skips."""
    model.__dict__[REPORT_ATTR] = dict(report)
    n_linear = sum(1 for m in model.modules() if isinstance(m, torch.nn.Linear))
    _warn_skipped(report, n_linear)


def attach(model, config, kind):
    """Make a quantize_-d diffusers / transformers model saveable with save_pretrained."""
    from .hf_config import CQuantConfig

    layers = quantized_layers(model)
    existing = getattr(getattr(model, "hf_quantizer", None), "quantization_config", None)
    if not layers:
        if isinstance(existing, CQuantConfig):
            detach(model, kind)
        return
    if isinstance(existing, CQuantConfig):
        qconfig = existing
    else:
        if getattr(model, "hf_quantizer", None) is not None:
            warnings.warn(f"{type(model).__name__} already has a {type(existing).__name__} quantizer; cquant replaces "
                          "it for save_pretrained", stacklevel=3)
        try:
            qconfig = CQuantConfig(config if config is not None else "int8wo")
        except TypeError:
            qconfig = CQuantConfig("int8wo")
    qconfig.quantized_layers = layers
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


def detach(model, kind):
    from .hf_config import CQuantConfig

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
