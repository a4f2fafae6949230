"""CQuantConfig: cquant as a `quantization_config=` of diffusers and transformers.

    transformer = FluxTransformer2DModel.from_pretrained(..., quantization_config=CQuantConfig("fp8dqrow"),
                                                         dtype=torch.bfloat16)
    CQuantConfig("int4wo", group_size=64)   # a scheme's fields as keywords, as diffusers' TorchAoConfig
    pipe = FluxPipeline.from_pretrained(..., quantization_config=PipelineQuantizationConfig(
        quant_mapping={"transformer": CQuantConfig("fp8dqrow"), "text_encoder_2": CQuantConfig("int8wo")}))

One class serves both libraries (it derives from transformers' QuantizationConfigMixin when
transformers is installed, and implements the methods diffusers calls), so the same object
works in a PipelineQuantizationConfig's quant_mapping for diffusers and transformers
components alike. `import cquant` registers it under quant_method "cquant".

A saved quantized model carries its CQuantConfig in config.json with `quantized_layers`: the
scheme of every quantized layer, so loading rebuilds exactly those layers (on the meta device,
without ever materializing float weights) whatever filter or mapping produced them.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from enum import Enum
from typing import Optional

from .. import ops
from ..configs import FqnToConfig, QuantConfig, as_config, config_from_name, with_fields
from ..schemes import scheme

__all__ = ["CQuantConfig", "CQuantMethod", "QUANT_METHOD"]

QUANT_METHOD = "cquant"


class CQuantMethod(str, Enum):
    # the member's name equals its value, so it hashes and compares like the plain string
    cquant = QUANT_METHOD


def _mixin_bases():
    try:
        from transformers.utils.quantization_config import QuantizationConfigMixin
    except Exception:  # transformers missing or broken: cquant's own methods suffice for diffusers
        return ()
    return (QuantizationConfigMixin,)


def _quant_type_to_json(qt):
    """Short form where it round-trips: a scheme name, else the config's dict."""
    if isinstance(qt, QuantConfig):
        try:
            if config_from_name(qt.name) == qt:
                return qt.name
        except ValueError:
            pass
    return qt.to_dict()


def _with_kwargs(quant_type, kwargs):
    """The config quant_type names, with fields set from kwargs."""
    if isinstance(quant_type, str):
        return config_from_name(quant_type, **kwargs)
    config = as_config(quant_type, what="quant_type")
    if isinstance(config, QuantConfig):
        return with_fields(config, kwargs)
    raise TypeError(f"CQuantConfig got keyword arguments {sorted(kwargs)}, which set the fields of one scheme; "
                    f"quant_type is a {type(quant_type).__name__}: put them in its configs instead")


@dataclass(init=False)
class CQuantConfig(*_mixin_bases()):
    """Quantization config of a diffusers / transformers model for cquant.

    Args:
        quant_type: what to quantize with: a scheme name ("int8wo", "int8dq", "fp8dqrow",
            "float8dq_e4m3_tensor", "fp8wo", "fp6_e3m2", ...), a config
            (Float8DynamicActivationFloat8WeightConfig(PerRow()), ...), an FqnToConfig or a dict
            {fqn or "re:regex" or "_default": config or None}.
        modules_to_not_convert: module names (or name prefixes / path components) left unquantized.
        quantized_layers: {fqn: scheme name} of a quantized model; written when a model is saved,
            read back when it is loaded. Leave it None when quantizing.
        format_version: cquant's stored-layout version of quantized_layers (cquant.FORMAT_VERSION
            when written; an older one in cquant.checkpoint.READABLE_FORMAT_VERSIONS loads, and is
            brought up to date when the model is saved again).
        version: version of this config's fields.
        **quant_type_kwargs: fields of the config a scheme name stands for, as diffusers'
            TorchAoConfig("int4wo", group_size=64) passes them (group_size, lowrank_rank, ...);
            they are folded into quant_type, which saves as that config.
    """

    quant_type: object = "int8wo"
    modules_to_not_convert: Optional[list] = None
    quantized_layers: Optional[dict] = None
    format_version: int = ops.FORMAT_VERSION
    version: int = 1
    quant_method: object = field(default=CQuantMethod.cquant, init=False)

    SUPPORTED_VERSIONS = frozenset({1})

    def __init__(self, quant_type="int8wo", modules_to_not_convert=None, quantized_layers=None,
                 format_version=ops.FORMAT_VERSION, version=1, **quant_type_kwargs):
        self.quant_type = quant_type
        self.modules_to_not_convert = modules_to_not_convert
        self.quantized_layers = quantized_layers
        self.format_version = format_version
        self.version = version
        self.quant_method = CQuantMethod.cquant
        if quant_type_kwargs:
            self.quant_type = _with_kwargs(quant_type, quant_type_kwargs)
        self.__post_init__()

    def __post_init__(self):
        self.quant_method = CQuantMethod.cquant
        self.quant_type = as_config(self.quant_type, what="quant_type")
        m = self.modules_to_not_convert
        if m is not None:
            if isinstance(m, str):
                m = [m]
            if not isinstance(m, (list, tuple)) or not all(isinstance(x, str) for x in m):
                raise TypeError(f"modules_to_not_convert must be a list of module names, got {self.modules_to_not_convert!r}")
            self.modules_to_not_convert = list(m)
        if self.quantized_layers is not None:
            if not isinstance(self.quantized_layers, dict):
                raise TypeError(f"quantized_layers must be a dict of module name -> scheme name, got "
                                f"{type(self.quantized_layers).__name__}")
            for k, v in self.quantized_layers.items():
                if not isinstance(k, str) or not isinstance(v, str):
                    raise TypeError(f"quantized_layers must map module names to scheme names; got {k!r}: {v!r}")
                # a scheme, not a config: a fused q / k / v layer's rank may exceed what configs take
                scheme(v)  # raises ValueError naming an unknown scheme
        for name in ("format_version", "version"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool):
                raise TypeError(f"CQuantConfig.{name} must be an int, got {v!r}")
        if self.version not in self.SUPPORTED_VERSIONS:
            raise ValueError(f"CQuantConfig.version = {self.version} is not supported by this cquant "
                             f"(supported: {sorted(self.SUPPORTED_VERSIONS)})")
        from ..checkpoint import check_schemes_in_version, readable_format_version

        readable_format_version(self.format_version, "this quantization_config")
        check_schemes_in_version(self.quantized_layers or {}, self.format_version, "this quantization_config")

    # ------------------------------------------------------------ what the libraries call

    def post_init(self):
        """transformers calls post_init() on some paths; validation already ran in __post_init__."""

    def to_dict(self):
        return {
            "quant_method": QUANT_METHOD,
            "quant_type": _quant_type_to_json(self.quant_type),
            "modules_to_not_convert": copy.deepcopy(self.modules_to_not_convert),
            "quantized_layers": copy.deepcopy(self.quantized_layers),
            "format_version": self.format_version,
            "version": self.version,
        }

    @classmethod
    def from_dict(cls, config_dict, return_unused_kwargs=False, **kwargs):
        if not isinstance(config_dict, dict):
            raise TypeError(f"expected a dict, got {type(config_dict).__name__}")
        d = dict(config_dict)
        method = d.pop("quant_method", QUANT_METHOD)
        if str(getattr(method, "value", method)) != QUANT_METHOD:
            raise ValueError(f"quant_method is {method!r}; a CQuantConfig has quant_method '{QUANT_METHOD}'")
        known = {"quant_type", "modules_to_not_convert", "quantized_layers", "format_version", "version"}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown CQuantConfig field(s) {unknown}; fields are {sorted(known)}")
        config = cls(**d)
        unused = {}
        for key, value in kwargs.items():
            if key in known:
                setattr(config, key, value)
            else:
                unused[key] = value
        if kwargs:
            config.__post_init__()
        return (config, unused) if return_unused_kwargs else config

    def to_json_string(self, use_diff=True):
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    def to_json_file(self, json_file_path):
        with open(json_file_path, "w", encoding="utf-8") as f:
            f.write(self.to_json_string())

    def to_diff_dict(self):
        return self.to_dict()

    def __iter__(self):
        yield from self.to_dict().items()

    def __repr__(self):
        return f"CQuantConfig({_quant_type_to_json(self.quant_type)!r}" + (
            f", {len(self.quantized_layers)} quantized layers)" if self.quantized_layers else ")")

    def update(self, **kwargs):
        unused = {}
        for key, value in kwargs.items():
            if key in ("quant_type", "modules_to_not_convert", "quantized_layers"):
                setattr(self, key, value)
            else:
                unused[key] = value
        self.__post_init__()
        return unused

    def get_loading_attributes(self):
        return {}

    # ------------------------------------------------------------ cquant's own use

    @property
    def is_mapping(self):
        return isinstance(self.quant_type, FqnToConfig)

    def set_layers(self, layers):
        """Record a model's current {fqn: scheme name}, in this cquant's format version (what is
        saved next is written in it)."""
        self.quantized_layers = layers
        self.format_version = ops.FORMAT_VERSION

    def excluded(self, fqn):
        """True when modules_to_not_convert names this module (exactly, as a prefix, or as a path component)."""
        for m in self.modules_to_not_convert or ():
            if fqn == m or fqn.startswith(m + ".") or m in fqn.split("."):
                return True
        return False
