"""Batch (CFG) parallelism for diffusers transformers: each rank runs one slice of the batch.

    # torchrun --nproc-per-node 2 app.py   (one process per GPU; several nodes work the same way)
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    torch.distributed.init_process_group("nccl")        # gloo on the CPU
    cquant.enable_batch_parallel(pipe.transformer)       # or the pipeline; group=... for a subgroup
    image = pipe(prompt, generator=torch.Generator().manual_seed(0)).images[0]   # on every rank

Pipelines with classifier-free guidance (SD3, CogVideoX, PixArt-Sigma, ...) concatenate the
unconditional and the conditional inputs into one batch of 2b and call the transformer once a
step. Once enabled, rank r of a group of W ranks runs the model's forward on rows
[r*B/W, (r+1)*B/W) of that batch (B = hidden_states.shape[0]; on 2 ranks, one guidance branch
each) and one all_gather along dim 0 gives every rank the whole output, in the type the forward
returns (a tuple with return_dict=False, else the model's output dataclass). Every rank must
call the model with the same inputs (the same prompt and seed), as with diffusers' context
parallelism: each contributes its slice of its own copy of them.

Which arguments are per sample is written down per model family (FAMILIES), not guessed from
shapes: Flux's img_ids / txt_ids ([seq, 3]) and CogVideoX's rotary embedding have a first
dimension that is not the batch. A per-sample tensor with one row (or none) is broadcast by the
model, so every rank keeps it whole. A batch that does not split evenly over the group (batch 1,
guidance off) runs whole on every rank, with a warning once per model: the right result, no
speed-up.

The split and the gather are a forward pre-hook and a forward hook on the model (torch's
register_forward_pre_hook / register_forward_hook), so they sit outside whatever replaces the
model's forward, in either order: diffusers' hooks, accelerate's offloading, cquant.optimize's
CUDA graphs (which then capture one slice's forward and never the collective). quantize_ and
optimize change layers and blocks inside and compose in either order. The gathered output
carries no autograd history: this is for inference (torch.no_grad, torch.inference_mode).
"""

from __future__ import annotations

import dataclasses
import inspect
import warnings

import torch

from .optimize import transformer_of

__all__ = ["enable_batch_parallel", "disable_batch_parallel", "FAMILIES"]

ROWS = "rows"  # a tensor whose dim 0 is the batch, or a list / tuple of such tensors
ITEMS = "items"  # a Python list with one entry per sample
WHOLE = "whole"  # the same for every sample: each rank passes it on unchanged

# The arguments of each model family's forward (diffusers 0.42.1). A dict describes the entries
# of a dict argument; its other entries (a LoRA scale, ...) are passed on unchanged.
FAMILIES = {
    "FluxTransformer2DModel": dict(
        hidden_states=ROWS, encoder_hidden_states=ROWS, pooled_projections=ROWS, timestep=ROWS,
        img_ids=WHOLE, txt_ids=WHOLE,  # [seq, 3] positions (a deprecated [1, seq, 3] is read as its [0])
        guidance=ROWS, joint_attention_kwargs={"ip_adapter_image_embeds": ROWS},
        controlnet_block_samples=ROWS, controlnet_single_block_samples=ROWS,  # lists of [B, seq, dim]
        return_dict=WHOLE, controlnet_blocks_repeat=WHOLE),
    "SD3Transformer2DModel": dict(
        hidden_states=ROWS, encoder_hidden_states=ROWS, pooled_projections=ROWS, timestep=ROWS,
        block_controlnet_hidden_states=ROWS, joint_attention_kwargs={"ip_adapter_image_embeds": ROWS},
        return_dict=WHOLE, skip_layers=WHOLE),
    "CogVideoXTransformer3DModel": dict(
        hidden_states=ROWS, encoder_hidden_states=ROWS, timestep=ROWS, timestep_cond=ROWS, ofs=ROWS,
        image_rotary_emb=WHOLE,  # (cos, sin), each [seq, head_dim]
        attention_kwargs=WHOLE, return_dict=WHOLE),
    "PixArtTransformer2DModel": dict(
        hidden_states=ROWS, encoder_hidden_states=ROWS, timestep=ROWS,
        added_cond_kwargs={"resolution": ROWS, "aspect_ratio": ROWS}, cross_attention_kwargs=WHOLE,
        attention_mask=ROWS, encoder_attention_mask=ROWS, return_dict=WHOLE),
    "QwenImageTransformer2DModel": dict(
        hidden_states=ROWS, encoder_hidden_states=ROWS, encoder_hidden_states_mask=ROWS, timestep=ROWS,
        img_shapes=ITEMS,  # one list of (frames, height, width) per sample
        guidance=ROWS, attention_kwargs=WHOLE, controlnet_block_samples=ROWS, additional_t_cond=ROWS,
        return_dict=WHOLE),
}

STATE_ATTR = "_cquant_batch_parallel"  # where an enabled model keeps its _BatchParallel


def _family(model):
    """(diffusers class, argument description) of model; TypeError where it is not known."""
    cls = next((c for c in type(model).__mro__ if c.__name__ in FAMILIES and c.__module__.startswith("diffusers.")),
               None)
    if cls is None:
        raise TypeError(f"model: batch parallelism knows which arguments are per sample for {', '.join(FAMILIES)}; "
                        f"got a {type(model).__name__}")
    if type(model).forward is not cls.forward:
        raise TypeError(f"model: {type(model).__name__} is a {cls.__name__} with a forward of its own, whose "
                        "per-sample arguments are not known")
    spec = FAMILIES[cls.__name__]
    unknown = [n for n in list(inspect.signature(cls.forward).parameters)[1:] if n not in spec]
    if unknown:  # another diffusers version: an argument nobody has said is per sample or not
        raise TypeError(f"model: {cls.__name__}.forward of this diffusers takes {', '.join(map(repr, unknown))}, not "
                        "known to batch parallelism as per sample or not (described: diffusers 0.42.1)")
    return cls, spec


def _group(group):
    """(group, rank in it, its size) of `group` (None: the world), with the process group checked."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("batch parallelism needs torch.distributed initialized on every rank first "
                           "(torch.distributed.init_process_group, e.g. 'nccl' under torchrun or 'gloo' on the CPU)")
    if group is None:
        group = dist.group.WORLD
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError("group: this process is not a member of it (torch.distributed.new_group returns a "
                         "placeholder to the ranks it leaves out)")
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed.ProcessGroup or None (the world), got {type(group).__name__}")
    return group, dist.get_rank(group), dist.get_world_size(group)


def _split(value, kind, name, start, rows, batch):
    """This rank's part of one argument: rows [start, start + rows) of a batch of `batch`."""
    if value is None or kind == WHOLE:
        return value
    if isinstance(kind, dict):
        if not isinstance(value, dict) or not any(k in value for k in kind):
            return value  # the caller's own dict where nothing in it is per sample
        return {k: _split(v, kind.get(k, WHOLE), f"{name}[{k!r}]", start, rows, batch) for k, v in value.items()}
    if kind == ITEMS:
        if isinstance(value, list) and len(value) == batch:
            return value[start:start + rows]
        return value  # one entry for every sample (or not a list: the model's own error)
    if isinstance(value, (list, tuple)):
        return type(value)(_split(v, kind, f"{name}[{i}]", start, rows, batch) for i, v in enumerate(value))
    if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape[0] == 1:
        return value  # a number, or one row the model broadcasts over the batch
    if value.shape[0] != batch:
        raise ValueError(f"{name} has {value.shape[0]} rows, expected {batch} (the batch of hidden_states), "
                         "1 or a scalar")
    return value[start:start + rows]


def _gather(t, group, world):
    """[world * n, ...]: every rank's [n, ...] tensor t, in rank order."""
    t = t.detach().contiguous()
    out = t.new_empty((world * t.shape[0], *t.shape[1:]))
    torch.distributed.all_gather_into_tensor(out, t, group=group)
    return out


def _gather_output(output, gather):
    """output with each tensor gathered: a tensor, a tuple (return_dict=False) or a diffusers
    output dataclass (a dict-like BaseOutput)."""
    if isinstance(output, torch.Tensor):
        return gather(output)
    if isinstance(output, tuple):
        items = [gather(v) if isinstance(v, torch.Tensor) else v for v in output]
        return tuple(items) if type(output) is tuple else type(output)(*items)
    if dataclasses.is_dataclass(output) and isinstance(output, dict):
        return dataclasses.replace(output, **{k: gather(v) for k, v in output.items() if isinstance(v, torch.Tensor)})
    raise TypeError(f"batch parallelism gathers a tensor, a tuple or a diffusers output; the forward returned a "
                    f"{type(output).__name__}")


class _BatchParallel:
    """The hooks of one enabled model and what they share: the group, this rank's place in it,
    the model family's description of its arguments."""

    def __init__(self, cls, spec, group, rank, world):
        self.cls, self.spec = cls, spec
        self.group, self.rank, self.world = group, rank, world
        params = list(inspect.signature(cls.forward).parameters.values())
        self.signature = inspect.Signature(params[1:])  # without self: the hook gets the call's arguments
        self.warned = False
        self.rows = None  # rows of this rank's slice while a split call runs
        self.handles = ()

    def attach(self, model):
        self.handles = (model.register_forward_pre_hook(self.before, with_kwargs=True),
                        model.register_forward_hook(self.after, with_kwargs=True))

    def before(self, module, args, kwargs):
        self.rows = None  # a call that raised before after() leaves no stale split behind
        if getattr(module, "_parallel_config", None) is not None:
            raise RuntimeError(f"{type(module).__name__}: diffusers' enable_parallelism was called after "
                               "cquant.enable_batch_parallel; both would split the same ranks' work. Use one of them "
                               "(cquant.disable_batch_parallel, or a model without enable_parallelism)")
        if self.world == 1:
            return None
        call = self.signature.bind_partial(*args, **kwargs).arguments
        hidden = call.get("hidden_states")
        if not isinstance(hidden, torch.Tensor) or hidden.dim() == 0:
            return None  # the forward raises about it as it would without batch parallelism
        batch = hidden.shape[0]
        if batch % self.world:
            self._warn_whole(module, batch)
            return None
        rows = batch // self.world
        start = self.rank * rows
        split = {n: _split(v, self.spec.get(n, WHOLE), n, start, rows, batch) for n, v in call.items()}
        self.rows = rows
        return (), split

    def after(self, module, args, kwargs, output):
        rows, self.rows = self.rows, None
        if rows is None:
            return None  # not split: the whole batch ran here
        return _gather_output(output, lambda t: _gather(t, self.group, self.world))

    def _warn_whole(self, module, batch):
        if not self.warned:
            self.warned = True
            warnings.warn(f"cquant batch parallelism: {type(module).__name__} got a batch of {batch}, which does not "
                          f"split evenly over the {self.world} ranks of its group; each rank runs the whole batch "
                          "(the right result, no speed-up). This warning is shown once per model.", stacklevel=2)

    # copy.deepcopy of an enabled model: the copy is enabled on the same process group (which
    # cannot be copied); its hook handles follow the copied model's hook dicts through `memo`
    def __deepcopy__(self, memo):
        import copy

        new = object.__new__(type(self))
        memo[id(self)] = new
        new.__dict__.update(self.__dict__)
        new.rows = None
        new.handles = copy.deepcopy(self.handles, memo)
        return new

    def __reduce__(self):
        raise TypeError("a model with batch parallelism enabled cannot be pickled (it holds a process group); "
                        "call cquant.disable_batch_parallel first")


def enable_batch_parallel(model, group=None):
    """Run each rank's slice of the batch and gather the outputs (see the module docstring).

    Args:
        model: a diffusers FluxTransformer2DModel, SD3Transformer2DModel,
            CogVideoXTransformer3DModel, PixArtTransformer2DModel or QwenImageTransformer2DModel
            (a subclass that keeps its forward too), or a pipeline holding one as .transformer;
            quantized by cquant.quantize_ or optimized, before or after, or not.
        group: the torch.distributed process group whose ranks share the batch (None: the
            world). A group of one rank changes nothing.

    Every rank of the group calls it, and then the model, with the same inputs. Calling it again
    with the same group changes nothing; with another group it raises ValueError (disable
    first). copy.deepcopy of an enabled model is enabled on the same group.

    Raises TypeError for a model class whose per-sample arguments are not known, ValueError for
    a model with diffusers' parallelism (enable_parallelism) on, RuntimeError where
    torch.distributed is not initialized. enable_parallelism called afterwards makes the next
    call raise RuntimeError. Returns what it was given.
    """
    given = model
    model = transformer_of(model)
    cls, spec = _family(model)
    if getattr(model, "_parallel_config", None) is not None:
        raise ValueError(f"model: {type(model).__name__} already has diffusers' parallelism on (enable_parallelism); "
                         "batch parallelism would split the same ranks' work. Use one of them.")
    group, rank, world = _group(group)
    state = getattr(model, STATE_ATTR, None)
    if state is not None:
        if state.group is group:
            return given
        raise ValueError("group: batch parallelism is already on for this model with another group; call "
                         "cquant.disable_batch_parallel(model) first")
    state = _BatchParallel(cls, spec, group, rank, world)
    state.attach(model)
    setattr(model, STATE_ATTR, state)
    return given


def disable_batch_parallel(model):
    """Undo enable_batch_parallel: the model (or the pipeline's .transformer) runs its whole batch
    on each rank again. Returns whether it was on."""
    model = transformer_of(model)
    state = model.__dict__.pop(STATE_ATTR, None)
    if state is None:
        return False
    for handle in state.handles:
        handle.remove()
    return True
