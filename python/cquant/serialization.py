"""Save and load quantized modules as safetensors, for models outside diffusers / transformers.

(diffusers and transformers models use their own save_pretrained / from_pretrained, which go
through cquant's quantizers and write the same metadata.)

    cquant.save_quantized(model, "model.safetensors")
    model = build_float_model_on_meta_or_cpu()
    cquant.load_quantized(model, "model.safetensors", device="cuda")

The file holds every tensor of model.state_dict() (codes, fp32 scales, biases and the float
layers), and string metadata: cquant's format version, the scheme of every quantized layer and
what each of its stored tensors is (cquant.checkpoint), so loading rebuilds exactly those layers
without creating their float weights, and refuses a file whose tensors disagree with it.
Tensors tied together (an embedding shared with an output head) are stored once, under the first
of their names; META_TIED maps each other name to it.
"""

from __future__ import annotations

import copy
import json
import os

import torch

from . import checkpoint
from .nn import QuantizedLinear
from .quantize import finish_, swap_in

__all__ = ["save_quantized", "load_quantized", "META_TIED"]

# Metadata key of {name: name it is stored under} for the tied tensors of a file (JSON).
META_TIED = "cquant_tied"


def save_quantized(model, path, *, metadata=None):
    """Write model's state_dict and cquant's metadata to a safetensors file (no pickle)."""
    from safetensors.torch import save_file

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    checkpoint.refuse_adapter_layers(model, f"cannot save {type(model).__name__} to {os.fspath(path)!r}")
    meta = dict(metadata or {})
    meta.update(checkpoint.metadata(model))
    state = {k: v.detach() for k, v in model.state_dict().items()}
    tied = _tied(state)
    if tied:
        meta[META_TIED] = json.dumps(tied, sort_keys=True)
    state = {k: v.contiguous() for k, v in state.items() if k not in tied}
    save_file(state, os.fspath(path), metadata=meta)


def _tied(state):
    """{name: first name} of the tensors of `state` that are the same view of the same memory as
    an earlier one (safetensors refuses to store shared memory twice)."""
    first, tied = {}, {}
    for k, v in state.items():
        if v.device.type == "meta":
            continue
        view = (v.device, v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape), v.stride(), v.dtype)
        if view in first:
            tied[k] = first[view]
        else:
            first[view] = k
    return tied


def _in_model_dtypes(model, state):
    """The file's float tensors in the dtypes of the model's own, as load_state_dict without
    assign=True copies them: the quantized layers compute in the model's dtype, and the float
    layers must match. A quantized layer's codes and scales are left as stored, for the checks."""
    own = model.state_dict(keep_vars=True)
    out = {}
    for k, t in state.items():
        mine = own.get(k)
        owner = k.rpartition(".")
        if (mine is not None and t.is_floating_point() and mine.is_floating_point() and t.dtype != mine.dtype
                and (owner[2] == "bias" or not isinstance(_submodule(model, owner[0]), QuantizedLinear))):
            t = t.to(mine.dtype)
        out[k] = t
    return out


def _submodule(model, fqn):
    try:
        return model.get_submodule(fqn)
    except AttributeError:
        return None


def _untie(state, meta, path):
    """Put the tied tensors a file stores once back under each of their names."""
    if META_TIED not in meta:
        return state
    try:
        tied = json.loads(meta[META_TIED])
    except ValueError as e:
        raise ValueError(f"{path}: unreadable {META_TIED} metadata ({e})") from None
    if not isinstance(tied, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in tied.items()):
        raise ValueError(f"{path}: {META_TIED} metadata is not a dict of tensor name -> stored tensor name")
    absent = sorted(v for v in tied.values() if v not in state)
    if absent:
        raise ValueError(f"{path}: {META_TIED} names tensors the file does not hold ({', '.join(absent[:5])}); the "
                         "file was edited or damaged")
    return dict(state, **{k: state[v] for k, v in tied.items() if k not in state})


def load_quantized(model, path, *, device=None, strict=True):
    """Load a file written by save_quantized into `model` (its float architecture), turning the
    layers the file lists into QuantizedLinear first. Returns the model. A model built on the meta
    device works when every tensor it needs is in the file (no non-persistent buffers). Float
    tensors take the model's dtypes (the quantized layers compute in the dtype of its first float
    parameter), as load_state_dict copies them.

    Raises ValueError for files that are not cquant checkpoints, were written with another format
    version, disagree with their own metadata, or do not match the model (missing, extra or
    differently shaped tensors, codes stored for a layer the metadata does not list); the model
    is then left as it was.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    path = os.fspath(path)
    if device is not None:
        device = torch.device(device)
        torch.empty(0, device=device)  # a device this torch cannot use says so now, not as a damaged file
    before = _snapshot(model)
    try:
        return _load(model, path, device, strict)
    except BaseException:
        _restore(before)  # the float layers swapped for skeletons, tensors assigned before the error
        raise


def _snapshot(model):
    """What puts `model` back as it was: each module's class and attributes, with copies of the
    tables that loading edits in place (parameters, buffers, submodules, hooks; no tensor is copied)."""
    snap = []
    for mod in model.modules():
        state = {k: copy.copy(v) if isinstance(v, (dict, set)) else v for k, v in mod.__dict__.items()}
        snap.append((mod, type(mod), state))
    return snap


def _restore(snap):
    for mod, cls, state in snap:
        mod.__dict__.clear()
        mod.__dict__.update(state)
        mod.__class__ = cls


def _load(model, path, device, strict):
    from safetensors import safe_open

    stored = checkpoint.read_checkpoint([path])
    if stored.layers is None:
        checkpoint.layers_from_metadata({}, path)  # raises: not a cquant checkpoint
    layers = checkpoint.layers_from_names(stored.layers, path)
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    checkpoint.fuse_for_loading(model, layers)
    swap_in(model, layers, dtype=dtype, empty=True)
    finish_(model)
    checkpoint.check_checkpoint(stored, layers, model, "its cquant metadata")
    dev = str(device) if device is not None else "cpu"
    try:
        with safe_open(path, framework="pt", device=dev) as f:
            state = {k: f.get_tensor(k) for k in f.keys()}
            meta = f.metadata() or {}
    except Exception as e:
        raise ValueError(f"{path}: cannot read its tensors ({type(e).__name__}: {e}); the file is damaged") from None
    state = _in_model_dtypes(model, _untie(state, meta, path))
    try:
        model.load_state_dict(state, strict=strict, assign=True)
    except RuntimeError as e:
        raise ValueError(f"{path} does not match this model: {e}") from None
    checkpoint.check_loaded(model, layers, path)
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.device.type == "meta"]
    if left:
        raise ValueError(f"{path} does not hold {', '.join(left[:5])}, which are still on the meta device "
                         "(non-persistent buffers are not saved: build the model on a real device before loading)")
    if device is not None:
        model.to(device)
    return model
