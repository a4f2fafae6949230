"""Scheme variants for the benchmarks and studies: a cquant scheme, optionally with another weight
group size, written as one string.

    NAME[-gG]      e.g. "int4wo", "int4wo-g64", "int4dq_r32-g128", "fp8dqrow"

NAME is any name cquant.schemes.scheme() takes, its low-rank suffix "_rR" included (a rank-R
correction of the quantization error; module level only, so cquant.quantize_ runs it, not
ops.linear); -gG picks the group size of a group-wise 4-bit scheme (Scheme.with_group_size).
Everything here is read from cquant.schemes / cquant.configs: no scheme is restated.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from cquant import ops
from cquant.configs import config_for_scheme
from cquant.schemes import SCHEME_NAMES, SCHEMES, scheme

_GROUP_SUFFIX = re.compile(r"^(?P<name>.+?)(?:-g(?P<group>\d+))?$")


@dataclass(frozen=True)
class Variant:
    """A parsed variant string: its name as written and the Scheme (group size and rank applied)."""

    name: str
    scheme: object

    @property
    def rank(self):
        """The rank of the scheme's low-rank correction (0: none)."""
        return int(getattr(self.scheme, "lowrank_rank", 0) or 0)

    @property
    def grouped(self):
        return is_grouped(self.scheme)


def is_grouped(s):
    """True for a scheme whose weight scales are per group of columns (the 4-bit ones)."""
    return s.weight_granularity == "group"


def group_size(s):
    """The weight group size of a scheme (0 for per-row / per-tensor scales)."""
    return int(getattr(s, "weight_group_size", 0) or 0) if is_grouped(s) else 0


def _split(spec):
    m = _GROUP_SUFFIX.match(spec.strip())
    if not m:
        raise ValueError(f"variant {spec!r}: expected NAME[-gG], e.g. int4wo-g64 or int4wo_r32-g64")
    return m.group("name"), (int(m.group("group")) if m.group("group") is not None else None)


def parse(spec):
    """The Variant of NAME[-gG]; ValueError naming the problem otherwise."""
    name, group = _split(spec)
    s = scheme(name)
    if group is not None:
        if not is_grouped(s):
            raise ValueError(f"variant {spec!r}: {s.name} has {s.weight_granularity} scales, not groups; -gG applies "
                             "to group-wise 4-bit schemes")
        s = s.with_group_size(group)
    return Variant(spec.strip(), s)


def with_rank(spec, rank):
    """The variant string of `spec` with a rank-`rank` low-rank correction (0: without one)."""
    name, group = _split(spec)
    base = scheme(name)
    if not rank and not getattr(base, "lowrank_rank", 0):
        return spec.strip()
    base = base.with_lowrank(0) if getattr(base, "lowrank_rank", 0) else base
    out = base.name + (f"_r{rank}" if rank else "")
    return out + (f"-g{group}" if group is not None else "")


def label(s):
    """The variant string of a scheme: its name, -gG where the group size is not the default."""
    out = s.name
    default = SCHEMES.get(getattr(s, "base_name", s.name))
    if is_grouped(s) and default is not None and group_size(s) != group_size(default):
        out += f"-g{group_size(s)}"
    return out


def with_group_sizes(names, sizes):
    """Variant strings of `names`, each group-wise scheme once per group size of `sizes` (none:
    its default), the other schemes once."""
    out = []
    for name in names:
        s = parse(name).scheme
        if is_grouped(s) and sizes and _split(name)[1] is None:
            out += [label(s.with_group_size(g)) for g in sizes]
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
    """The cquant config of a Variant (or variant string) for cquant.quantize_ (config_for_scheme:
    the scheme's config, its group size and low-rank rank set)."""
    v = parse(variant) if isinstance(variant, str) else variant
    cfg = config_for_scheme(v.scheme)
    fields = {f.name for f in dataclasses.fields(cfg)}
    if v.grouped and "group_size" in fields and getattr(cfg, "group_size") != group_size(v.scheme):
        cfg = dataclasses.replace(cfg, group_size=group_size(v.scheme))
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
