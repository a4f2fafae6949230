"""What cquant.verify hooks onto each linear layer: shapes and calls, and the error of each output.

A LayerProbe is a forward hook of one torch.nn.Linear (a cquant QuantizedLinear included). Per
call it counts the (input, weight, output) shapes and, when there is something to measure,
computes the same call in full precision (float32 inputs and weights, F.linear, the layer's fused
GELU if it has one) and adds the call's error to running sums on the device: the energy of the
reference, the energy of the difference, the largest absolute difference. No input or output is
kept after the call, so memory stays one layer's worth whatever the run's length; nothing is read
back to the host until the run ends (no synchronisation per call).

What is measured:
  * a quantized layer: its own output against the reference;
  * each candidate scheme (verify(..., schemes=[...])): the layer's float weight quantized with
    that scheme on the fly (a QuantizedLinear beside the model, never in it), run on the same
    input, against the same reference.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from ..device_fallback import kernel_refusal
from ..metrics import sqnr_db
from ..nn import QuantizedLinear

__all__ = ["ErrorSums", "LayerProbe", "CandidateCache", "MAX_SHAPES"]

# Distinct (input, weight, output) shapes kept per layer; calls of any further shape are counted
# together (a run whose sequence length changes every call would otherwise grow without bound).
MAX_SHAPES = 32
# Errors that mean "this scheme does not run this layer here" (a kernel's refusal, a layout the
# scheme cannot take), reported per layer instead of ending the run.
_SCHEME_ERRORS = (RuntimeError, NotImplementedError, ValueError, TypeError)


class ErrorSums:
    """Running error of computed outputs against their references, kept on the device."""

    __slots__ = ("signal", "noise", "max_err", "calls")

    def __init__(self):
        self.signal = self.noise = self.max_err = None
        self.calls = 0

    def add(self, ref, y):
        """Add one call: ref the float32 reference, y the computed output (same shape)."""
        self.calls += 1
        if ref.numel() == 0:
            return
        d = ref - y.to(ref.dtype)
        s = torch.linalg.vector_norm(ref, dtype=torch.float64).square()
        n = torch.linalg.vector_norm(d, dtype=torch.float64).square()
        m = d.abs().max()  # NaN propagates, as it must
        if self.signal is None:
            self.signal, self.noise, self.max_err = s, n, m
        else:
            self.signal, self.noise = self.signal + s, self.noise + n
            self.max_err = torch.maximum(self.max_err, m)

    def sqnr_db(self):
        """SQNR over every call so far (None before any element was measured).

        The sums of squares are the squared norms of all outputs laid end to end, so this is
        cquant.metrics.sqnr_db of the concatenated references and outputs. It is asked of that one
        function, with two-element vectors of the same norms: ref (|ref|, 0), x (|ref|, |noise|)."""
        if self.signal is None:
            return None
        s, n = math.sqrt(float(self.signal)), math.sqrt(float(self.noise))
        return sqnr_db(np.array([s, 0.0]), np.array([s, n]))

    def max_abs_err(self):
        return None if self.max_err is None else float(self.max_err)


def _float_shell(weight, bias, dtype):
    """A torch.nn.Linear holding `weight` (and `bias`) in dtype, for QuantizedLinear.from_float."""
    out_features, in_features = weight.shape
    lin = torch.nn.Linear(in_features, out_features, bias=bias is not None, device="meta", dtype=dtype)
    lin.weight = torch.nn.Parameter(weight.detach().to(dtype), requires_grad=False)
    if bias is not None:
        lin.bias = torch.nn.Parameter(bias.detach().to(device=weight.device, dtype=dtype), requires_grad=False)
    return lin


class CandidateCache:
    """Candidate layers (a layer's float weight quantized with one scheme) kept between calls while
    their bytes stay within `budget` bytes; past it they are quantized again at each call."""

    def __init__(self, budget):
        self.budget = budget
        self.used = 0
        self.layers = {}

    def get(self, key, build):
        layer = self.layers.get(key)
        if layer is None:
            layer = build()
            if self.used + layer.nbytes <= self.budget:
                self.layers[key] = layer
                self.used += layer.nbytes
        return layer


class LayerProbe:
    """Forward hook of one linear layer (see the module docstring).

    name: the layer's name in the report; module: the layer; reference: None (nothing to measure
    against), or a function returning (weight, bias) of the full-precision layer (any float dtype
    and device; the tensors of a reference model, or the dequantized stored weight);
    candidates: Schemes to try on the float weight (needs reference); cache: a CandidateCache."""

    def __init__(self, name, module, reference=None, candidates=(), cache=None, own_weight=True):
        self.name = name
        self.module = module
        self.reference = reference
        self.own_weight = own_weight  # the reference reads the layer's own tensors (not a reference model's)
        self.offloaded = 0  # calls not measured: the layer's tensors were on the meta device after its forward
        self.quantized = isinstance(module, QuantizedLinear)
        self.compute_dtype = module.compute_dtype if self.quantized else module.weight.dtype
        self.shapes = {}  # (input shape, weight shape, output shape) -> calls
        self.other_shapes = 0  # calls of shapes past MAX_SHAPES
        self.calls = 0
        self.errors = ErrorSums() if self.quantized and reference is not None else None
        self.candidates = list(candidates) if reference is not None else []
        self.candidate_errors = {s.name: ErrorSums() for s in self.candidates}
        self.refused = {}  # scheme name -> why it does not run this layer
        self.cache = cache
        for s in self.candidates:
            why = s.refusal(module.in_features, module.out_features)
            if why:
                self.refused[s.name] = why

    def __call__(self, module, args, kwargs, output):
        x = args[0] if args else kwargs.get("input")
        if not isinstance(x, torch.Tensor) or not isinstance(output, torch.Tensor):
            return None
        self.calls += 1
        key = (tuple(x.shape), (module.out_features, module.in_features), tuple(output.shape))
        if key in self.shapes or len(self.shapes) < MAX_SHAPES:
            self.shapes[key] = self.shapes.get(key, 0) + 1
        else:
            self.other_shapes += 1
        if self.errors is None and not self.candidates:
            return None
        with torch.no_grad():
            self._measure(x, output)
        return None

    def _measure(self, x, output):
        # accelerate's sequential offload moves a layer's tensors back to the meta device inside
        # its forward, before this hook runs: such calls are counted but cannot be measured
        if self.own_weight and self.module.weight.is_meta:
            self.offloaded += 1
            return
        weight, bias = self.reference()
        if weight.is_meta or bias is not None and bias.is_meta:
            self.offloaded += 1
            return
        ref = self._full_precision(x, weight, bias)
        if self.errors is not None:
            self.errors.add(ref, output)
        for s in self.candidates:
            if s.name in self.refused:
                continue
            try:
                layer = self._candidate(s, weight, bias, x.device)
                y = layer(x)
            except _SCHEME_ERRORS as e:
                self.refused[s.name] = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
                continue
            self.candidate_errors[s.name].add(ref, y)

    def _full_precision(self, x, weight, bias):
        dev = x.device
        ref = F.linear(x.to(torch.float32), weight.to(device=dev, dtype=torch.float32),
                       None if bias is None else bias.to(device=dev, dtype=torch.float32))
        # read per call: activation fusion undoes itself when something wraps the layer later
        return F.gelu(ref, approximate="tanh") if self._activation() else ref

    def _activation(self):
        return getattr(self.module, "activation", None) if self.quantized else None

    def _candidate(self, s, weight, bias, device):
        if device.type == "cuda":
            why = kernel_refusal(device.index if device.index is not None else torch.cuda.current_device(), s)
            if why:
                raise RuntimeError(why)

        def build():
            shell = _float_shell(weight.to(device), bias, self.compute_dtype)
            layer = QuantizedLinear.from_float(shell, s, device=device)
            layer.activation = self._activation()
            return layer

        if self.cache is None:
            return build()
        return self.cache.get((self.name, s.name, device, self._activation()), build)
