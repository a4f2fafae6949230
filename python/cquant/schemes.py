"""cquant's linear schemes as data: what each stores and what it runs, written once.

A scheme is a weight format with its scale granularity, plus either nothing (weight-only: the
activations stay in the compute dtype) or an activation format and granularity (dynamic: the
activations are quantized on the fly). The math of every scheme is in csrc/include/cquant.h.

    SCHEMES["fp8dqrow"]           the row of a canonical name
    scheme("float8dq_e4m3_row")   any name: canonical, torchao / diffusers alias, or "fpB_eEmM"
    scheme_names(names, what)     the schemes a user listed, checked by the one rule every front
                                  end (verify, bench, demo) applies

Configs (cquant.configs), the loaders, the demo, tests and benchmarks all read this table. Its
hardware floor (the oldest GPU whose kernels run a scheme) is asked from libcquant.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Optional

from . import ops

__all__ = ["Scheme", "SCHEMES", "SCHEME_NAMES", "scheme", "scheme_names", "MIN_IN_FEATURES", "GEMM_ALIGN"]

# Weight granularities with a group size.
GROUPED = ("group", "two_level")

# Smallest in_features any scheme takes: below it the scale and launch overheads outweigh the
# bytes saved, and tensor-core tiles are mostly padding.
MIN_IN_FEATURES = 16
# The CUDA kernels read weight and activation rows in 16-byte vectors; other row lengths take
# element-wise tails, and the 8-bit GEMMs copy the weight into padded rows on every call, which
# costs more than the quantized layer saves. So every scheme asks K to be a multiple of 16.
GEMM_ALIGN = 16


@dataclass(frozen=True)
class Scheme:
    """One row of the table: what a quantized linear layer stores and runs.

    weight_format / act_format are entries of libcquant's format table (act_format None for
    weight-only schemes); granularities are "row" (per output channel / per token), "tensor", or
    "group" (the 4-bit weight formats: one scale per weight_group_size columns of a row) or
    "two_level" (int4: a row scale and an integer multiplier per group of weight_group_size
    columns; weight_group_size is 0 for every other scheme). c_args is (weight_format,
    weight_granularity, act_format, act_granularity, weight_group_size) as libcquant's ints.
    lowrank_rank r > 0 adds a low-rank correction of the weight's rounding error (cquant.lowrank):
    two more stored tensors. Variants of a row are named with suffixes, a group size other than
    the default "_g<size>" and then a rank "_r<rank>" ("int4wo_g64_r16"), which scheme() reads.
    """

    name: str
    weight_format: ops.FormatInfo
    weight_granularity: str = "row"
    act_format: Optional[ops.FormatInfo] = None
    act_granularity: str = "row"
    aliases: tuple = field(default=(), compare=False)
    weight_group_size: int = 0
    lowrank_rank: int = 0
    c_args: tuple = field(init=False, compare=False, repr=False)
    min_compute_capability: int = field(init=False, compare=False, repr=False)

    def __post_init__(self):
        if self.weight_granularity in GROUPED:
            ops.check_group_size(self.weight_group_size, "weight_group_size")
        elif self.weight_group_size:
            raise ValueError(f"scheme {self.name!r}: weight_group_size = {self.weight_group_size} with "
                             f"weight_granularity {self.weight_granularity!r}; expected 0 (groups are for 'group' "
                             "and 'two_level')")
        args = (self.weight_format.id, ops.granularity_id(self.weight_granularity),
                self.act_format.id if self.act_format else ops.FORMAT_NONE, ops.granularity_id(self.act_granularity),
                int(self.weight_group_size))
        object.__setattr__(self, "c_args", args)
        object.__setattr__(self, "min_compute_capability", ops.linear_min_compute_capability(*args))

    @property
    def grouped(self):
        """True when the weight takes scales per group of weight_group_size columns (4-bit schemes)."""
        return self.weight_granularity in GROUPED

    def with_group_size(self, group_size):
        """This scheme with weights grouped by group_size columns (a power of two from
        ops.GROUP_SIZE_MIN to ops.GROUP_SIZE_MAX), named "..._g<size>" unless the size is the
        default (ops.GROUP_SIZE_DEFAULT): the name alone rebuilds it. Only for grouped schemes."""
        if not self.grouped:
            raise ValueError(f"scheme {self.name!r} has no weight groups ({self.weight_granularity} scales); a group "
                             "size is for the 4-bit schemes (int4wo, int4wo_sym, int4dq, int4dq_2l, fp8da_int4w)")
        return self._variant(ops.check_group_size(group_size, "group_size"), self.lowrank_rank)

    @property
    def dynamic(self):
        """True when activations are quantized on the fly (int8dq, fp8dq*)."""
        return self.act_format is not None

    @property
    def code_dtype(self):
        """torch dtype name of the stored codes: int8 for int8, uint8 for fp8 bytes and packed fpX."""
        return "int8" if self.weight_format.code_dtype == "int8" else "uint8"

    def row_bytes(self, in_features):
        """Bytes of one stored weight row of in_features codes (packed and padded for fpX)."""
        return ops.packed_row_bytes(self.weight_format, in_features)

    def scale_shape(self, out_features, in_features=None):
        """Shape of the fp32 weight scales: (N,) per output channel, (1,) per tensor, (N, G) per
        group (G = in_features / weight_group_size), (N, G, 2) for uint4 (scale, zero point), (N, 1 + G)
        for two-level int4 (the row scale, then each group's multiplier)."""
        if not self.grouped:
            return (out_features if self.weight_granularity == "row" else 1,)
        if in_features is None:
            raise ValueError(f"scheme {self.name!r} stores one scale per group of {self.weight_group_size} columns: "
                             "in_features is required to count them")
        if in_features % self.weight_group_size:
            raise ValueError(f"in_features={in_features} is not a multiple of weight_group_size="
                             f"{self.weight_group_size} of scheme {self.name!r}")
        groups = in_features // self.weight_group_size
        if self.weight_granularity == "two_level":
            return (out_features, 1 + groups)
        return (out_features, groups) + ((2,) if self.weight_format.scales_per_group == 2 else ())

    def n_scales(self, out_features, in_features=None):
        """Number of fp32 weight scale values: one per output channel, one for the tensor, or one
        (uint4: two, scale and zero point) per group of each row (two-level: one more a row;
        in_features required)."""
        n = 1
        for d in self.scale_shape(out_features, in_features):
            n *= d
        return n

    def weight_bytes(self, in_features, out_features):
        """Bytes of stored codes and scales (bias not included)."""
        return out_features * self.row_bytes(in_features) + 4 * self.n_scales(out_features, in_features)

    @property
    def base_name(self):
        """The table row's name, without the variant suffixes ("int4wo" of "int4wo_g64_r16")."""
        return self.name[:_SUFFIXES.search(self.name).start()]

    def _variant(self, group_size, rank):
        if (group_size, rank) == (self.weight_group_size, self.lowrank_rank):
            return self
        name = self.base_name + (f"_g{group_size}" if group_size and group_size != ops.GROUP_SIZE_DEFAULT else "")
        name += f"_r{rank}" if rank else ""
        return dataclasses.replace(self, name=name, weight_group_size=group_size, lowrank_rank=rank, aliases=())

    def with_lowrank(self, rank):
        """This scheme with a rank-`rank` low-rank correction (0: without one), named "..._r<rank>".
        Up to lowrank.MAX_FUSED_RANK: a fused q / k / v layer carries the sum of its parts' ranks
        (configs, what users ask for, stop at lowrank.MAX_RANK)."""
        from .lowrank import MAX_FUSED_RANK, check_rank

        return self._variant(self.weight_group_size, check_rank(rank, limit=MAX_FUSED_RANK))

    def lowrank_bytes(self, in_features, out_features, element_size=2):
        """Bytes of the low-rank factors (in a compute dtype of element_size bytes; 0 without them)."""
        return self.lowrank_rank * (in_features + out_features) * element_size

    def refusal(self, in_features, out_features):
        """Why this scheme cannot take a Linear(in_features, out_features), or None if it can."""
        if in_features < MIN_IN_FEATURES:
            return f"in_features={in_features} is below {MIN_IN_FEATURES}: too small to gain from quantization"
        if in_features % GEMM_ALIGN:
            return (f"in_features={in_features} is not a multiple of {GEMM_ALIGN}: rows not 16-byte aligned would "
                    "take the kernels' slow paths (and a padded weight copy on every call)")
        if self.grouped and in_features % self.weight_group_size:
            return (f"in_features={in_features} is not a multiple of the weight group size {self.weight_group_size} "
                    f"of {self.name}: group tails are not supported")
        if self.lowrank_rank > min(in_features, out_features):
            return (f"lowrank rank {self.lowrank_rank} exceeds min(in_features, out_features) = "
                    f"{min(in_features, out_features)}")
        return None


def _row(name, weight, wg="row", act=None, ag="row", aliases=(), group_size=0):
    return Scheme(name, ops.format_info(weight), wg, ops.format_info(act) if act else None, ag, tuple(aliases),
                  weight_group_size=group_size)


def _int4(name, weight, act=None, aliases=(), wg="group"):
    """A 4-bit scheme: weights per group of ops.GROUP_SIZE_DEFAULT columns, activations per token."""
    return _row(name, weight, wg, act, "row", aliases, ops.GROUP_SIZE_DEFAULT)


# The named schemes, in the order the README lists them. Aliases are torchao's and diffusers'
# names of the same thing.
SCHEMES = {s.name: s for s in (
    _row("int8wo", "int8", aliases=("int8_weight_only",)),
    _row("int8dq", "int8", act="int8", aliases=("int8_dynamic_activation_int8_weight",)),
    _row("fp8dqrow", "fp8_e4m3", act="fp8_e4m3", aliases=("float8dq_e4m3_row",)),
    _row("fp8dq", "fp8_e4m3", "tensor", "fp8_e4m3", "tensor",
         aliases=("float8dq", "float8dq_e4m3", "float8dq_e4m3_tensor")),
    _row("fp8wo", "fp8_e4m3", aliases=("float8wo", "float8wo_e4m3", "float8_weight_only")),
    _row("fp8wo_e5m2", "fp8_e5m2", aliases=("float8wo_e5m2",)),
    *(_row(name, name) for name in ("fp6_e3m2", "fp6_e2m3", "fp5_e2m2", "fp4_e2m1")),
    # 4-bit integer weights per group: int4wo is torchao's int4 weight-only (uint4 codes with a
    # zero point per group), int4wo_sym its symmetric variant
    _int4("int4wo", "uint4", aliases=("int4_weight_only",)),
    _int4("int4wo_sym", "int4"),
    _int4("int4dq", "int4", act="int8", aliases=("int8_dynamic_activation_int4_weight",)),
    # int4 codes with a row scale and an integer multiplier (1..16) per group: s2 * code is an
    # int8, so the layer is int8dq's int8 GEMM
    _int4("int4dq_2l", "int4", act="int8", wg="two_level"),
    _int4("fp8da_int4w", "int4", act="fp8_e4m3", aliases=("float8_dynamic_activation_int4_weight",)),
)}

# The schemes the README, the demo and the benchmarks show, one name each.
SCHEME_NAMES = ("int8wo", "int8dq", "fp8dqrow", "fp8dq", "fp8wo", "fp6_e3m2", "fp6_e2m3", "fp5_e2m2", "fp4_e2m1",
                "int4wo", "int4wo_sym", "int4dq", "int4dq_2l", "fp8da_int4w")

_BY_NAME = {alias: s for s in SCHEMES.values() for alias in (s.name, *s.aliases)}
# Variants of a table row are named with suffixes: "_g<size>" for a group size other than the
# default, then "_r<rank>" for a low-rank correction ("int4wo_g64_r16").
_SUFFIXES = re.compile(r"(?:_g([0-9]+))?(?:_r([0-9]+))?$")
_FPX_NAME = re.compile(r"fp([0-9x])_e([0-9])m([0-9])")


def fields_named_by(name):
    """The config fields a scheme name fixes itself: "group_size" ("_gG"), "lowrank_rank" ("_rR"),
    "ebits" and "mbits" (fpB_eEmM); keywords given beside the name may set only the others."""
    key = name.strip().lower()
    suffix = _SUFFIXES.search(key)
    fixed = set()
    if 0 < suffix.start() < len(key) and key not in _BY_NAME:
        fixed |= {"group_size"} if suffix.group(1) is not None else set()
        fixed |= {"lowrank_rank"} if suffix.group(2) is not None else set()
        key = key[:suffix.start()]
    if _FPX_NAME.fullmatch(key):
        fixed |= {"ebits", "mbits"}
    return fixed


def scheme(name):
    """The Scheme a name stands for: a canonical name ("fp8dqrow"), an alias ("float8dq_e4m3_row",
    "int8_weight_only", ...) or any fpX weight-only format "fpB_eEmM" (3 <= B <= 7), each with
    optional suffixes: a group size "_gG" for the 4-bit schemes ("int4wo_g64":
    Scheme.with_group_size(64)), then a low-rank rank "_rR" ("int8wo_r16": Scheme.with_lowrank(16))."""
    if isinstance(name, Scheme):
        return name
    if not isinstance(name, str):
        raise TypeError(f"a scheme name must be a string, got {type(name).__name__}")
    key = name.strip().lower()
    suffix = _SUFFIXES.search(key)
    if 0 < suffix.start() < len(key) and key not in _BY_NAME:
        base = key[:suffix.start()]
        if _SUFFIXES.search(base).start() < len(base) and base not in _BY_NAME:
            raise ValueError(f"scheme {name!r} repeats a suffix; expected at most one group size '_gG', then at "
                             "most one rank '_rR' (e.g. 'int4wo_g64_r16')")
        s = scheme(base)
        group, rank = suffix.group(1), suffix.group(2)
        if group is not None:
            s = s.with_group_size(int(group))
        return s.with_lowrank(int(rank)) if rank is not None else s
    if key in _BY_NAME:
        return _BY_NAME[key]
    m = _FPX_NAME.fullmatch(key)
    if m:
        bits, e, mb = m.group(1), int(m.group(2)), int(m.group(3))
        if bits != "x" and int(bits) != 1 + e + mb:
            raise ValueError(f"scheme {name!r}: fp{bits} does not have 1 + {e} + {mb} bits; did you mean "
                             f"'fp{1 + e + mb}_e{e}m{mb}'?")
        f = ops.fpx_format(e, mb)
        return SCHEMES.get(f.name) or _row(f.name, f.name)
    known = ", ".join(list(_BY_NAME) + ["fpB_eEmM (e.g. fp6_e3m2)"])
    raise ValueError(f"unknown quantization scheme {name!r}; expected one of {known}")


def _canonical_name(name):
    return scheme(name).name


def scheme_names(names, what, canonical=_canonical_name):
    """The canonical names of the schemes a user gave, in their order: one name (a str) or a list.

    The one rule of cquant.verify, `cquant verify`, `cquant bench` and `cquant demo`: ValueError
    (TypeError for a name that is not a str), its message starting with `what` (how the front end
    names the argument: "--quant 'int8wo,int8wo'", "schemes=[]"), for an empty list, an empty
    name, an unknown name, or a scheme named twice, an alias and its scheme ("int8wo" and
    "int8_weight_only") included: each is a slip, and running on would measure other than what
    was asked. canonical(name) gives a name's canonical spelling (default: the scheme's name);
    front ends with values of their own ("none", "torchao:int8wo") pass theirs.
    """
    single = isinstance(names, str)
    names = [names] if single else list(names)
    if not names:
        raise ValueError(f"{what} names no scheme; expected one or more scheme names such as 'int8wo'")
    for i, name in enumerate(names):
        if isinstance(name, str) and not name.strip():
            where = "is empty" if single else f"has an empty scheme name (entry {i + 1})"
            raise ValueError(f"{what} {where}; expected a scheme name such as 'int8wo'")
    out = []
    for name in names:
        try:
            out.append(canonical(name))
        except (TypeError, ValueError) as e:
            raise type(e)(f"{what}: {e}") from None
    for name in dict.fromkeys(out):
        spellings = [given for given, c in zip(names, out) if c == name]
        if len(spellings) > 1:
            said = f" (as {' and '.join(map(repr, dict.fromkeys(spellings)))})" if len(set(spellings)) > 1 else ""
            raise ValueError(f"{what} names {name} {'twice' if len(spellings) == 2 else f'{len(spellings)} times'}"
                             f"{said}; expected each scheme once")
    return out
