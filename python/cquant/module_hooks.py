"""diffusers' hooks on a module that cquant replaces by another one.

diffusers keeps a module's hooks in a HookRegistry at `module._diffusers_hook` and runs them
through an instance `forward` it sets on that module (diffusers/hooks/hooks.py). A new module put
in the old one's slot has neither, so the hooks would stop running without a word. That is where
`enable_parallelism` puts context parallelism (diffusers/hooks/context_parallel.py): the split of
the inputs on the model or some submodules, and the gather of the output on others (Flux's
`proj_out`); without the gather each rank returns only its own shard of the tokens.

A context-parallel hook holds only its plan and config (the split hook also the class whose
forward signature it reads argument positions from, recorded again when it is registered), so
registering the same hook objects on the new module, in the same order, is what
`enable_parallelism` would have done to it. Other hooks may hold state tied to the old module
(layerwise casting casts its weights when registered, group offloading moves them, cache hooks
keep per-module state): cquant does not replace a module that carries one.

torch's own forward and backward hooks (register_forward_hook, register_forward_pre_hook, ...)
move too: the new module takes the old one's hook dicts themselves, so the handles their
registration returned still remove them. An accelerate hook (`_hf_hook`, from add_hook_to_module:
dispatch_model, cpu offloading) wraps the bound forward of the module and holds its device map,
so a module carrying one is not replaced either.
"""

from __future__ import annotations

import inspect
import types

__all__ = ["hook_names", "torch_hook_kinds", "move_refusal", "detach", "attach", "invalidate_caches"]

REGISTRY_ATTR = "_diffusers_hook"  # where diffusers' HookRegistry keeps a module's hooks
ACCELERATE_ATTR = "_hf_hook"  # where accelerate's add_hook_to_module keeps a module's hook
# torch.nn.Module's per-module forward and backward hooks and the flags that go with them
TORCH_HOOK_ATTRS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
                    "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_backward_pre_hooks",
                    "_backward_hooks", "_is_full_backward_hook")
# The dicts that hold every torch hook of a module, and how messages name them: the kwargs and
# always-called variants are in these dicts too (the other attrs only flag their ids).
TORCH_HOOK_KINDS = {"_forward_pre_hooks": "torch forward pre-hook", "_forward_hooks": "torch forward hook",
                    "_backward_pre_hooks": "torch backward pre-hook", "_backward_hooks": "torch backward hook"}


def _registry(module):
    return module.__dict__.get(REGISTRY_ATTR)


def hook_names(module):
    """Names of the diffusers hooks registered on module, in registration order."""
    registry = _registry(module)
    return list(registry._hook_order) if registry is not None else []


def torch_hook_kinds(module):
    """How many of each kind of torch hook module carries, as names ("torch forward hook",
    "2 torch forward pre-hooks"); [] for none."""
    kinds = []
    for attr, kind in TORCH_HOOK_KINDS.items():
        n = len(module.__dict__.get(attr) or ())
        if n:
            kinds.append(kind if n == 1 else f"{n} {kind}s")
    return kinds


def _movable_types():
    try:
        from diffusers.hooks.context_parallel import ContextParallelGatherHook, ContextParallelSplitHook
    except ImportError:
        return None, ()
    return ContextParallelSplitHook, (ContextParallelSplitHook, ContextParallelGatherHook)


def _argument_positions(cls):
    return list(inspect.signature(cls.forward).parameters)[1:]


def _split_arguments(hook):
    """Names of the arguments a split hook splits before the forward runs (the others split outputs)."""
    return [name for name, entry in hook.metadata.items() if not getattr(entry, "split_output", False)]


def move_refusal(module, new_cls):
    """Why the hooks on module cannot move to a new_cls module that replaces it, or None."""
    accelerate = module.__dict__.get(ACCELERATE_ATTR)
    if accelerate is not None:
        return (f"it carries an accelerate hook ({type(accelerate).__name__}, from dispatch_model or cpu offloading) "
                f"that wraps its forward and cannot move to the {new_cls.__name__} replacing it; apply cquant's "
                "change before accelerate's")
    registry = _registry(module)
    if registry is None or not registry.hooks:
        return None
    split_cls, movable = _movable_types()
    fixed = [name for name in registry._hook_order if type(registry.hooks[name]) not in movable]
    if fixed:
        return (f"it carries diffusers hooks ({', '.join(fixed)}) that cannot move to the {new_cls.__name__} "
                "replacing it (cquant moves those of enable_parallelism only); add them after cquant's change")
    old, new = _argument_positions(type(module)), _argument_positions(new_cls)
    for name in registry._hook_order:
        hook = registry.hooks[name]
        if type(hook) is split_cls:
            for arg in _split_arguments(hook):
                if arg not in old or old.index(arg) >= len(new) or new[old.index(arg)] != arg:
                    return (f"its diffusers hook {name} splits the argument {arg!r}, which {new_cls.__name__}'s "
                            f"forward does not take in the same place")
    return None


def detach(module):
    """Take every hook off module, leaving its own forward: diffusers' (the last first, as diffusers
    unwinds them) and torch's forward and backward hooks; returns them for attach."""
    torch_hooks = {attr: module.__dict__[attr] for attr in TORCH_HOOK_ATTRS if module.__dict__.get(attr)}
    registry = _registry(module)
    if registry is None:
        return [], torch_hooks
    hooks = [(name, registry.hooks[name]) for name in registry._hook_order]
    for name, _ in reversed(hooks):
        registry.remove_hook(name, recurse=False)
    del module.__dict__[REGISTRY_ATTR]
    own = module.__dict__.get("forward")  # remove_hook put back the forward the first hook wrapped
    if isinstance(own, types.MethodType) and own.__self__ is module and own.__func__ is type(module).forward:
        del module.__dict__["forward"]
    return hooks, torch_hooks


def attach(module, hooks):
    """Register on module the hooks detach took off another one: torch's before the module's own
    (the same dicts, whose handles still remove them), then diffusers' in order."""
    diffusers_hooks, torch_hooks = hooks
    for attr, taken in torch_hooks.items():
        if isinstance(taken, dict):
            taken.update(module.__dict__.get(attr) or {})
        module.__dict__[attr] = taken
    if not diffusers_hooks:
        return
    from diffusers.hooks.hooks import HookRegistry

    registry = HookRegistry.check_if_exists_or_initialize(module)
    for name, hook in diffusers_hooks:
        registry.register_hook(hook, name)


def invalidate_caches(model):
    """Make every registry of model find its submodules' registries again: each caches the list
    (HookRegistry._get_child_registries, what invalidate_child_registries_cache clears), which
    still names those of the modules replaced."""
    for module in model.modules():
        registry = _registry(module)
        if registry is not None and getattr(registry, "_child_registries_cache", None) is not None:
            registry._child_registries_cache = None
