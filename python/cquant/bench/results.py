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

__all__ = ["STATUSES", "ResultStore", "read_results", "check_record"]

STATUSES = ("ok", "skipped", "error")
# what every record holds besides its status (the report groups and labels by these)
RECORD_FIELDS = ("key", "label", "model", "mode", "dtype", "batch")


def _clean(v):
    """JSON has no NaN / infinity: they are written as strings "nan", "inf", "-inf"."""
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    if isinstance(v, dict):
        return {k: _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    return v


def check_record(rec, where):
    """ValueError naming `where` unless rec is a record of cquant bench (what the report reads)."""
    if not isinstance(rec, dict) or rec.get("status") not in STATUSES or any(k not in rec for k in RECORD_FIELDS):
        raise ValueError(f"{where}: not a cquant bench record (needs a status and {', '.join(RECORD_FIELDS)})")


def _records(lines, path, cut_tail_ok, first_line=1):
    """{key: last record} of `lines` (the text of a results file, line by line); ValueError naming
    the first line that is not a record. cut_tail_ok: a last line that is not JSON is the tail of
    an interrupted write and is left out."""
    latest = {}
    for n, line in enumerate(lines, first_line):
        line = line.strip()
        if not line:
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            if cut_tail_ok and n > 1 and not any(x.strip() for x in lines[n - first_line + 1:]):
                break
            raise ValueError(f"{path}, line {n}: not a JSON record ({e})") from None
        check_record(rec, f"{path}, line {n}")
        latest.pop(rec["key"], None)
        latest[rec["key"]] = rec
    return latest


def _read_text(path):
    if not os.path.exists(path):
        raise FileNotFoundError(f"results file {path!r} does not exist")
    if os.path.isdir(path):
        raise ValueError(f"results file {path!r} is a directory; expected a JSONL file")
    with open(path, "rb") as f:
        data = f.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"results file {path!r} is not text (a JSONL file of cquant bench records)") from None


def read_results(path):
    """The records of a results file, the last one of each key (a rerun cell replaces its older
    record), in file order. FileNotFoundError naming the file; ValueError naming the bad line."""
    return list(_records(_read_text(path).split("\n"), path, cut_tail_ok=True).values())


_RECORD_START = '{"key": '  # how every record's line begins (append writes the key first)


class ResultStore:
    """Append-only JSONL store of one grid run; None path: kept in memory only."""

    def __init__(self, path=None):
        self.path = path
        self.records = {}
        if path and os.path.exists(path):
            self.records = self._resume(path)
        if path:
            try:  # a path that cannot be written fails now, not after the first cell has run
                os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
                open(path, "a").close()
            except OSError as e:
                raise ValueError(f"results file {path!r} cannot be written: {e.strerror or e}") from None

    @staticmethod
    def _resume(path):
        """The records of an existing file; a last line without its newline (an interrupted write)
        is cut off so appended records start on a line of their own. Every complete line is checked
        first: a file that is not a results file is refused (ValueError) and left untouched."""
        text = _read_text(path)
        complete, tail = text[:text.rfind("\n") + 1], text[text.rfind("\n") + 1:]
        records = _records(complete.split("\n"), path, cut_tail_ok=False)
        if tail.strip():
            try:
                records.update(_records([tail], path, cut_tail_ok=False, first_line=complete.count("\n") + 1))
            except ValueError:
                if not tail.startswith(_RECORD_START):  # not a record of ours: refuse, touch nothing
                    raise
                # a record cut short by an interrupted write: dropped, its cell runs again
                with open(path, "rb+") as f:
                    f.truncate(len(complete.encode("utf-8")))
                return records
        if text and not text.endswith("\n"):
            with open(path, "a") as f:
                f.write("\n")
        return records

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
