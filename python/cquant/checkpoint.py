"""What a quantized checkpoint says about itself, and the checks that loading makes.

A cquant checkpoint is a safetensors file (or shards) holding the state_dict of a model whose
quantized layers store codes ("weight") and fp32 scales ("weight_scale"), with string metadata
written into every file beside the tensors:

    cquant_format_version   cquant's stored-layout version (cquant.FORMAT_VERSION); files of an
                            older version in READABLE_FORMAT_VERSIONS load as they are
    cquant_version          the cquant that wrote it
    cquant_quantized_layers {fqn: scheme name} of every quantized layer (JSON)
    cquant_layer_tensors    {fqn: {"scheme", "in_features", "out_features",
                                   "weight": {"dtype", "shape"}, "weight_scale": {"dtype", "shape"},
                                   and with a low-rank correction "lowrank_up", "lowrank_down"}}
                            what each stored tensor of a quantized layer is (JSON; files written
                            before it was added lack it, and load with the other checks)

Every way of loading one (cquant.load_quantized, and diffusers' and transformers'
from_pretrained through cquant's quantizers) reads the files' headers here before any tensor is
loaded, and checks the list it was given (config.json's quantized_layers), the files' own
metadata and the stored tensors against each other: a layer list edited by hand, a scheme
changed, a tensor missing or replaced is refused with the layer named, instead of loading
wrong codes.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Optional

import torch

from . import ops
from .nn import COMPUTE_DTYPES, LOWRANK, QuantizedLinear, stored_tensors, unwritten_scales
from .quantize import quantized_layers
from .schemes import scheme

__all__ = ["READABLE_FORMAT_VERSIONS", "META_FORMAT_VERSION", "META_VERSION", "META_LAYERS", "META_TENSORS", "metadata", "read_metadata",
           "check_format_version", "stored_layer_names", "layers_from_metadata", "layers_from_names",
           "StoredCheckpoint", "read_checkpoint", "check_checkpoint", "fuse_for_loading", "install_tensor",
           "check_loaded", "check_all_quantized", "refuse_adapter_layers"]

# Keys of the safetensors metadata cquant writes next to a quantized model's tensors.
META_FORMAT_VERSION = "cquant_format_version"
META_VERSION = "cquant_version"
META_LAYERS = "cquant_quantized_layers"
META_TENSORS = "cquant_layer_tensors"

# Stored-layout versions this cquant reads, each with what it cannot hold. Version 1 is version 2
# without the 4-bit formats (int4, uint4) and their group-wise scales, and without low-rank
# corrections (which came with them); version 2 is version 3 without two-level int4 (int4dq_2l).
# Every layout an older version has is unchanged, so its files load as they are.
READABLE_FORMAT_VERSIONS = {1: "group-wise (4-bit) schemes or low-rank corrections",
                            2: "two-level 4-bit schemes (int4dq_2l)", ops.FORMAT_VERSION: None}
# safetensors' header dtype names -> torch's
_HEADER_DTYPES = {"BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16", "I32": "int32",
                  "U32": "uint32", "I64": "int64", "U64": "uint64", "F16": "float16", "BF16": "bfloat16",
                  "F32": "float32", "F64": "float64", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}
# at most this many problems are named in one error
_SHOWN = 6


def _key(fqn, name):
    """The state_dict key of tensor `name` of the module `fqn` ("" is the model itself, a bare layer)."""
    return f"{fqn}.{name}" if fqn else name


def _dtype_name(dtype):
    return str(dtype).removeprefix("torch.")


def _describe(mod):
    """The metadata entry of one quantized layer: its scheme, shape and the tensors it stores."""
    entry = {"scheme": mod.scheme.name, "in_features": mod.in_features, "out_features": mod.out_features}
    for name in mod.expected_shapes():
        t = getattr(mod, name)
        entry[name] = {"dtype": _dtype_name(t.dtype), "shape": list(t.shape)}
    return entry


def metadata(model=None):
    """String metadata for each safetensors file of a quantized model."""
    meta = {META_FORMAT_VERSION: str(ops.FORMAT_VERSION), META_VERSION: ops.VERSION}
    if model is not None:
        meta[META_LAYERS] = json.dumps(quantized_layers(model), sort_keys=True)
        described = {fqn: _describe(model.get_submodule(fqn)) for fqn in quantized_layers(model)}
        meta[META_TENSORS] = json.dumps(described, sort_keys=True, separators=(",", ":"))
    return meta


def _shown(items):
    items = list(items)
    return "; ".join(items[:_SHOWN]) + (f"; ... ({len(items) - _SHOWN} more)" if len(items) > _SHOWN else "")


# ---------------------------------------------------------------- reading headers


def _read_header(path):
    """(string metadata, {key: (dtype name, shape)}) of a safetensors file, without reading tensor data."""
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {}
            for k in f.keys():
                s = f.get_slice(k)
                tensors[k] = (_HEADER_DTYPES.get(s.get_dtype(), s.get_dtype().lower()), tuple(s.get_shape()))
    except Exception as e:
        raise ValueError(f"{path} is not a readable safetensors file ({type(e).__name__}: {e})") from None
    return meta, tensors


def read_metadata(path):
    """The string metadata of a safetensors file ({} when it has none)."""
    from safetensors import safe_open

    try:
        with safe_open(os.fspath(path), framework="pt") as f:
            return f.metadata() or {}
    except Exception as e:
        raise ValueError(f"{path} is not a readable safetensors file ({type(e).__name__}: {e})") from None


def check_format_version(meta, source):
    """Raise a ValueError naming `source` if its metadata says a cquant format version this cquant
    does not read. Returns the version (None when the metadata has none)."""
    if not meta or META_FORMAT_VERSION not in meta:
        return None
    return readable_format_version(meta[META_FORMAT_VERSION], source)


def readable_format_version(found, source):
    """`found` (an int or its string) as an int in READABLE_FORMAT_VERSIONS, else ValueError."""
    try:
        version = int(found)
    except (TypeError, ValueError):
        version = None
    if version not in READABLE_FORMAT_VERSIONS or isinstance(found, bool):
        readable = ", ".join(map(str, sorted(READABLE_FORMAT_VERSIONS)))
        raise ValueError(f"{source} was written with cquant format version {found}; this cquant ({ops.VERSION}) reads "
                         f"format versions {readable}. Install a matching cquant or quantize the float checkpoint "
                         "again.")
    return version


def check_schemes_in_version(layers, version, source):
    """Raise a ValueError if a layer's scheme ({fqn: Scheme or name}) did not exist in format
    `version`: such a file was edited (or written by something else)."""
    lacks = READABLE_FORMAT_VERSIONS.get(version)
    if not lacks:
        return
    newer = [f"{fqn} ({s if isinstance(s, str) else s.name})" for fqn, s in layers.items()
             if _newer_than(version, scheme(s) if isinstance(s, str) else s)]
    if newer:
        raise ValueError(f"{source} says cquant format version {version}, which has no {lacks}, but lists "
                         f"{_shown(newer)}; the file or its config was edited. Save the quantized model again.")


def _newer_than(version, s):
    """Whether Scheme s stores a layout that format `version` does not have."""
    if s.weight_granularity == "two_level":
        return version <= 2
    return version == 1 and (s.weight_granularity not in ("row", "tensor") or s.lowrank_rank > 0)


def _json(meta, key, source):
    try:
        value = json.loads(meta[key])
    except ValueError as e:
        raise ValueError(f"{source}: unreadable {key} metadata ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{source}: {key} metadata is a {type(value).__name__}, not a dict")
    return value


def stored_layer_names(meta, source="checkpoint"):
    """{fqn: scheme name} of the quantized layers a file's metadata lists ({} when none: a float file)."""
    if META_LAYERS in meta:
        return _json(meta, META_LAYERS, source)
    if META_TENSORS in meta:
        return {fqn: d.get("scheme") if isinstance(d, dict) else None
                for fqn, d in _json(meta, META_TENSORS, source).items()}
    return {}


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
    version = check_format_version(meta, source)
    layers = layers_from_names(_json(meta, META_LAYERS, source), source)
    check_schemes_in_version(layers, version, source)
    return layers


@dataclass
class StoredCheckpoint:
    """What the safetensors files of one checkpoint hold, read from their headers alone.

    tensors: {key: (dtype name, shape)} over all files. layers: {fqn: scheme name} the cquant
    metadata lists (None: the files carry no cquant metadata). described: the per-tensor
    metadata {fqn: entry} (None: written before cquant described its tensors)."""

    source: str
    tensors: dict
    layers: Optional[dict] = None
    described: Optional[dict] = None


_FLOAT_NAMES = tuple(_dtype_name(d) for d in COMPUTE_DTYPES)


def _stores(said, shape, dtype):
    """Whether a tensor described as said = (dtype name, shape) is one of shape and dtype (None:
    any compute dtype, as low-rank factors are stored)."""
    return said[1] == tuple(shape) and (said[0] in _FLOAT_NAMES if dtype is None else said[0] == _dtype_name(dtype))


def _describe_expected(shape, dtype):
    return f"{'a float' if dtype is None else _dtype_name(dtype)} {list(shape)}"


def _check_described(described, layers, tensors, source):
    """The per-tensor metadata agrees with the layer list, with its schemes and with the tensors."""
    problems = []
    if set(described) != set(layers):
        diff = sorted(set(described) ^ set(layers))
        problems.append(f"{META_LAYERS} and {META_TENSORS} list different layers ({', '.join(diff[:4])})")
    for fqn, d in described.items():
        try:
            sch = scheme(d["scheme"])
            expected = stored_tensors(sch, int(d["in_features"]), int(d["out_features"]))
            said = {name: (d[name]["dtype"], tuple(d[name]["shape"])) for name in expected}
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{source}: unreadable {META_TENSORS} entry for {fqn} ({type(e).__name__}: {e})") from None
        if layers.get(fqn, sch.name) != sch.name:
            problems.append(f"{fqn} is {layers[fqn]} in {META_LAYERS} but {sch.name} in {META_TENSORS}")
        extra = sorted(set(d) - set(expected) - {"scheme", "in_features", "out_features"})
        if extra:
            problems.append(f"{fqn} is described with {', '.join(extra)}, which a {sch.name} layer does not store")
        for name, (shape, dtype) in expected.items():
            if not _stores(said[name], shape, dtype):
                problems.append(f"{_key(fqn, name)} is described as {said[name][0]} {list(said[name][1])}, which a "
                                f"{sch.name} layer of {d['in_features']} -> {d['out_features']} does not store")
            found = tensors.get(_key(fqn, name))
            if found is not None and found != said[name]:
                problems.append(f"{_key(fqn, name)} is {found[0]} {list(found[1])} in the file, but its metadata says "
                                f"{said[name][0]} {list(said[name][1])}")
    if problems:
        raise ValueError(f"{source}: the file's tensors and its own cquant metadata disagree: {_shown(problems)}. "
                         "The file was edited or damaged; save the quantized model again.")


def read_checkpoint(files, source=None):
    """Read the headers of a checkpoint's safetensors files (every shard) into a StoredCheckpoint.

    Raises ValueError for an unreadable file, another cquant format version, shards whose cquant
    metadata differ (or that only some carry), and metadata that disagrees with itself or with
    the tensors it describes."""
    files = [os.fspath(f) for f in files]
    source = source or (files[0] if len(files) == 1 else f"{files[0]} (+{len(files) - 1} shards)")
    tensors, metas, versions = {}, [], set()
    for f in files:
        meta, header = _read_header(f)
        versions.add(check_format_version(meta, f))
        metas.append((f, {k: meta[k] for k in (META_LAYERS, META_TENSORS) if k in meta}))
        tensors.update(header)
    with_meta = [(f, m) for f, m in metas if m]
    if not with_meta:
        return StoredCheckpoint(source, tensors)
    if len(with_meta) != len(metas):
        bare = next(f for f, m in metas if not m)
        raise ValueError(f"{source}: shard {bare} has no cquant metadata but {with_meta[0][0]} has; the shards come "
                         "from different saves")
    first_file, first = with_meta[0]
    for f, m in with_meta[1:]:
        if m != first:
            raise ValueError(f"{source}: shards {first_file} and {f} list different quantized layers in their cquant "
                             "metadata; the shards come from different saves")
    layers = stored_layer_names(first, first_file)
    if len(versions - {None}) > 1:
        raise ValueError(f"{source}: its shards say different cquant format versions ({sorted(versions - {None})}); "
                         "the shards come from different saves")
    for version in versions - {None}:
        check_schemes_in_version(layers, version, source)
    described = _json(first, META_TENSORS, first_file) if META_TENSORS in first else None
    if described is not None:
        _check_described(described, layers, tensors, source)
    return StoredCheckpoint(source, tensors, layers, described)


# ---------------------------------------------------------------- checks against a model


def _get(model, fqn):
    try:
        return model.get_submodule(fqn)
    except AttributeError:
        return None


def _compare_lists(layers, stored, listed_by, source):
    problems = []
    for fqn in sorted(set(layers) | set(stored)):
        ours, theirs = layers.get(fqn), stored.get(fqn)
        if theirs is None:
            problems.append(f"{fqn} is listed ({ours.name}) but the files hold no quantized layer of that name")
        elif ours is None:
            problems.append(f"{fqn} holds {theirs} codes in the files but is not listed (it would load its codes "
                            "as float weights)")
        elif ours.name != theirs:
            problems.append(f"{fqn} is {ours.name} in the list but {theirs} in the files")
    if problems:
        raise ValueError(f"{source}: {listed_by} and the checkpoint's own cquant metadata disagree: "
                         f"{_shown(problems)}. {listed_by} was edited or belongs to another checkpoint; restore the "
                         "one that was saved with these files.")


def check_checkpoint(stored, layers, model, listed_by):
    """Check a checkpoint's files (a StoredCheckpoint) before loading them into `model`.

    layers: {fqn: Scheme} the loader will build (from `listed_by`, e.g. config.json's
    quantized_layers); `model` holds those layers as QuantizedLinear skeletons already. Refuses,
    with every layer named: a list that disagrees with the files' metadata (set or schemes), a
    stored weight or weight_scale missing or of another dtype or shape than the layer stores
    (float weights where codes belong), a layer described with another shape than the model's,
    and codes with scales stored for a float layer the list leaves out."""
    if stored.layers is not None:
        _compare_lists(layers, stored.layers, listed_by, stored.source)
    missing, wrong, other_model = [], [], []
    for fqn in layers:
        mod = _get(model, fqn)
        if not isinstance(mod, QuantizedLinear):
            other_model.append(f"{fqn} is not a linear layer of this model")
            continue
        d = (stored.described or {}).get(fqn)
        if d is not None and (d["in_features"], d["out_features"]) != (mod.in_features, mod.out_features):
            other_model.append(f"{fqn} is {d['in_features']} -> {d['out_features']} in the file but "
                               f"{mod.in_features} -> {mod.out_features} in this model")
            continue
        expected = stored_tensors(mod.scheme, mod.in_features, mod.out_features)
        for name, (shape, dtype) in expected.items():
            found = stored.tensors.get(_key(fqn, name))
            if found is None:
                missing.append(_key(fqn, name))
            elif not _stores(found, shape, dtype):
                wrong.append(f"{_key(fqn, name)} is {found[0]} {list(found[1])}, but a {mod.scheme.name} layer of "
                             f"{mod.in_features} -> {mod.out_features} stores {_describe_expected(shape, dtype)}")
        bias = stored.tensors.get(_key(fqn, "bias"))
        if bias is not None and (bias[0] not in _FLOAT_NAMES or bias[1] != (mod.out_features,)):
            wrong.append(f"{_key(fqn, 'bias')} is {bias[0]} {list(bias[1])}, but a layer of {mod.in_features} -> "
                         f"{mod.out_features} has a float bias [{mod.out_features}]")
        for name in LOWRANK:
            if name not in expected and _key(fqn, name) in stored.tensors:
                wrong.append(f"{_key(fqn, name)} is in the file, but a {mod.scheme.name} layer has no low-rank correction")
    unlisted = [k.rpartition(".")[0] for k in stored.tensors if k.endswith(".weight_scale")]
    unlisted = [f for f in unlisted if f not in layers and isinstance(_get(model, f), torch.nn.Linear)
                and not isinstance(_get(model, f), QuantizedLinear)]
    problems = []
    if other_model:
        problems.append(f"{_shown(other_model)} (the file belongs to another model)")
    if wrong:
        problems.append(f"{_shown(wrong)} (the file was written with another scheme, model or cquant format version)")
    if missing:
        problems.append(f"it does not hold {_shown(missing)} (the file is incomplete or belongs to another model)")
    if unlisted:
        problems.append(f"it stores quantized codes and scales for {_shown(unlisted)}, which {listed_by} does not list "
                        "(they would load as float weights)")
    if problems:
        raise ValueError(f"{stored.source}: " + "; ".join(problems))


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
    """Put one stored tensor (weight codes, weight_scale or a low-rank factor) of a skeleton in
    place, checked. Low-rank factors are converted to the layer's compute dtype, as its bias."""
    shape, dtype = module.expected_shapes()[name]
    if name in LOWRANK and tensor.dtype in COMPUTE_DTYPES:
        tensor = tensor.to(dtype)
    if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
        raise ValueError(f"{source}: {_key(fqn, name)} is {tensor.dtype} {tuple(tensor.shape)}, but a {module.scheme.name} "
                         f"layer of {module.in_features} -> {module.out_features} stores {dtype} {tuple(shape)}; the "
                         "file was written with another scheme, model or cquant format version")
    tensor = tensor.to(device) if device is not None else tensor
    if name == "weight":
        module.weight = torch.nn.Parameter(tensor, requires_grad=False)
    else:
        setattr(module, name, tensor)


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
                missing.append(_key(fqn, name))
            elif tuple(t.shape) != shape or t.dtype != dtype:
                raise ValueError(f"{source}: {_key(fqn, name)} is {t.dtype} {tuple(t.shape)}, expected {dtype} {shape} for "
                                 f"{mod.scheme.name}")
            elif name == "weight_scale" and (problem := unwritten_scales(mod.scheme, t)):
                raise ValueError(f"{source}: {_key(fqn, name)}: {problem}; the file was edited or damaged")
        if mod.bias is not None and mod.bias.device.type == "meta":
            missing.append(_key(fqn, "bias"))
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


# ---------------------------------------------------------------- saving


def _adapter_layers(model):
    """{fqn: PEFT adapter layer} of the layers an adapter layer wraps (it keeps them as base_layer)."""
    return {fqn: m for fqn, m in model.named_modules()
            if callable(getattr(m, "get_base_layer", None)) and isinstance(getattr(m, "base_layer", None),
                                                                           torch.nn.Module)}


def refuse_adapter_layers(model, what):
    """Raise ValueError, before anything is written, if PEFT adapter layers still wrap layers of
    model: its state_dict would store them as "<layer>.base_layer.weight" beside the adapter's
    tensors, names the model that loads the file does not have."""
    layers = _adapter_layers(model)
    if not layers:
        return
    adapters = sorted({name for m in layers.values() for attr in getattr(m, "adapter_layer_names", ())
                       for name in (getattr(m, attr, None) or {})})
    merged = sorted({name for m in layers.values() for name in getattr(m, "merged_adapters", None) or ()})
    shown = ", ".join(list(layers)[:3]) + (f", ... ({len(layers)} in all)" if len(layers) > 3 else "")
    state = f"merged into them ({', '.join(map(repr, merged))})" if merged else "unmerged"
    raise ValueError(
        f"{what}: the layers of PEFT adapter {', '.join(map(repr, adapters)) or '(unnamed)'} still wrap {shown} "
        f"({state}); they would be saved as '<layer>.base_layer.weight' beside the adapter's tensors, names no "
        "model loading the checkpoint has. Nothing was written. To save the merged model: fuse_lora() or "
        "merge_adapter(), then unload_lora() (PEFT's merge_and_unload() does both). To keep the adapter apart: save "
        "it on its own (peft.utils.get_peft_model_state_dict(model) through the pipeline's save_lora_weights()), "
        "unload_lora(), then save the model")
