"""Scheme variants for the benchmarks and studies: a cquant scheme, optionally with another weight
group size and a low-rank correction, written as one string.

    NAME[-gG][-rR]      e.g. "int4wo", "int4wo-g64", "int4dq-g128-r32", "fp8dqrow"

NAME is any name cquant.schemes.scheme() takes; -gG picks the group size of a group-wise 4-bit
scheme (Scheme.with_group_size); -rR adds the rank-R low-rank correction of the quantization
error (the configs' lowrank_rank; module level only, so cquant.quantize_ runs it, not ops.linear).
Everything here is read from cquant.schemes / cquant.configs: no scheme is restated.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from cquant import ops
from cquant.configs import config_for_scheme
from cquant.schemes import SCHEME_NAMES, SCHEMES, scheme

_SUFFIX = re.compile(r"^(?P<name>.+?)(?:-g(?P<group>\d+))?(?:-r(?P<rank>\d+))?$")


@dataclass(frozen=True)
class Variant:
    """A parsed variant string: its display name, the Scheme (group size applied) and the rank."""

    name: str
    scheme: object
    rank: int = 0

    @property
    def grouped(self):
        return is_grouped(self.scheme)


def is_grouped(s):
    """True for a scheme whose weight scales are per group of columns (the 4-bit ones)."""
    return s.weight_granularity == "group"


def group_size(s):
    """The weight group size of a scheme (0 for per-row / per-tensor scales)."""
    return int(getattr(s, "weight_group_size", 0) or 0) if is_grouped(s) else 0


def parse(spec):
    """The Variant of NAME[-gG][-rR]; ValueError naming the problem otherwise."""
    m = _SUFFIX.match(spec.strip())
    if not m:
        raise ValueError(f"variant {spec!r}: expected NAME[-gG][-rR], e.g. int4wo-g64-r32")
    s = scheme(m.group("name"))
    if m.group("group") is not None:
        if not is_grouped(s):
            raise ValueError(f"variant {spec!r}: {s.name} has {s.weight_granularity} scales, not groups; -gG applies "
                             "to group-wise 4-bit schemes")
        s = s.with_group_size(int(m.group("group")))
    rank = int(m.group("rank") or 0)
    return Variant(spec.strip(), s, rank)


def label(s, rank=0):
    """The variant string of a scheme: its name, -gG where the group size is not the default."""
    out = s.name
    if is_grouped(s) and group_size(s) != group_size(SCHEMES.get(s.name, s)):
        out += f"-g{group_size(s)}"
    return out + (f"-r{rank}" if rank else "")


def with_group_sizes(names, sizes):
    """Variant strings of `names`, each group-wise scheme once per group size of `sizes` (none:
    its default), the other schemes once."""
    out = []
    for name in names:
        s = parse(name).scheme
        if is_grouped(s) and sizes and "-g" not in name:
            out += [label(s.with_group_size(g)) if g != group_size(s) else name for g in sizes]
        else:
            out.append(name)
    return out


def weight_only_names():
    """The weight-only schemes the README shows (cquant.schemes.SCHEME_NAMES), in its order."""
    return [n for n in SCHEME_NAMES if not SCHEMES[n].dynamic]


# ---------------------------------------------------------------- array level (cquant.ops)


def quantize_weight(s, w):
    """(codes, scales) of weight w [N, K] as Scheme s stores them (ops.quantize)."""
    kw = dict(group_size=group_size(s)) if is_grouped(s) else {}
    return ops.quantize(w, s.weight_format.name, s.weight_granularity, **kw)


def linear_kwargs(s, k):
    """ops.linear's keyword arguments for Scheme s and in_features k."""
    kw = dict(weight_format=s.weight_format.name, weight_granularity=s.weight_granularity,
              act_format=s.act_format.name if s.act_format else None, act_granularity=s.act_granularity,
              in_features=k)
    if is_grouped(s):
        kw["weight_group_size"] = group_size(s)
    return kw


def stored_bytes(codes, scales):
    """Bytes of stored codes and scales."""
    return codes.numel() * codes.element_size() + scales.numel() * scales.element_size()


# ---------------------------------------------------------------- module level (cquant.quantize_)


def config(variant):
    """The cquant config of a Variant (or variant string) for cquant.quantize_: the scheme's
    config with its group size and low-rank rank set."""
    v = parse(variant) if isinstance(variant, str) else variant
    cfg = config_for_scheme(v.scheme)
    fields = {f.name for f in dataclasses.fields(cfg)}
    changes = {}
    if v.grouped and "group_size" in fields:
        changes["group_size"] = group_size(v.scheme)
    if v.rank:
        if "lowrank_rank" not in fields:
            raise ValueError(f"variant {v.name!r}: {type(cfg).__name__} has no low-rank correction (lowrank_rank)")
        changes["lowrank_rank"] = v.rank
    cfg = dataclasses.replace(cfg, **changes) if changes else cfg
    if cfg.scheme() != v.scheme:
        raise ValueError(f"variant {v.name!r}: its config {type(cfg).__name__} resolves to {cfg.scheme()!r}, "
                         f"not {v.scheme!r}")
    return cfg


def module_bytes(model):
    """Bytes a model stores, as users see them (diffusers' get_memory_footprint): every parameter
    and buffer in its stored form (codes, scales, low-rank factors, biases, unquantized layers),
    each tensor once. Works on the meta device (no memory)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) in seen:
            continue
        seen.add(id(t))
        total += t.nelement() * t.element_size()
    return total
