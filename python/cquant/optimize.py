"""cquant.optimize / cquant.unoptimize: fused block forwards for diffusers transformers.

    report = cquant.optimize(pipe)                    # or pipe.transformer; before or after quantize_
    print(report)                                     # what got a fused forward, what did not and why
    cquant.optimize(pipe, cuda_graph=True)            # also replay the transformer as CUDA graphs
    cquant.unoptimize(pipe)                           # everything as it was

optimize swaps the class of each block it knows (Flux's double and single blocks, SD3's joint
block, Qwen-Image's block, the final AdaLayerNormContinuous) for a subclass whose forward runs
cquant's fused ops (cquant/blocks). Nothing else changes: module names, parameters, state_dict
keys, isinstance checks, hooks, save/load, deepcopy and pickling see the same model, and each call
the fused forward cannot take (a LoRA-wrapped layer, an attention mask it does not know, a device
libcquant does not run on, autograd, ...) runs the diffusers forward. unoptimize swaps the classes
back. Modules optimize does not know are left alone; those in the model's block lists are
reported with the reason.
"""

from __future__ import annotations

import dataclasses
import types
import warnings
from typing import List, NamedTuple, Optional

import torch

from . import _callable_module
from . import cuda_graph as _graphs
from .shared_activations import unfused_class

__all__ = ["optimize", "unoptimize", "OptimizeReport"]


class Entry(NamedTuple):
    name: str  # the module's name in the transformer
    cls: str  # its (diffusers) class name
    reason: Optional[str] = None  # why it was not fused


@dataclasses.dataclass
class OptimizeReport:
    """What cquant.optimize did: `installed` and `skipped` modules (Entry: name, class, reason),
    whether CUDA-graph replay is on, and notes. print() it for a summary."""

    installed: List[Entry] = dataclasses.field(default_factory=list)
    skipped: List[Entry] = dataclasses.field(default_factory=list)
    cuda_graph: bool = False
    notes: List[str] = dataclasses.field(default_factory=list)

    def __str__(self):
        lines = [f"cquant.optimize: {len(self.installed)} modules fused, {len(self.skipped)} skipped, "
                 f"CUDA graphs {'on' if self.cuda_graph else 'off'}"]
        by_class = {}
        for e in self.installed:
            by_class.setdefault(e.cls, []).append(e.name)
        for cls, names in by_class.items():
            shown = ", ".join(names[:3]) + (f", ... ({len(names)} in all)" if len(names) > 3 else "")
            lines.append(f"  fused    {cls}: {shown}")
        for e in self.skipped:
            lines.append(f"  skipped  {e.name} ({e.cls}): {e.reason}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def transformer_of(obj):
    """The transformer of a pipeline (its .transformer), or obj itself when it is a module."""
    if isinstance(obj, torch.nn.Module):
        return obj
    model = getattr(obj, "transformer", None)
    if isinstance(model, torch.nn.Module):
        return model
    raise TypeError(f"expected a diffusers transformer (torch.nn.Module) or a pipeline with a .transformer, got "
                    f"{type(obj).__name__}")


def _block_lists(model):
    """Names of the model's ModuleLists of blocks (transformer_blocks, single_transformer_blocks, ...)."""
    return {name for name, mod in model.named_modules()
            if isinstance(mod, torch.nn.ModuleList) and name.rsplit(".", 1)[-1].endswith("blocks")}


def _is_reported(name, lists):
    """Whether a module not fused is listed in the report: the blocks of the model's block lists
    and the final norm_out."""
    parent, _, last = name.rpartition(".")
    return (parent in lists and last.isdigit()) or name == "norm_out"


def _rebind_hooks(module, old_cls, new_cls):
    """Point hooks registered on module before its class changed at the new class's forward: they
    hold the bound forward of the class the module had then (diffusers' hook registry in its
    function references, accelerate's add_hook_to_module in module._old_forward). So does the
    module's own `forward` once hooks are removed (both put the forward they held back there).
    Returns whether a hook was left that still holds another forward."""
    if "forward" not in module.__dict__:
        return False

    def rebind(holder, attr):
        f = getattr(holder, attr, None)
        if isinstance(f, types.MethodType) and f.__self__ is module and f.__func__ is old_cls.forward:
            setattr(holder, attr, types.MethodType(new_cls.forward, module))
            return True
        return False

    rebound = rebind(module, "forward")
    rebound = rebind(module, "_old_forward") or rebound
    refs = getattr(getattr(module, "_diffusers_hook", None), "_fn_refs", None)
    for ref in refs or ():
        for attr in ("forward", "original_forward"):
            rebind(ref, attr)
    return refs is None and not rebound


def _swap(module, new_cls):
    old_cls = type(module)
    module.__class__ = new_cls
    return _rebind_hooks(module, old_cls, new_cls)


def optimize(transformer_or_pipeline, *, cuda_graph=False):
    """Install cquant's fused block forwards into a diffusers transformer (or a pipeline's).

    Args:
        transformer_or_pipeline: FluxTransformer2DModel, SD3Transformer2DModel,
            QwenImageTransformer2DModel (or another model made of the same block classes), or a
            pipeline holding one as .transformer. Quantized by cquant.quantize_ or not (float32,
            float16, bfloat16), before or after quantize_; on the CPU or a CUDA device.
        cuda_graph: also replay the transformer's forward from CUDA graphs, one per input
            signature (cquant.cuda_graph); calls that cannot be graphed run eagerly.

    Returns an OptimizeReport. Calling it again is harmless; cquant.unoptimize undoes it.
    """
    if not isinstance(cuda_graph, bool):
        raise TypeError(f"cuda_graph must be True or False, got {cuda_graph!r}")
    model = transformer_of(transformer_or_pipeline)
    try:
        from .blocks import fused_classes
        fused = fused_classes()
    except ImportError as e:
        raise ImportError(f"cquant.optimize needs diffusers ({e})") from e
    report = OptimizeReport()
    lists = _block_lists(model)
    held = []
    for name, mod in model.named_modules():
        base = unfused_class(type(mod))
        cls = fused.get(base)
        only_as = getattr(cls, "_cquant_only_as", None)
        if only_as is not None and name.rpartition(".")[2] != only_as:
            continue  # e.g. an AdaLayerNormContinuous inside a block, which fuses it itself
        if cls is not None:
            reason = None if type(mod) is cls else cls._cquant_refusal(mod)
            if reason is None:
                if type(mod) is not cls and _swap(mod, cls):
                    held.append(name)
                report.installed.append(Entry(name, base.__name__))
            else:
                report.skipped.append(Entry(name, base.__name__, reason))
        elif _is_reported(name, lists):
            known = next((b for b in fused if isinstance(mod, b)), None)
            reason = (f"a subclass of {known.__name__} whose forward cquant has not read" if known is not None
                      else "not a block cquant has a fused forward for")
            report.skipped.append(Entry(name, type(mod).__name__, reason))
    if report.installed:
        from .blocks.common import device_ok

        for device in {p.device for p in model.parameters()}:
            device_ok(device)  # asked now: a torch.compile trace cannot ask libcquant
    if held:
        report.notes.append(f"{len(held)} fused modules have forward hooks of their own that hold the diffusers "
                            f"forward ({held[0]}, ...): remove those hooks and optimize again to fuse them")
    if cuda_graph:
        _graphs.install(model)
        report.cuda_graph = True
    elif _graphs.installed(model) is not None:
        report.cuda_graph = True
    if not report.installed:
        warnings.warn(f"cquant.optimize: {type(model).__name__} has no block cquant has a fused forward for; "
                      "nothing was changed" + (" but CUDA graphs" if cuda_graph else ""), RuntimeWarning, stacklevel=2)
    return report


def unoptimize(transformer_or_pipeline):
    """Undo cquant.optimize: every fused module gets its diffusers class back and the CUDA-graph
    forward (if any) is removed. Returns the names of the modules restored."""
    model = transformer_of(transformer_or_pipeline)
    restored = []
    for name, mod in model.named_modules():
        base = unfused_class(type(mod))
        if base is not type(mod):
            _swap(mod, base)
            restored.append(name)
    _graphs.uninstall(model)
    if restored:
        from .blocks.common import clear_rope_cache

        clear_rope_cache()
    return restored


_callable_module.make_callable(__name__, lambda: optimize)
