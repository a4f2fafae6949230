"""The results of a grid: one JSON object per line, appended as each cell finishes.

Every record holds its cell's axes, its stable key, a status ("ok", "skipped" with the reason,
"error" with the exception text), the measurements (cquant.bench.measure), every raw timing, the
run's settings and the environment. A grid that stopped part-way resumes from the file: cells
whose last record is "ok" or "skipped" are not run again ("error" ones only with retry_errors).
"""

from __future__ import annotations

import json
import math
import os

__all__ = ["STATUSES", "ResultStore", "read_results"]

STATUSES = ("ok", "skipped", "error")


def _clean(v):
    """JSON has no NaN / infinity: they are written as strings "nan", "inf", "-inf"."""
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    if isinstance(v, dict):
        return {k: _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    return v


def read_results(path):
    """The records of a results file, the last one of each key (a rerun cell replaces its older
    record), in file order. FileNotFoundError naming the file; ValueError naming the bad line."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"results file {path!r} does not exist")
    latest = {}
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                if n > 1 and not f.read().strip():  # the last line cut short by an interrupted write
                    break
                raise ValueError(f"{path}, line {n}: not a JSON record ({e})") from None
            if not isinstance(rec, dict) or "key" not in rec or rec.get("status") not in STATUSES:
                raise ValueError(f"{path}, line {n}: not a cquant bench record (needs a key and a status)")
            latest.pop(rec["key"], None)
            latest[rec["key"]] = rec
    return list(latest.values())


def _drop_partial_last_line(path):
    """Cut a last line left without its newline by an interrupted write, so appended records
    start on a line of their own."""
    with open(path, "rb+") as f:
        data = f.read()
        if data and not data.endswith(b"\n"):
            f.truncate(data.rfind(b"\n") + 1)


class ResultStore:
    """Append-only JSONL store of one grid run; None path: kept in memory only."""

    def __init__(self, path=None):
        self.path = path
        self.records = {}
        if path and os.path.exists(path):
            _drop_partial_last_line(path)
            self.records = {r["key"]: r for r in read_results(path)}

    def done(self, key, retry_errors=False):
        """True when `key` need not run again: its last record is ok or skipped (or error,
        unless retry_errors)."""
        rec = self.records.get(key)
        if rec is None:
            return False
        return rec["status"] != "error" or not retry_errors

    def append(self, record):
        record = _clean(record)
        self.records[record["key"]] = record
        if self.path:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
                f.flush()
                os.fsync(f.fileno())
        return record
