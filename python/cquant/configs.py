"""Quantization configs: what `cquant.quantize_` is asked to do, in torchao's vocabulary.

A config is a small dataclass with a `version` field. It validates itself when built (raising
TypeError / ValueError, never asserting), round-trips through `to_dict()` / `config_from_dict()`
and JSON, and resolves to a `Scheme`: the weight format, scale granularity and activation
handling that libcquant's linear op runs (see csrc/include/cquant.h for the math).

    Int8WeightOnlyConfig()                              "int8wo"
    Int8DynamicActivationInt8WeightConfig()             "int8dq"
    Float8DynamicActivationFloat8WeightConfig(PerRow()) "fp8dqrow"  ("float8dq_e4m3_row")
    Float8DynamicActivationFloat8WeightConfig(PerTensor()) "fp8dq"  ("float8dq_e4m3_tensor")
    Float8WeightOnlyConfig()                            "fp8wo"     ("float8wo_e4m3")
    FPXWeightOnlyConfig(3, 2)                           "fp6_e3m2"  (any "fpB_eEmM", 3 <= B <= 7)
    FqnToConfig({"re:.*attn.*": "fp8dqrow", "_default": "int8wo", "proj_out": None})
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from typing import ClassVar, Optional

from . import ops

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
    "FqnToConfig",
    "config_from_name",
    "config_from_dict",
    "config_from_json",
    "as_config",
    "scheme_from_name",
    "SCHEME_NAMES",
]

# Version of the config classes' fields (bumped when a field changes meaning); every config
# accepts exactly the versions listed in its SUPPORTED_VERSIONS.
CONFIG_VERSION = 1

# Smallest in_features any scheme takes: below it the scale and launch overheads outweigh the
# bytes saved, and tensor-core tiles are mostly padding.
MIN_IN_FEATURES = 16
# The CUDA kernels read weight and activation rows in 16-byte vectors; other row lengths take
# element-wise tails, and the 8-bit GEMMs copy the weight into padded rows on every call, which
# costs more than the quantized layer saves. So every scheme asks K to be a multiple of 16.
GEMM_ALIGN = 16
# Compute capability each kind of scheme needs on CUDA (kernels/linear.cu, kernels/gemv_wo.cu).
MIN_CC_WEIGHT_ONLY = 80
MIN_CC_INT8_DYNAMIC = 80
MIN_CC_FP8_DYNAMIC = 89


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


# ---------------------------------------------------------------- schemes


@dataclass(frozen=True)
class Scheme:
    """What one quantized linear layer stores and runs.

    weight_format / act_format are entries of libcquant's format table (act_format None for
    weight-only schemes); granularities are "row" or "tensor".
    """

    name: str
    weight_format: ops.FormatInfo
    weight_granularity: str = "row"
    act_format: Optional[ops.FormatInfo] = None
    act_granularity: str = "row"

    @property
    def dynamic(self):
        """True when activations are quantized on the fly (int8dq, fp8dq*)."""
        return self.act_format is not None

    def code_dtype(self):
        """torch dtype name of the stored codes: int8 for int8, uint8 for fp8 bytes and packed fpX."""
        return "int8" if self.weight_format.code_dtype == "int8" else "uint8"

    def row_bytes(self, in_features):
        return ops.packed_row_bytes(self.weight_format, in_features)

    def weight_bytes(self, in_features, out_features):
        """Bytes of stored codes and scales (bias not included)."""
        scales = out_features if self.weight_granularity == "row" else 1
        return out_features * self.row_bytes(in_features) + 4 * scales

    def refusal(self, in_features, out_features):
        """Why this scheme cannot take a Linear(in_features, out_features), or None if it can."""
        if in_features < MIN_IN_FEATURES:
            return f"in_features={in_features} is below {MIN_IN_FEATURES}: too small to gain from quantization"
        if in_features % GEMM_ALIGN:
            return (f"in_features={in_features} is not a multiple of {GEMM_ALIGN}: rows not 16-byte aligned would "
                    "take the kernels' slow paths (and a padded weight copy on every call)")
        return None

    def min_compute_capability(self):
        """Oldest CUDA compute capability (e.g. 89) whose kernels run this scheme."""
        if not self.dynamic:
            return MIN_CC_WEIGHT_ONLY
        return MIN_CC_INT8_DYNAMIC if self.act_format.name == "int8" else MIN_CC_FP8_DYNAMIC

    def c_args(self):
        """(weight_format, weight_granularity, act_format, act_granularity) as libcquant ints."""
        from . import _C

        g = {"row": _C.GRANULARITY_ROW, "tensor": _C.GRANULARITY_TENSOR}
        return (self.weight_format.id, g[self.weight_granularity],
                self.act_format.id if self.act_format else _C.FORMAT_NONE, g[self.act_granularity])


# ---------------------------------------------------------------- configs


def _check_version(cfg):
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

    def scheme(self):  # pragma: no cover - every subclass defines it
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

    def __post_init__(self):
        _check_version(self)

    def scheme(self):
        return Scheme("int8wo", ops.format_info("int8"))


@dataclass
class Int8DynamicActivationInt8WeightConfig(QuantConfig):
    """int8 weights per output channel x int8 activations quantized per token on the fly."""

    version: int = CONFIG_VERSION

    def __post_init__(self):
        _check_version(self)

    def scheme(self):
        i8 = ops.format_info("int8")
        return Scheme("int8dq", i8, "row", i8, "row")


@dataclass
class Float8DynamicActivationFloat8WeightConfig(QuantConfig):
    """fp8 e4m3 weights x fp8 e4m3 activations quantized on the fly.

    granularity: PerRow() (per output channel / per token, "fp8dqrow") or PerTensor() ("fp8dq");
    a pair (activation, weight) as torchao accepts must name the same granularity twice.
    """

    granularity: object = field(default_factory=PerRow)
    version: int = CONFIG_VERSION

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

    def scheme(self):
        f8 = ops.format_info("fp8_e4m3")
        if isinstance(self.granularity, PerRow):
            return Scheme("fp8dqrow", f8, "row", f8, "row")
        return Scheme("fp8dq", f8, "tensor", f8, "tensor")


_FP8_WEIGHT_DTYPES = {"float8_e4m3fn": "fp8_e4m3", "float8_e5m2": "fp8_e5m2"}


@dataclass
class Float8WeightOnlyConfig(QuantConfig):
    """fp8 weights (e4m3 by default, or e5m2), one fp32 scale per output channel."""

    weight_dtype: object = "float8_e4m3fn"
    version: int = CONFIG_VERSION

    def __post_init__(self):
        wd = self.weight_dtype
        name = str(wd).replace("torch.", "") if not isinstance(wd, str) else wd
        name = {"e4m3": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "float8_e4m3": "float8_e4m3fn",
                "e5m2": "float8_e5m2", "fp8_e5m2": "float8_e5m2"}.get(name.lower(), name.lower())
        if name not in _FP8_WEIGHT_DTYPES:
            raise ValueError(f"weight_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {wd!r}")
        self.weight_dtype = name
        _check_version(self)

    def scheme(self):
        fmt = _FP8_WEIGHT_DTYPES[self.weight_dtype]
        return Scheme("fp8wo" if fmt == "fp8_e4m3" else "fp8wo_e5m2", ops.format_info(fmt))


@dataclass
class FPXWeightOnlyConfig(QuantConfig):
    """Weights in a 1 + ebits + mbits bit float (3 to 7 bits, ebits >= 1), bit-packed along rows."""

    ebits: int = 3
    mbits: int = 2
    version: int = CONFIG_VERSION

    def __post_init__(self):
        ops.fpx_format(self.ebits, self.mbits)  # raises TypeError / ValueError naming ebits / mbits
        _check_version(self)

    def scheme(self):
        f = ops.fpx_format(self.ebits, self.mbits)
        return Scheme(f.name, f)


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
                                     FPXWeightOnlyConfig, FqnToConfig)}

_NAMES = {
    "int8wo": Int8WeightOnlyConfig,
    "int8_weight_only": Int8WeightOnlyConfig,
    "int8dq": Int8DynamicActivationInt8WeightConfig,
    "int8_dynamic_activation_int8_weight": Int8DynamicActivationInt8WeightConfig,
    "fp8dqrow": lambda: Float8DynamicActivationFloat8WeightConfig(PerRow()),
    "float8dq_e4m3_row": lambda: Float8DynamicActivationFloat8WeightConfig(PerRow()),
    "fp8dq": lambda: Float8DynamicActivationFloat8WeightConfig(PerTensor()),
    "float8dq": lambda: Float8DynamicActivationFloat8WeightConfig(PerTensor()),
    "float8dq_e4m3": lambda: Float8DynamicActivationFloat8WeightConfig(PerTensor()),
    "float8dq_e4m3_tensor": lambda: Float8DynamicActivationFloat8WeightConfig(PerTensor()),
    "fp8wo": Float8WeightOnlyConfig,
    "float8wo": Float8WeightOnlyConfig,
    "float8wo_e4m3": Float8WeightOnlyConfig,
    "float8_weight_only": Float8WeightOnlyConfig,
    "fp8wo_e5m2": lambda: Float8WeightOnlyConfig("float8_e5m2"),
    "float8wo_e5m2": lambda: Float8WeightOnlyConfig("float8_e5m2"),
}

# The names the README and the demo list, one per scheme.
SCHEME_NAMES = ("int8wo", "int8dq", "fp8dqrow", "fp8dq", "fp8wo", "fp6_e3m2", "fp6_e2m3", "fp5_e2m2", "fp4_e2m1")

_FPX_NAME = re.compile(r"fp([0-9x])_e([0-9])m([0-9])")


def config_from_name(name):
    """The config a torchao / diffusers style string names ("int8wo", "float8dq_e4m3_row", "fp6_e3m2", ...)."""
    if not isinstance(name, str):
        raise TypeError(f"a scheme name must be a string, got {type(name).__name__}")
    key = name.strip().lower()
    if key in _NAMES:
        return _NAMES[key]()
    m = _FPX_NAME.fullmatch(key)
    if m:
        bits, e, mb = m.group(1), int(m.group(2)), int(m.group(3))
        if bits != "x" and int(bits) != 1 + e + mb:
            raise ValueError(f"scheme {name!r}: fp{bits} does not have 1 + {e} + {mb} bits; did you mean "
                             f"'fp{1 + e + mb}_e{e}m{mb}'?")
        return FPXWeightOnlyConfig(e, mb)
    known = ", ".join(list(_NAMES) + ["fpB_eEmM (e.g. fp6_e3m2)"])
    raise ValueError(f"unknown quantization scheme {name!r}; expected one of {known}")


def scheme_from_name(name):
    return config_from_name(name).scheme()


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
    if cls is FqnToConfig:
        kwargs["fqn_to_config"] = {k: (config_from_dict(v) if isinstance(v, dict) else v)
                                   for k, v in kwargs.get("fqn_to_config", {}).items()}
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
