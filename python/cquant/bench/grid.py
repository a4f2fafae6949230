"""The experiment grid of `cquant bench`: axes, cells, and the combinations that cannot run (with why).

A grid is the union of blocks; a block is the cartesian product of its axis values. Each cell is
one experiment: a model in a mode, quantized by a scheme, with run-time toggles. Cells that cannot
run stay in the grid with the reason (tables, the progress bar and the JSONL show it), so a user
sees what was left out and why.

Axes (AXES): model, mode ("step": one transformer step, "pipeline": the whole pipeline), scheme
("none", a cquant scheme name such as "int4wo_g64", or "torchao:<name>"), quantize_text_encoder,
fuse_qkv, dtype ("bf16", "fp16"), batch, attention ("sdpa", "cquant", "cquant_int8"), optimize
(cquant.optimize), compile (torch.compile), cache (diffusers' FirstBlockCache).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
from dataclasses import dataclass

__all__ = ["Cell", "AXES", "DEFAULTS", "PRESETS", "TORCHAO_SCHEMES", "GridEnv", "grid_env", "make_grid",
           "default_grid", "parse_axis", "check_scheme", "skip_reason", "torch_dtype"]

MODES = ("step", "pipeline")
DTYPES = {"bf16": "bfloat16", "fp16": "float16"}
ATTENTION = {"sdpa": None, "cquant": "bf16", "cquant_int8": "int8"}  # -> cquant.enable_attention mode
# torchao's configs for the same ideas as cquant's schemes (a comparison point; needs torchao)
TORCHAO_SCHEMES = {
    "torchao:int8wo": ("Int8WeightOnlyConfig", {}),
    "torchao:int8dq": ("Int8DynamicActivationInt8WeightConfig", {}),
    "torchao:fp8dqrow": ("Float8DynamicActivationFloat8WeightConfig", {"granularity": "PerRow"}),
    # tinygemm's layout (torch's own _weight_int4pack_mm): the default "plain" needs the mslk package
    "torchao:int4wo": ("Int4WeightOnlyConfig", {"group_size": 128, "int4_packing_format": "tile_packed_to_4d"}),
}
_CHOICES = {"mode": MODES, "dtype": DTYPES, "attention": ATTENTION}  # axes of named values
BOOL_AXES = ("quantize_text_encoder", "fuse_qkv", "optimize", "compile", "cache")
AXES = ("model", "mode", "scheme", "quantize_text_encoder", "fuse_qkv", "dtype", "batch", "attention", "optimize",
        "compile", "cache")
DEFAULTS = dict(model="flux-dev", mode="step", scheme="none", quantize_text_encoder=False, fuse_qkv=False,
                dtype="bf16", batch=1, attention="sdpa", optimize=False, compile=False, cache=False)


@dataclass(frozen=True)
class Cell:
    """One experiment of the grid. `key` names it stably (the JSONL's resume key); `build_key`
    names the built model it needs: cells differing only in run-time toggles (attention,
    optimize, compile, cache) and batch share one quantized model."""

    model: str = DEFAULTS["model"]
    mode: str = DEFAULTS["mode"]
    scheme: str = DEFAULTS["scheme"]
    quantize_text_encoder: bool = False
    fuse_qkv: bool = False
    dtype: str = DEFAULTS["dtype"]
    batch: int = 1
    attention: str = "sdpa"
    optimize: bool = False
    compile: bool = False
    cache: bool = False

    @property
    def key(self):
        return "|".join(f"{a}={_text(getattr(self, a))}" for a in AXES)

    @property
    def build_key(self):
        return (self.model, self.mode, self.scheme, self.quantize_text_encoder, self.fuse_qkv, self.dtype)

    @property
    def baseline(self):
        """The cell every speed-up of this one is measured against: no scheme, eager, the same
        model, mode, dtype and batch."""
        return Cell(model=self.model, mode=self.mode, dtype=self.dtype, batch=self.batch)

    @property
    def is_baseline(self):
        return self == self.baseline

    @property
    def label(self):
        """scheme + toggles, as tables show it: "fp8dqrow +qkv @cquant +opt +compile"."""
        parts = [self.scheme]
        if self.quantize_text_encoder:
            parts.append("+te")
        if self.fuse_qkv:
            parts.append("+qkv")
        if self.attention != "sdpa":
            parts.append(f"@{self.attention}")
        parts += [f"+{name}" for name, on in (("opt", self.optimize), ("compile", self.compile),
                                               ("cache", self.cache)) if on]
        return " ".join(parts)

    def as_dict(self):
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d):
        return cls(**{a: d[a] for a in AXES if a in d})


def _text(v):
    return ("on" if v else "off") if isinstance(v, bool) else str(v)


def torch_dtype(name):
    import torch

    return getattr(torch, DTYPES[name])


# ---------------------------------------------------------------- parsing axis values


def check_scheme(name):
    """The canonical spelling of a scheme axis value; ValueError otherwise (the caller names the axis)."""
    if name == "none" or name in TORCHAO_SCHEMES:
        return name
    from ..schemes import scheme

    try:
        return scheme(name).name
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{e}; or 'none' (unquantized), or one of {', '.join(TORCHAO_SCHEMES)}") from None


def _check_model(name):
    from .models import MODEL_NAMES, resolve_name

    if not isinstance(name, str) or not name:
        raise ValueError(f"model must be a name, got {name!r}")
    try:
        resolve_name(name)
        return next((n for n in MODEL_NAMES if resolve_name(n) == resolve_name(name)), name)
    except ValueError:
        if os.path.isdir(name) or ("/" in name and not name.startswith((".", "/")) and name.count("/") == 1):
            return name  # a local directory or a hub id "org/name": a real checkpoint
        raise


def parse_axis(axis, values):
    """Axis values from a comma list or a list: checked, converted (booleans from off/on, batch
    to int). ValueError naming the axis and what was expected (an empty entry of a comma list,
    "int8wo,,fp8dqrow", included: cquant.demo.comma_list). Values named twice run once, except
    schemes, which are refused (cquant.schemes.scheme_names)."""
    if axis not in AXES:
        raise ValueError(f"unknown grid axis {axis!r}; expected one of {', '.join(AXES)}")
    if isinstance(values, str):
        from ..demo import comma_list

        items = comma_list(values, axis, "value", f"comma-separated {axis} values")
    else:
        items = list(values)  # an empty string among them is refused below, as any bad value of the axis is
    if not items:
        raise ValueError(f"{axis}: no value given")
    if axis == "scheme":  # the rule of every front end's scheme list: each scheme once, aliases included
        from ..schemes import scheme_names

        return scheme_names(items, f"scheme {values!r}", canonical=check_scheme)
    out = []
    for v in items:
        if axis in BOOL_AXES:
            if isinstance(v, bool):
                out.append(v)
            elif str(v).lower() in ("on", "true", "1", "yes"):
                out.append(True)
            elif str(v).lower() in ("off", "false", "0", "no"):
                out.append(False)
            else:
                raise ValueError(f"{axis}: {v!r} is not on or off")
        elif axis == "batch":
            try:
                b = int(v)
            except (TypeError, ValueError):
                raise ValueError(f"batch: {v!r} is not a whole number") from None
            if b < 1:
                raise ValueError(f"batch: {b} is below 1")
            out.append(b)
        elif axis in _CHOICES:
            if v not in _CHOICES[axis]:
                raise ValueError(f"{axis}: {v!r}; expected one of {', '.join(_CHOICES[axis])}")
            out.append(v)
        else:
            out.append(_check_model(v))
    return list(dict.fromkeys(out))


# ---------------------------------------------------------------- what cannot run, and why


@dataclass(frozen=True)
class GridEnv:
    """What decides which cells can run here: the device type, the CUDA compute capability (e.g.
    90; None off CUDA), whether torchao imports, and why libcquant's kernels cannot run on the
    GPU at all (a CPU-only build, no kernel image for it; None when they can)."""

    device: str = "cpu"
    capability: int | None = None
    torchao: bool = False
    cquant_refusal: str | None = None


def grid_env(device="cpu"):
    """The GridEnv of `device` ("cuda", "cuda:1", "cpu")."""
    import importlib.util

    import torch

    dev = torch.device(device)
    cap = refusal = None
    if dev.type == "cuda" and torch.cuda.is_available():
        from ..device_fallback import device_refusal

        index = dev.index if dev.index is not None else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        cap = 10 * major + minor
        refusal = device_refusal(index)
    return GridEnv(device=dev.type, capability=cap, torchao=importlib.util.find_spec("torchao") is not None,
                   cquant_refusal=refusal)


@functools.lru_cache(maxsize=None)
def _optimize_refusal(model):
    """Why cquant.optimize fuses nothing in `model` (asked from cquant's own block table on the
    tiny model of the same class), or None; None also for real checkpoints (known only once
    loaded: the runner records what optimize reports)."""
    from .models import load_config, model_info, resolve_name

    try:
        resolve_name(model)
    except ValueError:
        return None
    import torch
    import diffusers

    from ..blocks import fused_classes, static_refusal

    info = model_info(model)
    with torch.device("meta"):
        tiny = getattr(diffusers, info["class"])(**load_config(model, tiny=True))
    fused = fused_classes()
    reasons = []
    for mod in tiny.modules():
        cls = fused.get(type(mod))
        if cls is None:
            continue
        why = static_refusal(mod, cls)
        if why is None and cls._cquant_unfused.__name__ != "AdaLayerNormContinuous":
            return None
        if why:
            reasons.append(why)
    return (f"cquant.optimize has no fused block for {info['class']}" +
            (f" ({reasons[0]})" if reasons else ""))


@functools.lru_cache(maxsize=None)
def _fuse_qkv_refusal(model):
    from .models import model_info, resolve_name

    try:
        resolve_name(model)
    except ValueError:
        return None
    import diffusers

    cls = getattr(diffusers, model_info(model)["class"])
    if not callable(getattr(cls, "fuse_qkv_projections", None)):
        return f"{cls.__name__} has no fuse_qkv_projections()"
    return None


def _pipeline_refusal(model):
    try:
        from .pipeline import pipeline_support
    except ImportError as e:
        return f"pipeline mode is not available ({e})"
    return pipeline_support(model)


def skip_reason(cell, env=GridEnv()):
    """Why `cell` cannot run in `env`, or None. Asked from cquant (scheme hardware floors, the
    fused-block table) and from cquant.bench.pipeline, never restated here."""
    if cell.mode == "step" and cell.quantize_text_encoder:
        return "step mode runs the transformer alone: there is no text encoder to quantize"
    if cell.mode == "step" and cell.cache:
        return "a step cache (FirstBlockCache) needs a denoising loop: pipeline mode only"
    if cell.quantize_text_encoder and cell.scheme == "none":
        return "scheme none quantizes no text encoder"
    if cell.quantize_text_encoder and cell.scheme in TORCHAO_SCHEMES:
        return "text encoders are quantized with cquant schemes only"
    if cell.scheme in TORCHAO_SCHEMES:
        if not env.torchao:
            return "torchao is not importable"
        if "fp8" in cell.scheme and (env.capability or 0) < 89:
            return "torchao's float8 kernels need a CUDA GPU of compute capability 8.9 or newer"
        if cell.scheme == "torchao:int4wo" and env.device != "cuda":
            return "torchao's int4 weight-only kernels run on CUDA GPUs"
        if cell.scheme == "torchao:int4wo" and cell.dtype != "bf16":
            return "torchao's int4 weight-only kernels compute in bfloat16 only"
    elif cell.scheme != "none":
        from ..nn import COMPUTE_DTYPES
        from ..schemes import scheme

        if env.cquant_refusal:  # its layers would run a float fallback: no cquant number to measure
            return f"cquant's kernels cannot run on this GPU: {env.cquant_refusal}"
        s = scheme(cell.scheme)
        if torch_dtype(cell.dtype) not in COMPUTE_DTYPES:
            return f"cquant schemes do not compute in {cell.dtype}"
        if env.capability is not None and env.capability < s.min_compute_capability:
            need = s.min_compute_capability
            return (f"{s.name} needs compute capability {need // 10}.{need % 10}; this GPU has "
                    f"{env.capability // 10}.{env.capability % 10}")
    if env.cquant_refusal and (cell.optimize or cell.attention != "sdpa"):
        return f"cquant's kernels cannot run on this GPU: {env.cquant_refusal}"
    if cell.optimize:
        why = _optimize_refusal(cell.model)
        if why:
            return why
        if cell.scheme in TORCHAO_SCHEMES:
            return "cquant.optimize's fused blocks run cquant's layers, not torchao's"
    if cell.fuse_qkv:
        why = _fuse_qkv_refusal(cell.model)
        if why:
            return why
    if cell.mode == "pipeline":
        why = _pipeline_refusal(cell.model)
        if why:
            return why
    return None


# ---------------------------------------------------------------- grids


def _all_cquant_schemes():
    from ..schemes import SCHEME_NAMES

    return list(SCHEME_NAMES)


def _preset_blocks(name):
    """The blocks of a preset: lists of {axis: values} whose products are unioned."""
    if name == "quick":  # the CPU smoke grid: a tiny model, a handful of cells
        return [dict(scheme=["none", "int8wo", "int8dq"]), dict(scheme=["none", "int8dq"], optimize=[True])]
    if name == "default":
        return [dict(scheme=["none"] + _all_cquant_schemes() + list(TORCHAO_SCHEMES)),
                dict(scheme=["none", "fp8dqrow", "int8dq"], fuse_qkv=[False, True], attention=["sdpa", "cquant"],
                     optimize=[False, True]),
                dict(scheme=["none", "fp8dqrow", "torchao:fp8dqrow"], compile=[True])]
    if name == "product":  # exactly the product of the axes given (the others at their defaults)
        return [dict()]
    raise ValueError(f"grid {name!r}: expected one of {', '.join(PRESETS)}")


PRESETS = ("default", "quick", "product")


def make_grid(blocks, overrides=None, env=GridEnv()):
    """[(Cell, skip reason or None)] of the union of `blocks` (each {axis: values}, missing axes at
    DEFAULTS), every axis in `overrides` ({axis: values}) replacing that axis in every block.
    Order: by build key (the baseline's first), so cells that share a built model run together."""
    overrides = {a: parse_axis(a, v) for a, v in (overrides or {}).items()}
    cells = []
    for block in blocks:
        axes = {a: parse_axis(a, block[a]) if a in block else [DEFAULTS[a]] for a in AXES}
        axes.update(overrides)
        for values in itertools.product(*(axes[a] for a in AXES)):
            cells.append(Cell(**dict(zip(AXES, values))))
    # every speed-up is measured against its baseline cell: it is always in the grid
    cells += [c.baseline for c in cells]
    cells = list(dict.fromkeys(cells))
    models = list(dict.fromkeys(c.model for c in cells))

    def order(c):  # baselines first; then by built model; toggles off before on
        return (models.index(c.model), c.mode, c.dtype, not c.is_baseline, c.scheme != "none",
                c.build_key, c.batch, c.attention, c.optimize, c.compile, c.cache)

    cells.sort(key=order)
    return [(c, skip_reason(c, env)) for c in cells]


def default_grid(preset="default", *, env=GridEnv(), **overrides):
    """[(Cell, skip reason or None)] of a preset ("default" or "quick") with axes overridden by
    keyword (model="flux-dev,sd3-medium", scheme=[...], batch="1,4", ...)."""
    if preset not in PRESETS:
        raise ValueError(f"grid {preset!r}: expected one of {', '.join(PRESETS)}")
    return make_grid(_preset_blocks(preset), {a: v for a, v in overrides.items() if v is not None}, env)
