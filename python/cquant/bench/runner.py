"""run_grid: every cell of a grid measured once, each result appended to a JSONL file as it comes.

Order of work, for GPU time and memory (an 80 GB card, a 12 B model):
  1. per model: the bfloat16 master weights are drawn once (on the device, stored on the CPU);
  2. per model: the float32 model is built once, alone on the device, runs the inputs of every
     dtype and batch the grid asks for, and only its outputs are kept (on the CPU);
     per model and dtype: the baseline ("none", eager) stays resident on the device;
  3. cells sharing a build key (model, mode, scheme, text-encoder quantization, QKV fusion,
     dtype) share one built model, quantized from the master layer by layer onto the device;
     each cell switches its toggles (attention, optimize, compile, cache) on, is measured
     interleaved with the baseline, and switches them off again; the model is freed after its
     last cell.
With interleave=False (models that do not fit twice) the baseline is measured first and freed,
and speed-ups compare medians of separate runs (recorded as such).
"""

from __future__ import annotations

import datetime
import numbers
import time
import traceback

import torch

from . import measure as M
from .grid import Cell, default_grid, grid_env, skip_reason, torch_dtype
from .results import ResultStore
from .timing import interleave, latency_stats

__all__ = ["run_grid"]


class _Stop(Exception):
    """stop_after reached (a test hook: an interrupted grid)."""


def _now():
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _progress(total, enabled):
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="cquant bench", unit="cell")


class _Run:
    def __init__(self, store, settings, env, bar, stop_after):
        self.store, self.settings, self.env, self.bar, self.stop_after = store, settings, env, bar, stop_after
        self.written = 0
        self.out = []

    def record(self, cell, status, **fields):
        rec = dict(key=cell.key, label=cell.label, **cell.as_dict(), status=status, **fields,
                   settings=self.settings, env=self.env, finished_at=_now())
        self.out.append(self.store.append(rec))
        self.written += 1
        if self.bar is not None:
            self.bar.update(1)
            why = f" ({fields['reason']})" if "reason" in fields else ""
            self.bar.set_postfix_str(f"{cell.label}: {status}{why}")
        if self.stop_after is not None and self.written >= self.stop_after:
            raise _Stop()


def _as_cells(grid, env):
    out = []
    for item in grid:
        cell, reason = item if isinstance(item, tuple) else (item, None)
        if not isinstance(cell, Cell):
            raise TypeError(f"grid: expected Cell or (Cell, reason) items, got {type(item).__name__}")
        out.append((cell, reason if isinstance(item, tuple) else skip_reason(cell, env)))
    return out


def _check_settings(**values):
    """Bad counts or sizes fail here, naming the argument, not as an error in every cell."""
    least = dict(repeats=1, iters=1, warmup=0, height=16, width=16, frames=1, steps=1)
    for name, v in values.items():
        if v is None and name not in ("repeats", "iters", "warmup"):
            continue
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < least[name]:
            raise ValueError(f"{name} must be an int >= {least[name]}, got {v!r}")
        if name in ("height", "width") and v % 16:
            raise ValueError(f"{name} must be a multiple of 16, got {v}")


def run_grid(grid=None, *, preset="default", device="cuda", out=None, repeats=3, iters=5, warmup=2,
             interleave_baseline=True, tiny=False, seed=0, retry_errors=False, progress=True, stop_after=None,
             height=None, width=None, frames=None, steps=None, **axes):
    """Measure every cell of `grid` (default: default_grid(preset, **axes) for `device`) and
    return its records (see cquant.bench.results); with `out`, each is appended to that JSONL
    file as it finishes and cells already there (ok / skipped; error too unless retry_errors)
    are not run again.

    repeats x iters timed calls per cell after warmup calls, interleaved with the baseline (see
    cquant.bench.timing); interleave_baseline=False measures the baseline alone first (models that
    do not fit twice). tiny: the models' tiny variants (CPU-fast). stop_after: stop after writing
    that many records (a test hook). height / width / frames: the inputs' size (default: the
    model's); steps: denoising steps in pipeline mode.
    """
    _check_settings(repeats=repeats, iters=iters, warmup=warmup, height=height, width=width, frames=frames,
                    steps=steps)
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device: {e}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device}: CUDA is not available here")
    env = grid_env(device)
    cells = _as_cells(grid if grid is not None else default_grid(preset, env=env, **axes), env)
    store = ResultStore(out)
    settings = dict(repeats=repeats, iters=iters, warmup=warmup, interleaved=bool(interleave_baseline), tiny=tiny,
                    seed=seed, device=str(device), height=height, width=width, frames=frames, steps=steps)
    info = M.env_info(device)
    bar = _progress(len(cells), progress)
    run = _Run(store, settings, info, bar, stop_after)
    try:
        todo = []
        for cell, reason in cells:
            if store.done(cell.key, retry_errors):
                run.out.append(store.records[cell.key])
                if bar is not None:
                    bar.update(1)
            elif reason is not None:
                run.record(cell, "skipped", reason=reason)
            else:
                todo.append(cell)
        groups = {}
        for cell in todo:
            groups.setdefault((cell.model, cell.mode, cell.dtype), []).append(cell)
        masters = _Masters(device, settings)
        for cell in todo:
            if cell.mode == "step":
                masters.reference_inputs.setdefault(cell.model, set()).add((cell.dtype, cell.batch))
        last_group = {model: i for i, (model, _, _) in enumerate(groups)}  # free a model after its last group
        for i, ((model, mode, dtype), group) in enumerate(groups.items()):
            runner = _StepGroup if mode == "step" else _PipelineGroup
            runner(run, masters, model, dtype, group, device, settings).run_all()
            if last_group[model] == i:
                masters.drop(model)
    except _Stop:
        pass
    finally:
        if bar is not None:
            bar.close()
    return run.out


class _Masters:
    """Per model: the bfloat16 master weights, drawn once (on the device, kept on the CPU), and
    the float32 reference outputs of step mode, made once for every dtype and batch asked."""

    def __init__(self, device, settings):
        self.device, self.settings = device, settings
        self.models, self.refs, self.ref_notes = {}, {}, {}
        self.reference_inputs = {}  # model -> {(dtype, batch)} its step cells need

    def get(self, name):
        if name not in self.models:
            from .models import build_master, load_config, load_pretrained, model_info, resolve_name

            try:
                resolve_name(name)
            except ValueError:  # a hub id or a local directory: the real checkpoint's weights
                self.models[name] = load_pretrained(name, dtype=torch.bfloat16, device="cpu")
            else:
                self.models[name] = build_master(load_config(name, tiny=self.settings["tiny"]), self.settings["seed"],
                                                 device=self.device, cls=model_info(name)["class"])
        return self.models[name]

    def inputs(self, name, dtype, batch):
        """One step's inputs of `name` (seeded: the same tensors whenever asked)."""
        from .models import make_inputs

        s = self.settings
        return make_inputs(name, self.get(name), batch=batch, dtype=torch_dtype(dtype), device=self.device,
                           tiny=s["tiny"], seed=s["seed"] + 1, height=s["height"], width=s["width"],
                           frames=s["frames"])

    def reference(self, name, dtype, batch):
        """(float32 output on the CPU or None, why none): the float32 model (TF32 off) on the
        inputs of `dtype` upcast, for every (dtype, batch) of the model at the first call."""
        if name not in self.ref_notes:
            self.ref_notes[name] = self._make_references(name)
        return self.refs.get((name, dtype, batch)), self.ref_notes[name]

    def _make_references(self, name):
        tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        ref_model = note = None
        try:
            ref_model = M.float_copy(self.get(name), self.device, torch.float32)
            for dtype, batch in sorted(self.reference_inputs.get(name, ())):
                x = {k: (v.float() if torch.is_tensor(v) and v.is_floating_point() else v)
                     for k, v in self.inputs(name, dtype, batch).items()}
                self.refs[(name, dtype, batch)] = M.step_call(ref_model, x).float().cpu()
        except torch.cuda.OutOfMemoryError as e:
            note = f"no float32 reference: it does not fit on {self.device} ({str(e).splitlines()[0][:200]})"
        finally:
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
            ref_model = None
            M.free_memory()
        return note

    def drop(self, name):
        self.models.pop(name, None)
        for k in [k for k in self.refs if k[0] == name]:
            del self.refs[k]
        M.free_memory()


def _build_fields(probe, model, t0):
    return dict(weights_gb=M.gb(M.model_bytes(model)), weights_alloc_gb=M.gb(probe.allocated()),
                load_peak_gb=M.gb(probe.peak_since_reset()), build_s=round(time.perf_counter() - t0, 3))


def _timing_fields(t, interleaved_with_baseline):
    """The record's latency fields from cquant.bench.timing.interleave's result."""
    cand = t["candidate"]
    fields = dict(latency_ms=latency_stats([x for run in cand["runs"] for x in run]), median_ms=cand["median"],
                  spread_ms=cand["spread"], repeat_medians_ms=cand["repeat_medians"], runs_ms=cand["runs"],
                  interleaved=interleaved_with_baseline)
    if t["baseline"] is not None:
        fields.update(baseline_runs_ms=t["baseline"]["runs"], baseline_median_ms=t["baseline"]["median"])
    if t["speedup"] is not None:
        s = t["speedup"]
        fields.update(speedup=s["median"], speedup_min=s["min"], speedup_max=s["max"], speedup_repeats=s["repeats"])
    return fields


class _Group:
    """The cells of one model, mode and dtype: the baseline resident, build groups in turn."""

    def __init__(self, run, masters, model, dtype, cells, device, settings):
        self.run, self.masters, self.name, self.cells, self.device = run, masters, model, cells, device
        self.dtype = torch_dtype(dtype)
        self.settings = settings
        self.resident = None  # the baseline's built model (pipeline), resident while the group runs
        self.baseline = {}  # batch -> no-argument call of the resident baseline
        self.baseline_median = {}  # batch -> ms, when not interleaved

    def run_all(self):
        try:
            self.prepare()
        except Exception as e:  # the model or its reference cannot be made: every cell says why
            text = f"{type(e).__name__}: {e}"
            for cell in self.cells:
                self.run.record(cell, "error", error=f"preparing {self.name}: {text}", traceback=traceback.format_exc())
            self.free_baseline()
            return
        by_build = {}
        for cell in self.cells:
            by_build.setdefault(cell.build_key, []).append(cell)
        try:
            for key, cells in by_build.items():
                if self.resident is not None:  # the baseline cells run on the resident model itself
                    for cell in [c for c in cells if c.is_baseline]:
                        self.measure_and_record(cell, self.resident, self.resident_probe, self.resident_fields)
                    cells = [c for c in cells if not c.is_baseline]
                if not cells:
                    continue
                if not self.settings["interleaved"]:  # models that do not fit twice: the baseline goes first
                    self.free_baseline()
                self.run_build(key, cells)
        finally:
            self.free_baseline()

    def make_resident(self):
        """The baseline (no scheme, eager) built and kept on the device while the group runs."""
        self.resident_probe = M.MemoryProbe(self.device)
        self.resident_probe.reset()
        t0 = time.perf_counter()
        self.resident = self.build(self.cells[0].baseline, self.resident_probe)
        self.resident_fields = _build_fields(self.resident_probe, self.model_of(self.resident), t0)

    def measure_and_record(self, cell, built, probe, build_fields):
        try:
            fields = self.measure_cell(cell, built, probe)
        except M.Unsupported as e:
            self.run.record(cell, "skipped", reason=str(e))
            return
        except Exception as e:
            self.run.record(cell, "error", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc(),
                            **build_fields)
            return
        self.run.record(cell, "ok", **build_fields, **fields)

    def run_build(self, key, cells):
        probe = M.MemoryProbe(self.device)
        try:
            probe.reset()
            t0 = time.perf_counter()
            built = self.build(cells[0], probe)
            build_fields = _build_fields(probe, self.model_of(built), t0)
        except Exception as e:
            text = f"{type(e).__name__}: {e}"
            for cell in cells:
                self.run.record(cell, "error", error=f"building: {text}", traceback=traceback.format_exc())
            M.free_memory()
            return
        try:
            for cell in cells:
                self.measure_and_record(cell, built, probe, build_fields)
        finally:
            self.release(built)
            del built
            M.free_memory()

    def measure_cell(self, cell, built, probe):
        raise NotImplementedError

    def inference_peak(self, fn, probe):
        """GB: peak allocated during one more call, relative to before the cell's model was built
        (None off CUDA, where no call is spent on it)."""
        if not probe.cuda:
            return None
        probe.reset()
        fn()
        return M.gb(probe.peak_since_reset())

    def time_cell(self, cell, fn):
        """Timing fields of `fn` against the resident baseline (or alone: the baseline itself, or
        without interleaving against the baseline's separately measured median)."""
        s = self.settings
        base = None if cell.is_baseline else self.baseline.get(cell.batch)
        t = interleave(fn, base, repeats=s["repeats"], warmup=s["warmup"], iters=s["iters"], device=self.device)
        fields = _timing_fields(t, base is not None)
        if cell.is_baseline:
            self.baseline_median[cell.batch] = t["candidate"]["median"]
            fields.update(speedup=1.0, speedup_min=1.0, speedup_max=1.0)
        elif base is None:
            stored = self.run.store.records.get(cell.baseline.key, {})  # measured by an earlier, resumed run
            base_ms = self.baseline_median.get(cell.batch, stored.get("median_ms"))
            if isinstance(base_ms, (int, float)):
                fields.update(speedup=base_ms / t["candidate"]["median"], speedup_min=None, speedup_max=None,
                              speedup_note="baseline timed separately (not interleaved)")
        return fields


class _StepGroup(_Group):
    """Step mode: one transformer call on fixed inputs."""

    def prepare(self):
        batches = sorted({c.batch for c in self.cells})
        dtype = self.cells[0].dtype
        self.inputs = {b: self.masters.inputs(self.name, dtype, b) for b in batches}
        self.refs, self.ref_note = {}, None
        for b in batches:
            ref, self.ref_note = self.masters.reference(self.name, dtype, b)
            if ref is not None:
                self.refs[b] = ref
        if self.settings["interleaved"] or any(c.is_baseline for c in self.cells):
            self.make_resident()
            for b in batches:
                self.baseline[b] = (lambda b=b: M.step_call(self.resident, self.inputs[b]))

    def free_baseline(self):
        self.resident = None
        self.baseline.clear()
        M.free_memory()

    def build(self, cell, probe):
        master = self.masters.get(self.name)
        if cell.scheme == "none":
            model = M.float_copy(master, self.device, self.dtype)
        else:
            model = M.float_copy(master, torch.device("cpu"), self.dtype)  # quantized onto the device layer by layer
        return M.quantize_model(model, cell.scheme, self.device, fuse_qkv=cell.fuse_qkv)

    def model_of(self, built):
        return built

    def release(self, built):
        pass

    def measure_cell(self, cell, model, probe):
        from ..metrics import sqnr_db

        fields = {}
        with M.Toggles(model, cell) as t:
            inputs = self.inputs[cell.batch]
            fn = lambda: M.step_call(t.model, inputs)  # noqa: E731
            t0 = time.perf_counter()
            out = fn()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            first_s = time.perf_counter() - t0
            if cell.compile:
                fields["compile_s"] = first_s
            if cell.batch in self.refs:
                fields["sqnr_db"] = sqnr_db(self.refs[cell.batch], out.float().cpu())
            else:
                fields["sqnr_note"] = self.ref_note
            del out
            fields["infer_peak_gb"] = self.inference_peak(fn, probe)
            fields.update(self.time_cell(cell, fn))
            fields.update({k: v for k, v in t.notes.items()})
        return fields


class _PipelineGroup(_Group):
    """Pipeline mode: the whole pipeline (text encoders, the denoising loop, the VAE) per call;
    image quality against the same-dtype "none" pipeline with the same seed."""

    def prepare(self):
        self.refs = {}
        self.make_resident()
        for b in sorted({c.batch for c in self.cells}):
            self.baseline[b] = (lambda b=b: self.resident.generate(seed=self.settings["seed"], batch=b))
            self.refs[b] = self.baseline[b]()

    def new_pipeline(self):
        from .pipeline import build_pipeline

        s = self.settings
        return build_pipeline(self.name, dtype=self.dtype, device=self.device, quick=s["tiny"], seed=s["seed"],
                              height=s["height"], width=s["width"], frames=s["frames"], steps=s["steps"])

    def free_baseline(self):
        if self.resident is not None:
            self.resident.free()
        self.resident = None
        self.baseline.clear()
        M.free_memory()

    def build(self, cell, probe):
        import cquant

        pipe = self.new_pipeline()
        try:
            if cell.scheme != "none":
                if cell.scheme.startswith("torchao:"):
                    M.quantize_model(pipe.transformer, cell.scheme, self.device, fuse_qkv=cell.fuse_qkv)
                else:
                    cquant.quantize_(pipe.transformer, cell.scheme, device=self.device, progress=False)
                    if cell.fuse_qkv:
                        cquant.fuse_qkv_(pipe.transformer)
            elif cell.fuse_qkv:
                pipe.transformer.fuse_qkv_projections()
            if cell.quantize_text_encoder:
                from .pipeline import quantize_text_encoders

                pipe.text_encoder_bytes = quantize_text_encoders(pipe, cell.scheme)
        except Exception:
            pipe.free()
            raise
        return pipe

    def model_of(self, pipe):
        return pipe.transformer

    def release(self, pipe):
        pipe.free()

    def measure_cell(self, cell, pipe, probe):
        from ..metrics import psnr_db, ssim

        fields = {}
        te = getattr(pipe, "text_encoder_bytes", None)
        if te:
            fields["text_encoders_gb"] = M.gb(sum(te.values()))
        if cell.cache:
            why = pipe.enable_cache()
            if why:
                raise M.Unsupported(why)
        try:
            with M.Toggles(pipe.transformer, cell):
                seed, b = self.settings["seed"], cell.batch
                fn = lambda: pipe.generate(seed=seed, batch=b)  # noqa: E731
                t0 = time.perf_counter()
                images = fn()
                if cell.compile:
                    fields["compile_s"] = time.perf_counter() - t0
                if b in self.refs:
                    fields["psnr_db"] = psnr_db(self.refs[b], images)
                    fields["ssim"] = ssim(self.refs[b], images)
                del images
                fields["infer_peak_gb"] = self.inference_peak(fn, probe)
                fields.update(self.time_cell(cell, fn))
        finally:
            if cell.cache:
                disable = getattr(pipe.transformer, "disable_cache", None)
                if callable(disable):
                    disable()
        return fields
