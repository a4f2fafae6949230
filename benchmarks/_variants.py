"""Scheme variants for the benchmarks and studies, named as cquant.schemes names them: a table
row with optional suffixes, a group size other than the default "_gG" (4-bit schemes), then a
low-rank correction "_rR".

    "int4wo", "int4wo_g64", "int4dq_g32_r32", "fp8dqrow", "int8wo_r16"

The low-rank correction lives in the torch layer (cquant.quantize_ runs it, ops.linear does
not). Everything here is read from cquant.schemes / cquant.configs: no scheme is restated.
"""

from __future__ import annotations

from dataclasses import dataclass

from cquant import ops
from cquant.configs import config_for_scheme
from cquant.demo import comma_list
from cquant.schemes import SCHEME_NAMES, SCHEMES, scheme


@dataclass(frozen=True)
class Variant:
    """A parsed variant name: the name as written and its Scheme."""

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
    return s.grouped


def group_size(s):
    """The weight group size of a scheme (0 for per-row / per-tensor scales)."""
    return int(getattr(s, "weight_group_size", 0) or 0) if is_grouped(s) else 0


def parse(spec):
    """The Variant of a scheme name (cquant.schemes.scheme); ValueError naming the problem otherwise."""
    return Variant(spec.strip(), scheme(spec))


def with_rank(spec, rank):
    """The name of `spec` with a rank-`rank` low-rank correction (0: without one); `spec` itself
    where nothing changes."""
    s = scheme(spec)
    return spec.strip() if rank == s.lowrank_rank else s.with_lowrank(rank).name


def with_group_sizes(names, sizes):
    """The names, each group-wise scheme once per group size of `sizes` (none: as named), the
    other schemes once."""
    out = []
    for name in names:
        s = scheme(name)
        out += [s.with_group_size(g).name for g in sizes] if is_grouped(s) and sizes else [name]
    return list(dict.fromkeys(out))


def group_sizes(text):
    """The --group-sizes option of the benchmarks: "" (its default) for none, else comma-separated
    whole numbers; ValueError naming the option otherwise (an empty entry, "32,,64", included)."""
    if text == "":
        return []
    expected = "comma-separated whole numbers such as 32,64"
    sizes = comma_list(text, "--group-sizes", "group size", expected)
    try:
        return [int(g) for g in sizes]
    except ValueError:
        raise ValueError(f"--group-sizes {text!r}: expected {expected}") from None


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
    """The cquant config of a Variant (or name) for cquant.quantize_ (config_for_scheme)."""
    v = parse(variant) if isinstance(variant, str) else variant
    cfg = config_for_scheme(v.scheme)
    if cfg.scheme() != v.scheme:
        raise ValueError(f"variant {v.name!r}: its config {type(cfg).__name__} resolves to {cfg.scheme().name!r}, "
                         f"not {v.scheme.name!r}")
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
