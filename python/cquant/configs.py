"""Quantization configs: what `cquant.quantize_` is asked to do, in torchao's vocabulary.

A config is a small dataclass with a `version` field. It validates itself when built (raising
TypeError / ValueError, never asserting), round-trips through `to_dict()` / `config_from_dict()`
and JSON, and resolves to a `Scheme`: the weight format, scale granularity and activation
handling that libcquant's linear op runs (see csrc/include/cquant.h for the math).

The 4-bit configs take group_size, the columns sharing one scale (a power of two from 32 to
1024; 128 by default, as torchao's): a name carries it when it is not the default ("int4wo_g64"),
and config_from_name("int4wo", group_size=64) takes it as diffusers' TorchAoConfig passes it.
Every config takes lowrank_rank (keyword only, 0 by default): a low-rank correction of the
quantization error (cquant.lowrank), named with a suffix ("int4wo_r16", "int4wo_g64_r16").

    Int8WeightOnlyConfig()                              "int8wo"
    Int8DynamicActivationInt8WeightConfig()             "int8dq"
    Float8DynamicActivationFloat8WeightConfig(PerRow()) "fp8dqrow"  ("float8dq_e4m3_row")
    Float8DynamicActivationFloat8WeightConfig(PerTensor()) "fp8dq"  ("float8dq_e4m3_tensor")
    Float8WeightOnlyConfig()                            "fp8wo"     ("float8wo_e4m3")
    FPXWeightOnlyConfig(3, 2)                           "fp6_e3m2"  (any "fpB_eEmM", 3 <= B <= 7)
    Int4WeightOnlyConfig(group_size=128)                "int4wo"    ("int4_weight_only"; "int4wo_g64", ...)
    Int4WeightOnlyConfig(symmetric=True)                "int4wo_sym"
    Int8DynamicActivationInt4WeightConfig()             "int4dq"
    Int8DynamicActivationInt4TwoLevelWeightConfig()     "int4dq_2l"
    Float8DynamicActivationInt4WeightConfig()           "fp8da_int4w"
    FqnToConfig({"re:.*attn.*": "fp8dqrow", "_default": "int8wo", "proj_out": None})
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from typing import ClassVar, Optional

from . import ops
from .lowrank import check_rank
from .schemes import SCHEME_NAMES, SCHEMES, Scheme, fields_named_by, scheme

__all__ = [
    "CONFIG_VERSION",
    "QuantConfig",
    "Scheme",
    "PerRow",
    "PerTensor",
    "Int8WeightOnlyConfig",
    "Int8DynamicActivationInt8WeightConfig",
    "Float8DynamicActivationFloat8WeightConfig",
    "Float8WeightOnlyConfig",
    "FPXWeightOnlyConfig",
    "Int4WeightOnlyConfig",
    "Int8DynamicActivationInt4WeightConfig",
    "Int8DynamicActivationInt4TwoLevelWeightConfig",
    "Float8DynamicActivationInt4WeightConfig",
    "FqnToConfig",
    "config_from_name",
    "with_fields",
    "config_from_dict",
    "config_from_json",
    "as_config",
    "scheme_from_name",
    "config_for_scheme",
    "SCHEME_NAMES",
]

# Version of the config classes' fields (bumped when a field changes meaning); every config
# accepts exactly the versions listed in its SUPPORTED_VERSIONS.
CONFIG_VERSION = 1

# ---------------------------------------------------------------- granularities


@dataclass(frozen=True)
class PerRow:
    """One fp32 scale per row: per output channel for weights, per token for activations."""

    def to_dict(self):
        return {"type": "PerRow"}


@dataclass(frozen=True)
class PerTensor:
    """One fp32 scale for the whole tensor."""

    def to_dict(self):
        return {"type": "PerTensor"}


_GRANULARITY_TYPES = {"PerRow": PerRow, "PerTensor": PerTensor}


def _granularity_from(value, name="granularity"):
    if isinstance(value, (PerRow, PerTensor)):
        return value
    if isinstance(value, str):
        key = {"row": "PerRow", "perrow": "PerRow", "tensor": "PerTensor", "pertensor": "PerTensor"}.get(value.lower())
        if key:
            return _GRANULARITY_TYPES[key]()
    if isinstance(value, dict) and value.get("type") in _GRANULARITY_TYPES:
        return _GRANULARITY_TYPES[value["type"]]()
    if isinstance(value, type) and value in (PerRow, PerTensor):
        raise TypeError(f"{name} must be an instance, PerRow() or PerTensor(); got the class {value.__name__}")
    raise TypeError(f"{name} must be PerRow() or PerTensor(), got {value!r}")


# ---------------------------------------------------------------- configs


def _check_version(cfg):
    if hasattr(cfg, "lowrank_rank"):
        check_rank(cfg.lowrank_rank)
    v = cfg.version
    if not isinstance(v, int) or isinstance(v, bool):
        raise TypeError(f"{type(cfg).__name__}.version must be an int, got {type(v).__name__}")
    if v not in cfg.SUPPORTED_VERSIONS:
        raise ValueError(f"{type(cfg).__name__}.version = {v} is not supported by this cquant "
                         f"(supported: {sorted(cfg.SUPPORTED_VERSIONS)}); upgrade cquant to read it")


class QuantConfig:
    """Base of the per-layer configs. Subclasses are dataclasses with a `version` field."""

    SUPPORTED_VERSIONS: ClassVar[frozenset] = frozenset({CONFIG_VERSION})

    @property
    def name(self):
        """Canonical string name ("int8wo", "fp8dqrow", "fp6_e3m2", ...); config_from_name inverts it."""
        return self.scheme().name

    def scheme(self):
        """The Scheme this config quantizes with (its low-rank correction included)."""
        return self._scheme().with_lowrank(self.lowrank_rank)

    def _scheme(self):  # pragma: no cover - every subclass defines it
        raise NotImplementedError

    def to_dict(self):
        d = {"type": type(self).__name__}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            d[f.name] = v.to_dict() if hasattr(v, "to_dict") else v
        return d

    def to_json(self):
        return json.dumps(self.to_dict(), sort_keys=True)


@dataclass
class Int8WeightOnlyConfig(QuantConfig):
    """int8 weights (symmetric, one fp32 scale per output channel); activations stay as they are."""

    version: int = CONFIG_VERSION
    lowrank_rank: int = field(default=0, kw_only=True)

    def __post_init__(self):
        _check_version(self)

    def _scheme(self):
        return SCHEMES["int8wo"]


@dataclass
class Int8DynamicActivationInt8WeightConfig(QuantConfig):
    """int8 weights per output channel x int8 activations quantized per token on the fly."""

    version: int = CONFIG_VERSION
    lowrank_rank: int = field(default=0, kw_only=True)

    def __post_init__(self):
        _check_version(self)

    def _scheme(self):
        return SCHEMES["int8dq"]


@dataclass
class Float8DynamicActivationFloat8WeightConfig(QuantConfig):
    """fp8 e4m3 weights x fp8 e4m3 activations quantized on the fly.

    granularity: PerRow() (per output channel / per token, "fp8dqrow") or PerTensor() ("fp8dq");
    a pair (activation, weight) as torchao accepts must name the same granularity twice.
    """

    granularity: object = field(default_factory=PerRow)
    version: int = CONFIG_VERSION
    lowrank_rank: int = field(default=0, kw_only=True)

    def __post_init__(self):
        g = self.granularity
        if isinstance(g, (list, tuple)):
            if len(g) != 2:
                raise ValueError(f"granularity as a sequence must be (activation, weight), got {len(g)} items")
            a, w = (_granularity_from(x, "granularity") for x in g)
            if type(a) is not type(w):
                raise ValueError("granularity: activation and weight granularities must match "
                                 f"(PerRow, PerRow) or (PerTensor, PerTensor); got ({type(a).__name__}, {type(w).__name__})")
            g = a
        self.granularity = _granularity_from(g)
        _check_version(self)

    def _scheme(self):
        return SCHEMES["fp8dqrow" if isinstance(self.granularity, PerRow) else "fp8dq"]


_FP8_WEIGHT_DTYPES = {"float8_e4m3fn": "fp8_e4m3", "float8_e5m2": "fp8_e5m2"}


@dataclass
class Float8WeightOnlyConfig(QuantConfig):
    """fp8 weights (e4m3 by default, or e5m2), one fp32 scale per output channel."""

    weight_dtype: object = "float8_e4m3fn"
    version: int = CONFIG_VERSION
    lowrank_rank: int = field(default=0, kw_only=True)

    def __post_init__(self):
        wd = self.weight_dtype
        name = str(wd).replace("torch.", "") if not isinstance(wd, str) else wd
        name = {"e4m3": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "float8_e4m3": "float8_e4m3fn",
                "e5m2": "float8_e5m2", "fp8_e5m2": "float8_e5m2"}.get(name.lower(), name.lower())
        if name not in _FP8_WEIGHT_DTYPES:
            raise ValueError(f"weight_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {wd!r}")
        self.weight_dtype = name
        _check_version(self)

    def _scheme(self):
        return SCHEMES["fp8wo" if _FP8_WEIGHT_DTYPES[self.weight_dtype] == "fp8_e4m3" else "fp8wo_e5m2"]


@dataclass
class FPXWeightOnlyConfig(QuantConfig):
    """Weights in a 1 + ebits + mbits bit float (3 to 7 bits, ebits >= 1), bit-packed along rows."""

    ebits: int = 3
    mbits: int = 2
    version: int = CONFIG_VERSION
    lowrank_rank: int = field(default=0, kw_only=True)

    def __post_init__(self):
        ops.fpx_format(self.ebits, self.mbits)  # raises TypeError / ValueError naming ebits / mbits
        _check_version(self)

    def _scheme(self):
        return scheme(ops.fpx_format(self.ebits, self.mbits).name)


def _check_group_size(cfg):
    gs = cfg.group_size
    if not isinstance(gs, int) or isinstance(gs, bool):
        raise TypeError(f"{type(cfg).__name__}.group_size must be an int (columns per scale), got {type(gs).__name__}")
    if not ops.GROUP_SIZE_MIN <= gs <= ops.GROUP_SIZE_MAX or gs & (gs - 1):
        raise ValueError(f"{type(cfg).__name__}.group_size = {gs}; expected a power of two from {ops.GROUP_SIZE_MIN} "
                         f"to {ops.GROUP_SIZE_MAX} (columns sharing one scale; 128 is torchao's default)")


@dataclass
class Int4WeightOnlyConfig(QuantConfig):
    """4-bit weights with one scale per group of group_size columns; activations stay as they are.

    As torchao's Int4WeightOnlyConfig: unsigned codes [0, 15] with an integer zero point per group
    ("int4wo"); symmetric=True takes signed codes [-7, 7] and no zero point ("int4wo_sym").
    Layers whose in_features group_size does not divide are left unquantized (and reported)."""

    group_size: int = 128
    symmetric: bool = False
    version: int = CONFIG_VERSION
    lowrank_rank: int = field(default=0, kw_only=True)

    def __post_init__(self):
        _check_group_size(self)
        if not isinstance(self.symmetric, bool):
            raise TypeError(f"Int4WeightOnlyConfig.symmetric must be a bool, got {self.symmetric!r}")
        _check_version(self)

    def _scheme(self):
        return SCHEMES["int4wo_sym" if self.symmetric else "int4wo"].with_group_size(self.group_size)


@dataclass
class Int8DynamicActivationInt4WeightConfig(QuantConfig):
    """Symmetric 4-bit weights per group of group_size columns x int8 activations quantized per
    token on the fly ("int4dq")."""

    group_size: int = 128
    version: int = CONFIG_VERSION
    lowrank_rank: int = field(default=0, kw_only=True)

    def __post_init__(self):
        _check_group_size(self)
        _check_version(self)

    def _scheme(self):
        return SCHEMES["int4dq"].with_group_size(self.group_size)


@dataclass
class Int8DynamicActivationInt4TwoLevelWeightConfig(QuantConfig):
    """4-bit weights with a row scale and an integer multiplier (1..16) per group of group_size
    columns x int8 activations quantized per token on the fly ("int4dq_2l": int8dq's GEMM on the
    weight rows s2 * code)."""

    group_size: int = 128
    version: int = CONFIG_VERSION
    lowrank_rank: int = field(default=0, kw_only=True)

    def __post_init__(self):
        _check_group_size(self)
        _check_version(self)

    def _scheme(self):
        return SCHEMES["int4dq_2l"].with_group_size(self.group_size)


@dataclass
class Float8DynamicActivationInt4WeightConfig(QuantConfig):
    """Symmetric 4-bit weights per group of group_size columns x fp8 e4m3 activations quantized
    per token on the fly ("fp8da_int4w"; fp8 tensor cores: compute capability 8.9+)."""

    group_size: int = 128
    version: int = CONFIG_VERSION
    lowrank_rank: int = field(default=0, kw_only=True)

    def __post_init__(self):
        _check_group_size(self)
        _check_version(self)

    def _scheme(self):
        return SCHEMES["fp8da_int4w"].with_group_size(self.group_size)


# ---------------------------------------------------------------- per-module mapping


@dataclass
class FqnToConfig:
    """Per-module configs, keyed by fully qualified module name or by regex.

    Keys: an exact fqn ("transformer_blocks.0.attn.to_q"), a regex with the "re:" prefix that must
    match the whole fqn ("re:.*ff\\.net.*"), and "_default" for every other selected layer. Values:
    a config, a string name, or None (leave the module unquantized; it is reported as skipped).
    Exact names win over regexes; regexes are tried in insertion order.
    """

    fqn_to_config: dict = field(default_factory=dict)
    version: int = CONFIG_VERSION

    SUPPORTED_VERSIONS: ClassVar[frozenset] = frozenset({CONFIG_VERSION})

    def __post_init__(self):
        if not isinstance(self.fqn_to_config, dict):
            raise TypeError(f"fqn_to_config must be a dict of name or 're:regex' -> config, got "
                            f"{type(self.fqn_to_config).__name__}")
        resolved = {}
        for key, value in self.fqn_to_config.items():
            if not isinstance(key, str):
                raise TypeError(f"fqn_to_config keys must be strings, got {key!r}")
            if key.startswith("re:"):
                try:
                    re.compile(key[3:])
                except re.error as e:
                    raise ValueError(f"fqn_to_config key {key!r} is not a valid regex: {e}") from None
            if value is not None:
                value = as_config(value, allow_mapping=False, what=f"fqn_to_config[{key!r}]")
            resolved[key] = value
        self.fqn_to_config = resolved
        _check_version(self)
        self._regexes = [(k, re.compile(k[3:]), v) for k, v in resolved.items() if k.startswith("re:")]

    def config_for(self, fqn):
        """(config or None, matched key or None) for a module name."""
        if fqn in self.fqn_to_config:
            return self.fqn_to_config[fqn], fqn
        for key, rx, cfg in self._regexes:
            if rx.fullmatch(fqn):
                return cfg, key
        if "_default" in self.fqn_to_config:
            return self.fqn_to_config["_default"], "_default"
        return None, None

    def to_dict(self):
        return {"type": "FqnToConfig", "version": self.version,
                "fqn_to_config": {k: (v.to_dict() if v is not None else None) for k, v in self.fqn_to_config.items()}}

    def to_json(self):
        return json.dumps(self.to_dict(), sort_keys=True)

    def __eq__(self, other):
        return isinstance(other, FqnToConfig) and self.to_dict() == other.to_dict()


# ---------------------------------------------------------------- names, dicts, JSON

_CLASSES = {c.__name__: c for c in (Int8WeightOnlyConfig, Int8DynamicActivationInt8WeightConfig,
                                     Float8DynamicActivationFloat8WeightConfig, Float8WeightOnlyConfig,
                                     FPXWeightOnlyConfig, Int4WeightOnlyConfig, Int8DynamicActivationInt4WeightConfig,
                                     Int8DynamicActivationInt4TwoLevelWeightConfig,
                                     Float8DynamicActivationInt4WeightConfig, FqnToConfig)}

def config_for_scheme(s):
    """The config that resolves to Scheme s (the inverse of config.scheme())."""
    if not isinstance(s, Scheme):
        raise TypeError(f"config_for_scheme takes a cquant Scheme (cquant.schemes.scheme(name)), got {type(s).__name__}")
    cfg = _base_config_for_scheme(s)
    return dataclasses.replace(cfg, lowrank_rank=s.lowrank_rank) if s.lowrank_rank else cfg


def _base_config_for_scheme(s):
    w, a = s.weight_format.name, s.act_format.name if s.act_format else None
    if s.grouped:
        gs = s.weight_group_size
        if a is None:
            return Int4WeightOnlyConfig(gs, symmetric=w == "int4")
        if s.weight_granularity == "two_level":
            return Int8DynamicActivationInt4TwoLevelWeightConfig(gs)
        return (Int8DynamicActivationInt4WeightConfig if a == "int8" else Float8DynamicActivationInt4WeightConfig)(gs)
    if a is None:
        if w == "int8":
            return Int8WeightOnlyConfig()
        if w in ("fp8_e4m3", "fp8_e5m2"):
            return Float8WeightOnlyConfig("float8_e4m3fn" if w == "fp8_e4m3" else "float8_e5m2")
        return FPXWeightOnlyConfig(s.weight_format.ebits, s.weight_format.mbits)
    if a == "int8":
        return Int8DynamicActivationInt8WeightConfig()
    return Float8DynamicActivationFloat8WeightConfig(PerRow() if s.weight_granularity == "row" else PerTensor())


def config_from_name(name, **kwargs):
    """The config a torchao / diffusers style string names ("int8wo", "float8dq_e4m3_row", "fp6_e3m2",
    "int4wo", ...), with `kwargs` setting its fields as diffusers' TorchAoConfig("int4wo",
    group_size=64) passes them (a field the config does not have is a TypeError)."""
    cfg = config_for_scheme(scheme(name))
    if not kwargs:
        return cfg
    clash = sorted(k for k in fields_named_by(name) if k in kwargs and kwargs[k] != getattr(cfg, k))
    if clash:
        raise ValueError(f"{name!r} names {', '.join(f'{k}={getattr(cfg, k)}' for k in clash)}, but the keywords say "
                         f"{', '.join(f'{k}={kwargs[k]}' for k in clash)}; give the field once")
    return with_fields(cfg, kwargs, repr(name))


def with_fields(cfg, kwargs, what=None):
    """cfg with the fields in kwargs replaced (validated as when built)."""
    names = {f.name for f in dataclasses.fields(cfg)} - {"version"}
    unknown = sorted(set(kwargs) - names)
    if unknown:
        raise TypeError(f"{what or type(cfg).__name__} ({type(cfg).__name__}) takes no {', '.join(unknown)}; its fields "
                        f"are {', '.join(sorted(names)) or 'none'}")
    return dataclasses.replace(cfg, **kwargs)


def scheme_from_name(name):
    """The Scheme of a name (cquant.schemes.scheme)."""
    return scheme(name)


def config_from_dict(d):
    """Inverse of `config.to_dict()`."""
    if not isinstance(d, dict):
        raise TypeError(f"expected a config dict, got {type(d).__name__}")
    kind = d.get("type")
    if kind not in _CLASSES:
        raise ValueError(f"config dict has type {kind!r}; expected one of {', '.join(_CLASSES)}")
    cls = _CLASSES[kind]
    kwargs = {k: v for k, v in d.items() if k != "type"}
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(kwargs) - names
    if unknown:
        raise ValueError(f"{kind} has no field(s) {sorted(unknown)}; fields are {sorted(names)}")
    if cls is FqnToConfig and isinstance(kwargs.get("fqn_to_config"), dict):  # else FqnToConfig says what is wrong
        kwargs["fqn_to_config"] = {k: (config_from_dict(v) if isinstance(v, dict) else v)
                                   for k, v in kwargs["fqn_to_config"].items()}
    return cls(**kwargs)


def config_from_json(text):
    return config_from_dict(json.loads(text))


def as_config(value, *, allow_mapping=True, what="config"):
    """A config from a config, a string name, a dict (to_dict() form) or, with allow_mapping,
    a plain {fqn or 're:regex': config} mapping."""
    if isinstance(value, QuantConfig):
        return value
    if isinstance(value, FqnToConfig):
        if not allow_mapping:
            raise TypeError(f"{what}: an FqnToConfig cannot be nested inside another")
        return value
    if isinstance(value, str):
        return config_from_name(value)
    if isinstance(value, dict):
        if "type" in value and isinstance(value["type"], str) and value["type"] in _CLASSES:
            cfg = config_from_dict(value)
            if isinstance(cfg, FqnToConfig) and not allow_mapping:
                raise TypeError(f"{what}: an FqnToConfig cannot be nested inside another")
            return cfg
        if not allow_mapping:
            raise TypeError(f"{what}: a mapping cannot be nested inside another")
        return FqnToConfig(value)
    raise TypeError(f"{what} must be a cquant config, a scheme name such as 'int8wo', or a mapping of module "
                    f"names to configs; got {type(value).__name__}")
