"""GELU fused into the quantized linear layer before it.

A diffusion transformer's MLP is linear -> GELU(tanh) -> linear. Run eagerly, the GELU is a pass
of its own over the widest activation of the block (read and write 4 x hidden values a token),
about 3% of a Flux step. cquant's linear op applies the GELU to its fp32 result before rounding
(in cuBLASLt's epilogue or cquant's own), so that pass disappears. fuse_activations_ finds the
places where the GELU provably follows a quantized layer and nothing else reads the layer's
output:

* diffusers' GELU module (FeedForward's first layer: `proj` then gelu, approximate="tanh"), which
  becomes a LinearGELU holding the same `proj` (state_dict keys do not change);
* blocks whose forward computes `self.act_mlp(self.proj_mlp(...))` with act_mlp a
  torch.nn.GELU(approximate="tanh") (Flux, Chroma, HunyuanVideo single-stream blocks): proj_mlp
  takes the GELU and act_mlp becomes an identity.

The GELU moves into the layer only while nothing stands between the two: when the layer's slot
holds something else (PEFT wraps it to add a LoRA branch, which must go inside the GELU), the
fusion undoes itself on the next call and the GELU runs as a module again, until
fuse_activations_ finds the layer alone in its slot once more (the adapter unloaded). unfuse_activations_
puts the original modules back by hand (dequantize_ does it before it dequantizes). A GELU module
that carries hooks (torch's, or diffusers' such as a context-parallel plan's) is left as it is,
since the module replacing it would not run them.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F

from .nn import QuantizedLinear, QuantizedLinearSlice
from .shared_activations import unfused_class

__all__ = ["fuse_activations_", "unfuse_activations_", "LinearGELU"]

GELU_TANH = "gelu_tanh"
_ORIGINAL_ACT = "_cquant_act_mlp"  # where a block keeps the act_mlp it had before fusion


class LinearGELU(torch.nn.Module):
    """diffusers' GELU module (proj, then gelu with approximate="tanh") with the GELU fused into proj."""

    def __init__(self, original):
        super().__init__()
        self.proj = original.proj
        self.approximate = original.approximate
        self.__dict__["_original"] = original  # restored by unfuse_activations_; not a submodule
        self.__dict__["_fused"] = self.proj  # the layer that applies the GELU while it sits in `proj`
        self.proj.activation = GELU_TANH

    def forward(self, hidden_states):
        fused = self.__dict__["_fused"]
        if fused is not None and self.proj is not fused:  # wrapped or replaced: the GELU goes outside again
            fused.activation = None
            self.__dict__["_fused"] = fused = None
        out = self.proj(hidden_states)
        return out if fused is not None else F.gelu(out, approximate=self.approximate)

    def fuse_again(self):
        """Move the GELU into proj again where it went out (an adapter wrapped proj and was unloaded
        since, leaving the same quantized layer); returns whether it did."""
        if self.__dict__["_fused"] is not None or self.approximate != "tanh" or not _fusable_layer(self.proj):
            return False
        self.__dict__["_fused"] = self.proj
        self.proj.activation = GELU_TANH
        return True

    def unfused(self):
        """The original GELU module, around the same (now activation-free) proj."""
        if self.__dict__["_fused"] is not None:
            self.__dict__["_fused"].activation = None
        original = self.__dict__["_original"]
        original.proj = self.proj
        return original


def _fusable_layer(mod):
    return isinstance(mod, QuantizedLinear) and not isinstance(mod, QuantizedLinearSlice) and mod.activation is None


def _unhooked(mod):
    """No hooks on mod (torch's, or diffusers' which run through an instance forward): replacing it
    by another module would drop them without a word."""
    return not (mod._forward_hooks or mod._forward_pre_hooks or "forward" in mod.__dict__)


def _is_diffusers_gelu(mod):
    cls = type(mod)
    return (cls.__name__ == "GELU" and cls.__module__ == "diffusers.models.activations"
            and getattr(mod, "approximate", None) == "tanh" and _fusable_layer(getattr(mod, "proj", None))
            and _unhooked(mod))


def _forward_applies_act_mlp_to_proj_mlp(cls):
    """Whether cls.forward uses act_mlp exactly once, as act_mlp(proj_mlp(...))."""
    try:
        src = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False
    src = "".join(src.split())  # whitespace-free
    return src.count("self.act_mlp(") == 1 and "self.act_mlp(self.proj_mlp(" in src and src.count("act_mlp") == 1


def _is_mlp_block(mod):
    act = getattr(mod, "act_mlp", None)
    return (isinstance(act, torch.nn.GELU) and type(act) is torch.nn.GELU and act.approximate == "tanh"
            and _unhooked(act) and _fusable_layer(getattr(mod, "proj_mlp", None))
            and _forward_applies_act_mlp_to_proj_mlp(unfused_class(type(mod))))


def fuse_activations_(model):
    """Fuse each tanh GELU that follows a quantized linear layer into the layer; returns the fused layers' names."""
    fused = []
    for prefix, parent in list(model.named_modules()):
        join = (lambda n: f"{prefix}.{n}") if prefix else (lambda n: n)
        for name, child in list(parent._modules.items()):
            if child is not None and _is_diffusers_gelu(child):
                parent._modules[name] = LinearGELU(child)
                fused.append(join(f"{name}.proj"))
            elif isinstance(child, LinearGELU) and child.fuse_again():
                fused.append(join(f"{name}.proj"))
        if _is_mlp_block(parent):
            parent.__dict__[_ORIGINAL_ACT] = (parent.act_mlp, parent.proj_mlp)
            parent.proj_mlp.activation = GELU_TANH
            parent.act_mlp = torch.nn.Identity()
            if not any(h is _check_mlp_block for h in parent._forward_pre_hooks.values()):
                parent.register_forward_pre_hook(_check_mlp_block)
            fused.append(join("proj_mlp"))
    return fused


def _unfuse_mlp_block(block):
    act, layer = block.__dict__.pop(_ORIGINAL_ACT)
    layer.activation = None
    block.act_mlp = act


def _check_mlp_block(block, args):
    """Forward pre-hook of a fused block: undo the fusion once proj_mlp is no longer the fused layer."""
    state = block.__dict__.get(_ORIGINAL_ACT)
    if state is not None and block.proj_mlp is not state[1]:
        _unfuse_mlp_block(block)


def unfuse_activations_(model):
    """Undo fuse_activations_: the GELUs run as modules of their own again."""
    for parent in list(model.modules()):
        for name, child in list(parent._modules.items()):
            if isinstance(child, LinearGELU):
                parent._modules[name] = child.unfused()
        if _ORIGINAL_ACT in parent.__dict__:
            _unfuse_mlp_block(parent)
    return model
