"""Releasing a quantized model: build a tiny Flux with cquant's features, drop its last reference
with the garbage collector off, and name what is still alive (test_model_free*.py).

A reference cycle through a module keeps it and everything under it allocated after `del
model` until the collector next runs; on a GPU that is memory nvidia-smi and the next model
see taken. With the collector off, only reference counting frees, so a cycle shows.
"""

import gc
import inspect
import weakref

import torch

import cquant
import tiny_models as tm

# What a model gets before its forward, in this order (each a cquant entry point that installs
# something on the model's modules).
FEATURES = ("fuse_qkv", "attention", "optimize", "cuda_graph")


def prepare(scheme, features=(), device="cpu", dtype=torch.float32, **config):
    """A tiny quantized Flux on `device` with `features` (a subset of FEATURES) applied, and one
    forward's inputs. quantize_ moves it layer by layer, as a user quantizing onto a GPU does.
    config: constructor arguments of the tiny Flux to change (tiny_models.build)."""
    unknown = set(features) - set(FEATURES)
    if unknown:
        raise ValueError(f"unknown features {sorted(unknown)}; expected some of {FEATURES}")
    model = tm.build("flux", dtype=dtype, **config)
    cquant.quantize_(model, scheme, device=device)
    if "fuse_qkv" in features:
        model.fuse_qkv_projections()  # cquant's fuse_projections: views of one quantized layer
    if "attention" in features:
        cquant.enable_attention(model, "int8" if device != "cpu" else "bf16")
    if "optimize" in features or "cuda_graph" in features:
        cquant.optimize(model, cuda_graph="cuda_graph" in features)
    return model, tm.inputs("flux", dtype=dtype, device=device)


def _is_one_of(obj, objects):
    # a loop, not any(... for ...): a generator would close over obj in a cell, one more referrer
    for o in objects:
        if o is obj:
            return True
    return False


def _name(obj):
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def _describe_referrer(ref, obj, ignore):
    """What `ref` (which refers to obj) is; for a container (a dict, tuple, list or closure cell),
    also what holds the container: e.g. "a tuple held by functools.partial"."""
    if isinstance(ref, dict):
        what = f"a dict (under {[k for k, v in ref.items() if v is obj]})"
    elif isinstance(ref, (tuple, list)) or type(ref).__name__ == "cell":
        what = f"a {type(ref).__name__}"
    else:
        return _name(ref)
    holders = []
    for holder in gc.get_referrers(ref):
        if not _is_one_of(holder, ignore):
            holders.append(_name(holder))
    return f"{what} held by {', '.join(holders[:3]) or 'nothing the collector tracks'}"


def release(box):
    """Drop box[0], the only reference the caller holds to a torch.nn.Module, with the garbage
    collector off. Returns a description of the module and submodules still alive then (the
    outermost ones, each with what refers to it), or "" when everything was freed."""
    model = box.pop()
    refs = {name: weakref.ref(mod) for name, mod in model.named_modules()}
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        del model
        alive = {}
        for name, ref in refs.items():
            if ref() is not None:
                alive[name] = ref()
        lines = []
        ignore = [inspect.currentframe(), alive]  # this function's own references
        for name in list(alive):
            parent = name.rpartition(".")[0] if name else None
            if parent is not None and parent in alive:
                continue  # its parent is listed, which holds it
            mod = alive[name]
            referrers = gc.get_referrers(mod)
            said = []
            for ref in referrers:
                if not _is_one_of(ref, ignore):
                    said.append(_describe_referrer(ref, mod, ignore + [referrers]))
            lines.append(f"{name or 'the model'} ({type(mod).__name__}), referred to by: "
                         f"{'; '.join(said[:4]) or 'nothing the collector tracks'}")
        if lines:
            lines.insert(0, f"{len(alive)} of {len(refs)} modules outlived `del model` (a reference cycle):")
        return "\n".join(lines)
    finally:
        if was_enabled:
            gc.enable()
