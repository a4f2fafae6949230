"""PEFT LoRA adapters on cquant's quantized layers: merging and unmerging them correctly.

PEFT merges an adapter into its base layer by writing base_layer.weight.data (+= B A * scaling),
which for stored codes is meaningless: int8 and fp8 codes silently dropped the adapter or became
garbage, packed fpX rows raised shape errors. Once peft.tuners.lora.layer is imported, cquant
wraps its Linear.merge and Linear.unmerge (and update_layer); for a QuantizedLinear base layer:

* merge dequantizes the stored weight to fp32 (with its low-rank correction, if any), adds the
  delta of every merged adapter and requantizes it with the layer's scheme (new scales, the same
  group size, and a new low-rank correction of the same rank). The rounding costs accuracy: a
  LoraMergeWarning gives the SQNR of the requantized merged weight against the fp32 merged
  weight. Merging more adapters later requantizes again from the original codes plus every
  merged delta, never from codes rounded once already. safe_merge=True and False do the same:
  the merge is always computed in a copy and checked for non-finite values before anything
  changes. The pre-merge codes, scales, low-rank factors and bias are kept (in CPU memory, so the GPU holds one
  copy of the layer) until
* unmerge, which puts them back bit for bit.

diffusers' fuse_lora / unfuse_lora and PEFT's merge_adapter / unmerge_adapter /
merge_and_unload call these per layer, so they all take this path. Refused with a clear
error: DoRA (its weight norm would be read from the codes), other LoRA variants at merge time,
the views of a QKV-fused layer (QuantizedLinearSlice: merge into the fused layer instead), and
layers whose tensors are still on the meta device. Every other base layer goes to PEFT.
"""

from __future__ import annotations

import functools
import math
import warnings

import torch

from .. import lowrank, torch_ops
from ..nn import QuantizedLinear, QuantizedLinearSlice, _lowrank_factors

__all__ = ["LoraMergeWarning", "install"]

_UNMERGED = "_cquant_unmerged"  # on the LoRA layer: (codes, scales, bias, ..., factors) from before its first merge


class LoraMergeWarning(UserWarning):
    """A LoRA adapter was merged into a quantized layer by requantizing its weight."""


def _quantized_base(lora_layer):
    base = lora_layer.get_base_layer()
    return base if isinstance(base, QuantizedLinear) else None


def _refuse(base, names, lora_layer):
    what = f"cannot merge LoRA adapter(s) {names} into {base._describe()}"
    if isinstance(base, QuantizedLinearSlice):
        raise NotImplementedError(f"{what}: it is a view of rows of a QKV-fused layer (diffusers' "
                                  "fuse_qkv_projections); load the adapter before fusing, or target the fused layer")
    variants = {n: type(lora_layer.lora_variant[n]).__name__ for n in names if n in lora_layer.lora_variant}
    if variants:
        raise NotImplementedError(f"{what}: cquant merges plain LoRA only, not {variants}")
    if base.weight.is_meta or base.weight_scale.is_meta:
        raise RuntimeError(f"{what}: its tensors are on the meta device (never loaded)")


def _sqnr_db(ref, x):
    err = float((ref.double() - x.double()).norm())
    return math.inf if err == 0 else 20 * math.log10(float(ref.double().norm()) / err)


def _dequantize(base, codes, scale, factors=None):
    """The fp32 weight stored as (codes, scale) with the low-rank factors (up, down) if given."""
    wf, wg = base.scheme.c_args[:2]
    device = base.weight.device
    w = torch_ops.dequantize(codes.to(device), scale.to(device), wf, wg, base.in_features, torch.float32,
                             base.scheme.weight_group_size)
    if factors is not None:
        w += lowrank.weight(*(f.to(device) for f in factors))
    return w


def _factors_of(base):
    if not base.scheme.lowrank_rank:
        return None
    return tuple(getattr(base, n).detach().to("cpu") for n in ("lowrank_up", "lowrank_down"))


@torch.no_grad()
def _merge_quantized(lora_layer, base, names):
    _refuse(base, names, lora_layer)
    saved = lora_layer.__dict__.get(_UNMERGED)
    if saved is None:
        bias = base.bias
        saved = (base.weight.detach().to("cpu"), base.weight_scale.to("cpu"),
                 None if bias is None else bias.detach().to("cpu"), None if bias is None else bias.requires_grad,
                 _factors_of(base))
    codes, scale, bias, bias_grad, factors = saved
    merged = list(lora_layer.merged_adapters) + names
    w = _dequantize(base, codes, scale, factors)
    new_bias = None if bias is None else bias.to(device=w.device, dtype=torch.float32, copy=True)
    for name in merged:
        w += lora_layer.get_delta_weight(name).to(device=w.device, dtype=torch.float32)
        if lora_layer.lora_bias[name]:
            if new_bias is None:
                raise RuntimeError("Impossible to merge LoRA with `lora_bias=True` because the base layer has no bias.")
            new_bias += lora_layer.lora_B[name].bias.to(w.device, torch.float32) * lora_layer.scaling[name]
    if not torch.isfinite(w).all() or new_bias is not None and not torch.isfinite(new_bias).all():
        raise ValueError(f"NaNs detected in the merged weights. The adapter(s) {names} seem to be broken; "
                         f"{base._describe()} is left as it was")
    wf, wg = base.scheme.c_args[:2]
    new_codes, new_scale = torch_ops.quantize(w, wf, wg, base.scheme.weight_group_size)  # the same group size
    new_factors = _lowrank_factors(base.scheme, w, new_codes, new_scale, base.compute_dtype, pad=True)
    sqnr = _sqnr_db(w, _dequantize(base, new_codes, new_scale, new_factors))
    base._set_tensors(new_codes, new_scale, None, new_factors)
    if new_bias is not None:
        base.bias = torch.nn.Parameter(new_bias.to(base.compute_dtype), requires_grad=bias_grad)
    lora_layer.__dict__[_UNMERGED] = saved
    lora_layer.merged_adapters.extend(names)
    warnings.warn(f"cquant: merged LoRA adapter(s) {names} into {base._describe()} by requantizing its weight: "
                  f"SQNR {sqnr:.1f} dB of the requantized merged weight against the fp32 merged weight. unmerge() "
                  "restores the original codes exactly", LoraMergeWarning, stacklevel=3)


@torch.no_grad()
def _unmerge_quantized(lora_layer, base):
    codes, scale, bias, bias_grad, factors = lora_layer.__dict__.pop(_UNMERGED)
    device = base.weight.device
    base._set_tensors(codes.to(device), scale.to(device), None,
                      None if factors is None else tuple(f.to(device) for f in factors))
    if bias is not None:
        base.bias = torch.nn.Parameter(bias.to(device=device, dtype=base.compute_dtype), requires_grad=bias_grad)
    lora_layer.merged_adapters.clear()


def install(layer_module):
    """Wrap peft.tuners.lora.layer.Linear's merge, unmerge and update_layer (idempotent)."""
    from peft.tuners.tuners_utils import check_adapters_to_merge

    linear = layer_module.Linear
    if getattr(linear.merge, "_cquant", False):
        return
    peft_merge, peft_unmerge, peft_update = linear.merge, linear.unmerge, linear.update_layer

    @functools.wraps(peft_merge)
    def merge(self, safe_merge=False, adapter_names=None):
        base = _quantized_base(self)
        if base is None:
            return peft_merge(self, safe_merge=safe_merge, adapter_names=adapter_names)
        names = [n for n in check_adapters_to_merge(self, adapter_names) if n in self.lora_A]
        if names:
            _merge_quantized(self, base, names)

    @functools.wraps(peft_unmerge)
    def unmerge(self):
        base = _quantized_base(self)
        if base is None or _UNMERGED not in self.__dict__:
            return peft_unmerge(self)
        _unmerge_quantized(self, base)

    @functools.wraps(peft_update)
    def update_layer(self, adapter_name, *args, **kwargs):
        base = _quantized_base(self)
        config = kwargs.get("config", args[2] if len(args) > 2 else None)
        use_dora = kwargs.get("use_dora", getattr(config, "use_dora", False))
        if base is not None and use_dora:
            raise NotImplementedError(f"cannot add DoRA adapter {adapter_name!r} to {base._describe()}: DoRA reads "
                                      "the base weight's norm from its stored codes; use plain LoRA (use_dora=False)")
        return peft_update(self, adapter_name, *args, **kwargs)

    for fn in (merge, unmerge, update_layer):
        fn._cquant = True
    linear.merge, linear.unmerge, linear.update_layer = merge, unmerge, update_layer
