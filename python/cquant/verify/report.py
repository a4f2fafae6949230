"""The result of cquant.verify: per-layer rows, the overhead of the run, the suggested mapping.

    result.table()              text table, worst layers first ("markdown" for a pipe table)
    result._repr_html_()        what Jupyter shows
    result.to_json(path)        the whole result as JSON (non-finite numbers as "inf" / "-inf" / "nan")
    result.suggestion           {"exact.layer.name": "scheme" or None, "_default": None}: a mapping
                                cquant.quantize_ takes (per component for a pipeline)
    save_mapping / load_mapping the suggestion as a JSON file and back, checked as quantize_ reads it
"""

from __future__ import annotations

import html
import json
import math
from dataclasses import asdict, dataclass, field
from typing import Optional

__all__ = ["ShapeCount", "LayerResult", "VerifyResult", "suggest", "save_mapping", "load_mapping"]


@dataclass(frozen=True)
class ShapeCount:
    """One distinct call of a layer: input, weight [out_features, in_features] and output shapes."""

    input: tuple
    weight: tuple
    output: tuple
    calls: int


@dataclass
class LayerResult:
    """One linear layer of the verified run.

    scheme: the layer's scheme, or the float dtype of an unquantized layer. sqnr_db / max_abs_err:
    of the layer's own output against full precision over all its calls (None where not measured:
    a float layer, or no call). candidates: {scheme: {"sqnr_db", "max_abs_err", "bytes"}} of the
    candidate schemes measured on this layer's inputs, or {"refused": reason}. suggested: the
    cheapest candidate above the floor, None (stays unquantized), or "" when no suggestion was asked.
    reference: what the full-precision output was computed from ("reference" weights given to
    verify, the layer's own "float" weight, or its "dequantized" stored weight)."""

    name: str
    scheme: str
    calls: int
    shapes: list
    in_features: int
    out_features: int
    sqnr_db: Optional[float] = None
    max_abs_err: Optional[float] = None
    reference: str = ""
    candidates: dict = field(default_factory=dict)
    suggested: Optional[str] = ""
    note: str = ""

    def sort_key(self):
        """Worst first: NaN, then the lowest SQNR (the layer's own, else its worst candidate's),
        then the layers with nothing measured, then those never called."""
        values = [self.sqnr_db] if self.sqnr_db is not None else [
            c["sqnr_db"] for c in self.candidates.values() if c.get("sqnr_db") is not None]
        if not values:
            return (2 if self.calls else 3, 0.0)
        if any(math.isnan(v) for v in values):
            return (0, -math.inf)
        return (1, min(values))


def _num(v, digits=2):
    if v is None:
        return "-"
    if math.isnan(v):
        return "nan"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return f"{v:.{digits}f}"


def _secs(t):
    return f"{t:.2f} s" if t >= 1 else f"{t * 1e3:.2f} ms"


def _err(v):
    return "-" if v is None else f"{v:.3g}"


def _shapes_text(shapes):
    parts = []
    for s in shapes:
        parts.append(f"{list(s.input)} x {list(s.weight)} -> {list(s.output)} ({s.calls}x)")
    return "; ".join(parts)


def _candidates_text(candidates):
    parts = []
    for name, c in candidates.items():
        parts.append(f"{name} {_num(c['sqnr_db'], 1)}" if "sqnr_db" in c else f"{name} refused")
    return ", ".join(parts)


@dataclass
class VerifyResult:
    """What cquant.verify measured: `rows` (LayerResult, worst first), the run's overhead factor
    (wall time of the verify run / a normal run of the same call), both times in seconds, what
    the full-precision outputs were computed from, the floor and candidates of the suggestion,
    the suggestion itself and notes."""

    rows: list
    overhead: Optional[float] = None
    verify_s: Optional[float] = None
    normal_s: Optional[float] = None
    reference: str = ""
    candidates: list = field(default_factory=list)
    floor_db: Optional[float] = None
    suggestion: Optional[dict] = None
    notes: list = field(default_factory=list)

    COLUMNS = ("layer", "scheme", "calls", "SQNR dB", "max abs err", "candidates (SQNR dB)", "suggested", "shapes")

    def row(self, name):
        """The LayerResult of the layer called `name` (KeyError if none)."""
        for r in self.rows:
            if r.name == name:
                return r
        raise KeyError(f"no layer {name!r} in the result")

    def summary_lines(self):
        called = sum(1 for r in self.rows if r.calls)
        measured = [r for r in self.rows if r.sqnr_db is not None]
        lines = [f"{len(self.rows)} linear layers, {called} called, {sum(r.calls for r in self.rows)} calls; "
                 f"{len(measured)} quantized layers measured against {self.reference or 'nothing'}"]
        if self.overhead is not None:
            lines.append(f"verify run {_secs(self.verify_s)}, normal run {_secs(self.normal_s)}: overhead "
                         f"{self.overhead:.1f}x")
        if self.floor_db is not None:
            kept = sum(1 for r in self.rows if r.suggested)
            lines.append(f"suggestion (floor {self.floor_db:g} dB, candidates {', '.join(self.candidates)}): "
                         f"{kept} layers quantized, the others stay unquantized")
        return lines + [f"note: {n}" for n in self.notes]

    def _cells(self, r):
        sug = "" if r.suggested == "" else (r.suggested or "(float)")
        return (r.name, r.scheme, str(r.calls), _num(r.sqnr_db), _err(r.max_abs_err),
                _candidates_text(r.candidates), sug, _shapes_text(r.shapes) + (f" [{r.note}]" if r.note else ""))

    def table(self, fmt="text", limit=None):
        """The rows as a text table (fmt="text") or a markdown table (fmt="markdown"), worst
        first, the first `limit` rows (None: all), then the summary lines."""
        if fmt not in ("text", "markdown"):
            raise ValueError(f"fmt must be 'text' or 'markdown', got {fmt!r}")
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            raise ValueError(f"limit must be None or an int >= 1 (rows to show), got {limit!r}")  # -1 dropped a row
        rows = [self._cells(r) for r in (self.rows if limit is None else self.rows[:limit])]
        if fmt == "markdown":
            esc = [[c.replace("|", "\\|") for c in row] for row in rows]
            lines = ["| " + " | ".join(self.COLUMNS) + " |", "|" + "---|" * len(self.COLUMNS)]
            lines += ["| " + " | ".join(row) + " |" for row in esc]
            return "\n".join(lines + [""] + [f"- {s}" for s in self.summary_lines()])
        table = [self.COLUMNS] + rows
        widths = [max(len(row[i]) for row in table) for i in range(len(self.COLUMNS) - 1)]
        lines = []
        for i, row in enumerate(table):
            lines.append("  ".join(c.ljust(w) for c, w in zip(row[:-1], widths)) + "  " + row[-1])
            if i == 0:
                lines.append("-" * (sum(widths) + 2 * len(widths) + len(self.COLUMNS[-1])))
        return "\n".join([line.rstrip() for line in lines] + self.summary_lines())

    def __str__(self):
        return self.table()

    def __repr__(self):
        return f"<cquant.VerifyResult: {self.summary_lines()[0]}>"

    def _repr_html_(self):
        head = "".join(f"<th>{html.escape(c)}</th>" for c in self.COLUMNS)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in self._cells(r)) + "</tr>"
                       for r in self.rows)
        notes = "".join(f"<p>{html.escape(s)}</p>" for s in self.summary_lines())
        return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>{notes}"

    def to_dict(self):
        d = asdict(self)
        return _finite(d)

    def to_json(self, path=None):
        """The result as a JSON string (and written to `path` when given)."""
        text = json.dumps(self.to_dict(), indent=1, allow_nan=False)
        if path is not None:
            with open(path, "w", encoding="utf-8") as f:
                f.write(text + "\n")
        return text

    def save_mapping(self, path):
        """Write the suggestion to `path` as JSON (see load_mapping)."""
        if self.suggestion is None:
            raise ValueError("this result has no suggestion: run cquant.verify with schemes=[...] and floor_db=...")
        save_mapping(self.suggestion, path)


def _finite(obj):
    if isinstance(obj, float) and not math.isfinite(obj):
        return "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def _is_nested(mapping):
    return bool(mapping) and "_default" not in mapping and all(isinstance(v, dict) for v in mapping.values())


def suggest(rows, floor_db, components=None, fused_parts=None):
    """Per measured layer, the cheapest candidate whose SQNR is at least floor_db (None when no
    candidate is: the layer stays unquantized); sets each row's `suggested` and returns the
    quantize_ mapping {layer name: scheme or None, "_default": None}. Layers never called are
    left to "_default" (unquantized). components: the component names of a pipeline, whose rows
    are named "component.layer": the mapping is then {component: mapping}. fused_parts {fused
    layer: [its unfused parts]}: the parts get the fused layer's scheme too, so the mapping
    works on the model before QKV fusion as well (quantize_ leaves out the parts of a fused one)."""
    mapping = {}
    for r in rows:
        measured = {k: c for k, c in r.candidates.items() if c.get("sqnr_db") is not None}
        if not r.calls or not measured:
            continue
        pick = None
        for name, c in sorted(measured.items(), key=lambda kv: kv[1]["bytes"]):
            if c["sqnr_db"] >= floor_db:  # NaN never passes
                pick = name
                break
        r.suggested = pick
        mapping[r.name] = pick
        for part in (fused_parts or {}).get(r.name, ()):
            mapping[part] = pick
    if components is None:
        mapping["_default"] = None
        return mapping
    nested = {}
    for name, pick in mapping.items():
        comp, _, rest = name.partition(".")
        nested.setdefault(comp, {"_default": None})[rest] = pick
    return {c: dict(sorted(m.items(), key=lambda kv: kv[0] == "_default")) for c, m in nested.items()}


def save_mapping(mapping, path):
    """Write a quantize_ mapping (or a pipeline's {component: mapping}) to `path` as JSON."""
    _check_mapping(mapping, "mapping")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(mapping, f, indent=1)
        f.write("\n")


def load_mapping(path, component=None):
    """The mapping save_mapping wrote, ready for cquant.quantize_(model, mapping).

    A pipeline's file holds {component: mapping}: `component` picks one ("transformer"); without
    it the whole dict is returned (quantize each component with its own mapping). Raises
    ValueError naming the file when it is not such a mapping (an unknown scheme included)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"path: no mapping file {path!r}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"path: {path!r} is not JSON ({e})") from None
    _check_mapping(data, repr(path))
    if component is None:
        return data
    if not _is_nested(data):
        raise ValueError(f"component={component!r}: {path!r} holds the mapping of a single model, not per component")
    if component not in data:
        raise ValueError(f"component={component!r}: {path!r} has mappings for {sorted(data)}")
    return data[component]


def _check_mapping(mapping, what):
    from ..configs import FqnToConfig

    if not isinstance(mapping, dict) or not mapping:
        raise ValueError(f"{what}: expected a non-empty dict of layer names to scheme names, got "
                         f"{type(mapping).__name__}")
    for m in (mapping.values() if _is_nested(mapping) else [mapping]):
        bad = [k for k, v in m.items() if not isinstance(k, str) or not (v is None or isinstance(v, str))]
        if bad:
            raise ValueError(f"{what}: entries {bad[:3]} are not 'layer name': 'scheme' or null")
        try:
            FqnToConfig(m)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{what}: not a mapping cquant.quantize_ takes ({e})") from None
