"""diffusers and transformers integration: quantizer registration and model bookkeeping.

Neither library has a public registration API for third-party quantizers that both share, so
cquant adds itself to their quantizer tables (AUTO_QUANTIZER_MAPPING and
AUTO_QUANTIZATION_CONFIG_MAPPING of diffusers.quantizers.auto and transformers.quantizers.auto)
as soon as those modules are imported: immediately if they already are when cquant is
imported, otherwise right after the module executes (cquant._import_hooks). The same way, it
guards each library's float loading path against cquant checkpoints whose config.json lost its
quantization_config (float_loading). Importing cquant therefore never imports diffusers or
transformers itself. Failures (a library version that moved these tables or methods) become a
warning, never a failed import.
"""

from __future__ import annotations

import sys
import threading
import warnings

__all__ = ["install_import_hooks", "registered", "RegistrationWarning"]

QUANT_METHOD = "cquant"


class RegistrationWarning(UserWarning):
    """cquant could not add its quantizer to diffusers' or transformers' tables."""


_registered = {}  # library -> True once registered
_lock = threading.RLock()


def _keep_configs_in_sync():
    """quantize_, dequantize_ and fuse_qkv_ keep a diffusers / transformers model's quantization_config."""
    from ..quantize import add_sync_hook
    from .model_config import sync_quantization_config

    add_sync_hook(sync_quantization_config)


def _register_diffusers(auto):
    from .diffusers_quantizer import CQuantDiffusersQuantizer
    from .hf_config import CQuantConfig

    _keep_configs_in_sync()
    _put(auto, "diffusers", CQuantDiffusersQuantizer, CQuantConfig)


def _register_transformers(auto):
    from .hf_config import CQuantConfig
    from .transformers_quantizer import CQuantHfQuantizer

    _keep_configs_in_sync()
    _put(auto, "transformers", CQuantHfQuantizer, CQuantConfig)


def _put(auto, library, quantizer_cls, config_cls):
    quantizers = getattr(auto, "AUTO_QUANTIZER_MAPPING", None)
    configs = getattr(auto, "AUTO_QUANTIZATION_CONFIG_MAPPING", None)
    if not isinstance(quantizers, dict) or not isinstance(configs, dict):
        raise RuntimeError(f"{auto.__name__} has no AUTO_QUANTIZER_MAPPING / AUTO_QUANTIZATION_CONFIG_MAPPING dicts")
    for table, cls in ((quantizers, quantizer_cls), (configs, config_cls)):
        other = table.get(QUANT_METHOD)
        if getattr(other, "_cquant_placeholder", False):  # _cquant_autoload's stand-in until now
            other = None
        if other is not None and other is not cls and getattr(other, "__module__", "").split(".")[0] != "cquant":
            raise RuntimeError(f"{library} already maps '{QUANT_METHOD}' to {other!r}")
        table[QUANT_METHOD] = cls
    _registered[library] = True


def _guard_float_loading(module):
    from .float_loading import install

    name = module.__name__
    try:
        install(name, module)
    except Exception as e:  # a layout cquant does not know: warn, keep the library working
        warnings.warn(f"cquant could not guard {name.split('.')[0]}'s loading of quantized checkpoints without "
                      f"a cquant quantization_config ({type(e).__name__}: {e}); such a checkpoint would load its codes "
                      "as float weights there", RegistrationWarning, stacklevel=2)


_TARGETS = {"diffusers.quantizers.auto": _register_diffusers, "transformers.quantizers.auto": _register_transformers}
_GUARDED = ("diffusers.models.modeling_utils", "transformers.modeling_utils")


def _run(name, module):
    with _lock:
        try:
            _TARGETS[name](module)
        except Exception as e:  # a library layout cquant does not know: warn, keep the import working
            warnings.warn(f"cquant could not register its quantizer with {name.split('.')[0]} "
                          f"({type(e).__name__}: {e}); quantization_config=CQuantConfig(...) will not work there, "
                          "cquant.quantize_ still does", RegistrationWarning, stacklevel=2)


def install_import_hooks():
    """Register with diffusers / transformers now if imported, else right after they are (idempotent)."""
    from .._import_hooks import after_import

    for name in _TARGETS:
        if not _registered.get(name.split(".")[0]):
            after_import(name, lambda name=name: _run(name, sys.modules[name]))
    for name in _GUARDED:
        after_import(name, lambda name=name: _guard_float_loading(sys.modules[name]))
    after_import("peft.tuners.lora.layer", _merge_lora_into_quantized_layers)
    after_import("diffusers.loaders.lora_pipeline", _load_lora_into_fused_views)


def _merge_lora_into_quantized_layers():
    """PEFT's LoRA merge / unmerge learn cquant's layers (cquant.integrations.peft_lora)."""
    from .peft_lora import install

    install(sys.modules["peft.tuners.lora.layer"])


def _load_lora_into_fused_views():
    """Flux's load_lora_weights learns the views cquant's QKV fusion leaves (cquant.integrations.diffusers_lora)."""
    from .diffusers_lora import install

    install(sys.modules["diffusers.loaders.lora_pipeline"])


def registered():
    """{"diffusers": bool, "transformers": bool}: where cquant's quantizer is registered."""
    return {lib: bool(_registered.get(lib)) for lib in ("diffusers", "transformers")}
