"""What a quantized checkpoint says about itself, and the checks that loading makes.

A cquant checkpoint is a safetensors file (or shards) holding the state_dict of a model whose
quantized layers store codes ("weight") and fp32 scales ("weight_scale"), with string metadata
written beside the tensors: cquant's format version and the scheme of every quantized layer.
Every way of loading one (cquant.load_quantized, and diffusers' and transformers'
from_pretrained through cquant's quantizers) reads and checks it here.
"""

from __future__ import annotations

import json

import torch

from . import ops
from .nn import QuantizedLinear
from .quantize import quantized_layers
from .schemes import scheme

__all__ = ["META_FORMAT_VERSION", "META_VERSION", "META_LAYERS", "metadata", "read_metadata", "check_format_version",
           "layers_from_metadata", "layers_from_names", "fuse_for_loading", "install_tensor", "check_loaded",
           "check_all_quantized"]

# Keys of the safetensors metadata cquant writes next to a quantized model's tensors.
META_FORMAT_VERSION = "cquant_format_version"
META_VERSION = "cquant_version"
META_LAYERS = "cquant_quantized_layers"


def metadata(model=None):
    """String metadata for each safetensors file of a quantized model."""
    meta = {META_FORMAT_VERSION: str(ops.FORMAT_VERSION), META_VERSION: ops.VERSION}
    if model is not None:
        meta[META_LAYERS] = json.dumps(quantized_layers(model), sort_keys=True)
    return meta


def read_metadata(path):
    """The string metadata of a safetensors file ({} when it has none)."""
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt") as f:
            return f.metadata() or {}
    except Exception as e:
        raise ValueError(f"{path} is not a readable safetensors file ({type(e).__name__}: {e})") from None


def check_format_version(meta, source):
    """Raise a ValueError naming `source` if its metadata says another cquant format version."""
    if not meta or META_FORMAT_VERSION not in meta:
        return
    found = meta[META_FORMAT_VERSION]
    if found != str(ops.FORMAT_VERSION):
        raise ValueError(f"{source} was written with cquant format version {found}; this cquant ({ops.VERSION}) reads "
                         f"format version {ops.FORMAT_VERSION}. Install a matching cquant or quantize the float "
                         "checkpoint again.")


def layers_from_names(names, source):
    """{fqn: Scheme} of a {fqn: scheme name} listing (a config's quantized_layers or the metadata's)."""
    if not isinstance(names, dict):
        raise ValueError(f"{source}: the list of quantized layers is a {type(names).__name__}, not a dict of module "
                         "name -> scheme name")
    try:
        return {fqn: scheme(name) for fqn, name in names.items()}
    except (TypeError, ValueError) as e:
        raise ValueError(f"{source}: unreadable list of quantized layers ({e})") from None


def layers_from_metadata(meta, source):
    """{fqn: Scheme} a file's metadata lists; ValueError if it is not a cquant checkpoint."""
    if META_FORMAT_VERSION not in meta or META_LAYERS not in meta:
        raise ValueError(f"{source} has no cquant metadata ({META_FORMAT_VERSION}, {META_LAYERS}); it was not written "
                         "by cquant")
    check_format_version(meta, source)
    try:
        names = json.loads(meta[META_LAYERS])
    except ValueError as e:
        raise ValueError(f"{source}: unreadable {META_LAYERS} metadata ({e})") from None
    return layers_from_names(names, source)


def _get(model, fqn):
    try:
        return model.get_submodule(fqn)
    except AttributeError:
        return None


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


def check_all_quantized(model, layers, source):
    """Raise a ValueError if a layer planned for quantization got no float weight while loading."""
    unquantized = [f for f in layers if not isinstance(model.get_submodule(f), QuantizedLinear)]
    if unquantized:
        raise ValueError(f"{source} has no weights for {len(unquantized)} layers cquant planned to quantize: "
                         f"{unquantized[:5]}")
