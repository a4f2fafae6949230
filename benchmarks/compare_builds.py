"""Two builds of cquant timed by the same benchmarks on the same GPU: does a change cost speed?

Each benchmark (bench_gemv, bench_linear, ...) runs as a process of its own with the `--old`
package on PYTHONPATH, then with the `--new` one, for `--rounds` rounds (old, new, old, new, ...:
drift of the card between processes falls on both), with the benchmark's own interleaved baseline
inside each run. A row (shape and scheme) compares the medians over the rounds of its time and of
its speed-up over the benchmark's baseline (torch bf16 in the same process); a row whose speed-up
fell by more than `--tolerance` is named at the end.

    python benchmarks/compare_builds.py --old old/python --new python --bench gemv --bench linear \\
        --out compare.json

Each package directory holds a built cquant (its cquant/ with _C and libcquant.so); each build runs
the benchmark scripts of its own checkout (the benchmarks/ beside that python/) where it has them.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
# (list of rows in a result file, the keys naming a row, its time field) per benchmark
LAYOUT = {"gemv": (lambda d: [dict(r, M=s["M"], K=s["K"], N=s["N"]) for s in d["shapes"] for r in s["results"]],
                   ("M", "K", "N", "scheme"), "us"),
          "linear": (lambda d: d["results"], ("M", "K", "N", "method"), "ms")}


def script_of(bench, package):
    """A build's own benchmark script (its checkout's benchmarks/, beside its python/), or ours."""
    own = os.path.join(os.path.dirname(os.path.abspath(package)), "benchmarks", f"bench_{bench}.py")
    return own if os.path.exists(own) else os.path.join(HERE, f"bench_{bench}.py")


def run(bench, package, extra, out):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.abspath(package), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, script_of(bench, package), "--out", out, *extra]
    subprocess.run(cmd, env=env, check=True, stdout=sys.stderr)
    with open(out) as f:
        return json.load(f)


def rows_of(bench, data):
    rows_fn, keys, time_key = LAYOUT[bench]
    return {tuple(r[k] for k in keys): (r[time_key], r.get("speedup")) for r in rows_fn(data)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", required=True, help="directory holding the old build's cquant package")
    ap.add_argument("--new", required=True, help="directory holding the new build's cquant package")
    ap.add_argument("--bench", action="append", choices=sorted(LAYOUT), required=True)
    ap.add_argument("--rounds", type=int, default=2, help="old/new pairs of runs per benchmark (default 2)")
    ap.add_argument("--tolerance", type=float, default=0.03, help="speed-up loss that names a row (default 0.03)")
    ap.add_argument("--out", help="write every row of every run as JSON here")
    args, extra = ap.parse_known_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds {args.rounds}; expected at least 1")
    report, slower = {}, []
    with tempfile.TemporaryDirectory() as tmp:
        for bench in args.bench:
            runs = {"old": [], "new": []}
            for i in range(args.rounds):
                for which in ("old", "new"):
                    out = os.path.join(tmp, f"{bench}_{which}_{i}.json")
                    runs[which].append(rows_of(bench, run(bench, getattr(args, which), extra, out)))
            lines = [f"== bench_{bench}: medians over {args.rounds} rounds (time, speed-up over its baseline)",
                     f"{'row':<44} {'old':>9} {'new':>9} {'new/old':>8} {'x old':>7} {'x new':>7}"]
            table = []
            for key in runs["old"][0]:
                if not all(key in r for r in runs["old"] + runs["new"]):
                    continue
                t = {w: statistics.median(r[key][0] for r in runs[w]) for w in runs}
                sp = {w: (statistics.median(r[key][1] for r in runs[w]) if runs[w][0][key][1] is not None else None)
                      for w in runs}
                name = " ".join(str(k) for k in key)
                row = dict(row=name, old=t["old"], new=t["new"], ratio=t["new"] / t["old"], speedup_old=sp["old"],
                           speedup_new=sp["new"])
                table.append(row)
                fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
                lines.append(f"{name:<44} {t['old']:>9.4f} {t['new']:>9.4f} {t['new'] / t['old']:>8.3f} "
                             f"{fmt(sp['old']):>7} {fmt(sp['new']):>7}")
                if sp["old"] and sp["new"] and sp["new"] < sp["old"] * (1 - args.tolerance):
                    slower.append(f"bench_{bench} {name}: x{sp['old']:.2f} -> x{sp['new']:.2f}")
            report[bench] = {"rows": table, "runs": {w: [[[list(k), v] for k, v in r.items()] for r in runs[w]]
                                                     for w in runs}}
            print("\n".join(lines), flush=True)
    print(f"\n{len(slower)} rows lost more than {args.tolerance:.0%} of their speed-up"
          + (":\n  " + "\n  ".join(slower) if slower else ""))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(args=vars(args), extra=extra, report=report, slower=slower), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
