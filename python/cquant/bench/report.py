"""Markdown tables and plots of a grid's results, from the records alone (a JSONL file made on a GPU
machine can be reported anywhere).

    write_report("results.jsonl", "report/")   # report/report.md + report/*.png

Per model / mode / dtype / batch: one table sorted by weights memory and one by latency, then the
cells that were skipped (with the reason) or failed. Sizes are in GB, or in MB in a column whose
sizes all fall below 0.01 GB (tiny models); the header names the unit. Plots (matplotlib, imported
only here): latency against weights memory, latency bars with p90 / p99 whiskers, and quality
(SQNR, or PSNR in pipeline mode) against weights memory.
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
from collections.abc import Iterable, Mapping

from .results import check_record, read_results

__all__ = ["write_report", "markdown", "group_records", "memory_column", "memory_unit"]


def _num(v):
    """A record's number (results store NaN / infinity as strings), or None."""
    if isinstance(v, str):
        try:
            return float(v)
        except ValueError:
            return None
    return v


def _f(v, digits=2):
    v = _num(v)
    if v is None:
        return "-"
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return f"{v:.{digits}f}"


def group_records(records):
    """{(model, mode, dtype, batch): [records]} in the records' order."""
    groups = {}
    for r in records:
        groups.setdefault((r["model"], r["mode"], r["dtype"], r["batch"]), []).append(r)
    return groups


def memory_unit(values_gb):
    """(unit, factor) of a column of sizes in GB: ("GB", 1), or ("MB", 1e3) when every size is
    below 0.01 GB (tiny models), which in GB would read 0.000. One unit for the whole column,
    named in its header, so that its cells are plain numbers that compare."""
    sizes = [abs(v) for v in map(_num, values_gb) if v is not None and math.isfinite(v)]
    return ("MB", 1e3) if sizes and max(sizes) < 0.01 else ("GB", 1.0)


def memory_column(name, values_gb):
    """The header ("weights MB") and the cells (three decimals, in that unit) of a column of sizes
    in GB."""
    unit, factor = memory_unit(values_gb)
    cells = [_f(v) if v is None or not math.isfinite(v) else f"{v * factor:.3f}" for v in map(_num, values_gb)]
    return f"{name} {unit}", cells


def _speedup(r):
    s = _num(r.get("speedup"))
    if s is None:
        return "-"
    lo, hi = _num(r.get("speedup_min")), _num(r.get("speedup_max"))
    spread = f" ({lo:.2f}-{hi:.2f})" if lo is not None and hi is not None else " (not interleaved)"
    return f"{s:.2f}x{spread}"


def _quality(r):
    if r["mode"] == "pipeline":
        return f"{_f(r.get('psnr_db'), 1)} / {_f(r.get('ssim'), 3)}"
    return _f(r.get("sqnr_db"), 1)


def _table(rows, mode, dtype):
    quality = "PSNR dB / SSIM vs none" if mode == "pipeline" else "SQNR dB vs float32"
    pipeline = mode == "pipeline"
    # a pipeline's weights: the transformer's as stored, and the device memory the whole built
    # pipeline holds (text encoders and VAE included)
    weights = [("transformer", "weights_gb"), ("pipeline", "weights_alloc_gb")] if pipeline else [
        ("weights", "weights_gb")]
    memory = [memory_column(name, [r.get(field) for r in rows])
              for name, field in weights + [("load peak", "load_peak_gb"), ("inference peak", "infer_peak_gb")]]
    head = ["scheme + toggles", *(name for name, _ in memory), "mean ms", "p50 ms", "p90 ms", "p99 ms",
            f"speed-up vs {dtype} eager", "compile s", quality]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for i, r in enumerate(rows):
        lat = r.get("latency_ms") or {}
        cells = [r["label"], *(column[i] for _, column in memory),
                 _f(lat.get("mean"), 1), _f(lat.get("p50"), 1), _f(lat.get("p90"), 1), _f(lat.get("p99"), 1),
                 _speedup(r), _f(r.get("compile_s"), 1), _quality(r)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _sort_key(field):
    def key(r):
        v = _num(r.get(field)) if field != "latency" else _num((r.get("latency_ms") or {}).get("p50"))
        return (v is None, v if v is not None else 0.0, r["label"])
    return key


def _timing(settings):
    how = "interleaved" if settings.get("interleaved") else "timed separately"
    w = settings.get("warmup")
    return (f"{settings.get('repeats')} repeats x {settings.get('iters')} timed calls after {w} "
            f"warm-up call{'' if w == 1 else 's'}, baseline {how}{', tiny models' if settings.get('tiny') else ''}")


def _timing_lines(records):
    """How cells were timed: the most common settings, then every other one with its cells (a
    file that several runs appended to may mix them)."""
    by = {}
    for r in records:
        if r.get("settings") and r["status"] == "ok":
            by.setdefault(_timing(r["settings"]), []).append(r)
    if not by:
        return []
    common, *others = sorted(by, key=lambda k: -len(by[k]))
    lines = [f"Timing: {common}" + (" unless listed below" if others else "") + ". Speed-up: median over "
             "repeats of baseline / cell (min-max); peaks relative to the memory allocated before the cell's "
             "model was built.", ""]
    for k in others:
        cells = ", ".join(f"{r['label']} ({r['mode']}, batch {r['batch']})" for r in by[k])
        lines += [f"- {k}: {cells}"]
    return lines + ([""] if others else [])


def markdown(records):
    """The report's markdown text."""
    out = ["# cquant bench results", ""]
    env = next((r.get("env") for r in records if r.get("env")), None)
    if env:
        commit = f" ({env['cquant_commit'][:12]})" if env.get("cquant_commit") else ""
        parts = [env.get("device"), f"torch {env.get('torch')}", f"CUDA {env.get('cuda')}",
                 f"driver {env.get('driver')}" if env.get("driver") else None, f"diffusers {env.get('diffusers')}",
                 f"cquant {env.get('cquant')}{commit}"]
        out += ["Measured on " + ", ".join(p for p in parts if p) + ".", ""]
    out += _timing_lines(records)
    for (model, mode, dtype, batch), rows in group_records(records).items():
        ok = [r for r in rows if r["status"] == "ok"]
        out += [f"## {model}, {mode}, {dtype}, batch {batch}", ""]
        if ok:
            out += ["### By weights memory", "", _table(sorted(ok, key=_sort_key("weights_gb")), mode, dtype), ""]
            out += ["### By latency (p50)", "", _table(sorted(ok, key=_sort_key("latency")), mode, dtype), ""]
        skipped = [r for r in rows if r["status"] == "skipped"]
        if skipped:
            out += ["### Skipped", ""] + [f"- {r['label']}: {r.get('reason')}" for r in skipped] + [""]
        errors = [r for r in rows if r["status"] == "error"]
        if errors:
            out += ["### Failed", ""] + [f"- {r['label']}: {str(r.get('error')).splitlines()[0][:300]}"
                                        for r in errors] + [""]
    return "\n".join(out)


def _slug(*parts):
    return re.sub(r"[^A-Za-z0-9._-]+", "_", "_".join(str(p) for p in parts)).strip("_")


def _plots(records, out_dir):
    """Three plots per model / mode / dtype / batch with measured cells; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for (model, mode, dtype, batch), rows in group_records(records).items():
        ok = [r for r in rows if r["status"] == "ok" and r.get("latency_ms")]
        if not ok:
            continue
        title = f"{model}, {mode}, {dtype}, batch {batch}"
        slug = _slug(model, mode, dtype, f"b{batch}")
        p50 = [_num(r["latency_ms"]["p50"]) for r in ok]
        unit, factor = memory_unit([r.get("weights_gb") for r in ok])
        mem = [(_num(r.get("weights_gb")) or 0.0) * factor for r in ok]

        fig, ax = plt.subplots(figsize=(7, 5))
        ax.scatter(mem, p50)
        for r, x, y in zip(ok, mem, p50):
            ax.annotate(r["label"], (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.set(xlabel=f"weights {unit}", ylabel="latency p50 ms", title=f"latency vs memory: {title}")
        paths.append(_save(fig, out_dir, f"{slug}_latency_vs_memory.png"))

        fig, ax = plt.subplots(figsize=(max(6, 0.5 * len(ok)), 5))
        xs = range(len(ok))
        p90 = [_num(r["latency_ms"]["p90"]) for r in ok]
        p99 = [_num(r["latency_ms"]["p99"]) for r in ok]
        ax.bar(xs, p50, color="tab:blue", label="p50")
        ax.errorbar(xs, p50, yerr=[[0] * len(ok), [b - a for a, b in zip(p50, p90)]], fmt="none", ecolor="black",
                    capsize=4, label="p90")
        ax.scatter(xs, p99, marker="_", color="tab:red", s=120, label="p99", zorder=3)
        ax.set_xticks(list(xs))
        ax.set_xticklabels([r["label"] for r in ok], rotation=60, ha="right", fontsize=7)
        ax.set(ylabel="latency ms", title=f"latency: {title}")
        ax.legend()
        paths.append(_save(fig, out_dir, f"{slug}_latency_bars.png"))

        field, label = ("psnr_db", "PSNR dB vs none") if mode == "pipeline" else ("sqnr_db", "SQNR dB vs float32")
        q = [(_num(r.get(field)), m, r["label"]) for r, m in zip(ok, mem)]
        q = [t for t in q if t[0] is not None and math.isfinite(t[0])]
        if q:
            fig, ax = plt.subplots(figsize=(7, 5))
            ax.scatter([t[1] for t in q], [t[0] for t in q])
            for y, x, name in q:
                ax.annotate(name, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
            ax.set(xlabel=f"weights {unit}", ylabel=label, title=f"quality vs memory: {title}")
            paths.append(_save(fig, out_dir, f"{slug}_quality_vs_memory.png"))
    return paths


def _save(fig, out_dir, name):
    import matplotlib.pyplot as plt

    path = os.path.join(out_dir, name)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_report(results, out_dir, *, plots=True):
    """Write out_dir/report.md (and the plots, when matplotlib imports) from `results`: a JSONL
    path or a list of records. Returns {"markdown": path, "plots": [paths], "note": why no plots}."""
    if isinstance(results, (str, os.PathLike)):
        records = read_results(results)
    else:
        if isinstance(results, Mapping) or not isinstance(results, Iterable):
            raise TypeError(f"results: expected a JSONL path or a list of records, got {type(results).__name__}")
        records = list(results)
        for i, r in enumerate(records):
            check_record(r, f"results[{i}]")
    os.makedirs(out_dir, exist_ok=True)
    md = os.path.join(out_dir, "report.md")
    with open(md, "w") as f:
        f.write(markdown(records) + "\n")
    out = {"markdown": md, "plots": [], "note": None}
    if plots:
        if importlib.util.find_spec("matplotlib") is None:
            out["note"] = "no plots: matplotlib is not installed (pip install 'cquant[bench]')"
        else:
            out["plots"] = _plots(records, out_dir)
    return out
