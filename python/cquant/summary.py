"""cquant.summary(model): every linear layer, its scheme, shape, scale layout (per row, per tensor,
or per group of N columns, and the rank of a low-rank correction) and bytes before / after.

The result prints as a text table and renders as an HTML table in Jupyter (_repr_html_); its
`rows` and totals are there for programs.
"""

from __future__ import annotations

import html
from dataclasses import dataclass

import torch

from . import _callable_module
from .nn import QuantizedLinear, QuantizedLinearSlice, _fmt_mb
from .quantize import REPORT_ATTR

__all__ = ["summary", "Summary", "LayerRow"]


@dataclass(frozen=True)
class LayerRow:
    """One linear layer of a model."""

    name: str
    status: str  # "quantized", "view" (rows of a fused layer), "skipped" (a scheme refused it), "excluded", "float"
    scheme: str  # the scheme name, or the dtype of a float layer
    in_features: int
    out_features: int
    bytes_before: int  # the float layer: weight and bias
    bytes_after: int  # what the layer stores now
    note: str  # why a layer is not quantized, or what a view points at
    group_size: int = 0  # columns per weight scale of a 4-bit scheme (0: per row or per tensor)
    lowrank_rank: int = 0  # rank of the layer's low-rank correction (0: none)
    scales: str = ""  # "row", "tensor", "group 128" or "two-level 128", with ", rank 16" for a low-rank correction


def _float_bytes(mod):
    n = mod.weight.nbytes if isinstance(mod.weight, torch.Tensor) else 0
    return n + (mod.bias.nbytes if getattr(mod, "bias", None) is not None else 0)


def _row(name, mod, report):
    if isinstance(mod, QuantizedLinearSlice):
        # its bytes (float and quantized) are counted once, in the fused layer
        return LayerRow(name, "view", mod.scheme.name, mod.in_features, mod.out_features, 0, 0,
                        f"rows {mod.start}:{mod.stop} of a fused layer", *_variant(mod.scheme))
    if isinstance(mod, QuantizedLinear):
        return LayerRow(name, "quantized", mod.scheme.name, mod.in_features, mod.out_features, mod.nbytes_float,
                        mod.nbytes, "", *_variant(mod.scheme))
    kind, reason = report.get(name, ("float", "not quantized"))
    dtype = str(mod.weight.dtype).replace("torch.", "") if isinstance(mod.weight, torch.Tensor) else "?"
    size = _float_bytes(mod)
    return LayerRow(name, kind, dtype, mod.in_features, mod.out_features, size, size, reason)


def _variant(s):
    """(group_size, lowrank_rank, scales) of a LayerRow of a layer of scheme s."""
    kind = "two-level" if s.weight_granularity == "two_level" else "group"
    scales = f"{kind} {s.weight_group_size}" if s.weight_group_size else s.weight_granularity
    return s.weight_group_size, s.lowrank_rank, scales + (f", rank {s.lowrank_rank}" if s.lowrank_rank else "")


def _mb(n):
    return _fmt_mb(n)


class Summary:
    """Per-layer table of a (partly) quantized model. str() is a text table; Jupyter shows HTML."""

    COLUMNS = ("layer", "status", "scheme", "shape", "scales", "before", "after", "note")

    def __init__(self, rows):
        self.rows = list(rows)

    def count(self, status):
        return sum(1 for r in self.rows if r.status == status)

    @property
    def bytes_before(self):
        return sum(r.bytes_before for r in self.rows)

    @property
    def bytes_after(self):
        return sum(r.bytes_after for r in self.rows)

    @property
    def skipped(self):
        """{name: reason} of the layers a scheme could not take."""
        return {r.name: r.note for r in self.rows if r.status == "skipped"}

    def totals_line(self):
        ratio = f" ({self.bytes_before / self.bytes_after:.2f}x smaller)" if self.bytes_after else ""
        return (f"{len(self.rows)} linear layers: {self.count('quantized')} quantized, {self.count('view')} views of "
                f"fused layers, {self.count('skipped')} skipped, {self.count('excluded')} excluded, "
                f"{self.count('float')} float; linear weights {_mb(self.bytes_before)} -> {_mb(self.bytes_after)}"
                f"{ratio}")

    def _cells(self, r):
        return (r.name, r.status, r.scheme, f"{r.in_features} -> {r.out_features}", r.scales, _mb(r.bytes_before),
                _mb(r.bytes_after), r.note)

    def __str__(self):
        table = [self.COLUMNS] + [self._cells(r) for r in self.rows]
        widths = [max(len(row[i]) for row in table) for i in range(len(self.COLUMNS) - 1)]
        lines = []
        for i, row in enumerate(table):
            lines.append("  ".join(c.ljust(w) for c, w in zip(row[:-1], widths)) + "  " + row[-1])
            if i == 0:
                lines.append("-" * (sum(widths) + 2 * len(widths) + len("note")))
        lines.append(self.totals_line())
        return "\n".join(line.rstrip() for line in lines)

    def __repr__(self):
        return f"<cquant.Summary: {self.totals_line()}>"

    def _repr_html_(self):
        head = "".join(f"<th>{html.escape(c)}</th>" for c in self.COLUMNS)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in self._cells(r)) + "</tr>"
                       for r in self.rows)
        return (f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
                f"<p>{html.escape(self.totals_line())}</p>")


def summary(model):
    """A Summary of every torch.nn.Linear in `model` (quantized ones included)."""
    if not isinstance(model, torch.nn.Module):
        hint = "; for a pipeline, pass its denoiser (pipe.transformer)" if hasattr(model, "components") or \
            isinstance(getattr(model, "transformer", None), torch.nn.Module) else ""
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}{hint}")
    report = getattr(model, REPORT_ATTR, None) or {}
    rows, seen = [], set()
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and id(mod) not in seen:
            seen.add(id(mod))
            rows.append(_row(name, mod, report))
    return Summary(rows)


_callable_module.make_callable(__name__, lambda: summary)
