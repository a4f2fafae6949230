"""Replay a transformer's forward as a CUDA graph (cquant.optimize(..., cuda_graph=True)).

An eager quantized Flux step launches thousands of small kernels; on a fast GPU the launches, not
the kernels, set the step time at small batch sizes. CUDAGraphForward takes the place of the
module's forward (an attribute of the instance, as diffusers' hooks do): per distinct input
signature (every tensor's shape, dtype and device, every other argument's value) it warms the
forward up on a side stream, captures one CUDA graph, and from then on copies the inputs into the
graph's own input tensors, replays it and returns fresh copies of its outputs.

It runs the forward eagerly instead, warning once per reason, when it cannot be right to replay:
no CUDA tensors (or some on another device), autograd recording, diffusers' caching enabled (its
hooks decide on the host, step by step), an argument that cannot be part of a signature, more
than MAX_GRAPHS signatures, or a capture that fails. While torch.compile traces, it is not there.

A graph replays what it captured: Python state read inside forward (LoRA scales, the attention
backend, modules swapped in) is fixed at capture. After changing such state call
`reset()` on it (`transformer.forward.reset()`), or unoptimize and optimize again. The graphs keep
the model's parameters and buffers they read alive, so replacing one never leaves a graph
reading freed memory (it reads the old tensor until reset()). The module is held by weak
reference (it holds this forward): deleting the model frees it, its graphs and their memory pool
at once, without waiting for the garbage collector.
"""

from __future__ import annotations

import warnings
import weakref

import torch
from torch.utils import _pytree as pytree

__all__ = ["CUDAGraphForward", "install", "uninstall", "installed", "find", "warming_up"]

MAX_GRAPHS = 8
WARMUP_CALLS = 2
_warming = 0  # forwards being warmed up for a capture, on any device


def warming_up():
    """Whether a forward runs as the warm-up of a capture (eagerly, right before it): what the
    captured forward needs set up on the host (a Ulysses exchange's workspace) is set up then."""
    return _warming > 0
_SCALARS = (bool, int, float, str, bytes, type(None), torch.dtype, torch.device)


class _Unkeyable(Exception):
    pass


def _signature(obj, tensors):
    """A hashable description of obj (args and kwargs) with its tensors replaced by their
    metadata; appends the tensors to `tensors` in order."""
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return ("T", tuple(obj.shape), obj.stride(), obj.dtype, obj.device, obj.requires_grad)
    if isinstance(obj, _SCALARS):
        return (type(obj), obj)
    if isinstance(obj, (tuple, list)):
        return (type(obj), tuple(_signature(x, tensors) for x in obj))
    if isinstance(obj, dict):
        return (type(obj), tuple((k, _signature(v, tensors)) for k, v in obj.items()))
    raise _Unkeyable(type(obj).__name__)


def _rebuild(obj, tensors):
    """obj with its tensors replaced, in order, by the next ones of the iterator `tensors`."""
    if isinstance(obj, torch.Tensor):
        return next(tensors)
    if isinstance(obj, (tuple, list)):
        return type(obj)(_rebuild(x, tensors) for x in obj)
    if isinstance(obj, dict):
        return type(obj)((k, _rebuild(v, tensors)) for k, v in obj.items())
    return obj


class _Graph:
    __slots__ = ("graph", "inputs", "outputs", "spec", "keep")

    def __init__(self, graph, inputs, outputs, spec, keep):
        self.graph, self.inputs, self.outputs, self.spec = graph, inputs, outputs, spec
        self.keep = keep  # the module's parameters and buffers when captured: the memory the graph reads


class CUDAGraphForward:
    """The forward of `module`, replayed from CUDA graphs (see the module docstring).

    previous: the forward the module's instance had before (a diffusers hook's wrapper), or None
    for the class's forward."""

    def __init__(self, module, previous=None, max_graphs=MAX_GRAPHS):
        self._bind(module)
        self.previous = previous
        self.max_graphs = max_graphs
        self.enabled = True
        self._reset_state()

    def _bind(self, module):
        # weak: the module holds this object as its forward, and a strong reference back would be
        # a cycle keeping the whole model (and the graphs' pool) allocated after `del model`
        self._module_ref = weakref.ref(module)

    @property
    def module(self):
        """The module whose forward this is, or None once it is freed."""
        return self._module_ref()

    def _reset_state(self):
        self._graphs = {}  # signature -> _Graph, or None where capture failed
        self._pool = None
        self._warned = set()

    def reset(self):
        """Drop every captured graph (they are captured again on the next calls)."""
        self._reset_state()

    @property
    def num_graphs(self):
        return sum(g is not None for g in self._graphs.values())

    def _forward(self):
        if self.previous is not None:
            return self.previous
        module = self.module
        if module is None:
            raise ReferenceError("a CUDA-graph forward was called after its module was freed")
        return type(module).forward.__get__(module)

    def _warn(self, reason):
        if reason not in self._warned:
            self._warned.add(reason)
            warnings.warn(f"cquant CUDA graphs: {reason}; running {type(self.module).__name__} eagerly",
                          RuntimeWarning, stacklevel=4)

    def _eager(self, reason, forward, args, kwargs):
        self._warn(reason)
        return forward(*args, **kwargs)

    def __call__(self, *args, **kwargs):
        forward = self._forward()
        if not self.enabled or torch.compiler.is_compiling():
            return forward(*args, **kwargs)
        tensors = []
        try:
            key = _signature((args, kwargs), tensors)
        except _Unkeyable as e:
            return self._eager(f"an argument of type {e} cannot be part of a graph's signature", forward, args,
                               kwargs)
        reason = self._refusal(tensors)
        if reason is not None:
            return self._eager(reason, forward, args, kwargs)
        entry = self._graphs.get(key, False)
        if entry is None:
            return self._eager("capturing this input signature failed earlier", forward, args, kwargs)
        if entry is False:
            if len(self._graphs) >= self.max_graphs:
                return self._eager(f"more than {self.max_graphs} input signatures", forward, args, kwargs)
            entry = self._capture(key, forward, args, kwargs, tensors)
            if entry is None:
                return forward(*args, **kwargs)
        for static, t in zip(entry.inputs, tensors):
            static.copy_(t)
        entry.graph.replay()
        return pytree.tree_unflatten([t.clone() for t in entry.outputs], entry.spec)

    def _refusal(self, tensors):
        if not tensors:
            return "the call has no tensor arguments"
        device = tensors[0].device
        if device.type != "cuda":
            return "its inputs are not CUDA tensors"
        if any(t.device != device for t in tensors):
            return "its inputs are on more than one device"
        if torch.is_grad_enabled():
            return "autograd is recording (run under torch.no_grad() or torch.inference_mode())"
        if getattr(self.module, "_cache_config", None) is not None:
            return "diffusers' caching is enabled (its hooks decide on the host at every step)"
        return None

    def _capture(self, key, forward, args, kwargs, tensors):
        device = tensors[0].device
        with torch.inference_mode(False):  # plain tensors: later calls may run outside inference mode
            inputs = [t.clone() for t in tensors]
        s_args, s_kwargs = _rebuild((args, kwargs), iter(inputs))
        current = torch.cuda.current_stream(device)
        side = torch.cuda.Stream(device)
        side.wait_stream(current)
        global _warming
        _warming += 1
        try:
            with torch.cuda.stream(side):  # errors here are the forward's own: they propagate
                for _ in range(WARMUP_CALLS):
                    forward(*s_args, **s_kwargs)
        finally:
            _warming -= 1
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self._pool):
                out = forward(*s_args, **s_kwargs)
        except Exception as e:  # noqa: BLE001 - any capture failure means: run this signature eagerly
            self._graphs[key] = None
            self._warn(f"capture failed ({type(e).__name__}: {(str(e).splitlines() or [''])[0]})")
            return None
        leaves, spec = pytree.tree_flatten(out)
        if not all(isinstance(t, torch.Tensor) for t in leaves):
            self._graphs[key] = None
            self._warn("the forward returns values that are not tensors")
            return None
        if self._pool is None:
            self._pool = graph.pool()
        keep = tuple(self.module.parameters()) + tuple(self.module.buffers())
        entry = self._graphs[key] = _Graph(graph, inputs, leaves, spec, keep)
        return entry

    # pickling and deepcopy carry the set-up, not the graphs
    def __getstate__(self):
        return {"module": self.module, "previous": self.previous, "max_graphs": self.max_graphs,
                "enabled": self.enabled}

    def __setstate__(self, state):
        state = dict(state)
        self._bind(state.pop("module"))
        self.__dict__.update(state)
        self._reset_state()

    def __repr__(self):
        return f"CUDAGraphForward({type(self.module).__name__}, {self.num_graphs} graphs)"


def installed(module):
    """The CUDAGraphForward in module's forward, or None."""
    f = module.__dict__.get("forward")
    return f if isinstance(f, CUDAGraphForward) else None


def find(module):
    """The CUDAGraphForward of module: in its forward, or held by diffusers' hooks registered after
    it (enable_parallelism's, for one); None if it has none."""
    return installed(module) or next(_wrapped_forwards(module), None)


def install(module, max_graphs=MAX_GRAPHS):
    """Make module's forward a CUDAGraphForward (idempotent); returns it."""
    f = installed(module)
    if f is not None:
        f.enabled = True
        return f
    f = CUDAGraphForward(module, module.__dict__.get("forward"), max_graphs)
    module.forward = f
    return f


def uninstall(module):
    """Give module its forward back; returns whether a CUDAGraphForward was there. One that later
    hooks wrapped (diffusers' hook registry keeps a reference) is switched off and emptied."""
    f = installed(module)
    if f is not None:
        if f.previous is None:
            del module.forward
        else:
            module.forward = f.previous
        f.enabled = False
        f.reset()
        return True
    for g in _wrapped_forwards(module):
        g.enabled = False
        g.reset()
        return True
    return False


def _wrapped_forwards(module):
    """CUDAGraphForwards of module that diffusers' hooks registered later hold on to."""
    registry = getattr(module, "_diffusers_hook", None)
    for ref in getattr(registry, "_fn_refs", ()):
        for attr in ("forward", "original_forward"):
            f = getattr(ref, attr, None)
            if isinstance(f, CUDAGraphForward) and f.module is module:
                yield f
