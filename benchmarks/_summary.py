"""One line per benchmark result file: the median speed-up of each candidate over its baseline.

    python benchmarks/_summary.py gpu-results/bench_*.json
"""

import json
import os
import sys


def main(paths):
    for path in paths:
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError) as e:
            print(f"{os.path.basename(path)}: unreadable ({e})")
            continue
        h = data.get("headline")
        if not h:
            print(f"{os.path.basename(path)}: no headline")
            continue
        device = data.get("info", {}).get("device", "?")
        items = ", ".join(f"{name} {value:.2f}x" for name, value in h["speedup"].items())
        print(f"{os.path.basename(path)} ({device}; vs {h['baseline']}, {h['note']}): {items}")


if __name__ == "__main__":
    main(sys.argv[1:])
