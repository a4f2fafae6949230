"""cquant bench: measure schemes and toggles on diffusion transformers, so users can choose one.

    from cquant.bench import default_grid, run_grid, write_report

    grid = default_grid("default", model="flux-dev", batch="1,4")     # [(Cell, skip reason or None)]
    records = run_grid(grid, device="cuda", out="flux.jsonl")         # one JSONL record per cell
    write_report("flux.jsonl", "flux_report")                         # markdown tables + plots

The same from a shell: `cquant bench --help`. Layout: models (random-weight full-size models),
grid (axes, cells, what cannot run), timing / measure (how each number is made), runner,
results (JSONL, resume), report (tables, plots), cli.
"""

__all__ = ["run_grid", "default_grid", "make_grid", "write_report", "read_results", "Cell"]


def __getattr__(name):  # lazy: `import cquant.bench` stays cheap and needs neither diffusers nor matplotlib
    if name == "run_grid":
        from .runner import run_grid

        return run_grid
    if name in ("default_grid", "make_grid", "Cell"):
        from . import grid

        return getattr(grid, name)
    if name == "write_report":
        from .report import write_report

        return write_report
    if name == "read_results":
        from .results import read_results

        return read_results
    raise AttributeError(f"module 'cquant.bench' has no attribute {name!r}")
