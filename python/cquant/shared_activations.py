"""Activations quantized once for the layers of one attention module that read the same input.

An attention processor computes to_q(x), to_k(x) and to_v(x) (and add_q_proj(c), add_k_proj(c),
add_v_proj(c)) from one tensor, one call after another; with a dynamic scheme (int8dq, fp8dq*)
each call would quantize it again. Reusing the codes is only right if nothing writes x between
the calls, and no key on a tensor can show that: inference tensors have no version counter, and
writes through .data, a NumPy array or a DLPack view do not move it. So the codes are shared only
inside a scope where cquant knows every line that runs:

* the forward of an attention module whose processor is one of ALLOWED_PROCESSORS (diffusers'
  processors read here and known to write none of their inputs, and cquant's own);
* the forward of a block in ALLOWED_BLOCKS (Flux's single-stream block, whose proj_mlp reads the
  same normalized input as its attention), while its attention's processor is allowed.

finish_ (cquant.quantize) calls install_scopes, which gives those modules a forward pre-hook that
opens the scope and a forward hook that closes it, also when forward raises (always_call). The
scope is per thread; scopes nest and share one cache (every scope opened is read-only on the
input), which is dropped when the outermost closes. Outside a scope every layer quantizes its own
input. Inside, a hit needs the very same living tensor object (weak reference) with the same data
pointer, shape, strides and dtype, and the same version counter where it has one (not inference
tensors). Never while torch.compile traces, during CUDA-graph capture, or when x needs a
gradient. CQUANT_SHARE_ACTIVATIONS=0 turns sharing off.
"""

from __future__ import annotations

import threading
import weakref

import torch

from . import ops

__all__ = ["install_scopes", "ALLOWED_PROCESSORS", "ALLOWED_BLOCKS", "SCOPE_HOOKS", "scope", "usable", "quantize",
           "unfused_class"]

# Processors whose __call__ computes the projections of one input one after another and writes
# none of its inputs (module.qualname). A processor not listed (IP-adapter processors, custom
# ones, fused-QKV processors that make one call anyway) runs without sharing.
ALLOWED_PROCESSORS = frozenset({
    "diffusers.models.attention_processor.AttnProcessor2_0",
    "diffusers.models.attention_processor.JointAttnProcessor2_0",
    "diffusers.models.attention_processor.CogVideoXAttnProcessor2_0",
    "diffusers.models.transformers.transformer_flux.FluxAttnProcessor",
    "diffusers.models.transformers.transformer_qwenimage.QwenDoubleStreamAttnProcessor2_0",
    "cquant.attention_backend.CQuantAttnProcessor",
    "cquant.attention_backend.CQuantCogVideoXAttnProcessor",
})
# Blocks whose forward was read: nothing writes the tensor its listed layers share; the
# attention submodule named here must have an allowed processor for the scope to open.
ALLOWED_BLOCKS = {
    "diffusers.models.transformers.transformer_flux.FluxSingleTransformerBlock": "attn",
}
_PROJECTIONS = ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj")
_BLOCK_LAYERS = ("proj_mlp",)


def unfused_class(cls):
    """The diffusers class of a block cquant.optimize gave a fused forward (whose fallback is that
    class's forward), else cls itself."""
    return cls.__dict__.get("_cquant_unfused", cls)


def _qualname(cls):
    cls = unfused_class(cls)
    return f"{cls.__module__}.{cls.__qualname__}"


class _Scope(threading.local):
    def __init__(self):
        self.owners = []  # modules whose forward opened the scope, innermost last
        self.entry = None  # (weakref to x, key, (codes, scales))


scope = _Scope()
_allowed_types = {}  # processor type -> bool


def _processor_allowed(processor):
    cls = type(processor)
    ok = _allowed_types.get(cls)
    if ok is None:
        ok = _allowed_types[cls] = _qualname(cls) in ALLOWED_PROCESSORS
    return ok


def _open(module, owner_ok):
    if torch.compiler.is_compiling() or not owner_ok or not ops.settings()["share_activations"]:
        return
    owners = scope.owners
    if module in owners:
        # still listed from a forward that ended without its closing hook (KeyboardInterrupt is
        # not an Exception, so torch skips always_call hooks for it): that scope is stale
        owners.clear()
        scope.entry = None
    owners.append(module)


def _open_attention(module, args):
    if torch.compiler.is_compiling():
        return  # as _open_block: the first call fills _allowed_types, and a guard on it recompiled the model
    _open(module, _processor_allowed(getattr(module, "processor", None)))


def _open_block(module, args):
    if torch.compiler.is_compiling():
        return  # no scope while tracing (_open); and no class lookups for dynamo to trace
    attn = getattr(module, ALLOWED_BLOCKS[_qualname(type(module))], None)
    _open(module, _processor_allowed(getattr(attn, "processor", None)))


def _close(module, args, output):
    owners = scope.owners
    if owners and owners[-1] is module:
        owners.pop()
        if not owners:
            scope.entry = None


# What install_scopes hooks into modules (cquant.blocks lets attention modules keep them).
SCOPE_HOOKS = (_open_attention, _open_block, _close)


def _dynamic_layer(mod):
    """A layer that quantizes its input: cquant's dynamic-scheme layers (a Scheme that is dynamic),
    also inside a PEFT wrapper."""
    scheme = getattr(getattr(mod, "base_layer", mod), "scheme", None)
    return bool(getattr(scheme, "dynamic", False))


def _add_hooks(module, open_hook):
    if any(h is open_hook for h in module._forward_pre_hooks.values()):
        return False
    module.register_forward_pre_hook(open_hook)
    module.register_forward_hook(_close, always_call=True)
    return True


def install_scopes(model):
    """Give the attention modules and blocks of `model` whose dynamic-scheme layers read one input
    the hooks that open and close a sharing scope (idempotent). Returns how many got them."""
    added = 0
    for mod in model.modules():
        if _qualname(type(mod)) in ALLOWED_BLOCKS:
            if any(_dynamic_layer(getattr(mod, n, None)) for n in _BLOCK_LAYERS):
                added += _add_hooks(mod, _open_block)
        elif hasattr(mod, "processor") and any(_dynamic_layer(getattr(mod, n, None)) for n in _PROJECTIONS):
            added += _add_hooks(mod, _open_attention)
    return added


def usable(x, bias):
    """Whether x's codes may be shared now (a scope is open: checked by the caller first). The
    op fed shared codes records no gradient, so neither x nor the bias may need one."""
    if torch.is_grad_enabled() and (x.requires_grad or bias is not None and bias.requires_grad):
        return False
    if torch.compiler.is_compiling():
        return False
    return not (x.is_cuda and torch.cuda.is_current_stream_capturing())


def _forget(ref):
    entry = scope.entry
    if entry is not None and entry[0] is ref:
        scope.entry = None


def _key(x, act_format, act_granularity):
    version = None if x.is_inference() else x._version
    return (x.data_ptr(), x.shape, x.stride(), x.dtype, version, act_format, act_granularity)


def quantize(x, act_format, act_granularity, quantize_op):
    """(codes, scales) of x: the ones made earlier in this scope for the same x, else quantize_op's."""
    key = _key(x, act_format, act_granularity)
    entry = scope.entry
    if entry is not None and entry[0]() is x and entry[1] == key:
        return entry[2]
    scope.entry = None  # drop the previous codes before making new ones
    value = quantize_op(x, act_format, act_granularity)
    scope.entry = (weakref.ref(x, _forget), key, value)
    return value
