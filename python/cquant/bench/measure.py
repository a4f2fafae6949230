"""Measuring one cell: building and quantizing its model, switching its toggles, and what it costs.

What each number of a result is:
  weights_gb        bytes of the model as stored: every parameter and buffer in its stored form
                    (codes, scales, low-rank factors, biases, the layers left in float), 1 GB = 1e9
                    bytes (diffusers' get_memory_footprint counts the same)
  weights_alloc_gb  CUDA only: torch.cuda.memory_allocated() after the build minus before it
  load_peak_gb      CUDA only: peak torch.cuda.max_memory_allocated() while the model was built and
                    quantized (weights move to the GPU layer by layer from the CPU), minus what was
                    allocated before the build began
  infer_peak_gb     CUDA only: peak allocated during one call (after reset_peak_memory_stats),
                    minus what was allocated before the cell's model was built: the model's
                    weights plus the call's activations, not a resident baseline model
  compile_s         torch.compile cells: wall time of the first call (tracing and compiling)
  latency           ms per call (cquant.bench.timing): mean / min / p50 / p90 / p99 over every
                    timed call, and the interleaved median with its spread and the speed-up over
                    the baseline cell
  sqnr_db           step mode: of the transformer's output against a float32 forward of the same
                    weights (TF32 off), cquant.metrics.sqnr_db
  psnr_db / ssim    pipeline mode: of the decoded images against the same-dtype "none" run with
                    the same seed (cquant.metrics.psnr_db / ssim)
"""

from __future__ import annotations

import contextlib
import copy
import gc
import os
import platform
import subprocess

import torch

from .grid import ATTENTION, TORCHAO_SCHEMES

__all__ = ["env_info", "model_bytes", "free_memory", "MemoryProbe", "quantize_model", "Toggles", "Unsupported",
           "step_call", "gb"]


def gb(n):
    return None if n is None else n / 1e9


def _tensor_bytes(t):
    """Bytes a tensor stores: its elements, or for a wrapper subclass (torchao's quantized
    weights) the tensors it is made of (__tensor_flatten__)."""
    t = t.data if isinstance(t, torch.nn.Parameter) else t
    if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(_tensor_bytes(getattr(t, n)) for n in names)
    return t.nbytes


def _storage_key(t):
    t = t.data if isinstance(t, torch.nn.Parameter) else t
    if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):
        # a wrapper subclass's data_ptr() is 0: two torchao weights of one shape would look shared
        names, _ = t.__tensor_flatten__()
        return tuple(_storage_key(getattr(t, n)) for n in names)
    try:
        return (t.device.type, t.data_ptr(), t.nbytes) if t.device.type != "meta" else id(t)
    except RuntimeError:  # a wrapper subclass has no storage of its own
        return id(t)


def model_bytes(model):
    """Bytes of every parameter and buffer of `model` as stored (shared tensors counted once)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        key = _storage_key(t)
        if key in seen:
            continue
        seen.add(key)
        total += _tensor_bytes(t)
    return total


def free_memory():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class MemoryProbe:
    """CUDA memory around a stretch of work: `base` is what was allocated when it was made;
    peak_since_reset() the peak allocated since the last reset(), minus base. All None off CUDA."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        self.device = torch.device(device)
        if self.cuda:
            torch.cuda.synchronize(self.device)
        self.base = torch.cuda.memory_allocated(self.device) if self.cuda else None

    def reset(self):
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak_since_reset(self):
        if not self.cuda:
            return None
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device) - self.base

    def allocated(self):
        return torch.cuda.memory_allocated(self.device) - self.base if self.cuda else None


# ---------------------------------------------------------------- building


def _torchao_config(name):
    import torchao.quantization as tq

    cls, kwargs = TORCHAO_SCHEMES[name]
    kwargs = {k: (getattr(tq, v)() if k == "granularity" else v) for k, v in kwargs.items()}
    return getattr(tq, cls)(**kwargs)


def quantize_model(model, scheme, device, *, fuse_qkv=False):
    """`model` (float, on the CPU or `device`) with `scheme` applied, on `device`; returns the
    model (torchao quantizes in place on the device). fuse_qkv: q / k / v fused into one
    projection (cquant.fuse_qkv_ on the quantized layers; before quantizing for torchao and none)."""
    import cquant

    if scheme == "none" or scheme in TORCHAO_SCHEMES:
        model = model.to(device)
        if fuse_qkv:
            model.fuse_qkv_projections()
        if scheme != "none":
            import torchao.quantization as tq

            tq.quantize_(model, _torchao_config(scheme))
        return model
    cquant.quantize_(model, scheme, device=device, progress=False)
    if fuse_qkv:
        cquant.fuse_qkv_(model)
    return model


def float_copy(master, device, dtype):
    """`master`'s weights in `dtype` on `device` (a copy; the master is left as it is)."""
    from .models import materialize

    if device.type == "cpu" and dtype == next(master.parameters()).dtype:
        return copy.deepcopy(master)
    return materialize(master, device, dtype)


# ---------------------------------------------------------------- run-time toggles


class Toggles:
    """Switch a built model's run-time toggles (attention routing, fused blocks, torch.compile) on
    for one cell and off again, so cells differing only in these share one quantized model.

        with Toggles(model, cell) as t:
            t.model(**inputs)        # compiled in place when cell.compile
            t.notes                  # what optimize reported, ...
    """

    def __init__(self, model, cell):
        self.base, self.cell, self.model, self.notes = model, cell, model, {}
        self._processors = None

    def __enter__(self):
        try:
            self._switch_on()
        except BaseException:
            self.__exit__(None, None, None)  # what was switched on before the failure goes off again
            raise
        return self

    def _switch_on(self):
        import cquant

        cell, model = self.cell, self.base
        if cell.attention != "sdpa":
            self._processors = _attention_processors(model)
            cquant.enable_attention(model, ATTENTION[cell.attention])
        if cell.optimize:
            with _warnings_kept(self.notes):
                report = cquant.optimize(model)
            self.notes["optimize_report"] = str(report)
            if not report.installed:
                raise Unsupported(f"cquant.optimize fused nothing in {type(model).__name__}")
        if cell.compile:  # in place (nn.Module.compile): a pipeline holding the model runs it compiled too
            model.compile()

    def __exit__(self, *exc):
        import cquant

        if self.cell.compile:
            self.base._compiled_call_impl = None  # what nn.Module.compile set
            torch._dynamo.reset()
        if self.cell.optimize:
            cquant.unoptimize(self.base)
        if self._processors is not None:
            for mod, proc, backend in self._processors:
                if mod.processor is not proc:
                    mod.set_processor(proc)
                if backend is _MISSING:  # set_attention_backend gave the processor a backend of its own
                    proc.__dict__.pop("_attention_backend", None)
                else:
                    proc._attention_backend = backend
            self._processors = None
        return False


class Unsupported(RuntimeError):
    """A cell found not to run at run time (recorded as skipped, with this reason)."""


@contextlib.contextmanager
def _warnings_kept(notes):
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    if caught:
        notes["optimize_warnings"] = sorted({str(w.message)[:300] for w in caught})


_MISSING = object()


def _attention_processors(model):
    """(module, processor, the processor's own _attention_backend or _MISSING) of every attention
    layer: what enable_attention changes (processors swapped, backends set), to be put back."""
    out = []
    for m in model.modules():
        proc = getattr(m, "processor", None)
        if proc is not None and callable(getattr(m, "set_processor", None)):
            out.append((m, proc, vars(proc).get("_attention_backend", _MISSING) if hasattr(proc, "__dict__")
                        else _MISSING))
    return out


def step_call(model, inputs):
    """One transformer step: model(**inputs)[0] without autograd."""
    with torch.no_grad():
        return model(**inputs)[0]


# ---------------------------------------------------------------- the environment


def _git_commit():
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        r = subprocess.run(["git", "-C", here, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() or None if r.returncode == 0 else None


def _driver_version():
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                           text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.splitlines()[0].strip() if r.returncode == 0 and r.stdout.strip() else None


def env_info(device):
    """What a result was measured with: device name, capability, torch / CUDA / driver / diffusers /
    cquant versions, the cquant git commit when the package runs from a checkout, host, Python."""
    import cquant

    device = torch.device(device)
    try:
        import diffusers

        dv = diffusers.__version__
    except ImportError:
        dv = None
    info = dict(torch=torch.__version__, cuda=torch.version.cuda, diffusers=dv, cquant=cquant.__version__,
                cquant_commit=_git_commit(), python=platform.python_version(), host=platform.node(),
                device_type=device.type)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(device=props.name, capability=f"{props.major}.{props.minor}",
                    memory_gb=round(props.total_memory / 1e9, 1), driver=_driver_version())
    else:
        info.update(device=platform.processor() or platform.machine() or "cpu")
    return info
