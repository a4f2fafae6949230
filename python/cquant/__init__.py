"""cquant: quantized linear layers and attention for diffusion transformers, in C and CUDA."""

from . import _libs

_libs.export_cublaslt_path()

from . import ops
from .ops import CudaError

__version__ = ops.VERSION
FORMAT_VERSION = ops.FORMAT_VERSION

__all__ = ["CudaError", "FORMAT_VERSION", "__version__", "ops"]

from .attention import attention, register_torch_op as register_attention_op
from .attention import workspace_size as attention_workspace_size

__all__ += ["attention", "attention_workspace_size", "register_attention_op"]

from .attention_backend import enable_attention, register_attention_backends
from .attention_backend import install_import_hooks as _install_attention_hooks

_install_attention_hooks()
__all__ += ["enable_attention", "register_attention_backends"]

# The torch-facing API loads on first use, so `import cquant` stays cheap for NumPy users.
_LAZY = {
    "quantize_": "quantize", "dequantize_": "quantize", "SkippedLayersWarning": "quantize",
    "UnmatchedKeysWarning": "quantize",
    "quantize_pipeline": "quantize", "fuse_qkv_": "quantize",
    "summary": "summary", "Summary": "summary",
    "QuantizedLinear": "nn",
    "fuse_activations_": "activation_fusion", "unfuse_activations_": "activation_fusion",
    "save_quantized": "serialization", "load_quantized": "serialization",
    "optimize": "optimize", "unoptimize": "optimize", "OptimizeReport": "optimize",
    "enable_batch_parallel": "batch_parallel", "disable_batch_parallel": "batch_parallel",
    "CQuantConfig": "integrations.hf_config",
    "VerifyResult": "verify",
}
_CONFIG_NAMES = (
    "PerRow", "PerTensor", "Int8WeightOnlyConfig", "Int8DynamicActivationInt8WeightConfig",
    "Float8DynamicActivationFloat8WeightConfig", "Float8WeightOnlyConfig", "FPXWeightOnlyConfig",
    "Int4WeightOnlyConfig", "Int8DynamicActivationInt4WeightConfig", "Int8DynamicActivationInt4TwoLevelWeightConfig",
    "Float8DynamicActivationInt4WeightConfig", "FqnToConfig",
    "config_from_name", "config_from_dict", "config_from_json",
)
_LAZY.update({name: "configs" for name in _CONFIG_NAMES})
_LAZY.update({"SCHEMES": "schemes", "SCHEME_NAMES": "schemes", "Scheme": "schemes"})


def __getattr__(name):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    if name in ("nn", "verify"):  # cquant.verify: a package that is also callable as verify(...)
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'cquant' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY) | {"nn", "verify"})


# diffusers and transformers learn about cquant's quantizer when (and if) they are imported.
from .integrations import install_import_hooks as _install_import_hooks  # noqa: E402

_install_import_hooks()

__all__ += ["nn", "verify", *_LAZY]
