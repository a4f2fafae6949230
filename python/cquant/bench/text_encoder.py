"""`cquant bench --mode text-encoder`: is a quantized text encoder worth it? For the T5-XXL and
CLIP encoders of the registry pipelines, each scheme against the bfloat16 encoder: weight memory,
the GPU memory loading takes, latency, and how far its embeddings move (MSE, SQNR).

How the numbers are made:
  * the bfloat16 encoder is drawn once (random weights, pipeline_configs.json) and kept on the
    CPU; every candidate is loaded from that copy the way a user loads a checkpoint: the float
    one moved to the device, the quantized ones by quantize_(..., device=device), layer by layer
    (load peak = the device memory's high-water mark while loading, above what was there before);
  * the candidates run on the same token ids (a random prompt of the pipeline's length);
  * latency: all candidates interleaved in `repeats` repeats (the order rotating), `iters` timed
    calls each per repeat (CUDA events; perf_counter on the CPU); a candidate's time is the
    median of its per-repeat medians with the spread of those medians; mean / min / p50 / p90 /
    p99 over all its calls; its speed-up the median over repeats of bf16 median / its median;
  * MSE and SQNR (cquant.metrics.sqnr_db) of the embedding the pipeline takes from the encoder
    (T5: the last hidden state; Qwen2.5-VL: the last hidden state after the chat template; CLIP: Flux's pooled output, SD3's penultimate hidden state,
    with the pooled text_embeds' SQNR beside it) against the bfloat16 encoder's.
"""

from __future__ import annotations

import copy
import gc
import json
import math
import os
import platform
import statistics
import warnings

import torch

from ..metrics import sqnr_db
from . import components
from .pipeline import T5_FLOAT16, _module_bytes, text_encoder_note, text_lengths
from .report import memory_column
from .timing import latency_stats, time_runs

# quick=True: 2-layer encoders of these widths on the CPU
_TINY_WIDTHS = {"t5-v1.1-xxl": 64, "clip-l": 32, "clip-g": 32, "qwen2.5-vl-7b": 64}
_GB = 1e9


def _check_args(models, schemes, batch, repeats, iters, warmup):
    from ..schemes import SCHEME_NAMES, scheme as lookup

    if isinstance(models, str):
        models = (models,)
    if not models:
        raise ValueError("models: expected at least one model")
    for m in models:
        if m not in components.pipeline_names():
            raise ValueError(f"models: {m!r} has no random-weight text encoders; expected names from "
                             f"{', '.join(components.pipeline_names())}")
    if isinstance(schemes, str):
        schemes = (schemes,)
    schemes = [s for s in schemes if s != "none"]
    for s in schemes:
        try:
            lookup(s)
        except (KeyError, ValueError, TypeError):
            raise ValueError(f"schemes: unknown scheme {s!r}; expected names from {', '.join(SCHEME_NAMES)}") from None
    for name, value in (("batch", batch), ("repeats", repeats), ("iters", iters)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be a non-negative int, got {warmup!r}")
    return tuple(models), schemes


class _Memory:
    """The device memory's high-water mark while loading, above what was allocated before."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.device = device

    def __enter__(self):
        if self.cuda:
            gc.collect()
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            self.base = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        self.peak = None
        return self

    def __exit__(self, *exc):
        if self.cuda and exc[0] is None:
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device) - self.base


def _load(master, scheme, device):
    """A copy of the CPU master on `device`: moved as is ("none") or quantized layer by layer."""
    from ..quantize import SkippedLayersWarning, quantize_

    enc = copy.deepcopy(master)
    if scheme == "none":
        return enc.to(device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SkippedLayersWarning)
        return quantize_(enc, scheme, device=device, progress=False)


def _main_output(outputs):
    return "embeds" if "embeds" in outputs else "pooled"


def _time_interleaved(fns, *, repeats, warmup, iters, device):
    """{name: (all call times, per-repeat medians)} with the candidates' order rotating per repeat."""
    names = list(fns)
    for n in names:
        time_runs(fns[n], warmup=warmup, iters=0, device=device)
    runs = {n: [] for n in names}
    for r in range(repeats):
        k = r % len(names)
        for n in names[k:] + names[:k]:
            runs[n].append(time_runs(fns[n], warmup=1, iters=iters, device=device))
    return {n: ([t for rep in runs[n] for t in rep], [statistics.median(rep) for rep in runs[n]]) for n in names}


def _study_encoder(model, name, kind, family, schemes, *, dtype, device, quick, batch, repeats, warmup, iters, seed):
    length = text_lengths(model)[name]
    ids = components.token_ids(kind, length, batch, seed=seed)
    drawn = components.build_text_encoder(kind, family, dtype=dtype, device=device, seed=seed,
                                          width=_TINY_WIDTHS[kind] if quick else None)
    master = drawn.to("cpu")  # in place: the device copy is gone
    del drawn
    encoders, rows = {}, {}
    for scheme in ["none", *schemes]:
        row = {"model": model, "text_encoder": name, "encoder": kind, "class": type(master).__name__,
               "scheme": scheme, "dtype": str(dtype).replace("torch.", ""), "device": str(device),
               "batch": batch, "tokens": length}
        note = text_encoder_note(master) if scheme != "none" else None
        if note:
            row["note"] = note
        if note and note.startswith(T5_FLOAT16):
            row["error"] = note
            rows[scheme] = row
            continue
        try:
            with _Memory(device) as mem:
                encoders[scheme] = _load(master, scheme, device)
        except Exception as e:  # a scheme this device or encoder cannot take: say so, go on
            row["error"] = f"{type(e).__name__}: {e}"
            rows[scheme] = row
            continue
        row["weights_gb"] = _module_bytes(encoders[scheme]) / _GB
        row["load_peak_gb"] = mem.peak / _GB if mem.peak is not None else None
        rows[scheme] = row
    del master
    with torch.inference_mode():
        outs = {s: components.encoder_outputs(enc, kind, family, ids) for s, enc in encoders.items()}
        fns = {s: (lambda enc=enc: components.encoder_outputs(enc, kind, family, ids)) for s, enc in encoders.items()}
        timed = _time_interleaved(fns, repeats=repeats, warmup=warmup, iters=iters, device=device)
    ref = outs["none"]
    key = _main_output(ref)
    base_medians = timed["none"][1]
    for scheme, (all_ms, medians) in timed.items():  # the schemes loaded, "none" first
        row = rows[scheme]
        stats = latency_stats(all_ms)
        row.update({f"{k}_ms": v for k, v in stats.items() if k != "n"}, calls=stats["n"], repeats=repeats,
                   median_ms=statistics.median(medians), spread_ms=[min(medians), max(medians)])
        if scheme != "none":
            ratios = [b / c for b, c in zip(base_medians, medians)]
            row["speedup"] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
        r, x = ref[key].float(), outs[scheme][key].float()
        row.update(output=key, mse=float(torch.mean((r - x) ** 2)), sqnr_db=sqnr_db(r, x))
        if key == "embeds" and "pooled" in ref:
            row["pooled_sqnr_db"] = sqnr_db(ref["pooled"].float(), outs[scheme]["pooled"].float())
    encoders.clear()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return [rows[s] for s in ["none", *schemes]]


def run_study(models=("flux-dev",), schemes=("fp8dqrow", "fp8wo", "int8wo"), *, dtype=torch.bfloat16,
              device="cuda", quick=False, batch=1, repeats=5, out_dir=None, warmup=2, iters=None, seed=0) -> list[dict]:
    """One row per (model, text encoder, scheme incl. "none" = the unquantized encoder); see the
    module docstring for how each number is made. quick=True: 2-layer encoders on the CPU.
    out_dir: also write text_encoder_study.json and text_encoder_study.md there."""
    models, schemes = _check_args(models, schemes, batch, repeats, iters or 1, warmup)
    device = torch.device("cpu" if quick else device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: CUDA is not available here; use quick=True for the CPU variant")
    iters = iters or (3 if quick else 10)
    rows = []
    for model in models:
        spec = components.pipeline_spec(model)
        for name, kind in spec["text_encoders"].items():
            rows += _study_encoder(model, name, kind, spec["family"], schemes, dtype=dtype, device=device,
                                   quick=quick, batch=batch, repeats=repeats, warmup=warmup, iters=iters, seed=seed)
    if out_dir is not None:
        write_study(rows, out_dir, quick=quick)
    return rows


# ---------------------------------------------------------------- output


def _json_safe(v):
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # "inf" / "nan": JSON has no such numbers
    if isinstance(v, dict):
        return {k: _json_safe(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_json_safe(x) for x in v]
    return v


def markdown_table(rows) -> str:
    measured = [r for r in rows if "error" not in r]
    (weights, weight_cells), (peak, peak_cells) = (
        memory_column(name, [r.get(field) for r in measured])
        for name, field in (("weights", "weights_gb"), ("load peak", "load_peak_gb")))
    head = (f"| model | encoder | scheme | {weights} | {peak} | median ms (spread) | p90 ms | p99 ms "
            "| speed-up | MSE | SQNR dB |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    cells = iter(zip(weight_cells, peak_cells))
    for r in rows:
        enc = f"{r['text_encoder']} ({r['encoder']})"
        if "error" in r:
            lines.append(f"| {r['model']} | {enc} | {r['scheme']} | {r['error']} |" + " |" * 7)
            continue
        weight_cell, peak_cell = next(cells)
        sp = r.get("speedup")
        speed = f"{sp['median']:.2f}x ({sp['min']:.2f}-{sp['max']:.2f})" if sp else "1"
        lines.append(
            f"| {r['model']} | {enc} | {r['scheme']} | {weight_cell} | {peak_cell} "
            f"| {r['median_ms']:.2f} ({r['spread_ms'][0]:.2f}-{r['spread_ms'][1]:.2f}) | {r['p90_ms']:.2f} "
            f"| {r['p99_ms']:.2f} | {speed} | {r['mse']:.3g} | {r['sqnr_db']:.1f} |")
    return "\n".join(lines) + "\n"


def write_study(rows, out_dir, *, quick=False):
    """text_encoder_study.json (rows and where they were measured) and .md (the table) in out_dir."""
    os.makedirs(out_dir, exist_ok=True)
    env = {"torch": torch.__version__, "python": platform.python_version(), "quick": quick,
           "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
    with open(os.path.join(out_dir, "text_encoder_study.json"), "w") as f:
        json.dump(_json_safe({"environment": env, "rows": rows}), f, indent=1)
    with open(os.path.join(out_dir, "text_encoder_study.md"), "w") as f:
        f.write("# Quantized text encoders against bfloat16\n\n")
        f.write(f"torch {env['torch']}, {env['gpu'] or 'CPU'}{', tiny encoders (quick)' if quick else ''}. "
                "Speed-up: bf16 median / median, per repeat, median (min-max). MSE and SQNR: the embedding "
                "the pipeline uses against the bf16 encoder's.\n\n")
        f.write(markdown_table(rows))
        notes = sorted({r["note"] for r in rows if r.get("note") and "error" not in r})
        if notes:
            f.write("\n" + "".join(f"- {n}\n" for n in notes))
