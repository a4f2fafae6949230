"""verify(): run a model or pipeline once with every linear layer hooked; gather the rows.

Every torch.nn.Linear (cquant's QuantizedLinear included; in a pipeline, in every component: the
denoiser, the text encoders, the VAE) gets a forward hook (probe.LayerProbe) for the length of the
call, which counts each distinct (input, weight, output) shape and, for quantized layers and
candidate schemes, accumulates the error of the output against the same call in full precision.
Which modules are hooked and what each is measured against: targets. The result: report.

Full precision: F.linear in float32 (TF32 off) with the float weight. A QuantizedLinear does not
keep its float weight: pass `reference=` (the unquantized model or pipeline, or a state_dict,
matched by layer name) to include the weight's rounding in the error; without it the dequantized
stored weight stands in, and only the error of the activations and the kernel is measured.

cquant.optimize's fused block forwards only run layers with no hooks, so during the verify run
they take their diffusers forward and every layer is measured through its own forward; CUDA-graph
replay (optimize(cuda_graph=True)) is switched off for the run, since hooks do not run in a
replayed graph, and back on after (its graphs are captured again); torch.compile'd code runs
eagerly (torch.compiler.set_stance("force_eager")). The normal run timed for the overhead factor
runs the model as it is.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Mapping

import torch

from .. import cuda_graph as _graphs
from ..nn import QuantizedLinearSlice
from ..schemes import scheme as _scheme
from ..schemes import scheme_names
from ..shared_activations import unfused_class
from . import targets
from .probe import MAX_SHAPES, CandidateCache, LayerProbe
from .report import LayerResult, ShapeCount, VerifyResult, suggest

__all__ = ["verify", "DEFAULT_CACHE_BYTES"]

DEFAULT_CACHE_BYTES = 2 << 30
_DEQUANTIZED_NOTE = ("no reference given: quantized layers were measured against their dequantized stored weight, "
                     "so only the activation / kernel error is measured, not the weight's rounding")


def _as_call(model, call):
    if callable(call):
        return call
    if not isinstance(model, torch.nn.Module):
        raise TypeError("call: for a pipeline, pass a function that runs it (lambda: pipe('a prompt'))")
    if isinstance(call, Mapping):
        kwargs = dict(call)

        def run():
            with torch.no_grad():
                return model(**kwargs)

        return run
    if isinstance(call, (tuple, list)):
        args = tuple(call)

        def run():
            with torch.no_grad():
                return model(*args)

        return run
    raise TypeError(f"call must be a function of no arguments that runs the model once, or the model's inputs as a "
                    f"dict (model(**inputs)) or a tuple (model(*inputs)); got {type(call).__name__}")


def _eager():
    """Compiled code runs eagerly inside (so that the hooks run), where torch can say so."""
    stance = getattr(torch.compiler, "set_stance", None)
    return stance("force_eager") if stance is not None else contextlib.nullcontext()


def _cuda_devices(components):
    return {p.device for comp in components.values() for p in comp.parameters() if p.is_cuda}


def _timed(fn, devices):
    for d in devices:
        torch.cuda.synchronize(d)
    t0 = time.perf_counter()
    fn()
    for d in devices:
        torch.cuda.synchronize(d)
    return time.perf_counter() - t0


def _check_args(schemes, floor_db, timing, warmup, cache_bytes):
    if not isinstance(timing, bool):
        raise TypeError(f"timing must be True or False, got {timing!r}")
    if schemes is not None and not isinstance(schemes, str) and (isinstance(schemes, Mapping) or
                                                                 not isinstance(schemes, Iterable)):
        raise TypeError(f"schemes must be a scheme name or a list of names (['int8wo', 'fp8dqrow']), got {schemes!r}")
    if schemes is not None:
        schemes = schemes if isinstance(schemes, str) else list(schemes)  # an iterator is read once
        schemes = scheme_names(schemes, f"schemes={schemes!r}")
    cands = [_scheme(s) for s in (schemes or ())]
    if floor_db is not None:
        if isinstance(floor_db, bool) or not isinstance(floor_db, (int, float)) or floor_db != floor_db:
            raise TypeError(f"floor_db must be a number of dB, got {floor_db!r}")
        if not cands:
            raise ValueError("floor_db: a suggestion needs candidate schemes (schemes=[...])")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be an int >= 0, got {warmup!r}")
    if isinstance(cache_bytes, bool) or not isinstance(cache_bytes, int) or cache_bytes < 0:
        raise ValueError(f"cache_bytes must be an int >= 0, got {cache_bytes!r}")
    return cands


def verify(model, call, *, reference=None, schemes=None, floor_db=None, timing=True, warmup=1,
           cache_bytes=DEFAULT_CACHE_BYTES):
    """Run `call` once with every linear layer of `model` hooked; return a VerifyResult.

    Args:
        model: a torch.nn.Module (quantized by cquant.quantize_ or not), or a pipeline (a diffusers
            pipeline: every torch.nn.Module component is hooked; rows are named "component.layer").
        call: a function of no arguments running the model once (lambda: pipe("a prompt")), or a
            model's inputs: a dict for model(**call), a tuple for model(*call) (run under no_grad).
        reference: the unquantized model (or pipeline, or a state_dict keyed like the rows) whose
            weights the full-precision outputs of quantized layers are computed with, matched by
            layer name (a fused to_qkv from the reference's to_q / to_k / to_v). None: the
            dequantized stored weight (only activation and kernel error is measured then).
        schemes: candidate scheme names (one name, or a non-empty list naming each scheme once;
            cquant.schemes.scheme_names) to try on every layer's float weight (a float layer's
            own, or the reference's): each is quantized on the fly, beside the model, and run on
            the layer's inputs of this run.
        floor_db: with schemes, suggest per layer the cheapest candidate (stored bytes, from
            cquant.schemes) whose SQNR is at least floor_db; layers none satisfies stay
            unquantized. result.suggestion is the quantize_ mapping.
        timing: also time a normal run of `call` (after `warmup` untimed ones) for the overhead
            factor; False runs `call` only once, with the hooks.
        cache_bytes: bytes of candidate layers kept between calls (past it they are quantized
            again at each call).

    The hooks are removed, and CUDA-graph replay restored, also when `call` raises.
    """
    components = targets.components_of(model, "model")
    cands = _check_args(schemes, floor_db, timing, warmup, cache_bytes)
    fn = _as_call(model, call)
    weights = targets.reference_weights(reference, components) if reference is not None else None
    layers = targets.linear_layers(components)
    if not layers:
        raise ValueError(f"model: {type(model).__name__} has no torch.nn.Linear layers to verify")
    cache = CandidateCache(cache_bytes)
    probes = {}
    fused_parts = targets.fused_parts(components)
    for name, mod in layers.items():
        ref, kind = targets.reference_for(name, mod, weights, fused_parts)
        # candidates quantize a float weight: never the dequantized codes of a quantized layer
        probes[name] = (LayerProbe(name, mod, ref, cands if kind != "dequantized" else (), cache,
                                   own_weight=kind != "reference"), kind)
    _check_reference_matched(weights, probes)
    devices = _cuda_devices(components)
    normal_s = None
    if timing:
        for _ in range(warmup):
            fn()
        normal_s = _timed(fn, devices)
    notes = _fused_blocks_note(components)
    if targets.compiled(model):
        notes.append("torch.compile'd modules ran eagerly during the verify run (torch.compiler.set_stance("
                     "'force_eager'): hooks do not run inside compiled code; the normal run was compiled")
    graphs = [m for comp in components.values() for m in comp.modules() if _graphs.installed(m) is not None]
    handles = []
    precision = torch.get_float32_matmul_precision()
    try:
        for m in graphs:
            _graphs.uninstall(m)
        torch.set_float32_matmul_precision("highest")
        for name, (probe, _) in probes.items():
            handles.append(layers[name].register_forward_hook(probe, with_kwargs=True))
        with _eager():
            verify_s = _timed(fn, devices)
    finally:
        for h in handles:
            h.remove()
        torch.set_float32_matmul_precision(precision)
        for m in graphs:
            _graphs.install(m)
    if graphs:
        notes.append(f"CUDA-graph replay of {len(graphs)} module(s) was off during the verify run (hooks do not run "
                     "in a replayed graph) and is on again; its graphs are captured again on the next calls")
    rows = [_row(probe, kind) for probe, kind in probes.values()]
    kinds = {kind for probe, kind in probes.values() if probe.quantized}
    if "dequantized" in kinds:
        notes.append(_DEQUANTIZED_NOTE if kinds == {"dequantized"} else
                     "some quantized layers had no reference weight: those were measured against their dequantized "
                     "stored weight (activation / kernel error only); see the rows' `reference`")
    if cands and "dequantized" in kinds:
        notes.append("candidate schemes were not tried on quantized layers without a reference weight")
    offloaded = sum(p.offloaded for p, _ in probes.values())
    if offloaded:
        notes.append(f"{offloaded} calls were counted but not measured: the layer's tensors were back on the meta "
                     "device when its forward returned (accelerate's sequential CPU offload); use model CPU offload "
                     "or none for verify")
    if any(p.other_shapes for p, _ in probes.values()):
        notes.append(f"layers with more than {MAX_SHAPES} distinct shapes count the further ones together "
                     "(note column)")
    suggestion = None
    if floor_db is not None:
        suggestion = suggest(rows, floor_db, None if "" in components else list(components), fused_parts)
    rows.sort(key=LayerResult.sort_key)
    return VerifyResult(rows=rows, overhead=verify_s / normal_s if normal_s else None, verify_s=verify_s,
                        normal_s=normal_s, reference=_reference_text(kinds), candidates=[s.name for s in cands],
                        floor_db=floor_db, suggestion=suggestion, notes=notes)


def _check_reference_matched(weights, probes):
    """A reference that names none of the quantized layers is a mistake (another model, a state_dict
    with a prefix): refuse it rather than fall back to the dequantized weights unasked."""
    if weights is None:
        return
    kinds = [kind for _, kind in probes.values()]
    if "dequantized" in kinds and "reference" not in kinds:
        quantized = [name for name, (_, kind) in probes.items() if kind == "dequantized"]
        raise ValueError(f"reference: none of its weights is named like a quantized layer of the model (the model's: "
                         f"{', '.join(quantized[:3])}{', ...' if len(quantized) > 3 else ''}; the reference's: "
                         f"{', '.join(sorted(weights)[:3]) or 'none'}{', ...' if len(weights) > 3 else ''}); pass the "
                         "unquantized model this one was quantized from, or its state_dict")


def _reference_text(kinds):
    if not kinds:
        return "float32 outputs of the float weights"
    if kinds == {"dequantized"}:
        return "the dequantized stored weights (activation / kernel error only)"
    return "the reference weights" + (" (some layers: dequantized stored weights)" if "dequantized" in kinds else "")


def _fused_blocks_note(components):
    fused = sum(1 for comp in components.values() for m in comp.modules() if unfused_class(type(m)) is not type(m))
    if not fused:
        return []
    return [f"{fused} modules have cquant.optimize's fused forwards: a fused forward only runs hook-free layers, so "
            "during the verify run they took their diffusers forward and each layer was measured through its own "
            "forward (the fused path's shared activation codes were not); the normal run used the fused forwards"]


def _row(probe, kind):
    mod = probe.module
    shapes = [ShapeCount(*k, calls=c) for k, c in probe.shapes.items()]
    errors = probe.errors
    elem = torch.empty((), dtype=probe.compute_dtype).element_size()

    def stored(s):  # bytes the layer would store in scheme s (codes, scales, low-rank factors)
        k, n = mod.in_features, mod.out_features
        return s.weight_bytes(k, n) + s.lowrank_bytes(k, n, elem)

    cands = {}
    def order(s):  # cheapest first, refused last: a refused scheme may not fit the layer (a group size not
        refused = s.name in probe.refused  # dividing in_features), so its bytes are not even defined
        return (refused, 0 if refused else stored(s))

    for s in sorted(probe.candidates, key=order):
        if s.name in probe.refused:
            cands[s.name] = {"refused": probe.refused[s.name]}
            continue
        e = probe.candidate_errors[s.name]
        cands[s.name] = {"sqnr_db": e.sqnr_db(), "max_abs_err": e.max_abs_err(), "bytes": stored(s)}
    scheme = mod.scheme.name if probe.quantized else str(mod.weight.dtype).replace("torch.", "")
    note = f"{probe.other_shapes} calls of further shapes" if probe.other_shapes else ""
    if probe.offloaded:
        note = ", ".join(x for x in (note, f"{probe.offloaded} calls offloaded, not measured") if x)
    if isinstance(mod, QuantizedLinearSlice) and not probe.calls:
        note = f"rows {mod.start}:{mod.stop} of a fused layer, which runs instead"
    if probe.quantized and mod.activation:
        note = ", ".join(x for x in (note, f"fused {mod.activation}") if x)
    return LayerResult(name=probe.name, scheme=scheme, calls=probe.calls, shapes=shapes,
                       in_features=mod.in_features, out_features=mod.out_features,
                       sqnr_db=errors.sqnr_db() if errors is not None else None,
                       max_abs_err=errors.max_abs_err() if errors is not None else None,
                       reference=kind if (probe.quantized or probe.candidates) else "", candidates=cands, note=note)

